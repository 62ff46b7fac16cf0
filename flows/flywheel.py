"""Prefect flows that only wire stages: ``flywheel`` (bootstrap then N rounds), ``iteration``
(one round) and ``stage`` (one stage of one round).

Caching lives in the artifact store, not in Prefect: every stage computes its artifact id from
its config and inputs and returns at once when that artifact exists. So ``iteration`` and
``stage`` simply walk the DAG from the start; the stages before the one asked for are cache hits.

Run in-process (no server needed):

    flywheel run                      # == python -m flows.flywheel
    flywheel stage sft --round 0 --force

or, with ``make serve``, as deployments: ``prefect deployment run 'flywheel/default'``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NONE

import stages.dpo
import stages.evaluate
import stages.expert
import stages.explore
import stages.grpo
import stages.index
import stages.init
import stages.mcts
import stages.pareto
import stages.reflect
import stages.rft
import stages.sft
import stages.sft_more
import stages.splice
import stages.tasks
from flows.walk import splices
from flywheel.config import BASELINES, Config, load_config
from flywheel.html_report import write_html
from flywheel.progress import say  # stdout once, and the flow run's logs in Prefect
from flywheel.report import collect, format_table, write_state
from flywheel.store import ArtifactRef, Store, rerun_reason
from flywheel.tracking import Tracker

# Stages that talk to environments get a retry: env servers are the flaky part.
RETRIES = {"expert": 1, "explore": 1, "mcts": 1, "reflect": 1, "evaluate": 1}


# One name per stage everywhere: module, config section, Prefect task, artifact folder.
STAGES = {
    "tasks": stages.tasks,
    "index": stages.index,
    "expert": stages.expert,
    "init": stages.init,
    "sft": stages.sft,
    "explore": stages.explore,
    "pareto": stages.pareto,
    "reflect": stages.reflect,
    "mcts": stages.mcts,
    "splice": stages.splice,
    "dpo": stages.dpo,
    "grpo": stages.grpo,
    "evaluate": stages.evaluate,
    "sft_more": stages.sft_more,
    "rft": stages.rft,
}
BOOTSTRAP_ONLY = ("tasks", "index", "expert", "init")
ROUNDS_ONLY = (
    "explore", "pareto", "reflect", "mcts", "splice", "dpo", "grpo", "sft_more", "rft",
)  # fmt: skip
# The stages that produce a round's data, by entry of iteration.data.
DATA_STAGES = {
    "explore": ("explore", "pareto"),
    "reflect": ("reflect",),
    "mcts": ("mcts", "splice"),
}

# A stage's input is an artifact or a list of them (sft's trajectory artifacts); it returns its
# artifact, or a tuple of them (pareto writes pairs and groups).
StageInput = ArtifactRef | list[ArtifactRef]
StageResult = ArtifactRef | tuple[ArtifactRef, ...]


class StopAfter(Exception):  # noqa: N818 - control flow, not an error
    def __init__(self, ref: StageResult):
        self.ref = ref


@dataclass
class Plan:
    """What one flow invocation does: which (stage, round) to force, where to stop."""

    cfg: Config
    store: Store
    tracker: Tracker
    force: set[tuple[str, int]] = field(default_factory=set)
    force_all: bool = False
    stop_at: tuple[str, int] | None = None
    parent_run: str | None = None
    evaluations: list[str] = field(default_factory=list)
    # Set by a whole run (flywheel_flow): its rounds, and the run's record (flywheel.json) is
    # rewritten after each evaluation so `flywheel report` shows this run's rows as they come.
    recorded_rounds: int | None = None
    repeat: bool = False  # a repeat of the last round (iteration.repeats): tracked apart


@task(cache_policy=NONE, task_run_name="{name}-round-{round}")
def run_stage(name: str, round: int, plan: Plan, *inputs: StageInput, **kwargs) -> StageResult:
    force = plan.force_all or (name, round) in plan.force
    module = STAGES[name]
    if name in BOOTSTRAP_ONLY:
        ref = module.run(plan.cfg, plan.store, *inputs, force=force)
    else:
        ref = module.run(plan.cfg, plan.store, *inputs, round=round, force=force, **kwargs)
    return ref


def _run(
    plan: Plan, name: str, round: int, *inputs: StageInput, last: bool = True, **kwargs
) -> StageResult:
    """Run one stage; ``last=False`` marks a stage that runs again later in the same round
    (round 0 evaluates pi_init, then the SFT policy), so ``stage`` stops at the later one."""
    t0 = time.perf_counter()
    result = run_stage.with_options(retries=RETRIES.get(name, 0))(
        name, round, plan, *inputs, **kwargs
    )
    took = time.perf_counter() - t0
    for ref in result if isinstance(result, tuple) else (result,):
        cached = ref.id not in plan.store.committed
        label = "cache hit" if cached else f"{took:7.1f}s"
        say(f"[round {round}] {name:<9} {label:>9}  {ref.id:<22} {_headline(ref)}")
        why = None if cached else rerun_reason(plan.store, ref)
        if why:  # what a user who expected a cache hit needs to know
            say(f"          {'':<9} {'':>9}  ({why})")
        plan.tracker.log_stage(plan.store, ref, cached, repeat=plan.repeat)
        if name == "evaluate":
            plan.evaluations.append(ref.id)
            if plan.recorded_rounds is not None:
                write_state(plan.store, plan.recorded_rounds, plan.evaluations, finished=False)
    if plan.stop_at == (name, round) and last:
        raise StopAfter(result)
    return result


def _step(
    plan: Plan, name: str, round: int, *inputs: StageInput, last: bool = True, **kwargs
) -> ArtifactRef:
    """``_run`` for a stage that writes one artifact (every stage but tasks and pareto)."""
    result = _run(plan, name, round, *inputs, last=last, **kwargs)
    assert isinstance(result, ArtifactRef), f"stage {name} wrote {len(result)} artifacts"
    return result


# The numbers a stage's progress line shows, by the end of their summary keys.
HEADLINES = (
    "/success_rate", "/nodes_per_tree", "/success_share", "/revisions_per_tree",
    "/recovered_share",
)  # fmt: skip


def _headline(ref: ArtifactRef) -> str:
    keys = [k for k in ref.summary if k.endswith(HEADLINES)]
    if keys:
        return "  ".join(f"{k}={ref.summary[k]:.3f}" for k in keys)
    if "final_loss" in ref.summary:
        return f"loss={ref.summary['final_loss']:.4f}"
    return ""


def bootstrap(plan: Plan) -> dict[str, ArtifactRef]:
    """Round 0: tasks -> [index] -> expert -> init -> sft (validated on the val split), then the
    SFT policy evaluated on the test split (and the untrained one first, with
    evaluate.untrained). ``index`` runs when an env searches a corpus; its envs then search it."""
    split = _run(plan, "tasks", 0)
    assert isinstance(split, tuple)  # tasks writes one artifact per split
    train, val, test = split
    if stages.index.artifact_config(plan.cfg):
        indexes = _run(plan, "index", 0)
        assert isinstance(indexes, tuple)  # one artifact per distinct corpus and embedder
        plan.cfg = stages.index.attach(plan.cfg, indexes)
    expert = _step(plan, "expert", 0, train, val)
    init = _step(plan, "init", 0, expert, train)
    if "mcts" in plan.cfg.iteration.data:  # a base model's tokenizer: known from here on
        stages.splice.check_thoughts(plan.cfg, plan.store, init)
    if plan.cfg.evaluate.untrained:
        _step(plan, "evaluate", 0, init, test, last=False)
    sft = _step(plan, "sft", 0, init, [expert], val_tasks=val, val_demos=expert)
    _step(plan, "evaluate", 0, sft, test)
    return {"train": train, "val": val, "test": test, "expert": expert, "policy": sft}


@dataclass
class RoundData:
    """What a round's training steps read: its start policy pi_r and the data pi_r produced."""

    start: ArtifactRef  # pi_r, where the round's first training step starts
    own: list[ArtifactRef]  # trajectories the round's sft reads (with replay, earlier rounds' too)
    pairs: ArtifactRef | None  # pareto's DPO pairs (None without explore)
    groups: ArtifactRef | None  # pareto's GRPO groups
    explored: ArtifactRef | None  # None when iteration.data has no explore


