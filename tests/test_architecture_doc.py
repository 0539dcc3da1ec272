"""docs/architecture.md is the map of the code: every module of ``splitft/`` has a row in the
table of its folder, with its one job, and every row names a module that exists. A room added,
moved or removed without the map fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
#: Section headings name their folder: "## The edge: `splitft/edge/`", or the root's "the root of `splitft/`".
HEADING = re.compile(r"^## .*`(splitft/[\w/]*)`\s*$")
ROW = re.compile(r"^\| `([\w.]+\.py)` \| (.+) \|$")


def rooms_in_doc() -> dict[str, dict[str, str]]:
    """Folder → {module file → its job}, from the doc's tables."""
    found: dict[str, dict[str, str]] = {}
    folder = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            heading = HEADING.match(line)
            folder = heading.group(1).rstrip("/") if heading else None
        elif folder is not None and (row := ROW.match(line)):
            found.setdefault(folder, {})[row.group(1)] = row.group(2)
    return found


def rooms_in_tree() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / "splitft").rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py") and "__pycache__" not in path.parts:
            found.setdefault(str(path.parent.relative_to(ROOT)), set()).add(path.name)
    return found


def test_every_module_of_splitft_has_a_row_in_its_folders_table_and_every_row_a_module():
    doc, tree = rooms_in_doc(), rooms_in_tree()
    assert set(doc) == set(tree), "folders mapped / in the tree differ"
    for folder, modules in tree.items():
        assert set(doc[folder]) == modules, f"{folder}: missing {sorted(modules - set(doc[folder]))}, " \
                                            f"gone {sorted(set(doc[folder]) - modules)}"


def test_each_row_says_what_its_room_does():
    for folder, rows in rooms_in_doc().items():
        for module, job in rows.items():
            assert len(job.split()) >= 4, f"{folder}/{module}: say its one job"
