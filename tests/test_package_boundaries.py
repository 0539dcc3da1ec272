"""compressors/ and transports/ are leaves: each imports its own libraries and the standard library,
never splitft/ nor each other; and splitft ships its type hints."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import compressors
import splitft
import transports

STDLIB = set(sys.stdlib_module_names)


def _imports(package: Path) -> list[tuple[str, str]]:
    """(file, top-level module) of every absolute import in ``package``, nested ones included."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found += [(path.name, a.name.split(".")[0]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.append((path.name, (node.module or "").split(".")[0]))
    return found


def test_compressors_import_only_torch_numpy_and_stdlib() -> None:
    allowed = {"torch", "numpy", "compressors"} | STDLIB
    for name, mod in _imports(Path(compressors.__file__).parent):
        assert mod in allowed, f"compressors/{name} imports {mod}"


def test_transports_import_only_pyzmq_and_stdlib() -> None:
    allowed = {"zmq", "transports"} | STDLIB
    imports = _imports(Path(transports.__file__).parent)
    assert any(mod == "zmq" for _, mod in imports)  # the walk sees the real imports
    for name, mod in imports:
        assert mod in allowed, f"transports/{name} imports {mod}"


def test_splitft_ships_its_type_hints() -> None:
    root = Path(splitft.__file__).parent
    assert (root / "py.typed").is_file()
    assert 'splitft = ["py.typed"]' in (root.parent / "pyproject.toml").read_text()


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
