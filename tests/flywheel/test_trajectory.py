"""flywheel.trajectory: the row round trip, where stored ids go (encode, encode_sampled, chat),
and how they follow a cut (split, stored_span) or a join (+). Encodings are checked against
sequences built by hand from the tiny tokenizer's template: ``<|role|>content<|end|>\\n``."""

from __future__ import annotations

import itertools

import polars as pl
import pytest

from data_contracts import table_from_rows, trajectories
from flywheel.trajectory import Trajectory, align_turn_ids, stored_span


def msg(role: str, content: str, loss: bool = False) -> dict:
    return {"role": role, "content": content, "loss": loss}


OPENING = [msg("user", "Solve the task."), msg("assistant", "Ok."), msg("user", "What is 37 + 12?")]
TURNS = [
    msg("assistant", "<python>print(37 + 12)</python>", True),
    msg("user", "49"),
    msg("assistant", "<answer>49</answer>", True),
]


def row(messages: list[dict], ids: list[list[int]], source: str = "explore") -> dict:
    """A whole trajectories row; log-probs -0.125, -0.25, ... along the stored ids (exact in
    float32, so a row read back from its table is equal)."""
    step = itertools.count(1)
    return {
        "task_id": "t0", "env": "arith", "split": "train", "round": 1, "policy": "sft-abc",
        "source": source, "sample_idx": 2, "messages": messages, "reward": 1.0, "success": True,
        "steps": 2, "tool_calls": 1, "tool_errors": 0, "tool_ok": 1, "invalid_actions": 0,
        "tokens": sum(map(len, ids)), "finish_reason": "done", "seed": 5,
        "turn_token_ids": ids,
        "turn_logprobs": [[-0.125 * next(step) for _ in turn] for turn in ids],
    }  # fmt: skip


