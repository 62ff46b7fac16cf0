"""Tasks: one row per generated task, train, val and test splits of every env.

| column     | type   | meaning                                                    |
|------------|--------|------------------------------------------------------------|
| task_id    | string | unique within the artifact, e.g. ``arith-test-000123``      |
| env        | string | env name from the config                                   |
| split      | string | ``train``, ``val`` or ``test``                             |
| seed       | int64  | seed the generator used for this task                      |
| difficulty | int32  | env-defined difficulty level (arith: number of operations) |
| prompt     | string | the task text (the first observation)                      |
| answer     | string | gold answer as text, empty when unknown                    |
| meta       | string | env-specific JSON the oracle needs                         |
"""

import pyarrow as pa

from data_contracts._base import Contract

SCHEMA_VERSION = 1
SCHEMA = pa.schema(
    [
        ("task_id", pa.string()),
        ("env", pa.string()),
        ("split", pa.string()),
        ("seed", pa.int64()),
        ("difficulty", pa.int32()),
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("meta", pa.string()),
    ]
)
CONTRACT = Contract("tasks", SCHEMA_VERSION, SCHEMA)
