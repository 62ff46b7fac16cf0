"""flywheel.html_report: on a store written with the real Store and contracts (two envs, the
bootstrap, two rounds, both baselines, explore, GRPO groups and revised trajectories, with
success counts chosen here), every number the pages show equals the artifacts'; trajectory
pages show loss flags; the pages load nothing from elsewhere; a refused or failed write leaves
nothing behind. The last test does the same on the tiny flywheel run."""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import polars as pl
import pytest

from flywheel.cli import main
from flywheel.html_report import _time_section, write_html
from flywheel.metrics import flatten, summarize
from flywheel.pareto import trajectory_ranks
from flywheel.report import COLUMNS, _cell, collect, format_table
from flywheel.store import ArtifactRef, Store
from tests.conftest import write_tiny_yaml

ENVS = ("arith", "toy")
N_TEST = 12  # test tasks per env; task i has difficulty 1 + i % 3, and the first k are solved
# Solved test tasks of arith per (round, policy); toy solves one fewer.
SOLVED = {(0, "init"): 1, (0, "sft"): 3, (1, "dpo"): 6, (2, "dpo"): 8, (2, "sft_more"): 4, (2, "rft"): 5}  # fmt: skip
N_TRAIN, K = 4, 3  # explored tasks per env and samples per task
_tags = itertools.count()


# -- a store with known numbers -----------------------------------------------------------------


def _put(
    store: Store, kind: str, stage: str, rnd: int, rows: list[dict], inputs: list[str], **commit
):
    w = store.writer(kind, stage=stage, round=rnd, config={"tag": next(_tags)}, inputs=inputs)
    w.write_shard(0, rows)
    return w.commit(**commit)


def _messages(question: str, calls: int, answer: str) -> list[dict]:
    msgs = [
        {"role": "user", "content": "Solve it with <python>print(...)</python>.", "loss": False},
        {"role": "assistant", "content": "Ok.", "loss": False},
        {"role": "user", "content": question, "loss": False},
    ]
    for i in range(calls):
        msgs.append({"role": "assistant", "content": f"<python>print({i} + 1)</python>", "loss": True})  # fmt: skip
        msgs.append({"role": "user", "content": str(i + 1), "loss": False})
    msgs.append({"role": "assistant", "content": f"I am done. <answer>{answer}</answer>", "loss": True})  # fmt: skip
    return msgs


def _checkpoint(store: Store, stage: str, rnd: int, inputs: list[str]):
    row = {"policy": stage, "round": rnd, "parent": "", "base": "embedded", "num_params": 1, "train_steps": 1, "final_loss": 1.0}  # fmt: skip
    return _put(store, "checkpoints", stage, rnd, [row], inputs)


def _evaluate(store: Store, policy, rnd: int):
    rows = []
    for env in ENVS:
        solved = SOLVED[(rnd, policy.stage)] - (env == "toy")
        for i in range(N_TEST):
            ok = i < solved
            rows.append(
                {
                    "task_id": f"{env}-test-{i}",
                    "env": env,
                    "difficulty": 1 + i % 3,
                    "policy": policy.id,
                    "policy_stage": policy.stage,
                    "round": rnd,
                    "success": ok,
                    "reward": 1.0 if ok else 0.25,
                    "steps": 2,
                    "tool_calls": 1 + i % 2,
                    "tool_errors": 0,
                    "tool_ok": 1,
                    "tokens": 20 + i,
                    "finish_reason": "done",
                    "messages": _messages(f"test {i}", 1, "3"),
                }  # fmt: skip
            )
    frame = pl.DataFrame(rows).drop("messages")
    summary = flatten(summarize(frame))  # as stages/evaluate.py computes it
    for (env, level), group in frame.group_by(["env", "difficulty"]):
        summary[f"{env}/success_rate_d{level}"] = float(group["success"].mean())
    extra = {"policy": policy.id, "policy_stage": policy.stage}
    return _put(store, "eval", "evaluate", rnd, rows, [policy.id], summary=summary, extra=extra)


