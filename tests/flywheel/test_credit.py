"""flywheel/credit.py: departures from the oracle, GRPO's weights netted inside a group on a
hand-built group (every number worked out by hand below), the greedy check, and
``flywheel credit`` on the shared tiny flywheel's explore artifact."""

from __future__ import annotations

import math

import polars as pl
import pytest
import torch

from flywheel.cli import main
from flywheel.credit import (
    AFTER,
    DEPARTURE,
    NO_ORACLE,
    ON_PATH,
    Sample,
    advantages,
    cut_after_departure,
    departure,
    greedy_share,
    measure,
)
from flywheel.training.losses import group_advantages

G = ("arith", "t0")


def sample(ids, mask, reward, group=G):
    return Sample(group, list(ids), list(mask), float(reward), reward >= 1.0)


def test_departure_is_the_common_prefix_length():
    assert departure([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert departure([1, 2], [1, 2, 3]) == 2  # a prefix never departs
    assert departure([5], [1]) == 0


def test_advantages_are_grpos():
    for rewards in ([1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.5, 0.25, 1.0, 0.0, 0.0], [1.0]):
        expected = group_advantages(torch.tensor(rewards), [0] * len(rewards))
        assert advantages(rewards) == pytest.approx(expected.tolist())


def test_a_shared_prefix_cancels_and_the_rest_lands_at_and_after_the_departure():
    # prompt 7 7 (untrained), then one success and two failures; the oracle is the success.
    #   success   7 7 | 1 2 3      rewards 1, 0, 0: advantages 4/3... worked out below
    #   fail a    7 7 | 1 5 6      departs at position 3 (token 5), in turn 1
    #   fail b    7 7 | 1 2 8      departs at position 4 (token 8)
    mask = [0, 0, 1, 1, 1]
    good = sample([7, 7, 1, 2, 3], mask, 1)
    a = sample([7, 7, 1, 5, 6], mask, 0)
    b = sample([7, 7, 1, 2, 8], mask, 0)
    # an all-equal group is left out; a group without an oracle counts under NO_ORACLE
    same = [sample([7, 1], [0, 1], 0, ("arith", "t1")), sample([7, 2], [0, 1], 0, ("arith", "t1"))]
    lone = [sample([7, 1], [0, 1], 1, ("arith", "t2")), sample([7, 2], [0, 1], 0, ("arith", "t2"))]
    found = measure([good, a, b, *same, *lone], {G: good.ids})

    w_good, w_fail, _ = advantages([1, 0, 0])
    assert w_good == pytest.approx(2 / math.sqrt(1 / 3) / 3, rel=1e-5)  # (1 - 1/3) / std
    assert found.groups == 2 and found.samples == 5 and found.failed == 3
    assert found.failed_tokens == 3 + 3 + 1
    assert found.failed_tokens_on_path == 1 + 2  # a: token 1; b: tokens 1 2
    assert found.departing_turn == {1: 2}
    # gross: every trained position's |advantage|; t2's pair has advantages +-1/sqrt(2)
    w2 = advantages([1, 0])[0]
    assert found.gross == pytest.approx(3 * w_good + 6 * abs(w_fail) + 2 * w2, rel=1e-6)
    # nodes: 1 (all three: net 0), 2 (good + b), 3 (good), 5 (a), 6 (a), 8 (b); t2: two leaves
    net = 0 + abs(w_good + w_fail) + w_good + 3 * abs(w_fail) + 2 * w2
    assert found.net == pytest.approx(net, rel=1e-6)
    assert found.cancelled == pytest.approx(1 - net / found.gross, rel=1e-6) and found.cancelled > 0
    assert found.pushed_down[ON_PATH] == pytest.approx(3 * abs(w_fail), rel=1e-6)
    assert found.net_down[ON_PATH] == pytest.approx(0.0, abs=1e-9)  # node 1 and node 2 net >= 0
    assert found.pushed_down[DEPARTURE] == pytest.approx(2 * abs(w_fail), rel=1e-6)
    assert found.net_down[DEPARTURE] == pytest.approx(2 * abs(w_fail), rel=1e-6)
    assert found.pushed_down[AFTER] == pytest.approx(abs(w_fail), rel=1e-6)  # a's token 6
    assert found.pushed_down[NO_ORACLE] == pytest.approx(w2, rel=1e-6)
    assert [(pos, token) for _, pos, token in found.departures] == [(3, 2), (4, 3)]


def test_greedy_share_asks_whether_the_policy_itself_leaves_the_oracle_there():
    mask = [0, 1, 1]
    # (sample, departure, the oracle's token there); the policy's argmax is always token 1
    slip = (sample([7, 3, 2], mask, 0), 1, 1)  # oracle says 1, argmax 1: greedy follows it
    mistake = (sample([7, 1, 4], mask, 0), 2, 2)  # oracle says 2, argmax 1: greedy leaves too
    both_wrong = (sample([7, 5, 4], mask, 0), 1, 9)  # sampled 5, argmax 1, oracle 9
    untrained = (sample([7, 1, 2], [0, 0, 1], 0), 1, 4)  # departs on a prompt token
    beyond = (sample([7, 1], [0, 1], 0), 2, 4)  # never departs inside its own ids
    past_oracle = (sample([7, 1, 2], mask, 0), 2, -1)  # the oracle ended before it
    seen = []

    def first(context):
        seen.append(list(context))
        return 1

    found = greedy_share([slip, mistake, both_wrong, untrained, beyond, past_oracle], first)
    assert found == (3, 2)
    assert seen == [[7], [7, 1], [7]]


@pytest.fixture(scope="module")
def tiny(tiny_cli):
    return tiny_cli


def credit(capsys, tiny, stage: str, round: int):
    """``flywheel credit`` on the tiny run's artifact of ``stage``: (its ref, rc, out, err)."""
    path, store, made = tiny
    # the run's own artifact: other tests of the session add versions to the shared store
    (ref,) = [r for r in store.list(round=round, stage=stage) if r.id in made]
    capsys.readouterr()
    rc = main(["credit", "--config", str(path), ref.id])
    out, err = capsys.readouterr()
    return ref, rc, out, err


@pytest.mark.slow  # the shared tiny flywheel run
def test_credit_reads_a_real_explore_artifact(tiny, capsys):
    explore, rc, out, _ = credit(capsys, tiny, "explore", 1)
    assert rc == 0
    frame = pl.from_arrow(tiny[1].read(explore))
    varied = (
        frame.group_by("task_id")
        .agg(n=pl.len(), failed=(~pl.col("success")).sum(), k=pl.col("reward").n_unique())
        .filter(pl.col("k") > 1)
    )
    assert f"{explore.id}: {frame.height} samples from {explore.inputs[0]}" in out
    assert (
        f"groups with differing rewards: {varied.height} ({varied['n'].sum()} samples, "
        f"{varied['failed'].sum()} failed)" in out
    )
    assert "cancels inside the groups" in out
    assert "departures where the policy's greedy choice leaves the oracle too:" in out


@pytest.mark.slow  # the shared tiny flywheel run
def test_credit_refuses_an_env_the_config_does_not_name_before_loading_the_policy(
    tiny, capsys, monkeypatch
):
    path, store, made = tiny
    (explore,) = [r for r in store.list(round=1, stage="explore") if r.id in made]

    def no_load(*args, **kwargs):
        raise AssertionError("the policy was loaded before the env was checked")

    monkeypatch.setattr("flywheel.checkpoint.load_policy", no_load)
    capsys.readouterr()
    rc = main(
        ["credit", "--config", str(path), explore.id, "envs.0.name=other", "envs.0.suite=arith"]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert err.strip() == (
        f"flywheel: error: {explore.id} explored env 'arith', which the config does not name"
    )


@pytest.mark.slow  # the shared tiny flywheel run
def test_credit_refuses_an_artifact_that_is_not_an_exploration(tiny, capsys):
    sft, rc, _, err = credit(capsys, tiny, "sft", 0)
    assert rc == 2
    assert (
        err.strip()
        == f"flywheel: error: {sft.id} is a sft artifact; credit reads an explore artifact"
    )


def test_cut_after_departure_keeps_the_first_token_off_every_better_path():
    mask = [0, 1, 1, 1, 1]
    ids = [7, 1, 2, 9, 9]
    # shares 1 token with the first better sample, 2 with the second: departs at position 3
    assert cut_after_departure(ids, mask, [[7, 1, 5, 5, 5], [7, 1, 2, 3, 3]]) == [0, 1, 1, 1, 0]
    assert cut_after_departure(ids, mask, [[8]]) == [0, 0, 0, 0, 0]  # departs on the prompt
    assert cut_after_departure(ids, mask, []) == mask  # nothing better: left as it is
