"""The docs cannot rot: docs/config.md equals what the config's help text generates, every
config field has help text, every error message docs/troubleshooting.md quotes is still in the
source, the recipes' example environment runs, every `flywheel ...` command the docs show parses
and names only config keys and env options that exist, every YAML block loads as a config and
every Python block parses, and the README and docs link only to files that exist."""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from flywheel.agent import expert_episodes
from flywheel.cli import _config_path, _parse, main
from flywheel.config import (
    ConfigError,
    EnvConfig,
    config_from_dict,
    config_reference,
    field_help,
    load_config,
)
from flywheel.envs import make_suite

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
REGENERATE = ".venv/bin/flywheel config --reference > docs/config.md"
# A heading of troubleshooting.md quotes a message: ### `config error: unknown key <key>`
MESSAGE = re.compile(r"^### (`+) ?(.+?) ?\1$")
# What varies in a quoted message: <key>, '<name>' (a repr), or an elision ...
VARIABLE = re.compile(r"'?<[^>]+>'?|\.\.\.")


def test_config_reference_is_up_to_date():
    committed = (DOCS / "config.md").read_text()
    assert committed == config_reference(), (
        f"docs/config.md is out of date with flywheel/config.py: run `{REGENERATE}`"
    )


def test_config_reference_command_prints_the_reference(capsys):
    assert main(["config", "--reference"]) == 0
    out = capsys.readouterr().out
    assert out == config_reference()
    lines = out.splitlines()
    for key, text in field_help():  # every key is a row, or a section's heading, with its help
        rows = [line for line in lines if line.startswith(f"| `{key}` |")]
        if not rows:
            at = lines.index(f"## `{key}`")
            rows = [lines[at + 2]]
        assert text.replace("<", "&lt;").replace("|", "\\|") in rows[0], key


def test_every_config_field_has_help_text():
    missing = [key for key, text in field_help() if len(text.split()) < 2]
    assert not missing, f"config fields without help text (Field(description=...)): {missing}"