def _trajectory(env: str, rnd: int, task: int, k: int, source: str, policy: str) -> dict:
    reward = ((3 * task + k + rnd) % 5) / 4  # 0, .25, .5, .75, 1
    calls = (task + k) % 4
    msgs = _messages(f"{env} train {task}", calls, "3")
    return {
        "task_id": f"{env}-train-{task}", "env": env, "split": "train", "round": rnd,
        "policy": policy, "source": source, "sample_idx": k, "messages": msgs, "reward": reward,
        "success": reward == 1.0, "steps": calls + 1, "tool_calls": calls, "tool_errors": 0,
        "tool_ok": calls, "invalid_actions": 0, "tokens": 10 + 7 * ((task * k + rnd) % 6),
        "finish_reason": "done", "seed": 100 * task + k,
        "turn_token_ids": [[5, 6, 7]] * (calls + 1), "turn_logprobs": [[-0.5, -1.0, -1.5]] * (calls + 1),
    }  # fmt: skip


def _groups_rows(explore: list[dict], rnd: int) -> list[dict]:
    """The arith tasks 0 and 1 as selected GRPO groups."""
    frame = pl.DataFrame(explore)
    ranks = trajectory_ranks(frame)
    rows = []
    for row, rank in zip(explore, ranks, strict=True):
        if row["env"] == "arith" and row["task_id"] in ("arith-train-0", "arith-train-1"):
            keep = ("task_id", "env", "policy", "sample_idx", "reward", "success", "tool_calls", "tool_ok", "invalid_actions", "tokens", "finish_reason", "messages", "turn_token_ids", "turn_logprobs")  # fmt: skip
            rows.append(
                {
                    **{k: row[k] for k in keep},
                    "round": rnd,
                    "group_front": 1,
                    "group_crowding": 1.0,
                    "group_x1": 0.5,
                    "group_x2": 0.25,
                    "group_size": K,
                    "group_mean_reward": 0.5,
                    "pareto_rank": int(rank),
                }  # fmt: skip
            )
    return rows


def build_store(root: Path, run: str = "tiny") -> Store:
    """Round 0 (init, sft), rounds 1-2 (explore, groups, dpo; round 2 also revised
    trajectories), baselines sft_more and rft, and an eval artifact for every policy."""
    store = Store(str(root), run)
    init = _checkpoint(store, "init", 0, [])
    _evaluate(store, init, 0)
    policy = _checkpoint(store, "sft", 0, [init.id])
    _evaluate(store, policy, 0)
    for rnd in (1, 2):
        rows = [_trajectory(env, rnd, t, k, "explore", policy.id) for env in ENVS for t in range(N_TRAIN) for k in range(K)]  # fmt: skip
        explore = _put(store, "trajectories", "explore", rnd, rows, [policy.id])
        _put(store, "groups", "pareto", rnd, _groups_rows(rows, rnd), [explore.id])
        inputs = [policy.id, explore.id]
        if rnd == 2:
            revised = [_trajectory("arith", rnd, t, 9, "revision", policy.id) for t in (1, 2)]
            inputs.append(_put(store, "trajectories", "splice", rnd, revised, [explore.id]).id)
        policy = _checkpoint(store, "dpo", rnd, inputs)
        _evaluate(store, policy, rnd)
    for name in ("sft_more", "rft"):
        _evaluate(store, _checkpoint(store, name, 2, []), 2)
    return store


# -- reading the pages --------------------------------------------------------------------------