class Expect:
    """The hand-built sequence: pieces of ids, each trained or not."""

    def __init__(self, tokenizer):
        self.tok, self.ids, self.mask = tokenizer, [], []

    def add(self, ids: list[int], trained: bool = False) -> Expect:
        self.ids += ids
        self.mask += [int(trained)] * len(ids)
        return self

    def text(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def user(self, content: str) -> Expect:
        return self.add(self.text(f"<|user|>{content}<|end|>\n"))

    def assistant(self, body: list[int], trained: bool, *, cut: bool = False) -> Expect:
        """Header, the turn's body (content and end-of-turn token), the newline after it. A
        body ``cut`` before its end-of-turn token gets the one the template writes, untrained."""
        self.add(self.text("<|assistant|>")).add(body, trained)
        if cut:
            self.add([self.tok.eos_token_id])
        return self.add(self.text("\n"))

    def said(self, content: str, trained: bool) -> Expect:
        """An assistant turn tokenized from its text."""
        return self.assistant(self.text(content) + [self.tok.eos_token_id], trained)


@pytest.fixture
def stored(tokenizer):
    """Ids a policy generated for TURNS' two turns: "49" as "4", "9" (text would give one
    piece), and a second turn cut at max_new_tokens (no end-of-turn token)."""
    ids = tokenizer.convert_tokens_to_ids
    return [ids(["<python>", "print", "(", "37", " +", " ", "12", ")", "</python>", "<|end|>"]),
            ids(["<answer>", "4", "9"])]  # fmt: skip


def test_from_row_and_to_row_round_trip(stored):
    full = row(OPENING + TURNS, stored)
    traj = Trajectory.from_row(full)
    assert traj.messages == OPENING + TURNS and traj.turn_token_ids == stored
    assert traj.fields["task_id"] == "t0" and "messages" not in traj.fields
    assert traj.to_row() == full
    # Through the contract's table and back, as a stage reads it.
    [read] = table_from_rows(trajectories.CONTRACT, [full]).to_pylist()
    assert read == full and Trajectory.from_row(read).to_row() == full


def test_stored_ids_belong_to_the_last_assistant_messages():
    assert align_turn_ids(OPENING + TURNS, [[1], [2]]) == [[], [1], [2]]
    assert align_turn_ids(OPENING + TURNS, [[0], [1], [2]]) == [[0], [1], [2]]
    assert Trajectory(OPENING + TURNS).turn_ids() == [[], [], []]
    with pytest.raises(
        ValueError, match="trajectory arith/t0 sample 2: 3 stored turns for 1 assistant"
    ):
        Trajectory.from_row(row(OPENING, [[1], [2], [3]])).turn_ids()


def test_expert_row_is_encoded_from_text(tokenizer):
    ids, mask = Trajectory.from_row(row(OPENING + TURNS, [], source="expert")).encode(tokenizer)
    want = Expect(tokenizer).user("Solve the task.").said("Ok.", False).user("What is 37 + 12?")
    want.said(TURNS[0]["content"], True).user("49").said(TURNS[2]["content"], True)
    assert (ids, mask) == (want.ids, want.mask)


def test_explore_row_trains_its_stored_ids(tokenizer, stored):
    ids, mask = Trajectory.from_row(row(OPENING + TURNS, stored)).encode(tokenizer)
    want = Expect(tokenizer).user("Solve the task.").said("Ok.", False).user("What is 37 + 12?")
    want.assistant(stored[0], True).user("49").assistant(stored[1], True, cut=True)
    assert (ids, mask) == (want.ids, want.mask)
    assert ids != Trajectory.from_row(row(OPENING + TURNS, [])).encode(tokenizer)[0]


def test_a_generated_opening_turn_keeps_its_ids_untrained(tokenizer, stored):
    ok = tokenizer.convert_tokens_to_ids(["O", "k", ".", "<|end|>"])  # not how text tokenizes
    ids, mask = Trajectory.from_row(row(OPENING + TURNS, [ok, *stored])).encode(tokenizer)
    want = Expect(tokenizer).user("Solve the task.").assistant(ok, False)
    assert (ids[: len(want.ids)], mask[: len(want.ids)]) == (want.ids, want.mask)


def test_revision_row_prefix_from_text_and_continuation_on_stored_ids(tokenizer, stored):
    """As splice builds it: a generated prefix (not trained), a revision turn (trained, not
    generated), then the good continuation: only the continuation keeps stored ids."""
    prefix = Trajectory.from_turns(
        [msg("assistant", "<answer>3</answer>"), msg("user", "Invalid action")], [[7, 8]], [[-1.0, -1.0]]
    )  # fmt: skip
    revision = Trajectory([msg("assistant", "Ok.", True), msg("user", "Tom has 5 apples")])
    continuation = Trajectory.from_turns(TURNS, stored, [[-0.5] * len(t) for t in stored])
    spliced = Trajectory(OPENING) + prefix + revision + continuation
    assert spliced.turn_token_ids == stored
    assert (Trajectory(OPENING) + prefix).turn_token_ids == [[7, 8]]  # nothing ended the run yet
    ids, mask = spliced.encode(tokenizer)
    want = Expect(tokenizer).user("Solve the task.").said("Ok.", False).user("What is 37 + 12?")
    want.said("<answer>3</answer>", False).user("Invalid action")
    want.said("Ok.", True).user("Tom has 5 apples")
    want.assistant(stored[0], True).user("49").assistant(stored[1], True, cut=True)
    assert (ids, mask) == (want.ids, want.mask)


def test_from_turns_keeps_the_last_run_of_generated_turns():
    messages = [msg("assistant", "a"), msg("user", "o"), msg("assistant", "b"),
                msg("assistant", "c")]  # fmt: skip
    traj = Trajectory.from_turns(messages, [[1], None, [3]], [[-1.0], None, [-3.0]])
    assert (traj.turn_token_ids, traj.turn_logprobs) == ([[3]], [[-3.0]])
    traj = Trajectory.from_turns(messages, [[1], [2], [3]], [[-1.0], [-2.0], [-3.0]])
    assert traj.turn_token_ids == [[1], [2], [3]]
    assert Trajectory.from_turns(messages, [[1], [2], []], [[], [], []]).turn_token_ids == []
    with pytest.raises(ValueError, match="2 id lists and 3 log-prob lists for 3 assistant"):
        Trajectory.from_turns(messages, [[1], [2]], [[], [], []])


def test_encode_sampled_trains_the_generated_turns_with_their_logprobs(tokenizer, stored):
    # Flags do not matter: the expert-written first turn is not trained even with loss true,
    # the generated second one is even with loss false.
    messages = [*OPENING, TURNS[0], TURNS[1], {**TURNS[2], "loss": False}]
    traj = Trajectory.from_row(row(messages, stored[1:]))
    ids, mask, old = traj.encode_sampled(tokenizer)
    want = Expect(tokenizer).user("Solve the task.").said("Ok.", False).user("What is 37 + 12?")
    want.said(TURNS[0]["content"], False).user("49").assistant(stored[1], True, cut=True)
    assert (ids, mask) == (want.ids, want.mask)
    start = mask.index(1)
    assert old[start : start + 3] == [-0.125, -0.25, -0.375]
    assert not any(old[:start]) and not any(old[start + 3 :])


def test_encode_sampled_errors_name_the_trajectory(tokenizer, stored):
    full = row(OPENING + TURNS, stored)
    broken = full | {"turn_logprobs": [full["turn_logprobs"][0][:-1], full["turn_logprobs"][1]]}
    with pytest.raises(ValueError, match="arith/t0 sample 2: turn_token_ids and turn_logprobs"):
        Trajectory.from_row(broken).encode_sampled(tokenizer)
    more = row(OPENING[:2], stored)
    with pytest.raises(ValueError, match="arith/t0 sample 2: 2 stored turns for 1 assistant"):
        Trajectory.from_row(more).encode_sampled(tokenizer)


def test_chat_is_the_engine_prompt(stored):
    chat = Trajectory.from_row(row(OPENING + TURNS, stored)).chat(session=3)
    assert chat.messages == [{"role": m["role"], "content": m["content"]} for m in OPENING + TURNS]
    assert (chat.turn_token_ids, chat.session) == ([[], *stored], 3)


@pytest.mark.parametrize(
    ("at", "head_ids", "tail_ids"),
    [
        (0, [], ["ok", "a", "b"]),
        (2, ["ok"], ["a", "b"]),  # "Ok." generated: its ids stay in the head
        (3, ["ok"], ["a", "b"]),
        (4, ["ok", "a"], ["b"]),  # a cut with ids on both sides
        (6, ["ok", "a", "b"], []),
    ],
)
def test_split_moves_the_ids_with_their_turns(at, head_ids, tail_ids):
    named = {"ok": [1], "a": [2, 3], "b": [4]}
    traj = Trajectory.from_row(row(OPENING + TURNS, list(named.values())))
    head, tail = traj.split(at)
    assert head.messages == traj.messages[:at] and tail.messages == traj.messages[at:]
    assert head.turn_token_ids == [named[k] for k in head_ids]
    assert tail.turn_token_ids == [named[k] for k in tail_ids]
    assert len(head.turn_logprobs) == len(head_ids) and len(tail.turn_logprobs) == len(tail_ids)
    assert (head + tail) == traj and head.fields == tail.fields == traj.fields


def test_every_assistant_message_keeps_its_ids_across_a_split():
    for stored in ([[2, 3], [4]], [[1], [2, 3], [4]], [[4]], []):
        traj = Trajectory(OPENING + TURNS, stored, [[-1.0] * len(t) for t in stored])
        for at in range(len(traj.messages) + 1):
            head, tail = traj.split(at)
            assert head.turn_ids() + tail.turn_ids() == traj.turn_ids()
            assert head + tail == traj
    head, tail = Trajectory(OPENING + TURNS, [[2, 3], [4]]).split(2)
    assert (head.turn_token_ids, tail.turn_token_ids) == ([], [[2, 3], [4]])


def test_stored_span_is_the_same_rule_on_polars_columns():
    cases = [
        (n, g, first, stop)
        for n in range(4)
        for g in range(n + 1)
        for first in range(n + 1)
        for stop in range(first, n + 1)
    ]
    frame = pl.DataFrame(cases, schema=["n", "g", "first", "stop"], orient="row")
    start, end = stored_span(*(pl.col(c) for c in frame.columns), maximum=pl.max_horizontal)
    got = frame.select(start=start, end=end).rows()
    assert got == [stored_span(*case) for case in cases]
    # By hand: 3 assistant messages, 2 stored lists (the first message is tokenized from text).
    assert stored_span(3, 2, 0, 1) == (0, 0)
    assert stored_span(3, 2, 0, 2) == (0, 1)
    assert stored_span(3, 2, 1, 3) == (0, 2)
    assert stored_span(3, 2, 2, 3) == (1, 2)
