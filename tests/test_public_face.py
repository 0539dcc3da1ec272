"""splitft's public face: what a script needs, each name typed for a type checker.

`from splitft import split` was `Any` to mypy when the package loaded its names lazily; the names
now have their types under TYPE_CHECKING, so a type checker catches a script's misuse."""

from __future__ import annotations

from pathlib import Path

import pytest

import splitft

ROOT = Path(__file__).resolve().parent.parent


def test_the_public_names_are_what_a_script_needs_and_each_one_loads():
    assert 10 <= len(splitft.__all__) <= 20
    assert {"split", "SplitModel", "Codecs", "Factory", "Faults", "Link", "Schedule", "errors"} <= set(splitft.__all__)
    assert not {"EdgeSession", "CloudSession"} & set(splitft.__all__)  # the runtimes' insides are not the face
    for name in splitft.__all__:
        assert getattr(splitft, name) is not None


def test_a_type_checker_sees_what_split_is_and_catches_its_misuse(tmp_path):
    api = pytest.importorskip("mypy.api")
    script = tmp_path / "user_script.py"
    script.write_text("import splitft\n\nreveal_type(splitft.split)\nmodel: int = splitft.split\n")
    out, _, status = api.run([str(script), "--config-file", str(ROOT / "pyproject.toml"),
                              "--cache-dir", str(ROOT / ".mypy_cache")])
    assert "-> splitft.edge.model.SplitModel" in out  # the revealed signature, not Any
    assert 'Incompatible types in assignment' in out and status == 1