@dataclass
class RoundResult:
    policy: ArtifactRef  # pi_{r+1}
    data: RoundData  # what the training steps read (iteration.repeats trains on it again)
    trained: list[ArtifactRef]  # the checkpoint of every training step, in order
    spliced: ArtifactRef | None = None  # revisions and good paths, with mcts in iteration.data
    reflected: ArtifactRef | None = None  # hinted revisions, with reflect in iteration.data
    resampled: ArtifactRef | None = None  # grpo's own explore, with grpo.resample after a step

    @property
    def explored(self) -> ArtifactRef | None:
        """The round's exploration (None when iteration.data has no explore)."""
        return self.data.explored


def one_round(
    plan: Plan,
    round: int,
    policy: ArtifactRef,
    boot: dict[str, ArtifactRef],
    earlier: list[RoundResult],
) -> RoundResult:
    """Round r >= 1: the round's data from pi_r (explore -> pairs and groups, and with reflect
    its failures -> hinted revisions; mcts -> trees -> revisions and good paths, as
    iteration.data says), the configured training steps (``train_round``), then pi_{r+1}
    evaluated. With sft.replay, the round's sft also reads the ``earlier`` rounds'
    explorations."""
    kinds = plan.cfg.iteration.data
    # With resample (which the config allows only after a step before grpo) the round explores
    # twice; ``stage explore`` (or pareto) stops at the second.
    again = plan.cfg.grpo.resample
    explored = spliced = reflected = pairs = groups = None
    if "explore" in kinds:
        explored = _step(plan, "explore", round, policy, boot["train"], last=not again)
        mined = _run(plan, "pareto", round, explored, boot["expert"], last=not again)
        assert isinstance(mined, tuple)  # pareto writes two artifacts
        pairs, groups = mined
        if "reflect" in kinds:
            reflected = _step(plan, "reflect", round, explored, policy, boot["train"])
    if "mcts" in kinds:
        trees = _step(plan, "mcts", round, policy, boot["train"], explored=explored)
        spliced = _step(plan, "splice", round, trees, policy, boot["train"])
    own = [ref for ref in (explored, reflected, spliced) if ref is not None]
    if plan.cfg.sft.replay:
        own += explorations(earlier)
    data = RoundData(policy, own, pairs, groups, explored)
    policy, trained, resampled = train_round(plan, round, data, boot)
    return RoundResult(policy, data, trained, spliced, reflected, resampled)


