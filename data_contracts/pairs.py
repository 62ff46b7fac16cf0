"""Preference pairs for DPO: one row per (chosen, rejected) pair of continuations of one prompt.

Written by the ``pareto`` stage (ALGORITHMS.md, "Exploration rollouts and contrastive pairs"):
``kind=expert`` pairs an explored trajectory with the task's expert trajectory (ETO);
``kind=best_worst`` pairs the best and the worst of the K samples of a task (ours).

| column                  | type                              | meaning                                                    |
|-------------------------|-----------------------------------|------------------------------------------------------------|
| task_id                 | string                            | task both sides ran                                        |
| env                     | string                            | env name                                                   |
| round                   | int32                             | flywheel round of the pareto stage that built the pair     |
| policy                  | string                            | checkpoint id that produced the explored side(s)           |
| kind                    | string                            | ``expert`` or ``best_worst``                               |
| prompt                  | list<struct<role, content, loss>> | shared prefix: instruction, ``Ok.``, first observation     |
| chosen                  | list<struct<role, content, loss>> | preferred continuation; ends with an assistant turn        |
| rejected                | list<struct<role, content, loss>> | dispreferred continuation; ends with an assistant turn, cut to at most len(chosen side's trajectory) + cut_extra_messages messages in all |
| chosen_reward           | double                            | env reward of the whole chosen trajectory                  |
| rejected_reward         | double                            | env reward of the whole rejected trajectory                |
| chosen_source           | string                            | trajectories ``source`` of the chosen side (expert, explore...) |
| rejected_source         | string                            | same for the rejected side                                 |
| chosen_sample_idx       | int32                             | ``sample_idx`` of the chosen side; -1 for the expert        |
| rejected_sample_idx     | int32                             | same for the rejected side                                 |
| chosen_turn_token_ids   | list<list<int32>>                 | generated ids of the chosen side's sampled assistant turns that survive the cut; empty for the expert |
| rejected_turn_token_ids | list<list<int32>>                 | same for the rejected side                                 |

As in trajectories, ``*_turn_token_ids`` belong to the *last* assistant messages of
``prompt + side`` (``flywheel.trajectory``): DPO trains on the sampled ids, never on
re-tokenized text.
"""

import pyarrow as pa

from data_contracts._base import Contract
from data_contracts.trajectories import MESSAGE

SCHEMA_VERSION = 1
KINDS = ("expert", "best_worst")
SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("round", pa.int32()),
        ("policy", pa.string()),
        ("kind", pa.string()),
        ("prompt", pa.list_(MESSAGE)),
        ("chosen", pa.list_(MESSAGE)),
        ("rejected", pa.list_(MESSAGE)),
        ("chosen_reward", pa.float64()),
        ("rejected_reward", pa.float64()),
        ("chosen_source", pa.string()),
        ("rejected_source", pa.string()),
        ("chosen_sample_idx", pa.int32()),
        ("rejected_sample_idx", pa.int32()),
        ("chosen_turn_token_ids", pa.list_(pa.list_(pa.int32()))),
        ("rejected_turn_token_ids", pa.list_(pa.list_(pa.int32()))),
    ]
)
CONTRACT = Contract("pairs", SCHEMA_VERSION, SCHEMA)
