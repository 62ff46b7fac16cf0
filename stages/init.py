"""Stage ``init``: the starting checkpoint pi_init.

With ``model.base`` null it builds the embedded policy: a word-level tokenizer trained on the
expert trajectories' text and the train tasks' prompts, and a randomly initialised tiny Llama-architecture model, all local.
With ``model.base`` a local Hugging Face folder it loads that model and tokenizer as they are.

    flywheel stage init --round 0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from flywheel.checkpoint import write_checkpoint
from flywheel.config import Config
from flywheel.progress import say
from flywheel.store import ArtifactRef, Store


def artifact_config(cfg: Config) -> dict[str, Any]:
    """What the artifact id hashes: the model section and the seed of the random init, and
    whether the tokenizer also learns the revision turns splice writes (rounds with mcts: the
    envs' no-op actions those turns end with) and the envs' reflection hints (rounds with
    reflect: the hints themselves)."""
    # number_digits is hashed only when not 3, so the ids from before the field stay the same.
    model = cfg.model.model_dump(
        exclude={"tiny": {"number_digits"}} if cfg.model.tiny.number_digits == 3 else None
    )
    config: dict[str, Any] = {"model": model, "seed": cfg.train_seed}
    if _revises(cfg):
        config["revision_noops"] = _noops(cfg)
    if _reflects(cfg):
        config["hints"] = _hints(cfg)
    return config


def _revises(cfg: Config) -> bool:
    return "mcts" in cfg.iteration.data and cfg.splice.revisions


def _reflects(cfg: Config) -> bool:
    return "reflect" in cfg.iteration.data


def _noops(cfg: Config) -> list[str]:
    """The no-op action of every env that has one (what splice's revision turns take)."""
    from flywheel.envs import make_suite

    found = (getattr(make_suite(e), "noop", None) for e in cfg.envs)
    return [noop for noop in found if isinstance(noop, str)]


def revision_texts(cfg: Config) -> list[str]:
    """The revision turns the embedded tokenizer learns when the rounds splice: each published
    thought with each env's no-op (splice.thoughts must be written in their words)."""
    from flywheel.splice import REVISION_THOUGHTS, revision_turn

    return [revision_turn(t, noop) for noop in _noops(cfg) for t in REVISION_THOUGHTS]


def _hints(cfg: Config) -> dict[str, list[str]]:
    from flywheel.reflect import hints_of

    return hints_of(cfg.envs)


def run(
    cfg: Config, store: Store, expert: ArtifactRef, train: ArtifactRef, *, force: bool = False
) -> ArtifactRef:
    base = cfg.model.base
    inputs = [] if base else [expert.id, train.id]
    w = store.writer(
        "checkpoints",
        stage="init",
        round=0,
        config=artifact_config(cfg),
        inputs=inputs,
        force=force,
    )
    if w.cached:
        return w.ref
    if base:
        model, tokenizer = _load_base(base)
    else:
        from flywheel.model import build_tiny_policy

        messages = store.read(expert, columns=["messages"]).column("messages")
        texts = pc.struct_field(pc.list_flatten(messages), "content").to_pylist()
        # Every train prompt too: tasks without a demonstration must not hold unknown words.
        texts += store.read(train, columns=["prompt"]).column("prompt").to_pylist()
        if _revises(cfg):  # splice's revision turns ("Thought: I made a mistake ...")
            texts += revision_texts(cfg)
        if _reflects(cfg):  # the hints that open reflect's hinted turns
            texts += [hint for hints in _hints(cfg).values() for hint in hints]
        tokenizer, model = build_tiny_policy(texts, cfg.model.tiny, cfg.train_seed)
    ref = write_checkpoint(
        w,
        model,
        tokenizer,
        policy="init",
        round=0,
        parent="",
        base=base or "embedded",
        summary={"vocab_size": len(tokenizer)},
    )
    say(
        f"init: {ref.summary['num_params']:,} parameters, vocabulary {len(tokenizer):,} ({base or 'embedded'})"
    )
    return ref


def _load_base(base: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(base)
    if not (folder / "config.json").exists():
        raise ValueError(
            f"model.base {base!r} is not a local Hugging Face model folder (no config.json)"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        raise ValueError(f"model.base {base!r}: the tokenizer has no chat template")
    return AutoModelForCausalLM.from_pretrained(folder, dtype="float32"), tokenizer
