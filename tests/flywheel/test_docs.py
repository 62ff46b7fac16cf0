"""The docs cannot rot: docs/config.md equals what the config's help text generates, every
config field has help text, every error message docs/troubleshooting.md quotes is still in the
source, the recipes' example environment runs, every `flywheel ...` command the docs show parses
and names only config keys and env options that exist, every YAML block loads as a config and
every Python block parses, the README and docs link only to files and headings that exist, and
a reference to another page's section by name ("docs/results.md, \"...\"") names one it has."""

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


def doc_pages() -> list[Path]:
    """The pages whose links, commands, configs and code the checks below read."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), ROOT / "benchmarks" / "README.md"]


def headings(page: Path) -> list[str]:
    """A Markdown page's headings as written (outside code blocks)."""
    found, in_code = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6}\s+(.*?)\s*$", line)):
            found.append(m.group(1))
    return found


def anchor(heading: str) -> str:
    """The fragment a Markdown renderer (GitHub's) gives a heading: link text kept, lowercase,
    punctuation dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in headings(page):
        slug = anchor(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def broken_links(page: Path) -> list[str]:
    """Links of a page to a file that does not exist, or to a heading its target lacks."""
    broken = []
    for target, fragment in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        dest = page.parent / target if target else page
        if not dest.exists():
            broken.append(f"{page.name} -> {target}")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            broken.append(f"{page.name} -> {target}#{fragment} (no such heading)")
    return broken


def test_links_point_to_files_and_headings_that_exist():
    broken = [b for page in doc_pages() for b in broken_links(page)]
    assert not broken, f"broken links: {broken}"


def test_a_link_to_a_missing_heading_is_caught(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## The plateau (measured)\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#the-plateau-measured), [gone](a.md#the-plateau), [self](#b)\n# B\n")
    assert broken_links(page) == ["b.md -> a.md#the-plateau (no such heading)"]


# A reference to a section of another page by its name, as the docs, help texts and config
# comments write them: `docs/results.md, "The bootstrap's plateau"` (the path may be a link:
# `[docs/results.md](docs/results.md), "..."`), or `README, "Where the bar stands"`. The name is
# the start of a heading of that page, or of a paragraph's bold lead (`**Expert thoughts: ...**`).
SECTION_REF = re.compile(
    r"((?:\.\./)?(?:[\w.-]+/)*[\w.-]+\.md|README)(?:\]\([^)]*\))?\)?,?\s+(?:sections?\s+)?"
    r'("[^"]{3,120}"(?:(?:,\s*|\s+and\s+|,\s+and\s+)"[^"]{3,120}")*)'
)


def _words(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("`", "").replace("\\", "")).strip().lower()


def section_names(page: Path) -> list[str]:
    # A bold lead opens a paragraph or a list item; it may wrap onto the next line.
    leads = re.findall(r"^\s*(?:[-*]\s+)?\*\*([^*]+?)\*\*", page.read_text(), flags=re.M)
    return [_words(name) for name in [*headings(page), *leads]]


def unknown_sections(page: Path) -> list[str]:
    # References wrap across lines, in comments too: join them first.
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", page.read_text())
    missing = []
    for target, names in SECTION_REF.findall(text):
        target = "README.md" if target == "README" else target
        dest = next((d for d in (page.parent / target, ROOT / target) if d.is_file()), None)
        if dest is None:  # a page outside this repository (../shared's DESIGN.md, ...)
            continue
        known = section_names(dest)
        for name in re.findall(r'"([^"]+)"', names):  # `"A" and "B"` names two sections
            if not any(section.startswith(_words(name)) for section in known):
                missing.append(f'{page.relative_to(ROOT)} -> {target}, "{name}"')
    return missing


def test_section_references_name_sections_that_exist():
    pages = [*doc_pages(), *sorted(ROOT.glob("configs/*.yaml"))]
    for folder in ("flywheel", "stages", "flows", "benchmarks", "data_contracts", "examples"):
        pages += sorted((ROOT / folder).rglob("*.py"))
    missing = [m for page in pages for m in unknown_sections(page)]
    assert not missing, f"references to sections that do not exist: {missing}"


def test_a_reference_to_a_renamed_section_is_caught(tmp_path, monkeypatch):
    (tmp_path / "results.md").write_text(
        "# R\n\n## The bootstrap's plateau (measured)\n\n**Expert thoughts: x.**\n"
    )
    page = tmp_path / "page.md"
    page.write_text(
        'See [results.md](results.md), "The bootstrap\'s plateau" and results.md, "Expert\n'
        'thoughts", but results.md, "The old plateau" is gone, as is the second of results.md,\n'
        '"Expert thoughts" and "Old thoughts".\n'
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert unknown_sections(page) == [
        'page.md -> results.md, "The old plateau"',
        'page.md -> results.md, "Old thoughts"',
    ]


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