def rft_reads_exploration_only(plan: Plan, rounds: int) -> bool:
    """Whether a walk of ``rounds`` rounds can leave out the last round's training: a stage
    rerun of rft in that round reads its exploration, which comes before the round's training,
    and nothing the training writes. Not with grpo.resample, whose second exploration (which
    rft reads too) samples from a policy the round trained."""
    return (
        plan.stop_at == ("rft", rounds)
        and "explore" in plan.cfg.iteration.data
        and not plan.cfg.grpo.resample
    )


def explore_only(
    plan: Plan, round: int, policy: ArtifactRef, boot: dict[str, ArtifactRef]
) -> RoundResult:
    """Round r's exploration alone (``rft_reads_exploration_only``): no mining, search or
    training; the round's policy stays pi_r."""
    say(f"[round {round}] rft reads this round's exploration only: its other stages do not run")
    explored = _step(plan, "explore", round, policy, boot["train"])
    return RoundResult(policy, RoundData(policy, [explored], None, None, explored), trained=[])


def train_round(
    plan: Plan, round: int, data: RoundData, boot: dict[str, ArtifactRef]
) -> tuple[ArtifactRef, list[ArtifactRef], ArtifactRef | None]:
    """The round's training steps (each from the previous step's checkpoint) on ``data``, then
    the last checkpoint evaluated: (that checkpoint, every step's checkpoint, grpo's resampled
    exploration or None). With grpo.resample, a grpo step after another step first explores
    again from the policy it starts from and trains on those groups."""
    policy, groups = data.start, data.groups
    resampled = None
    trained: list[ArtifactRef] = []
    for name in plan.cfg.iteration.steps:
        if name == "grpo" and plan.cfg.grpo.resample and trained:
            # The round's groups were sampled before the earlier steps changed the policy:
            # sample them again, same tasks and settings, from the policy grpo starts from.
            resampled = _step(plan, "explore", round, policy, boot["train"])
            mined = _run(plan, "pareto", round, resampled, boot["expert"])
            assert isinstance(mined, tuple)
            groups = mined[1]
        # dpo and grpo run only with explore (the config refuses them otherwise); grpo reads the
        # explore and expert artifacts only with MIX on (grpo.expert_weight > 0).
        inputs_of: dict[str, tuple[StageInput | None, ...]] = {
            "sft": (data.own + [boot["expert"]] if plan.cfg.sft.with_expert else data.own,),
            "dpo": (data.pairs,),
            "grpo": (groups, resampled or data.explored, boot["expert"]),
        }
        inputs = [x for x in inputs_of[name] if x is not None]
        assert len(inputs) == len(inputs_of[name]), f"{name} lacks its data"
        policy = _step(
            plan, name, round, policy, *inputs, val_tasks=boot["val"], val_demos=boot["expert"]
        )
        trained.append(policy)
    _step(plan, "evaluate", round, policy, boot["test"])
    return policy, trained, resampled