VOID = {"meta", "br", "img", "input", "link", "hr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def all(self) -> list[Node]:
        return [self, *(n for child in self.children for n in child.all())]

    def find(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        return [
            n
            for n in self.all()
            if (tag is None or n.tag == tag)
            and (cls is None or cls in n.attrs.get("class", "").split())
            and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def by_id(self, node_id: str) -> Node:
        (hit,) = [n for n in self.all() if n.attrs.get("id") == node_id]
        return hit

    def content(self) -> str:
        return "".join(self.text) + "".join(c.content() for c in self.children)


class _Tree(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = self.at = Node("#root", {})

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs}, self.at)
        self.at.children.append(node)
        if tag not in VOID:
            self.at = node

    def handle_startendtag(self, tag, attrs):
        self.at.children.append(Node(tag, {k: v or "" for k, v in attrs}, self.at))

    def handle_endtag(self, tag):
        node = self.at
        while node.parent is not None and node.tag != tag:
            node = node.parent
        if node.parent is not None:
            self.at = node.parent

    def handle_data(self, data):
        self.at.text.append(data)


def parse(path: Path) -> Node:
    tree = _Tree()
    tree.feed(path.read_text(encoding="utf-8"))
    return tree.root


def rows_of(table: Node) -> list[list[Node]]:
    return [row.find("td") for row in table.find("tr") if row.find("td")]


@dataclass
class Report:
    store: Store
    index: Path
    page: Node


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Report:
    root = tmp_path_factory.mktemp("html-report")
    store = build_store(root / "store")
    index = write_html(store, root / "out")
    return Report(store, index, parse(index))


def evals(store: Store) -> list:
    return store.list(stage="evaluate")


# -- the numbers --------------------------------------------------------------------------------


def test_success_per_round_equals_the_eval_artifacts(report):
    seen = set()
    for ref in evals(report.store):
        for env in ENVS:
            figure = report.page.by_id(f"success-by-round-{env}")
            (mark,) = figure.find(cls="mark", data_eval_id=ref.id)
            p, n = ref.summary[f"{env}/success_rate"], int(ref.summary[f"{env}/n_tasks"])
            assert float(mark.attrs["data-success"]) == p
            assert float(mark.attrs["data-se"]) == pytest.approx(math.sqrt(p * (1 - p) / n))
            # the counts this store was written with
            stage = ref.manifest["policy_stage"]
            assert p == pytest.approx((SOLVED[(ref.round, stage)] - (env == "toy")) / N_TEST)
            kind = "reference" if stage in ("init", "sft_more", "rft") else "point"
            assert kind in mark.attrs["class"].split(), (stage, mark.attrs)
            seen.add((ref.round, stage))
    assert seen == set(SOLVED)
    points = report.page.by_id("success-by-round-arith").find("circle", cls="mark")
    assert [(p.attrs["data-round"], p.attrs["data-policy"]) for p in points] == [("0", "sft"), ("1", "dpo"), ("2", "dpo")]  # fmt: skip
    assert float(points[1].attrs["data-success"]) == 0.5  # 6 of 12
    assert float(points[1].attrs["data-se"]) == pytest.approx(math.sqrt(0.25 / 12))


def test_the_table_holds_the_cells_of_flywheel_report(report):
    rows = collect(report.store)
    table = rows_of(report.page.by_id("evaluations"))
    assert len(table) == len(rows) == 2 * len(SOLVED)
    summaries = {ref.id: ref.summary for ref in evals(report.store)}
    for row, cells in zip(rows, table, strict=True):
        assert [c.content() for c in cells[: len(COLUMNS)]] == [_cell(row, col) for col in COLUMNS]
        assert cells[-1].content() == row["eval_id"]
        summary = summaries[row["eval_id"]]
        for col, cell in zip(COLUMNS, cells, strict=False):
            key = "success_rate" if col == "success" else col
            if f"{row['env']}/{key}" in summary:
                assert float(cell.attrs["data-value"]) == summary[f"{row['env']}/{key}"], col
    assert report.page.by_id("report-text").content() == format_table(rows)


def test_success_per_difficulty_equals_the_eval_summaries(report):
    by = {(r.round, r.manifest["policy_stage"]): r.summary for r in evals(report.store)}
    for env in ENVS:
        bars = report.page.by_id(f"success-by-difficulty-{env}").find("rect", cls="mark")
        assert len(bars) == 3 * 3  # rounds 0-2, difficulties 1-3
        for bar in bars:
            summary = by[(int(bar.attrs["data-round"]), bar.attrs["data-policy"])]
            key = f"{env}/success_rate_d{bar.attrs['data-difficulty']}"
            assert float(bar.attrs["data-success"]) == pytest.approx(summary[key])
            assert int(bar.attrs["data-n"]) == N_TEST // 3


def test_stage_times_add_up_the_manifests_of_the_evaluations_lineage(report):
    lineage = report.store.ancestors(r["eval_id"] for r in collect(report.store))
    want = Counter((r.round, r.stage) for r in lineage)
    seconds: Counter = Counter()
    for r in lineage:
        seconds[(r.round, r.stage)] += r.manifest["seconds"]
    rows = rows_of(report.page.by_id("stage-times"))
    got = {(int(c[0].content()), c[1].content()): c for c in rows}
    assert set(got) == set(want) and len(rows) == len(want)  # one row per round and stage
    assert [int(c[0].content()) for c in rows] == sorted(int(c[0].content()) for c in rows)
    total = sum(seconds.values())  # 0.0 where every stage of this small store took < 0.05 s
    for key, cells in got.items():
        assert int(cells[2].content()) == want[key]
        assert float(cells[3].attrs["data-value"]) == pytest.approx(seconds[key])
        share = seconds[key] / total if total else 0.0
        assert float(cells[4].attrs["data-value"]) == pytest.approx(share)


def test_stage_times_say_what_was_resumed_or_not_timed():
    def ref(art_id, stage, **manifest):
        return ArtifactRef(art_id, "eval", stage, 1, "", {"created": art_id, **manifest})

    lineage = [
        ref("a", "explore", started="1", seconds=60.0, resumed=True),
        ref("b", "explore"),  # written before stages were timed
        ref("c", "evaluate", started="2", seconds=20.0, resumed=False),
    ]
    tree = _Tree()
    tree.feed(_time_section(lineage))
    rows = rows_of(tree.root.by_id("stage-times"))
    assert [[c.content() for c in row] for row in rows] == [
        ["1", "explore", "2", "1:00 + 1 not timed (resumed)", "75%"],
        ["1", "evaluate", "1", "0:20", "25%"],
    ]
    assert "none of these" in _time_section(lineage[1:2]).lower()


def test_explore_histograms_count_every_episode(report):
    for rnd in (1, 2):
        (ref,) = report.store.list(round=rnd, stage="explore")
        rows = report.store.read(ref).to_pylist()
        rewards = Counter(f"{min(int(r['reward'] * 10), 9) / 10:.1f}" for r in rows)
        calls = Counter(str(r["tool_calls"]) for r in rows)
        for fig, expected in (("explore-reward", rewards), ("explore-tool-calls", calls)):
            bars = report.page.by_id(fig).find("rect", cls="mark", data_round=str(rnd))
            got = {b.attrs["data-bin"].split("-")[0]: int(b.attrs["data-count"]) for b in bars}
            assert got == dict(expected), fig
            assert {b.attrs["data-artifact"] for b in bars} == {ref.id}


def test_pareto_front_marks_every_trajectory_of_the_last_round(report):
    (ref,) = report.store.list(round=2, stage="explore")
    traj = pl.from_arrow(report.store.read(ref))
    front = int((trajectory_ranks(traj) == 1).sum())
    (groups,) = [r for r in report.store.list(round=2, stage="pareto") if r.kind == "groups"]
    figure = report.page.by_id("pareto-front")
    svgs = figure.find("svg")
    assert [s.attrs["data-x"] for s in svgs] == ["tokens", "tool_calls"]
    for svg in svgs:
        marks = svg.find("circle", cls="mark")
        assert _count(marks) == len(traj) == 2 * N_TRAIN * K
        assert _count(marks, front="1") == front > 0
        assert _count(marks, selected="1") == groups.manifest["rows"] == 2 * K
        assert all(
            "front" in m.attrs["class"].split() for m in marks if m.attrs["data-front"] == "1"
        )


def _count(marks: list[Node], **match: str) -> int:
    """Trajectories behind the marks whose data-* attributes equal ``match``."""
    picked = [m for m in marks if all(m.attrs[f"data-{k}"] == v for k, v in match.items())]
    return sum(int(m.attrs["data-count"]) for m in picked)


# -- trajectory pages ---------------------------------------------------------------------------


def test_trajectory_links_best_worst_and_revised(report):
    table = rows_of(report.page.by_id("trajectory-links"))
    cells = {(r[0].content(), r[1].content()): r for r in table}
    assert set(cells) == {(str(r), env) for r in (1, 2) for env in ENVS}
    assert cells[("1", "arith")][4].content() == "none"  # no revised trajectories in round 1
    revised = cells[("2", "arith")][4].find("a")
    assert len(revised) == 2 and cells[("2", "toy")][4].content() == "none"
    for rnd in (1, 2):
        (ref,) = report.store.list(round=rnd, stage="explore")
        rows = [r for r in report.store.read(ref).to_pylist() if r["env"] == "arith"]
        for which, col, pick in (("best", 2, max), ("worst", 3, min)):
            (link,) = cells[(str(rnd), "arith")][col].find("a")
            assert link.content() == which
            page = parse(report.index.parent / link.attrs["href"])
            facts = {r[0].content(): r[1] for r in rows_of(page.by_id("facts"))}
            assert float(facts["reward"].attrs["data-value"]) == pick(r["reward"] for r in rows)
            (row,) = [r for r in rows if r["task_id"] == facts["task_id"].content() and r["sample_idx"] == int(facts["sample_idx"].content())]  # fmt: skip
            check_conversation(page, row)
    page = parse(report.index.parent / revised[0].attrs["href"])
    facts = {r[0].content(): r[1].content() for r in rows_of(page.by_id("facts"))}
    assert facts["source"] == "revision" and facts["reward"] == "1.000"


def check_conversation(page: Node, row: dict) -> None:
    """Every message in order with its role, content and loss flag; actions marked."""
    items = page.find("li", cls="msg")
    assert [i.attrs["data-role"] for i in items] == [m["role"] for m in row["messages"]]
    assert [i.attrs["data-loss"] for i in items] == [str(m["loss"]).lower() for m in row["messages"]]  # fmt: skip
    assert [i.find("pre")[0].content() for i in items] == [m["content"] for m in row["messages"]]
    for item, m in zip(items, row["messages"], strict=True):
        label = item.find("span", cls="loss")[0].content()
        assert label == ("trained (loss on)" if m["loss"] else "not trained")
    assert sum(len(i.find("mark", cls="action")) for i in items) == row["tool_calls"] + 1
    tokens = [t.content() for t in page.find("span", cls="tokens")]
    assert len(tokens) == len(row["turn_token_ids"])
    assert all(t.startswith("3 generated tokens, mean log-prob -1.000") for t in tokens)


def test_pages_are_self_contained_and_links_resolve(report):
    pages = sorted(report.index.parent.rglob("*.html"))
    assert len(pages) == 1 + 2 * 2 * 2 + 2  # index, best and worst per round and env, 2 revised
    for path in pages:
        text = path.read_text(encoding="utf-8")
        assert "<script" not in text and "<link" not in text and "@import" not in text
        assert "url(" not in text
        for node in parse(path).all():
            for key in ("src", "href"):
                if key in node.attrs:
                    target = node.attrs[key]
                    assert not target.startswith(("http:", "https:", "//", "/")), (path, target)
                    assert (path.parent / target).resolve().is_file(), (path, target)


# -- writing ------------------------------------------------------------------------------------


def test_rewrite_replaces_a_report_and_refuses_other_folders(report, tmp_path):
    out = tmp_path / "reports" / "tiny"
    first = write_html(report.store, out)
    (out / "trajectories" / "stale.html").write_text("old")
    assert write_html(report.store, out) == first
    assert not (out / "trajectories" / "stale.html").exists()
    assert sorted(p.name for p in tmp_path.joinpath("reports").iterdir()) == ["tiny"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="holds no flywheel report: refusing"):
        write_html(report.store, mine)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    with pytest.raises(ValueError, match="is inside .*notes.txt, which is a file"):
        write_html(report.store, mine / "notes.txt" / "report")


def test_a_failed_write_leaves_nothing(report, tmp_path, monkeypatch):
    written = []

    def fail_after_two(self, text, encoding=None):
        if len(written) == 2:
            raise OSError(28, "No space left on device", str(self))
        written.append(self)
        return len(text)

    monkeypatch.setattr(Path, "write_text", fail_after_two)
    with pytest.raises(OSError, match="No space left"):
        write_html(report.store, tmp_path / "a" / "b" / "report")
    monkeypatch.undo()
    assert len(written) == 2 and list(tmp_path.iterdir()) == []


def test_no_evaluations_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"no evaluated policies yet \(run `flywheel run`\)"):
        write_html(Store(str(tmp_path / "store"), "tiny"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_writes_the_report_and_prints_its_path(tmp_path, capsys):
    config = write_tiny_yaml(tmp_path)  # store at tmp_path/store, run "tiny"
    assert main(["report", "--html", "--config", str(config)]) == 2  # nothing evaluated yet
    err = capsys.readouterr().err
    assert err == "flywheel: error: no evaluated policies yet (run `flywheel run`)\n"
    assert not (tmp_path / "work" / "report").exists()
    build_store(tmp_path / "store")
    assert main(["report", "--html", "--config", str(config)]) == 0
    default = tmp_path / "work" / "report" / "tiny" / "index.html"
    assert capsys.readouterr().out == f"{default}\n"
    assert parse(default).by_id("evaluations")
    assert main(["report", "--html", str(tmp_path / "elsewhere"), "--config", str(config)]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'elsewhere' / 'index.html'}\n"
    assert main(["report", "--html", str(config), "--config", str(config)]) == 2
    assert capsys.readouterr().err == f"flywheel: error: report path {config} is a file, not a folder\n"  # fmt: skip
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        assert main(["report", "--html", str(locked / "r"), "--config", str(config)]) == 2
        assert "cannot write to" in capsys.readouterr().err


@pytest.mark.slow
def test_the_tiny_flywheel_run(tiny_flywheel, tmp_path):
    """The real run: its evaluations (from flywheel.json), explore and pareto artifacts."""
    from flywheel.config import load_config

    cfg = load_config(None, tiny_flywheel.overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    page = parse(write_html(store, tmp_path / "report"))
    rows = collect(store)
    assert rows == tiny_flywheel.report
    assert page.by_id("report-text").content() == format_table(rows)
    for row in rows:
        (mark,) = page.by_id(f"success-by-round-{row['env']}").find(cls="mark", data_eval_id=row["eval_id"])  # fmt: skip
        assert float(mark.attrs["data-success"]) == store.get(row["eval_id"]).summary[f"{row['env']}/success_rate"]  # fmt: skip
    # the run's own explore (other tests add versions of it to the shared store)
    (explore,) = [
        r for r in store.list(round=1, stage="explore") if r.id in tiny_flywheel.artifacts
    ]
    bars = page.by_id("explore-tool-calls").find("rect", cls="mark")
    assert sum(int(b.attrs["data-count"]) for b in bars) == explore.manifest["rows"]
    links = page.by_id("trajectory-links").find("a")
    assert len(links) == 2  # round 1: best and worst
    best = parse(tmp_path / "report" / links[0].attrs["href"])
    (row,) = [
        r
        for r in store.read(explore).to_pylist()
        if r["task_id"] == best.by_id("facts").find("td")[1].content()
        and str(r["sample_idx"]) == rows_of(best.by_id("facts"))[6][1].content()
    ]
    assert [i.attrs["data-loss"] for i in best.find("li", cls="msg")] == [str(m["loss"]).lower() for m in row["messages"]]  # fmt: skip


def test_the_line_of_rounds_takes_a_repeated_rounds_own_run():
    """iteration.repeats: round 2 evaluated twice; the line through the rounds takes the first
    (the run's own checkpoint), round 0 its last evaluation (the SFT policy after init)."""
    from flywheel.html_report import _main_series

    def r(round_: int, policy: str, eval_id: str, **extra) -> dict:
        return {"round": round_, "policy": policy, "env": "arith", "eval_id": eval_id, **extra}

    mean = {"of": ["e2a", "e2b"]}
    rows = [
        r(0, "init", "e0i"), r(0, "sft", "e0"), r(1, "sft", "e1"),
        r(2, "sft", "e2a", repeats=mean), r(2, "sft", "e2b", repeats=mean), r(2, "rft", "eb"),
    ]  # fmt: skip
    assert [x["eval_id"] for x in _main_series(rows, "arith")] == ["e0", "e1", "e2a"]


def test_a_run_that_has_not_finished_says_so_under_the_title(tmp_path):
    from flywheel.report import write_state

    store = build_store(tmp_path / "store")
    ids = sorted(ref.id for ref in evals(store))
    assert len(ids) > 2
    write_state(store, 1, ids[:2], finished=False)
    text = write_html(store, tmp_path / "out").read_text()
    assert f'id="unfinished">note: the last `flywheel run` of {store.run} has not finished' in text
    assert all(i in text for i in ids[:2]) and not any(i in text for i in ids[2:])
    write_state(store, 1, ids, finished=True)
    assert 'id="unfinished"' not in write_html(store, tmp_path / "out").read_text()
    write_state(store, 1, [], finished=False)  # a run that has not reached its first evaluation
    with pytest.raises(ValueError, match=r"^no evaluated policies yet: the last `flywheel run` of"):
        write_html(store, tmp_path / "empty")
    assert not (tmp_path / "empty").exists()
