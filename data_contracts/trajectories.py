"""Trajectories, the central contract: one row per episode.

| column          | type                                   | meaning                                              |
|-----------------|----------------------------------------|------------------------------------------------------|
| task_id         | string                                 | task the episode ran                                 |
| env             | string                                 | env name                                             |
| split           | string                                 | ``train``, ``val`` or ``test``                       |
| round           | int32                                  | flywheel round that produced it (0 = bootstrap)      |
| policy          | string                                 | checkpoint artifact id that acted; ``oracle`` for expert |
| source          | string                                 | expert, explore, mcts, revision or import            |
| sample_idx      | int32                                  | index among the K samples of this task               |
| messages        | list<struct<role, content, loss>>      | the conversation; ``loss`` marks trained turns        |
| reward          | double                                 | final env reward in [0, 1]                           |
| success         | bool                                   | env's success flag                                   |
| steps           | int32                                  | assistant turns taken (invalid ones included)        |
| tool_calls      | int32                                  | turns that called a tool                             |
| tool_errors     | int32                                  | tool calls that failed                               |
| tool_ok         | int32                                  | tool calls with a non-empty, non-error result        |
| invalid_actions | int32                                  | turns with no parsable action                        |
| tokens          | int32                                  | generated tokens over all assistant turns            |
| finish_reason   | string                                 | done, max_steps, invalid or error                    |
| seed            | int64                                  | per-episode sampling seed                            |
| turn_token_ids  | list<list<int32>>                      | generated ids of each sampled assistant turn          |
| turn_logprobs   | list<list<float>>                      | behaviour log-prob of each of those ids              |

``turn_token_ids`` belong to the *last* ``len(turn_token_ids)`` assistant messages (the
generated ones; ``flywheel.trajectory`` is the one place that reads them): expert and imported
rows leave both lists empty, and a revision's untrained prefix and its revision turn have none,
so those turns are tokenized from text when trained on.
"""

import pyarrow as pa

from data_contracts._base import Contract

SCHEMA_VERSION = 1
MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string()), ("loss", pa.bool_())])
SOURCES = ("expert", "explore", "mcts", "revision", "import")
FINISH_REASONS = ("done", "max_steps", "invalid", "error")
SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("split", pa.string()),
        ("round", pa.int32()),
        ("policy", pa.string()),
        ("source", pa.string()),
        ("sample_idx", pa.int32()),
        ("messages", pa.list_(MESSAGE)),
        ("reward", pa.float64()),
        ("success", pa.bool_()),
        ("steps", pa.int32()),
        ("tool_calls", pa.int32()),
        ("tool_errors", pa.int32()),
        ("tool_ok", pa.int32()),
        ("invalid_actions", pa.int32()),
        ("tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("seed", pa.int64()),
        ("turn_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("turn_logprobs", pa.list_(pa.list_(pa.float32()))),
    ]
)
CONTRACT = Contract("trajectories", SCHEMA_VERSION, SCHEMA)
