"""compressors/ is a leaf: it imports torch, numpy and the standard library, nothing else."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import compressors

ALLOWED = {"torch", "numpy", "compressors"} | set(sys.stdlib_module_names)


def test_compressors_import_only_torch_numpy_and_stdlib() -> None:
    root = Path(compressors.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module or ""]
            else:
                continue
            for mod in mods:
                assert mod.split(".")[0] in ALLOWED, f"{path.name} imports {mod}"


def test_no_global_rng_calls_in_the_package() -> None:
    root = Path(compressors.__file__).parent
    banned = ("torch.manual_seed", "np.random.", "numpy.random.", "random.random", "torch.seed(")
    for path in sorted(root.glob("*.py")):
        text = path.read_text()
        for b in banned:
            assert b not in text, f"{path.name} uses the global RNG ({b})"
        for line in text.splitlines():
            for fn in ("torch.randn(", "torch.rand(", "torch.randint("):
                if fn in line:
                    assert "generator=" in line, f"{path.name}: {line.strip()} draws from the global RNG"


def test_tests_run_against_this_checkout() -> None:
    # an editable install of another checkout must not shadow the code under test
    assert Path(compressors.__file__).resolve().parent.parent == Path(__file__).resolve().parent.parent
