"""Load: one explore stage with 1,000 concurrent arith episodes (500 tasks x K=2 in one shard, so
all 1,000 are live in the agent loop at once) leaves no process, file descriptor, thread or
memory behind. Measured in this process from /proc before and after; run twice, so that memory
the first run keeps for good (allocator pools, caches) is told apart from growth per run.

The policy is scripted (every episode runs one Python tool call in the sandbox, then answers
with its output), so the load is on the agent loop, the env and the sandbox, the parts that own
processes and descriptors; the rest of the stage (tasks, shards, store, summary) is the real one.

    .venv/bin/python -m pytest tests/reliability/test_load.py -s
"""

from __future__ import annotations

import contextlib
import gc
import io
import re
import time

import pytest

import flywheel.engines.hf
import stages.expert
import stages.explore
import stages.init
import stages.tasks
from flywheel.config import load_config
from flywheel.engines.base import Generation
from flywheel.store import Store
from tests.conftest import tiny_overrides
from tests.reliability.test_signals import descendants, open_fds, rss_kb, threads

EPISODES = 1000
TOOL_OUTPUT = re.compile(r"^-?\d+$")


class ScriptedEngine:
    """Calls the tool once (a product of two numbers from the prompt), then answers with what
    the tool printed."""

    def __init__(self, model, tokenizer, **kw):
        pass

    def generate(self, chats, params):
        out = []
        for chat in chats:
            last = chat.messages[-1]["content"].strip()
            if TOOL_OUTPUT.match(last):
                text = f"<answer>{last}</answer>"
            else:
                a, b = ([int(x) for x in re.findall(r"\d+", last)] + [6, 7])[:2]
                text = f"<python>print({a} * {b})</python>"
            out.append(Generation(text, [1, 2, 3], [-0.5, -0.5, -0.5], "stop"))
        return out

    def close(self):
        pass


def measure() -> dict[str, int]:
    gc.collect()
    time.sleep(0.5)  # let the sandbox's calls finish exiting
    import os

    return {
        "fds": open_fds(),
        "threads": threads(),
        "processes": len(descendants(os.getpid())),
        "rss_mb": rss_kb() // 1024,
    }


@pytest.mark.slow
def test_one_thousand_concurrent_episodes_leak_nothing(tmp_path, monkeypatch):
    n_tasks = EPISODES // 2
    overrides = tiny_overrides(
        tmp_path,
        f"envs.arith.n_train={n_tasks}",
        "explore.samples_per_task=2",
        f"explore.shard_size={EPISODES}",
        "expert.n_tasks=8",
    )
    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    monkeypatch.setattr(flywheel.engines.hf, "HFEngine", ScriptedEngine)
    with contextlib.redirect_stdout(io.StringIO()):
        train, val, _ = stages.tasks.run(cfg, store)
        init = stages.init.run(cfg, store, stages.expert.run(cfg, store, train, val), train)
        # warm-up: imports, the sandbox's fork server, thread pools (a window of 8 tasks)
        small = load_config(None, [*overrides, "explore.n_tasks=8"])
        stages.explore.run(small, store, init, train, round=1)
    before = measure()
    runs, took = [], []
    for force in (False, True):
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            ref = stages.explore.run(cfg, store, init, train, round=1, force=force)
        took.append(time.perf_counter() - t0)
        runs.append(measure())
        table = store.read(ref)
        assert table.num_rows == EPISODES
        assert sum(table.column("tool_calls").to_pylist()) == EPISODES  # each ran its tool call
        assert sum(table.column("tool_errors").to_pylist()) == 0  # and the sandbox answered
    first, second = runs
    print(
        f"\n{EPISODES} concurrent episodes, 2 runs ({took[0]:.1f}s, {took[1]:.1f}s): "
        f"before {before}, after run 1 {first}, after run 2 {second}"
    )
    assert first["processes"] == second["processes"] == before["processes"]
    assert first["fds"] == second["fds"] == before["fds"]
    assert first["threads"] == second["threads"] == before["threads"]
    # A leak of 16 KB per episode would add 16 MB per run.
    assert second["rss_mb"] - first["rss_mb"] < 16, (first, second)
