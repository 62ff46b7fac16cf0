"""Eval results: one row per held-out episode; the per-env summary metrics (ALGORITHMS.md,
"Evaluation metrics") are in the manifest's ``summary``.

| column         | type                              | meaning                                          |
|----------------|-----------------------------------|--------------------------------------------------|
| task_id        | string                            | test task                                        |
| env            | string                            | env name                                         |
| difficulty     | int32                             | the task's difficulty                            |
| policy         | string                            | checkpoint artifact id evaluated                 |
| policy_stage   | string                            | init, sft, dpo, grpo, rft, sft_more              |
| round          | int32                             | round of that checkpoint                         |
| success        | bool                              | solved                                           |
| reward         | double                            | final reward (0 when the episode never finished) |
| steps          | int32                             | assistant turns                                  |
| tool_calls     | int32                             | tool calls                                       |
| tool_errors    | int32                             | failed tool calls                                |
| tool_ok        | int32                             | tool calls with a usable result                  |
| tokens         | int32                             | reasoning length: generated assistant tokens     |
| finish_reason  | string                            | done, max_steps, invalid or error                |
| messages       | list<struct<role, content, loss>> | the episode, for reading                         |
"""

import pyarrow as pa

from data_contracts._base import Contract
from data_contracts.trajectories import MESSAGE

SCHEMA_VERSION = 1
SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("difficulty", pa.int32()),
        ("policy", pa.string()),
        ("policy_stage", pa.string()),
        ("round", pa.int32()),
        ("success", pa.bool_()),
        ("reward", pa.float64()),
        ("steps", pa.int32()),
        ("tool_calls", pa.int32()),
        ("tool_errors", pa.int32()),
        ("tool_ok", pa.int32()),
        ("tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("messages", pa.list_(MESSAGE)),
    ]
)
CONTRACT = Contract("eval", SCHEMA_VERSION, SCHEMA)