@functools.cache
def _source_strings() -> list[str]:
    """Every string literal of the package, an f-string's replacement fields as NUL."""
    found = []
    for folder in ("flywheel", "stages", "flows", "data_contracts"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.append(node.value)
                elif isinstance(node, ast.JoinedStr):
                    found.append(
                        "".join(
                            v.value if isinstance(v, ast.Constant) else "\0" for v in node.values
                        )
                    )
    return found


def quoted_messages() -> list[str]:
    lines = (DOCS / "troubleshooting.md").read_text().splitlines()
    return [m[2] for m in map(MESSAGE.match, lines) if m]


def message_pattern(message: str) -> re.Pattern[str]:
    """A quoted message as a regex over one source string: fixed text verbatim, a ``<...>``
    as one or more replacement fields (with at most 3 characters between them: ``{a}.{b}``),
    ``...`` as anything."""
    parts = []
    for i, token in enumerate(re.split(f"({VARIABLE.pattern})", message)):
        if i % 2 == 0:
            parts.append(re.escape(token))
        else:
            parts.append(".*?" if token == "..." else "\\0(?:[^\\0]{0,3}\\0)*")
    return re.compile("".join(parts), re.S)


def test_troubleshooting_quotes_messages_the_source_still_prints():
    messages = quoted_messages()
    assert len(messages) >= 30
    strings = _source_strings()
    stale = [m for m in messages if not any(message_pattern(m).search(s) for s in strings)]
    assert not stale, f"docs/troubleshooting.md quotes messages no longer in the source: {stale}"


def test_a_changed_message_is_caught():
    """The check above fails for a message the source does not print."""
    strings = _source_strings()
    assert any(message_pattern("no artifact <id> in <store>/<run>").search(s) for s in strings)
    for fake in ("config error: unknown keys <key>", "no artifact <id> at <store>"):
        assert not any(message_pattern(fake).search(s) for s in strings), fake


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def test_recipes_example_env_runs(tmp_path, monkeypatch):
    recipes = (DOCS / "recipes.md").read_text()
    code = next(b for b in _blocks(recipes, "python") if "class ReverseSuite" in b)
    (tmp_path / "reverse_env.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "reverse_env", raising=False)
    env_yaml = next(b for b in _blocks(recipes, "yaml") if "reverse_env:ReverseSuite" in b)
    cfg = config_from_dict(yaml.safe_load(env_yaml))
    suite = make_suite(cfg.envs[0])
    tasks = suite.tasks("train", 6, 0)
    assert tasks == suite.tasks("train", 12, 0)[:6]  # a prefix of a longer call
    rows = expert_episodes(suite, tasks)
    assert [r["success"] for r in rows] == [True] * 6
    assert all(r["finish_reason"] == "done" for r in rows)
    with pytest.raises(ValueError, match="unknown option envs.reverse.options.nope"):
        make_suite(EnvConfig(name="reverse", suite="reverse_env:ReverseSuite", options={"nope": 1}))


def test_recipes_model_preset_is_a_valid_config():
    recipes = (DOCS / "recipes.md").read_text()
    preset = next(b for b in _blocks(recipes, "yaml") if "model:" in b)
    cfg = config_from_dict(yaml.safe_load(preset))
    assert cfg.model.base and cfg.sft.deepspeed_config
    assert (ROOT / cfg.sft.deepspeed_config).is_file()


def test_links_point_to_files_that_exist():
    broken = []
    for page in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


def doc_pages() -> list[Path]:
    """The pages whose commands, configs and code the checks below read."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "benchmarks" / "README.md"]


# A documented command: `flywheel ...` at the start of a code block's line (continuations joined;
# after `&&` too), or in inline code in the prose.
COMMAND_LINE = re.compile(r"^\s*(?:\$ )?(?:.*&&\s*)?(?:\.venv/bin/)?flywheel\s+(.*)$", re.M)
COMMAND_INLINE = re.compile(r"`(?:\.venv/bin/)?flywheel ([^`]+)`")
# What a reader fills in: <id>, ..., $VAR, an [optional] part, a capitalised name (NAME, R, LR).
PLACEHOLDER = re.compile(r"<|\.\.\.|\$|(?:^|\s)\[[a-z]|(?:^|[\s=])[A-Z][A-Z_]*(?=\s|$)")


def documented_commands(text: str) -> list[str]:
    """The arguments of every `flywheel` command in a markdown text that has no placeholder."""
    found = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        found += [re.sub(r"\s+", " ", line.split(" #")[0]) for line in COMMAND_LINE.findall(joined)]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    found += [re.sub(r"\s+", " ", m) for m in COMMAND_INLINE.findall(prose)]
    return [c.strip() for c in found if c.strip() and not PLACEHOLDER.search(c)]


def command_problem(command: str) -> str | None:
    """Why `flywheel <command>` would be refused before any work: a subcommand or option the
    CLI does not have, an override the config rejects (checked against the default config), or
    an env option the env does not have.
    None when it parses; a mention without the values it needs (`flywheel compare`,
    `flywheel show --source`) passes."""
    try:
        argv = shlex.split(command)
    except ValueError as err:
        return f"not shell words: {err}"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = _parse(argv)
    except SystemExit:
        message = err.getvalue().strip()
        mention = "arguments are required" in message or "expected one argument" in message
        return None if mention else message
    overrides = [o for o in getattr(args, "overrides", None) or [] if "=" in o]
    try:
        cfg = load_config(_config_path(None), overrides)
        for env in cfg.envs:
            make_suite(env)  # refuses options the env does not have
    except (ConfigError, ValueError) as error:
        return str(error)
    return None


def test_documented_commands_parse_and_name_existing_config_keys():
    checked, stale = 0, []
    for page in doc_pages():
        for command in documented_commands(page.read_text()):
            checked += 1
            problem = command_problem(command)
            if problem:
                stale.append(f"{page.relative_to(ROOT)}: flywheel {command[:80]}: {problem}")
    assert checked >= 100
    assert not stale, "documented commands the CLI refuses:\n" + "\n".join(stale)


def test_a_stale_documented_command_is_caught():
    """The check above finds a removed option, subcommand or config key, and skips what a
    reader fills in."""
    text = (
        "Run `flywheel run sft.lr=1e-3 run.rounds=1` or\n\n```bash\n.venv/bin/flywheel stage rft \\\n"
        "  --round 1 rft.nope=2   # a comment\ncd x && flywheel report --json\n```\n"
        "then `flywheel show <id>`, `flywheel stage NAME --round R`, `flywheel run [a.b=1]`"
        " and `flywheel run iteration.data=[explore,mcts]`."
    )
    assert documented_commands(text) == [
        "stage rft --round 1 rft.nope=2",
        "report --json",
        "run sft.lr=1e-3 run.rounds=1",
        "run iteration.data=[explore,mcts]",
    ]
    assert command_problem("run sft.lr=1e-3 run.rounds=1") is None
    assert command_problem("report --json") is None
    assert command_problem("compare") is None  # mentions of a subcommand, an option
    assert command_problem("show --source") is None
    assert "rft.nope" in (command_problem("stage rft --round 1 rft.nope=2") or "")
    assert "invalid choice" in (command_problem("evaluate --round 1") or "")
    assert "unrecognized" in (command_problem("report --jsonl") or "")
    assert "sft.lr" in (command_problem("run sft.lr=fast") or "")
    assert "distractorz" in (command_problem("run envs.0.options.max_distractorz=5") or "")


def test_documented_yaml_configs_load():
    """Every YAML block of the README and docs is a config (or part of one) that loads."""
    blocks = [(page, b) for page in doc_pages() for b in _blocks(page.read_text(), "ya?ml")]
    assert len(blocks) >= 10
    for page, block in blocks:
        data = yaml.safe_load(block)
        assert isinstance(data, dict), f"{page.relative_to(ROOT)}: a YAML block is not a mapping"
        try:
            config_from_dict(data)
        except ConfigError as error:
            pytest.fail(f"{page.relative_to(ROOT)}: a YAML block does not load: {error}")
    with pytest.raises(ConfigError, match="sft.lrr"):
        config_from_dict(yaml.safe_load("sft:\n  lrr: 1.0e-3\n"))


def test_documented_python_is_valid_python():
    """Every Python block of the README and docs parses (sketches use `...` for bodies)."""
    blocks = [(page, b) for page in doc_pages() for b in _blocks(page.read_text(), "python")]
    assert len(blocks) >= 5
    for page, block in blocks:
        try:
            ast.parse(block)
        except SyntaxError as error:
            pytest.fail(f"{page.relative_to(ROOT)}: a Python block does not parse: {error}")
