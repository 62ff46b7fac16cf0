"""Stage ``splice``: the round's MCTS trees -> revision trajectories (source=revision) and good
paths (source=mcts), which round sft trains on (ALGORITHMS.md, "Revision splicing (Agent-R)").
The algorithms are in flywheel/splice.py; this module reads, verifies, replays and writes.

Per tree: bad paths are paired with good ones by ``splice.alpha`` and ``splice.beta``; a bad
path's first error is found by the verifier (``rule``: the env's step signals; ``judge``: the
policy answers ``Judgement: Good|Bad|Uncertain`` for every step of the bad paths, all trees'
steps in ONE batched greedy engine call); the bad prefix up to and including that error (not
trained), a revision turn ``Thought: <reflection>\\nAction: <the env's no-op>`` (trained) and the
good path's remaining turns (trained) make one trajectory. The revision turn's observation is
the env's real answer: the task is replayed through a fresh env up to the error, then the no-op
is stepped. An env needs a no-op action (its suite's ``noop``: craft's ``inventory``, arith's
``<python>print()</python>``).

Summary per env: ``trees``, ``revisions``, ``revisions_per_tree``, ``trees_revised`` (share of
trees with a revision), ``good_paths``, ``good_paths_per_tree``; with the judge, ``judged_steps``
and ``bad_steps``.

    flywheel stage splice --round 1 iteration.data=[explore,mcts]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flywheel.checkpoint import checkpoint_dir
from flywheel.config import Config
from flywheel.engines.base import Chat, SamplingParams
from flywheel.envs import EnvSuite, Task, make_suite
from flywheel.mcts import Node, Tree, trees_from_rows
from flywheel.model import train_tokenizer
from flywheel.progress import say
from flywheel.splice import (
    REVISION_THOUGHTS,
    Flags,
    good_paths,
    judge_chat,
    judge_flags,
    judge_nodes,
    parse_judgement,
    path_row,
    pick_thought,
    revision_turn,
    select_revisions,
    splice,
    unspellable,
)
from flywheel.store import ArtifactRef, Store
from stages._common import load_tasks, rollout_setup

COUNTS = ("trees", "revisions", "trees_revised", "good_paths")  # summed per env


def artifact_config(cfg: Config) -> dict[str, Any]:
    """What the artifact id hashes: the splice section (the judge's token limit and the engine
    only when the judge runs) and the env settings (the revision turn is stepped for real)."""
    sp = cfg.splice
    judge = sp.verifier == "judge"
    # revisions is hashed only when off and thoughts only when set, so the ids from before
    # those fields stay the same.
    exclude = {"revisions"} if sp.revisions else set()
    if sp.thoughts is None:
        exclude.add("thoughts")
    if not judge:
        exclude.add("judge_max_new_tokens")
    conf: dict[str, Any] = {
        "splice": sp.model_dump(exclude=exclude),
        "envs": cfg.envs_dump(),
    }
    if judge:
        conf["engine"] = cfg.engine_dump()
    return conf


def run(
    cfg: Config,
    store: Store,
    trees: ArtifactRef,
    policy: ArtifactRef,
    tasks: ArtifactRef,
    *,
    round: int,
    force: bool = False,
) -> ArtifactRef:
    sp = cfg.splice
    check_thoughts(cfg, store, policy)
    w = store.writer(
        "trajectories",
        stage="splice",
        round=round,
        config=artifact_config(cfg),
        inputs=[trees.id, policy.id, tasks.id],
        force=force,
    )
    if w.cached:
        return w.ref
    forest = trees_from_rows(store.read(trees).to_pylist())
    suites = _suites(cfg, {t.env for t in forest}, noop=sp.revisions)
    by_id = {
        task.task_id: task
        for env in suites
        for task in load_tasks(store, tasks, env=env, split="train")
    }
    thoughts = tuple(sp.thoughts or REVISION_THOUGHTS)
    flags: dict[str, Flags] = {}
    judged: dict[str, list[str]] = {}
    if sp.verifier == "judge" and forest:
        flags, judged = judge(cfg, store, policy, tasks, forest)
    rows: list[dict[str, Any]] = []
    counts: dict[str, dict[str, float]] = {}
    for tree in forest:
        suite = suites[tree.env]
        made = tree_rows(tree, suite, by_id[tree.task_id], sp.alpha, sp.beta,
                         flags.get(tree.tree_id), good=sp.good_paths,
                         revisions=sp.revisions, thoughts=thoughts)  # fmt: skip
        rows += [{**row, "round": round, "policy": policy.id} for row in made]
        c = counts.setdefault(tree.env, dict.fromkeys(COUNTS, 0.0))
        revisions = sum(row["source"] == "revision" for row in made)
        c["trees"] += 1
        c["revisions"] += revisions
        c["trees_revised"] += revisions > 0
        c["good_paths"] += len(made) - revisions
    for i, start in enumerate(range(0, len(rows), sp.shard_rows)):
        w.write_shard(i, rows[start : start + sp.shard_rows])
    for env, c in sorted(counts.items()):
        say(
            f"splice: {env}: {c['revisions']:.0f} revisions and {c['good_paths']:.0f} good "
            f"paths from {c['trees']:.0f} trees"
        )
    return w.commit(summary=_summary(counts, judged))


def check_envs(cfg: Config) -> None:
    """A one-line ValueError unless every env of the config names the no-op action a revision
    turn takes. The flow calls it before any work when its rounds will splice, so a config that
    pairs mcts with such an env fails at once, not after the bootstrap and the search."""
    _suites(cfg, {env_cfg.name for env_cfg in cfg.envs}, noop=cfg.splice.revisions)


def check_thoughts(
    cfg: Config, store: Store | None = None, policy: ArtifactRef | None = None
) -> None:
    """A one-line ValueError when revisions are written with ``splice.thoughts`` the policy's
    tokenizer cannot spell: round sft would train on unknown tokens. With ``policy``, its
    tokenizer is read; without, the embedded tokenizer's words for revision turns are checked
    from the config alone (the flow does that before any work; a base model's tokenizer is
    checked once init has written it)."""
    sp = cfg.splice
    if not (sp.revisions and sp.thoughts):
        return
    if policy is not None:
        from transformers import AutoTokenizer

        assert store is not None
        tokenizer = AutoTokenizer.from_pretrained(checkpoint_dir(store, policy))
    elif cfg.model.base is None:
        import stages.init

        texts = stages.init.revision_texts(cfg)  # what init's embedded tokenizer learns of them
        tokenizer = train_tokenizer(texts, number_digits=cfg.model.tiny.number_digits)
    else:
        return
    unknown = unspellable(tokenizer, sp.thoughts)
    if unknown:
        raise ValueError(
            f"splice.thoughts: the policy's tokenizer cannot spell {', '.join(map(repr, unknown))}; "
            "the embedded tokenizer knows the words of the published thoughts "
            "(flywheel.splice.REVISION_THOUGHTS), so write the thoughts in those"
        )


def _suites(cfg: Config, envs: set[str], *, noop: bool = True) -> dict[str, EnvSuite]:
    """The suites of the envs the trees searched; with ``noop`` (revisions are written) each
    must name its no-op action."""
    suites = {}
    for env_cfg in cfg.envs:
        if env_cfg.name not in envs:
            continue
        suite = make_suite(env_cfg)
        if noop and not isinstance(getattr(suite, "noop", None), str):
            raise ValueError(
                f"splice: env {env_cfg.name} names no no-op action (its suite's noop), which "
                "the revision turn takes: iteration.data=[..., mcts] needs an env that has one "
                "(e.g. craft or arith)"
            )
        suites[env_cfg.name] = suite
    missing = envs - set(suites)
    if missing:
        raise ValueError(f"splice: the trees searched envs {sorted(missing)} the config lacks")
    return suites


def tree_rows(
    tree: Tree,
    suite: EnvSuite,
    task: Task,
    alpha: float,
    beta: float,
    flags: Flags | None,
    *,
    good: bool = True,
    revisions: bool = True,
    thoughts: Sequence[str] = REVISION_THOUGHTS,
) -> list[dict[str, Any]]:
    """A tree's revision rows (with ``revisions``; each revision turn opens with one of
    ``thoughts``), then (with ``good``) its good paths as plain rows; trajectory rows without
    ``round`` and ``policy``."""
    rows: list[dict[str, Any]] = []
    picked = select_revisions(tree, alpha=alpha, beta=beta, flags=flags) if revisions else []
    noop: str = getattr(suite, "noop", "")  # a str when revisions are written: see _suites
    for k, rev in enumerate(picked):
        text = revision_turn(pick_thought(tree.tree_id, k, thoughts=thoughts), noop=noop)
        observation = revision_observation(suite, task, rev.bad[1 : rev.cut + 2], text)
        rows.append(
            splice(
                rev.bad, rev.good, rev.cut, text, revision_observation=observation, sample_idx=k
            )  # fmt: skip
        )
    if good:
        rows += [
            path_row(p, source="mcts", sample_idx=i) for i, p in enumerate(good_paths(tree, alpha))
        ]
    return rows


def revision_observation(suite: EnvSuite, task: Task, prefix: list[Node], text: str) -> str:
    """The env's answer to the revision turn ``text`` taken after ``prefix`` (the bad path's
    steps up to and including its first error), replayed through a fresh env. Where the error
    ended the episode, or the replay fails (an env error at the cut), the error's own
    observation stands in: there is no state to take the turn in."""
    error = prefix[-1]
    if error.done:
        return error.observation
    env = suite.make()
    try:
        env.reset(task)
        for node in prefix:
            env.step(node.text)
        return env.step(text)[0]
    except Exception:  # noqa: BLE001 - a broken replay costs this row its observation, no more
        return error.observation
    finally:
        env.close()


def judge(
    cfg: Config, store: Store, policy: ArtifactRef, tasks: ArtifactRef, forest: list[Tree]
) -> tuple[dict[str, Flags], dict[str, list[str]]]:
    """The policy's verdict on every step of every tree's bad paths, in one greedy batched
    call: flags per tree id, and the verdicts per env (for the summary)."""
    sp = cfg.splice
    nodes = [
        (tree, node) for tree in forest for node in judge_nodes(tree, alpha=sp.alpha, beta=sp.beta)
    ]
    if not nodes:
        return {}, {}
    sampling = SamplingParams(temperature=0.0, max_new_tokens=sp.judge_max_new_tokens, seed=0)
    with rollout_setup(cfg, store, policy, tasks, split="train", limit=1, label="splice") as (
        engine,
        _,
        _,
    ):
        gens = engine.generate([Chat(judge_chat(node)) for _, node in nodes], sampling)
    verdicts: dict[str, dict[int, str]] = {}
    judged: dict[str, list[str]] = {}
    for (tree, node), gen in zip(nodes, gens, strict=True):
        verdict = parse_judgement(gen.text)
        verdicts.setdefault(tree.tree_id, {})[node.node_id] = verdict
        judged.setdefault(tree.env, []).append(verdict)
    return {tree_id: judge_flags(v) for tree_id, v in verdicts.items()}, judged


def _summary(counts: dict[str, dict[str, float]], judged: dict[str, list[str]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for env, c in sorted(counts.items()):
        trees = max(c["trees"], 1)
        out |= {
            f"{env}/trees": c["trees"],
            f"{env}/revisions": c["revisions"],
            f"{env}/revisions_per_tree": c["revisions"] / trees,
            f"{env}/trees_revised": c["trees_revised"] / trees,
            f"{env}/good_paths": c["good_paths"],
            f"{env}/good_paths_per_tree": c["good_paths"] / trees,
        }
        if env in judged:
            out[f"{env}/judged_steps"] = len(judged[env])
            out[f"{env}/bad_steps"] = sum(v == "bad" for v in judged[env])
    return {k: float(v) for k, v in out.items()}
