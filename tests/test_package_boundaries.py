"""compressors/ and transports/ are leaves: each imports its own libraries and the standard library,
never splitft/ nor each other; splitft ships its type hints; and its modules import each other
without cycles."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import compressors
import splitft
import transports
from tests.import_graph import runtime_cycles, runtime_imports

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
        text = re.sub(r"(np|numpy)\.random\.default_rng\((?!\))", "", path.read_text())  # a generator of its own, seeded
        for b in banned:
            assert b not in text, f"{path.name} uses the global RNG ({b})"
        for line in text.splitlines():
            for fn in ("torch.randn(", "torch.rand(", "torch.randint("):
                if fn in line:
                    assert "generator=" in line, f"{path.name}: {line.strip()} draws from the global RNG"


def test_tests_run_against_this_checkout() -> None:
    # an editable install of another checkout must not shadow the code under test
    assert Path(compressors.__file__).resolve().parent.parent == Path(__file__).resolve().parent.parent


def test_the_import_graph_sees_runtime_cycles_and_only_those(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from .a import A\n")
    (package / "a.py").write_text("from . import b\nA = 1\n")
    (package / "b.py").write_text("try:\n    from .a import A\nexcept ImportError:\n    pass\n")
    (package / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .d import D\n")
    (package / "d.py").write_text("from .c import C\n\ndef later():\n    from .e import E\n")
    (package / "e.py").write_text("class E:\n    from .d import D\n")
    assert runtime_cycles(package) == [["pkg.a", "pkg.b"]]
    assert runtime_cycles(package, typing=True) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert runtime_imports(package)["pkg.e"] == {"pkg.d"}  # a class body runs at import, a function's does not


ROOT_PACKAGE = Path(splitft.__file__).parent


def test_splitft_has_no_import_cycle_not_even_for_type_checkers() -> None:
    assert runtime_cycles(ROOT_PACKAGE) == []
    # imports inside functions and for type checkers too: the rooms see each other through protocols
    assert runtime_cycles(ROOT_PACKAGE, deferred=True, typing=True) == []


def test_edge_and_cloud_never_import_each_other_and_shared_rooms_import_neither() -> None:
    graph = runtime_imports(ROOT_PACKAGE, deferred=True, typing=True)

    def side(module: str) -> str:
        parts = module.split(".")
        if len(parts) > 2 or (len(parts) == 2 and (ROOT_PACKAGE / parts[1]).is_dir()):
            return parts[1]  # edge, cloud, wire, app, privacy
        return "shared"  # a module at the root: cut, factories, options, devices, metrics, ...

    forbidden = {"edge": {"cloud", "app"}, "cloud": {"edge", "app"}, "wire": {"edge", "cloud", "app"},
                 "shared": {"edge", "cloud", "app"}}
    wrong = [(module, dep) for module, deps in graph.items() for dep in deps
             if side(dep) in forbidden.get(side(module), set()) and module not in ("splitft", "splitft.__main__")]
    assert wrong == []
