"""GRPO groups: one row per trajectory of a selected group (the K rollouts of one task), with
everything GRPO needs to train without reading the trajectories again.

Written by the ``pareto`` stage (ALGORITHMS.md, "Group-wise Pareto filtering and curriculum"):
groups that pass the post-filter are sorted into Pareto fronts over (x1, x2) and filled front by
front up to the budget, the overflowing front cut by crowding distance.

| column            | type                              | meaning                                                   |
|-------------------|-----------------------------------|-----------------------------------------------------------|
| task_id           | string                            | task of the group                                         |
| env               | string                            | env name                                                  |
| round             | int32                             | flywheel round of the pareto stage                        |
| policy            | string                            | checkpoint id that sampled the trajectory (behaviour policy) |
| group_front       | int32                             | the group's Pareto front (1 = non-dominated), among groups that passed the post-filter |
| group_crowding    | double                            | the group's crowding distance within its front (inf at the boundaries) |
| group_x1          | double                            | population variance of the group's tool-call counts       |
| group_x2          | double                            | population variance of the group's success (0/1)          |
| group_size        | int32                             | trajectories in the group (K)                             |
| group_mean_reward | double                            | mean reward of the group                                  |
| sample_idx        | int32                             | the trajectory's index among the K samples                |
| reward            | double                            | final env reward in [0, 1] (a missing reward counts 0)    |
| success           | bool                              | env's success flag                                        |
| pareto_rank       | int32                             | the trajectory's Pareto front among its group over (reward up, tool calls down, tokens down); 1 = best |
| tool_calls        | int32                             | turns that called a tool                                  |
| tool_ok           | int32                             | tool calls with a usable result (valid calls, for the efficiency reward) |
| invalid_actions   | int32                             | turns with no parsable action (format penalty)            |
| tokens            | int32                             | generated tokens over all assistant turns                 |
| finish_reason     | string                            | done, max_steps, invalid or error                         |
| messages          | list<struct<role, content, loss>> | the conversation, as in trajectories                      |
| turn_token_ids    | list<list<int32>>                 | generated ids of each sampled assistant turn              |
| turn_logprobs     | list<list<float>>                 | behaviour log-prob of each of those ids                   |

Rows of one group are adjacent and ordered by ``sample_idx``; groups are in selection order
(front, then crowding distance descending).
"""

import pyarrow as pa

from data_contracts._base import Contract
from data_contracts.trajectories import MESSAGE

SCHEMA_VERSION = 1
SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("round", pa.int32()),
        ("policy", pa.string()),
        ("group_front", pa.int32()),
        ("group_crowding", pa.float64()),
        ("group_x1", pa.float64()),
        ("group_x2", pa.float64()),
        ("group_size", pa.int32()),
        ("group_mean_reward", pa.float64()),
        ("sample_idx", pa.int32()),
        ("reward", pa.float64()),
        ("success", pa.bool_()),
        ("pareto_rank", pa.int32()),
        ("tool_calls", pa.int32()),
        ("tool_ok", pa.int32()),
        ("invalid_actions", pa.int32()),
        ("tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("messages", pa.list_(MESSAGE)),
        ("turn_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("turn_logprobs", pa.list_(pa.list_(pa.float32()))),
    ]
)
CONTRACT = Contract("groups", SCHEMA_VERSION, SCHEMA)
