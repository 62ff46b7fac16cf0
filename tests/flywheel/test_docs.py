"""The docs cannot rot: docs/config.md equals what the config's help text generates, every
config field has help text, every error message docs/troubleshooting.md quotes is still in the
source, the recipes' example environment runs, and the README and docs link only to files that
exist."""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

import pytest
import yaml

from flywheel.agent import expert_episodes
from flywheel.cli import main
from flywheel.config import EnvConfig, config_from_dict, config_reference, field_help
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
