"""Bad input, refused before any work: every case runs ``flywheel.cli.main`` in-process from an
empty current folder and must exit 2 with exactly one line on stderr, ``flywheel: error: ...``,
naming the key, file or argument and what was expected, print nothing on stdout, and write
nothing (no ``work/``, no ``work/prefect``, no ``.tmp-*``: the tmp folder is listed before and
after).

    .venv/bin/python -m pytest tests/reliability/test_bad_input.py
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flywheel.cli import main

REPO = Path(__file__).resolve().parents[2]


def listing(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def refused(capsys, argv: list[str], *needles: str) -> str:
    """Run ``argv``; assert the one-line refusal and return the line."""
    capsys.readouterr()
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, f"exit {rc} for {argv}; stderr: {err!r}"
    assert out == "", f"stdout: {out!r}"
    lines = err.splitlines()
    assert len(lines) == 1, f"stderr is not one line:\n{err}"
    assert lines[0].startswith("flywheel: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def cwd(tmp_path, monkeypatch) -> Path:
    """An empty current folder under tmp_path (no configs/default.yaml: the built-in defaults)."""
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


def P(argv: str, *needles: str, files: dict[str, str] | None = None, id: str):  # noqa: N802
    """A case: ``argv`` split on spaces, or on '|' where it has one ({tmp} is the tmp folder),
    the substrings its error line must hold, and files to create under tmp before the listing
    is taken."""
    return pytest.param(argv, needles, files or {}, id=id)


GT0 = "greater than 0"
GE0 = "greater than or equal to 0"
GE1 = "greater than or equal to 1"
FINITE = "finite number"

CASES = [
    # -- config values: ranges ---------------------------------------------------------------
    P("run explore.temperature=inf", "explore.temperature", FINITE, id="temperature-inf"),
    P("run explore.temperature=.nan", "explore.temperature", FINITE, id="temperature-nan"),
    P("run explore.temperature=-1", "explore.temperature", GE0, id="temperature-negative"),
    P("run evaluate.temperature=inf", "evaluate.temperature", FINITE, id="eval-temperature-inf"),
    P("run evaluate.n_tasks=-1", "evaluate.n_tasks", GE1, id="eval-n_tasks-negative"),
    P("run evaluate.n_tasks=0", "evaluate.n_tasks", GE1, id="eval-n_tasks-zero"),
    P("run evaluate.val_tasks=-3", "evaluate.val_tasks", GE1, id="eval-val_tasks-negative"),
    P("run expert.n_tasks=-5", "expert.n_tasks", GE0, id="expert-n_tasks-negative"),
    P("run explore.n_tasks=-1", "explore.n_tasks", GE1, id="explore-n_tasks-negative"),
    P("run sft.max_steps=-1", "sft.max_steps", GE1, id="sft-max_steps-negative"),
    P("run sft.max_steps=0", "sft.max_steps", GE1, id="sft-max_steps-zero"),
    P("run sft.lr=0", "sft.lr", GT0, id="sft-lr-zero"),
    P("run sft.lr=inf", "sft.lr", FINITE, id="sft-lr-inf"),
    P("run sft.epochs=0", "sft.epochs", GE1, id="sft-epochs-zero"),
    P("run sft.epochs=1.5", "sft.epochs", "integer", id="sft-epochs-fraction"),
    P("run sft.warmup_ratio=1.5", "sft.warmup_ratio", "less than or equal to 1", id="warmup>1"),
    P("run sft.zero_stage=4", "sft.zero_stage", "less than or equal to 3", id="zero-stage-4"),
    P("run sft.micro_batch_size=0", "sft.micro_batch_size", GE1, id="micro-batch-zero"),
    P("run sft.max_length=0", "sft.max_length", "greater than or equal to 8", id="max-length"),
    P("run sft.patience=0", "sft.patience", GE1, id="patience-zero"),
    P("run rft.per_task=0", "rft.per_task", GE1, id="rft-per_task-zero"),
    P("run dpo.beta=[0.1,-1]", "dpo.beta", "> 0", id="dpo-beta-negative"),
    P("run dpo.beta=[]", "dpo.beta", "at least 1", id="dpo-beta-empty"),
    P("run dpo.lr=[.inf]", "dpo.lr.0", FINITE, id="dpo-lr-inf"),
    P("run grpo.expert_weight=1", "grpo.expert_weight", "less than 1", id="grpo-weight-1"),
    P("run grpo.expert_ratio=0", "grpo.expert_ratio", GT0, id="grpo-ratio-0"),
    P("run grpo.clip=0", "grpo.clip", GT0, id="grpo-clip-0"),
    P("run grpo.kl_coef=-0.1", "grpo.kl_coef", GE0, id="grpo-kl-negative"),
    P("run explore.top_p=0", "explore.top_p", GT0, id="top_p-zero"),
    P("run explore.top_p=1.5", "explore.top_p", "less than or equal to 1", id="top_p>1"),
    P("run explore.samples_per_task=0", "explore.samples_per_task", GE1, id="K-zero"),
    P("run explore.shard_size=0", "explore.shard_size", GE1, id="shard-size-zero"),
    P("run pareto.graded_threshold=2", "pareto.graded_threshold", "less than", id="graded>1"),
    P("run pareto.budget=-1", "pareto.budget", GE0, id="budget-negative"),
    P("run run.rounds=-1", "run.rounds", GE0, id="run.rounds-negative"),
    P("run run.log_every=-1", "run.log_every", GE0, id="log_every-negative"),
    P("run engine.batch_size=0", "engine.batch_size", GE1, id="batch-size-zero"),
    P("run engine.max_new_tokens=0", "engine.max_new_tokens", GE1, id="max-new-tokens-zero"),
    P("run engine.env_workers=0", "engine.env_workers", GE1, id="env-workers-zero"),
    # -- config values: types and choices ------------------------------------------------------
    P("run engine.kind=gpt", "engine.kind", "'hf', 'openai' or 'vllm'", id="engine-kind"),
    P("run engine.kind=vllm", "engine.vllm.python", "make vllm-env", id="engine-vllm-missing"),
    P(
        "run engine.kind=openai engine.openai.base_urls=[http://127.0.0.1:9]",
        "engine:",
        "http://127.0.0.1:9",
        "ConnectError",
        id="engine-openai-unreachable",
    ),  # fmt: skip
    P("run engine.openai.base_urls=[ftp://x]", "engine.openai.base_urls", "http(s) URL", id="url"),
    P("run run.seed=abc", "run.seed", "integer", id="seed-not-int"),
    P("run tracking.enabled=maybe", "tracking.enabled", "boolean", id="bool-maybe"),
    P("run iteration.steps=[ppo]", "iteration.steps.0", "'sft', 'dpo' or 'grpo'", id="step"),
    P("run iteration.steps=[]", "iteration.steps", "at least 1", id="steps-empty"),
    P("run baselines=[rft,rft]", "baselines must be unique", id="baselines-twice"),
    P(
        "run grpo.resample=true iteration.steps=[grpo]",
        "grpo.resample=true",
        "[grpo]",
        id="resample-first",
    ),
    P(
        "run grpo.mix_source=own grpo.expert_weight=0",
        "grpo.mix_source=own",
        "expert_weight > 0",
        id="own-weight-0",
    ),
    P("run grpo.mix_source=mine", "grpo.mix_source", "'expert' or 'own'", id="mix-source"),
    P("run sft.lrr=1", "unknown key sft.lrr", id="unknown-key"),
    P("run sft=3", "sft", "dictionary", id="section-not-mapping"),
    P("run sft.lr", "sft.lr", "key.sub=value", id="override-without-value"),
    # -- the model -----------------------------------------------------------------------------
    P("run model.tiny.hidden_size=0", "model.tiny.hidden_size", GE1, id="hidden-zero"),
    P("run model.tiny.hidden_size=-8", "model.tiny.hidden_size", GE1, id="hidden-negative"),
    P("run model.tiny.num_heads=0", "model.tiny.num_heads", GE1, id="heads-zero"),
    P("run model.tiny.num_layers=0", "model.tiny.num_layers", GE1, id="layers-zero"),
    P("run model.tiny.intermediate_size=-1", "intermediate_size", GE1, id="mlp-negative"),
    P("run model.tiny.max_position_embeddings=0", "max_position_embeddings", id="positions"),
    P("run model.tiny.hidden_size=30", "model.tiny", "num_heads (4)", id="hidden-not-divisible"),
    P("run model.tiny.hidden_size=12", "model.tiny", "even head width", id="odd-head-width"),
    P("run model.base={tmp}/no-model", "model.base", "no such folder", id="base-missing"),
    P(
        "run sft.deepspeed_config={tmp}/none.json",
        "sft.deepspeed_config",
        "no such file",
        id="deepspeed-template-missing",
    ),
    # -- envs ----------------------------------------------------------------------------------
    P("run envs=[]", "envs", "at least 1", id="envs-empty"),
    P("run envs.arith.n_train=0", "envs.arith.n_train", GE1, id="n_train-zero"),
    P("run envs.arith.n_test=-1", "envs.arith.n_test", GE1, id="n_test-negative"),
    P("run envs.arith.n_val=-1", "envs.arith.n_val", GE0, id="n_val-negative"),
    P("run envs.arith.max_steps=0", "envs.arith.max_steps", GE1, id="env-max-steps-zero"),
    P("run envs.craft.n_train=1", "no entry named 'craft'", id="env-override-unknown-entry"),
    P("run envs.arith.name=zzz", "env 'zzz' is not built in", id="env-unknown"),
    P("run envs.arith.suite=no_such_mod:X", "cannot import 'no_such_mod:X'", id="suite-import"),
    P("run envs.arith.options.timeout_s=-1", "envs.arith.options.timeout_s", GT0, id="timeout-neg"),
    P("run envs.arith.options.timeout_s=0", "envs.arith.options.timeout_s", GT0, id="timeout-0"),
    P("run envs.arith.options.timeout_s=inf", "options.timeout_s", FINITE, id="timeout-inf"),
    P("run envs.arith.options.cpu_s=0", "envs.arith.options.cpu_s", GE1, id="cpu-zero"),
    P("run envs.arith.options.cpu_s=many", "envs.arith.options.cpu_s", "integer", id="cpu-str"),
    P("run envs.arith.options.memory_mb=0", "envs.arith.options.memory_mb", "32", id="memory"),
    P("run envs.arith.options.max_output_chars=0", "options.max_output_chars", GE1, id="output"),
    P("run envs.arith.options.max_distractors=-1", "options.max_distractors", GE0, id="distract"),
    P("run envs.arith.options.max_value=5", "options.max_value", "50", id="max-value-small"),
    P(
        "run envs.arith.options.difficulty_weights=[0,0,0]",
        "options.difficulty_weights",
        "not all 0",
        id="weights-zero",
    ),
    P("run envs.arith.options.nope=1", "unknown option envs.arith.options.nope", id="option-?"),
    P("stage tasks --round 0 envs.arith.options.timeout_s=-1", "options.timeout_s", id="stage"),
    # -- the run name and folders --------------------------------------------------------------
    P("run run.name=../../x", "run.name", "plain name", id="run-name-escapes"),
    P("run run.name=a/b", "run.name", "plain name", id="run-name-slash"),
    P("run run.name=", "run.name", "plain name", id="run-name-empty"),
    P("run run.name=.hidden", "run.name", "plain name", id="run-name-dot"),
    P("run run.name=a*", "run.name", "plain name", id="run-name-glob"),
    P("run run.work_dir=", "run.work_dir", "must not be empty", id="work-dir-empty"),
    P(
        "run run.work_dir={tmp}/afile",
        "run.work_dir",
        "is a file, not a folder",
        files={"afile": "x"},
        id="work-dir-is-a-file",
    ),
    P(
        "run run.work_dir={tmp}/afile/sub",
        "run.work_dir",
        "inside",
        files={"afile": "x"},
        id="work-dir-inside-a-file",
    ),
    P(
        "run run.store={tmp}/afile",
        "run.store",
        "is a file",
        files={"afile": "x"},
        id="store-is-a-file",
    ),
    # -- YAML files ----------------------------------------------------------------------------
    P(
        "run --config {tmp}/dup.yaml",
        "dup.yaml line 5",
        "duplicate key 'run'",
        files={"dup.yaml": "run:\n  rounds: 1\nsft:\n  lr: 0.1\nrun:\n  seed: 3\n"},
        id="yaml-duplicate-section",
    ),
    P(
        "config --config {tmp}/dup.yaml",
        "dup.yaml line 3",
        "duplicate key 'lr'",
        files={"dup.yaml": "sft:\n  lr: 0.1\n  lr: 0.2\n"},
        id="yaml-duplicate-key",
    ),
    P(
        "run --config {tmp}/dup.yaml",
        "dup.yaml line 4",
        "duplicate key 'n_train'",
        files={"dup.yaml": "envs:\n  - name: arith\n    n_train: 5\n    n_train: 6\n"},
        id="yaml-duplicate-in-list-entry",
    ),
    P(
        "run --config {tmp}/list.yaml",
        "list.yaml must hold a mapping",
        files={"list.yaml": "- 1\n- 2\n"},
        id="yaml-not-a-mapping",
    ),
    P(
        "run --config {tmp}/broken.yaml",
        "broken.yaml line",
        "not valid YAML",
        files={"broken.yaml": "run: [unclosed\n"},
        id="yaml-invalid",
    ),
    P(
        "run --config {tmp}/unknown.yaml",
        "unknown key model.tiny.widht",
        files={"unknown.yaml": "model:\n  tiny:\n    widht: 3\n"},
        id="yaml-unknown-key",
    ),
    P("run --config {tmp}/none.yaml", "no such file", id="config-missing"),
    P("run|sft.beta={a: 1, a: 2}", "sft.beta", "duplicate key 'a'", id="override-duplicate"),
    # -- command-line arguments ----------------------------------------------------------------
    P("run --rounds -1", "--rounds", "integer >= 0, got -1", id="rounds-negative"),
    P("run --rounds two", "--rounds", "integer >= 0", id="rounds-not-int"),
    P("run --nope", "unrecognized arguments: --nope", id="unknown-option"),
    P("stage sft --round -1", "--round", ">= 0", id="stage-round-negative"),
    P("stage sft", "--round", "required", id="stage-round-missing"),
    P("stage nope --round 0", "unknown stage 'nope'", id="stage-unknown"),
    P("stage sft --round 1", "stage sft does not run in round 1", id="stage-not-in-plan"),
    P("stage ../x --round 0", "'../x' is not a plain name", id="stage-path"),
    P("artifacts show *", "'*' is not a plain name", id="show-glob"),
    P("artifacts show sft-*", "'sft-*' is not a plain name", id="show-glob-suffix"),
    P("artifacts show sft-[ab]", "is not a plain name", id="show-glob-class"),
    P("artifacts show ../x", "is not a plain name", id="show-path"),
    P("artifacts lineage a/b", "is not a plain name", id="lineage-path"),
    P("artifacts show sft-abc --rows -1", "--rows", ">= 0, got -1", id="rows-negative"),
    P("artifacts ls --round -1", "--round", ">= 0", id="ls-round-negative"),
    P("artifacts ls --stage *", "--stage", "plain name", id="ls-stage-glob"),
    P("artifacts show sft-abc", "no artifact sft-abc", id="show-missing"),
    P("serve --port 0", "--port", "1..65535", id="port-zero"),
    P("serve --port 70000", "--port", "1..65535", id="port-too-big"),
    P("report extra", "config override 'extra': expected key.sub=value", id="report-extra"),
    # -- import / export (flywheel/interchange.py): a malformed file names file, record, field --
    P(
        "import {tmp}/bad.json --format eto --env arith",
        "bad.json: record 1 (id 'x'): conversations[2].from: expected human|gpt|system, got 'bot'",
        files={
            "bad.json": '[{"id": "a", "conversations": [{"from": "human", "value": "q"}]}, {"id": "x", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "Ok."}, {"from": "bot", "value": "a"}]}]'
        },
        id="import-eto-bad-from",
    ),
    P(
        "import {tmp}/bad.jsonl --format openai --env arith",
        "bad.jsonl: line 2: messages[0].weight: expected 0 or 1, got 2",
        files={
            "bad.jsonl": '{"messages": [{"role": "user", "content": "q"}]}\n{"messages": [{"role": "assistant", "content": "a", "weight": 2}]}\n'
        },
        id="import-openai-bad-weight",
    ),
    P(
        "import {tmp}/bad.json --format agentgym --env arith",
        "bad.json: not valid JSON",
        files={"bad.json": "[{"},
        id="import-not-json",
    ),
    P(
        "import {tmp}/none.json --format eto --env arith",
        "none.json: no such file",
        id="import-missing",
    ),
    P(
        "import {tmp}/d.json --format csv --env arith",
        "--format",
        "invalid choice: 'csv'",
        id="import-format",
    ),
    P("import {tmp}/d.json --format eto", "--env", "required", id="import-env-missing"),
    P(
        "import {tmp}/d.json --format eto --env ../x",
        "'../x' is not a plain name",
        id="import-env-path",
    ),
    P(
        "import {tmp}/d.json --format eto --env a --split dev",
        "--split",
        "invalid choice",
        id="import-split",
    ),
    P("export sft-abc --format trl", "no artifact sft-abc", id="export-missing"),
    P("export sft-abc --format csv", "--format", "invalid choice: 'csv'", id="export-format"),
    P("", "required: command", id="no-command"),
    P("frobnicate", "invalid choice: 'frobnicate'", id="unknown-command"),
]


@pytest.mark.parametrize(("argv", "needles", "files"), CASES)
def test_bad_input_is_one_line_and_writes_nothing(argv, needles, files, cwd, capsys):
    tmp = cwd.parent
    for name, text in files.items():
        (tmp / name).write_text(text)
    before = listing(tmp)
    words = argv.split("|" if "|" in argv else " ") if argv else []
    args = [a.replace("{tmp}", str(tmp)) for a in words if a]
    refused(capsys, args, *needles)
    assert listing(tmp) == before


def test_a_server_without_log_probs_is_refused_for_a_run_that_explores(cwd, capsys):
    from tests.flywheel.engines.scripted_server import ScriptedServer

    before = listing(cwd.parent)
    with ScriptedServer(end_id=2, token_ids=False, logprobs=False) as server:
        urls = f"engine.openai.base_urls=[{server.url}]"
        line = refused(capsys, ["run", "engine.kind=openai", urls], server.url, "no generated")
        assert "token ids and no log-probs; explore trains on them" in line
        # Evaluating alone needs neither: that refusal is for rounds that explore.
        assert "no generated" not in _preflight_error(
            ["run", "--rounds", "0", "engine.kind=openai", urls]
        )
    assert listing(cwd.parent) == before


def _preflight_error(argv: list[str]) -> str:
    """What the pre-flight checks say of ``argv`` ('' when they pass), without running it."""
    from flywheel import cli
    from flywheel.config import load_config

    args = cli._parser().parse_args(argv)
    cfg = load_config(None, args.overrides)
    try:
        cli._preflight(
            cfg, explores=(args.rounds if args.rounds is not None else cfg.run.rounds) > 0
        )
    except ValueError as err:
        return str(err)
    return ""


def test_read_only_work_dir(cwd, capsys):
    if os.getuid() != 0:
        locked = cwd.parent / "locked"
        locked.mkdir()
        locked.chmod(0o500)
    elif not os.access("/proc/sys", os.W_OK):
        locked = Path("/proc/sys")  # root may write anywhere but a read-only mount
    else:
        pytest.skip("root, and no read-only folder to point at")
    before = listing(cwd.parent)
    try:
        refused(capsys, ["run", f"run.work_dir={locked}/work"], "run.work_dir", "cannot write")
    finally:
        if locked.parent == cwd.parent:
            locked.chmod(0o700)
    assert listing(cwd.parent) == before


def test_file_system_errors_during_a_run_are_one_line(cwd, capsys, monkeypatch):
    # a disk that fills up mid-run: the OSError reaches main, which names it and the path
    import flows.flywheel

    def full(**_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(cwd / "work" / "store"))

    monkeypatch.setattr(flows.flywheel, "flywheel_flow", full)
    refused(capsys, ["run"], "No space left on device", str(cwd / "work" / "store"))


@pytest.mark.parametrize(
    "argv", [["--help"], ["run", "--help"], ["stage", "--help"], ["artifacts", "ls", "--help"]]
)
def test_help_writes_nothing(argv, cwd, capsys, monkeypatch):
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    before = listing(cwd.parent)
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "usage: flywheel" in out and err == ""
    assert listing(cwd.parent) == before


def test_nothing_is_written_without_prefect_home_set(tmp_path):
    """A fresh process, PREFECT_HOME unset, from an empty folder: --help and a stage refused
    after Prefect was imported leave no ./work/prefect behind."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_HOME")}
    env["PYTHONPATH"] = str(REPO)
    for argv, rc in ((["--help"], 0), (["stage", "nope", "--round", "0"], 2)):
        done = subprocess.run(
            [sys.executable, "-m", "flywheel.cli", *argv],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == rc, done.stderr
        assert len(done.stderr.splitlines()) == (rc != 0), done.stderr
        assert list(tmp_path.iterdir()) == []


def test_a_missing_expert_data_file_is_refused_before_any_work(cwd, capsys):
    before = listing(cwd.parent)
    refused(
        capsys,
        ["run", "expert.data=[{path: nowhere.json, format: eto, env: arith}]"],
        "expert.data.0.path",
        "no such file nowhere.json",
    )
    assert listing(cwd.parent) == before
