"""Checkpoints: a Hugging Face model folder (``save_pretrained`` of model and tokenizer) plus
``checkpoint.parquet``, one row describing it. transformers and vLLM load the folder as it is.

| column      | type   | meaning                                                          |
|-------------|--------|------------------------------------------------------------------|
| policy      | string | the stage that produced it: init, sft, dpo, grpo, rft, sft_more  |
| round       | int32  | flywheel round (0 = bootstrap)                                   |
| parent      | string | artifact id of the checkpoint it started from (empty for init)   |
| base        | string | the base model folder, or ``embedded`` for the tiny policy        |
| num_params  | int64  | parameter count                                                  |
| train_steps | int64  | optimizer steps taken by the stage (0 for init)                  |
| final_loss  | double | last training loss (NaN for init)                                |
"""

import pyarrow as pa

from data_contracts._base import Contract

SCHEMA_VERSION = 1
SCHEMA = pa.schema(
    [
        ("policy", pa.string()),
        ("round", pa.int32()),
        ("parent", pa.string()),
        ("base", pa.string()),
        ("num_params", pa.int64()),
        ("train_steps", pa.int64()),
        ("final_loss", pa.float64()),
    ]
)
CONTRACT = Contract("checkpoints", SCHEMA_VERSION, SCHEMA)
# Files that must be in the folder for it to be loadable.
REQUIRED_FILES = ("config.json", "tokenizer_config.json")