def repeat_last_round(
    plan: Plan, round: int, last: RoundResult, boot: dict[str, ArtifactRef]
) -> None:
    """iteration.repeats > 1: the last round's training steps again on the same data, with
    training seeds train_seed + 1, + 2, ..., each evaluated (the report averages them task by
    task). The first repeat is the round itself, so a run's ids do not depend on repeats."""
    seed, n = plan.cfg.train_seed, plan.cfg.iteration.repeats
    for k in range(1, n):
        say(
            f"[round {round}] repeat {k + 1} of {n}: the round's training steps, train seed {seed + k}"
        )
        run = plan.cfg.run.model_copy(update={"train_seed": seed + k})
        again = replace(plan, cfg=plan.cfg.model_copy(update={"run": run}), repeat=True)
        train_round(again, round, last.data, boot)


def explorations(rounds: list[RoundResult]) -> list[ArtifactRef]:
    """Every exploration of these rounds, in order (grpo.resample's after its round's first):
    what rft reads, and what sft.replay adds to a later round's sft."""
    return [ref for r in rounds for ref in (r.explored, r.resampled) if ref is not None]


def baselines(
    plan: Plan, round: int, boot: dict[str, ArtifactRef], rounds: list[RoundResult]
) -> None:
    """After the last round: each configured baseline trained from the SFT policy and
    evaluated on the same test tasks (sft_more with the rounds' compute, rft on their explore
    data, grpo's resampled explorations included). A stage rerun of one baseline runs that one
    only (they read nothing of each other) and stops after its last evaluation."""
    explored = explorations(rounds)
    names: list[str] = list(plan.cfg.baselines)
    if plan.stop_at is not None and plan.stop_at[0] in BASELINES:
        names = [plan.stop_at[0]]
    for name in names:
        data: tuple[StageInput, ...] = (
            (boot["expert"], [ref for r in rounds for ref in r.trained])
            if name == "sft_more"
            else (explored, boot["expert"])
        )
        section = getattr(plan.cfg, name)
        seed = plan.cfg.baseline_seed(section)
        for k in range(section.repeats):
            # A repeat is the same stage with the next data order: a plan whose config says so
            # (the first keeps the run's config, so its id is the one a single run has).
            cfg = plan.cfg
            if k:
                cfg = cfg.model_copy(update={name: section.model_copy(update={"seed": seed + k})})
            ref = _step(
                replace(plan, cfg=cfg),
                name,
                round,
                boot["policy"],
                *data,
                val_tasks=boot["val"],
                val_demos=boot["expert"],
                last=False,
            )
            _step(plan, "evaluate", round, ref, boot["test"])
            if plan.stop_at == (name, round) and k == section.repeats - 1:
                raise StopAfter(ref)  # a baseline's rerun ends with its evaluation


