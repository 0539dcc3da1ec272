"""The documentation shows code that works: every Python block of the README and the site's pages
is valid Python whose splitft names exist, every `splitft ...` command line parses with the
command's own parser (each flag and value it names exists), and the README stays a front door.
(`mkdocs build --strict`, which CI runs, checks every link and anchor.)"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

import splitft
from splitft.app.cli import _build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```(\w+)[^\n]*\n(.*?)```", re.S)


def blocks(language: tuple[str, ...]) -> list[tuple[str, str]]:
    """(where, code) of each fenced block in one of ``language``."""
    found = []
    for page in PAGES:
        for match in BLOCK.finditer(page.read_text(encoding="utf-8")):
            if match.group(1) in language:
                line = page.read_text(encoding="utf-8")[:match.start()].count("\n") + 1
                found.append((f"{page.relative_to(ROOT)}:{line}", match.group(2)))
    return found


PYTHON = blocks(("python",))


@pytest.mark.parametrize("where,code", PYTHON, ids=[w for w, _ in PYTHON])
def test_a_python_block_is_valid_python_and_its_splitft_names_exist(where, code):
    tree = ast.parse(code)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "splitft":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), \
                    f"{where}: {node.module} has no {alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "splitft":
                    importlib.import_module(alias.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "splitft"):
            assert hasattr(splitft, node.attr), f"{where}: splitft has no {node.attr}"


def command_lines() -> list[tuple[str, str]]:
    """Each `splitft ...` command of a shell block, continuation lines joined, variables filled in."""
    found = []
    for where, code in blocks(("bash", "sh", "shell")):
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            match = re.match(r"^(?:for .*?; do )?(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?splitft\s+(.*?)(?:\s*&(?:\s*done)?)?$",
                             line)
            if match:
                args = re.sub(r"\$\(\([^)]*\)\)|\$\([^)]*\)|\$\w+", "X", match.group(1))
                found.append((where, args))
    return found


COMMANDS = command_lines()


@pytest.mark.parametrize("where,args", COMMANDS, ids=[f"{w}:{a[:40]}" for w, a in COMMANDS])
def test_a_command_line_in_the_docs_parses_with_the_commands_own_parser(where, args):
    words = [w for w in shlex.split(args) if w != "X"]  # a variable standing for flags (as $KEYS) adds none
    errors = io.StringIO()
    with contextlib.redirect_stderr(errors):
        try:
            _build_parser().parse_args(words)
        except SystemExit as exit:
            assert exit.code == 0, f"{where}: `splitft {args}` does not parse: {errors.getvalue().strip()}"


def test_the_docs_show_commands_and_python_to_check():
    assert len(PYTHON) >= 5 and len(COMMANDS) >= 25  # what the pages show today: the extraction finds them


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    for page in re.findall(r"\]\((docs/[\w/.-]+\.md)", readme):
        assert (ROOT / page).exists(), page
