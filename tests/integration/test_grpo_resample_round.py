"""A round with ``iteration.steps=[sft, grpo]`` and ``grpo.resample`` through the real flow: after
the round's SFT step the round explores again from the SFT'd policy, and grpo trains on the
groups of that exploration, not on those the round's starting policy sampled; rft reads both
explorations. Without ``resample`` grpo trains on the round's first groups (the same walk,
one exploration fewer)."""

from __future__ import annotations

import contextlib
import io

import pytest

from flywheel.config import load_config
from flywheel.store import Store
from tests.conftest import run_flywheel, stage_lines, tiny_overrides

OVERRIDES = (
    "evaluate.untrained=false",
    "iteration.steps=[sft,grpo]",
    "sft.with_expert=true",
    "grpo.micro_batch_size=8",
    "grpo.max_length=256",
    "grpo.max_steps=2",
    "baselines=[rft]",
)


@pytest.mark.integration
def test_grpo_resample_explores_again_from_the_policy_it_starts_from(tmp_path):
    overrides = tiny_overrides(tmp_path, *OVERRIDES, "grpo.resample=true")
    printed, _, _ = run_flywheel(overrides, rounds=1)
    round1 = [stage for r, stage, _, _ in stage_lines(printed) if r == 1]
    assert round1 == [
        "explore", "pareto", "pareto", "sft",
        "explore", "pareto", "pareto", "grpo", "evaluate",
        "rft", "evaluate",
    ], printed[-3000:]  # fmt: skip

    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    (sft0,) = store.list(0, "sft")
    (sft1,) = store.list(1, "sft")
    (grpo,) = store.list(1, "grpo")
    (rft,) = store.list(1, "rft")
    first, again = sorted(store.list(1, "explore"), key=lambda ref: ref.inputs[0] != sft0.id)
    assert first.inputs[0] == sft0.id and again.inputs[0] == sft1.id
    assert first.inputs[1:] == again.inputs[1:]  # the same train tasks
    groups = {ref.inputs[0]: ref for ref in store.list(1, "pareto") if ref.kind == "groups"}
    assert grpo.inputs[:2] == [sft1.id, groups[again.id].id]
    # the rows grpo reads were sampled by the policy it starts from
    sampled_by = set(store.read(again, columns=["policy"]).column("policy").to_pylist())
    assert sampled_by == {sft1.id}
    assert set(store.read(groups[again.id], columns=["policy"]).column("policy").to_pylist()) <= {
        sft1.id
    }
    assert {first.id, again.id} <= set(rft.inputs)

    # The same run without resample: the round's first exploration feeds grpo, and a changed
    # grpo input reruns grpo and what follows only.
    plain = [o for o in overrides if o != "grpo.resample=true"]
    printed, _, _ = run_flywheel(plain, rounds=1)
    lines = [(s, hit) for r, s, hit, _ in stage_lines(printed) if r == 1]
    assert [s for s, _ in lines] == [
        "explore", "pareto", "pareto", "sft", "grpo", "evaluate", "rft", "evaluate"
    ], printed[-3000:]  # fmt: skip
    assert [hit for _, hit in lines] == [True, True, True, True, False, False, False, False]
    plain_grpo = next(ref for ref in store.list(1, "grpo") if ref.id != grpo.id)
    assert plain_grpo.inputs[:2] == [sft1.id, groups[first.id].id]


@pytest.mark.integration
def test_sft_replay_reads_every_earlier_exploration_as_rft_does(tmp_path):
    overrides = tiny_overrides(
        tmp_path, *OVERRIDES, "grpo.resample=true", "sft.replay=true", "run.rounds=2"
    )
    printed, _, _ = run_flywheel(overrides, rounds=2)
    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    (expert,) = store.list(0, "expert")
    (sft0,) = store.list(0, "sft")
    (grpo1,) = store.list(1, "grpo")
    (sft1,) = store.list(1, "sft")
    (sft2,) = store.list(2, "sft")
    (rft,) = store.list(2, "rft")

    def explorations(round: int, first_from: str) -> list[str]:
        # the round's first exploration, then the one grpo.resample ran after its sft
        refs = store.list(round, "explore")
        return [ref.id for ref in sorted(refs, key=lambda ref: ref.inputs[0] != first_from)]

    round1 = explorations(1, sft0.id)
    round2 = explorations(2, grpo1.id)
    assert len(round1) == len(round2) == 2, printed[-3000:]
    # round 1 has nothing to replay; round 2's sft reads its exploration, then round 1's two
    assert sft1.inputs[1:3] == [round1[0], expert.id]
    assert sft2.inputs[:5] == [grpo1.id, round2[0], *round1, expert.id]
    assert rft.inputs[1:5] == [*round1, *round2]


@pytest.mark.integration
def test_stage_explore_stops_after_the_resampled_exploration(tmp_path):
    """With resample the round explores twice: ``stage explore`` and ``stage pareto`` reach the
    second exploration (sampled by the round's SFT'd policy), not only the first."""
    from flows.flywheel import stage_flow

    overrides = tiny_overrides(tmp_path, *OVERRIDES, "grpo.resample=true")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        explored = stage_flow("explore", round=1, overrides=overrides)
        mined = stage_flow("pareto", round=1, overrides=overrides).split()
    printed = out.getvalue()
    cfg = load_config(None, overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    (sft1,) = store.list(1, "sft")
    assert store.list(1, "grpo") == [], printed[-3000:]  # stopped before grpo
    again = store.get(explored)
    assert again.inputs[0] == sft1.id  # the resampled exploration, not the first
    assert len(store.list(1, "explore")) == 2
    assert [store.get(i).inputs[0] for i in mined] == [explored, explored]
    round1 = [(stage, hit) for r, stage, hit, _ in stage_lines(printed) if r == 1]
    # the second walk finds both explorations and the sft step in the store, then mines
    assert round1[-7:] == [
        ("explore", True), ("pareto", True), ("pareto", True), ("sft", True),
        ("explore", True), ("pareto", False), ("pareto", False),
    ], round1  # fmt: skip