def check_run(cfg: Config, rounds: int, stop_at: tuple[str, int] | None = None) -> None:
    """Raise a one-line ValueError, before any work, when the walk would fail at a later stage
    for a reason the config already shows (a splice over an env with no no-op action, revision
    thoughts the embedded tokenizer cannot spell)."""
    if splices(cfg, rounds, stop_at):
        stages.splice.check_envs(cfg)
        stages.splice.check_thoughts(cfg)


def _walk(plan: Plan, rounds: int, with_baselines: bool = True) -> StageResult | None:
    try:
        boot = bootstrap(plan)
        policy = boot["policy"]
        done: list[RoundResult] = []
        for r in range(1, rounds + 1):
            if r == rounds and rft_reads_exploration_only(plan, rounds):
                done.append(explore_only(plan, r, policy, boot))
                break
            done.append(one_round(plan, r, policy, boot, done))
            policy = done[-1].policy
        if with_baselines and done:
            baselines(plan, rounds, boot, done)
            if plan.stop_at is None:  # a whole run, not a stage rerun
                repeat_last_round(plan, rounds, done[-1], boot)
        return policy
    except StopAfter as stop:
        return stop.ref


def _plan(config: str | None, overrides: list[str], **kw) -> Plan:
    cfg = load_config(config, overrides)
    # The built-in defaults are not the demo's yaml (another lr, env options, tokenizer): a run
    # started outside the checkout by mistake would otherwise go unnoticed.
    source = config or "the built-in defaults (no config file)"
    say(f"config: {source}" + (f" with {' '.join(overrides)}" if overrides else ""))
    store = Store(cfg.run.store_root(), cfg.run.name)
    tracker = Tracker(cfg.tracking_uri(), cfg.tracking.experiment, enabled=cfg.tracking.enabled)
    return Plan(cfg=cfg, store=store, tracker=tracker, **kw)


def _tracked(plan: Plan, name: str, rounds: int, with_baselines: bool = True) -> StageResult | None:
    """Walk the DAG inside an MLflow run tree; afterwards ``plan.parent_run`` is its parent run
    (new, or the existing one when every artifact already had its run: see flywheel.tracking)."""
    check_run(plan.cfg, rounds, plan.stop_at)  # before any work, e.g. a splice that must fail
    if plan.recorded_rounds is not None:  # a whole run: from now on a report shows its rows
        write_state(plan.store, plan.recorded_rounds, [], finished=False)
    plan.tracker.begin(
        name,
        run=plan.cfg.run.name,
        rounds=rounds,
        params=plan.cfg.model_dump(),
        tags={"store": plan.cfg.run.store_root()},
    )
    status = "FAILED"
    try:
        result = _walk(plan, rounds, with_baselines)
        status = "FINISHED"
    finally:
        plan.parent_run = plan.tracker.finish(status)
    if plan.parent_run:
        print(f"MLflow: {plan.tracker.ui_url(plan.parent_run)}", flush=True)
    return result


