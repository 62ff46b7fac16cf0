"""Engines: how a policy generates. ``open_engine`` builds the one ``engine.kind`` names for a
stage and closes it when the stage is done; stages build engines nowhere else.

    with open_engine(cfg.engine, model, tokenizer) as engine:
        rows = run_episodes(engine, suite, tasks, sampling=..., max_steps=6)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from flywheel.config import ENGINES_NOT_BUILT, ConfigError, EngineConfig
from flywheel.engines.base import Engine


@contextmanager
def open_engine(
    cfg: EngineConfig, model: Any, tokenizer: Any, *, device: str | None = None
) -> Iterator[Engine]:
    """The engine ``cfg.kind`` names on the policy ``model``/``tokenizer`` (``device``: where to
    run it; default CPU, or pass the device the model already lives on), closed on exit."""
    if cfg.kind in ENGINES_NOT_BUILT:  # the config refuses these already; a guard for dicts
        raise ConfigError(
            f"config error: engine.kind: {cfg.kind} is not available yet: "
            f"{ENGINES_NOT_BUILT[cfg.kind]}; use hf"
        )
    from flywheel.engines import hf  # transformers loads only when an engine is built

    engine = hf.HFEngine(
        model,
        tokenizer,
        batch_size=cfg.batch_size,
        device=device or "cpu",
        prefix_cache=cfg.prefix_cache,
    )
    try:
        yield engine
    finally:
        engine.close()
