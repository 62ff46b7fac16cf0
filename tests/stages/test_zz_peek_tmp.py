import polars as pl
from tests.stages.test_dpo_grpo import *  # noqa

def test_peek(world, sampled):
    store, tok, policy = world
    f = pl.from_arrow(store.read(sampled))
    print(f.select("task_id", "reward", "tokens", "finish_reason", pl.col("turn_token_ids").list.len().alias("turns")))
    print([[t[-1] == tok.eos_token_id for t in r] for r in f["turn_token_ids"].to_list()])
    cfg = Cfg(grpo=GrpoConfig(lr=3e-3, epochs=3, **TRAIN | {"micro_batch_size": 4}))
    ref = grpo.run(cfg, store, policy, sampled, round=1)
    print(ref.summary)
    for e in train_log(store, ref): print(e)