@flow(name="flywheel", validate_parameters=False)
def flywheel_flow(
    config: str | None = None,
    overrides: list[str] | None = None,
    rounds: int | None = None,
    force: bool = False,
) -> list[dict]:
    """Bootstrap then ``rounds`` rounds (default: the config's run.rounds); prints the report."""
    plan = _plan(config, list(overrides or []), force_all=force)
    n = plan.cfg.run.rounds if rounds is None else rounds
    plan.recorded_rounds = n
    _tracked(plan, f"{plan.cfg.run.name}", n)
    write_state(plan.store, n, plan.evaluations, finished=True)
    rows = collect(plan.store)
    print(format_table(rows))
    if rows:  # the HTML report of the run, next to the work folder's other outputs, and in MLflow
        page = write_html(plan.store, Path(plan.cfg.run.work_dir) / "report" / plan.cfg.run.name)
        plan.tracker.log_file(plan.parent_run, page.parent, artifact_path="report")
        print(f"HTML report: {page}", flush=True)
    return rows


@flow(name="iteration", validate_parameters=False)
def iteration_flow(
    config: str | None = None, overrides: list[str] | None = None, round: int = 1
) -> str | None:
    """One round: everything before it is a cache hit (or is computed if missing)."""
    plan = _plan(config, list(overrides or []))
    ref = _tracked(plan, f"{plan.cfg.run.name}-round-{round}", round, with_baselines=False)
    assert not isinstance(ref, tuple)  # without stop_at the walk returns the last policy
    return ref.id if ref else None


def check_stage(name: str, round: int) -> None:
    """Raise a one-line ValueError when ``name`` is not a stage or does not run in ``round``."""
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    if round < 0 or round == 0 and name in ROUNDS_ONLY or round > 0 and name in BOOTSTRAP_ONLY:
        raise ValueError(f"stage {name} does not run in round {round}")


def check_plan(cfg: Config, name: str, round: int) -> None:
    """Raise a one-line ValueError, before any work, when the config never runs ``name`` in
    ``round`` (a training step not in iteration.steps, a baseline not in baselines)."""
    check_stage(name, round)
    if name == "index" and not stages.index.artifact_config(cfg):
        raise ValueError("stage index does not run: no env searches a corpus without an index")
    if name in ("sft", "dpo", "grpo") and round > 0 and name not in cfg.iteration.steps:
        raise ValueError(
            f"stage {name} does not run in round {round} with iteration.steps={cfg.iteration.steps}"
        )
    for kind, names in DATA_STAGES.items():
        if name in names and kind not in cfg.iteration.data:
            raise ValueError(f"stage {name} does not run with iteration.data={cfg.iteration.data}")
    if name in BASELINES and name not in cfg.baselines:
        raise ValueError(f"stage {name} does not run with baselines={cfg.baselines}")


@flow(name="stage", validate_parameters=False)
def stage_flow(
    name: str,
    round: int = 0,
    config: str | None = None,
    overrides: list[str] | None = None,
    force: bool = False,
) -> str:
    """One stage of one round (``force`` writes a new version even when nothing changed)."""
    check_stage(name, round)
    plan = _plan(config, list(overrides or []), stop_at=(name, round))
    check_plan(plan.cfg, name, round)
    if force:
        plan.force.add((name, round))
    rounds = max(round, 0)
    result = _tracked(
        plan, f"{plan.cfg.run.name}-{name}-round-{round}", rounds, with_baselines=name in BASELINES
    )
    refs: tuple[ArtifactRef, ...] = (
        () if result is None else result if isinstance(result, tuple) else (result,)
    )
    if result is None or refs[0].stage != name:
        raise ValueError(
            f"stage {name} does not run in round {round} with iteration.steps={plan.cfg.iteration.steps}"
        )
    return " ".join(ref.id for ref in refs)


if __name__ == "__main__":
    flywheel_flow()
