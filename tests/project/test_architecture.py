"""The shape of the code: concept packages, imports flowing one way, small modules, pure policy.

These read the source (``ast``), so they fail the moment a module breaks
the layering, not when a cycle happens to bite at import time.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT


#: each package may import only packages of a lower layer (or its own)
LAYERS = {
    "errors": 0,
    "units": 0,
    "exit_codes": 1,  # one exit-status mapping for fabric and fabric-node  # durations and sizes: parsed and printed alike by every flag
    "v1": 0,
    "format": 1,
    "rpc": 1,
    "trust": 1,
    "observability": 1,  # metrics, log format, probe endpoint: used by the node, importable by any layer above
    "store": 2,
    "serving": 3,
    "access": 3,  # principals and verbs on id prefixes: over store's id rules, checked by the node's edge
    "transport": 3,
    "origins": 3,  # S3, the Hub, HTTP, a directory: fetched into a scratch directory the store then stages; revision records
    "client": 4,
    "harness": 5,
    "integrations": 5,
    "cli": 6,
    "node": 7,
}
#: ~400 lines is the budget for one idea; generated code is exempt
MAX_MODULE_LINES = 420
#: pure policy: plain functions over plain data, testable without a device, a model or a socket
PURE_MODULES = (
    "fabric/serving/policy.py", "fabric/transport/swarm.py", "fabric/access/policy.py",
    "fabric/transport/placement.py", "fabric/transport/lookup.py", "fabric/transport/holder_directory.py", "fabric/transport/rehoming.py",
    "fabric/transport/home_copies.py",
)
#: what a pure policy may import from fabric: the error types, the id rules, the size parser (plain ``re`` over strings), and
#: the placement and the eviction choice (themselves pure)
PURE_MAY_IMPORT = {"adapter_fabric.errors", "adapter_fabric.store.ids", "adapter_fabric.units", "adapter_fabric.transport.placement",
                   "adapter_fabric.store.eviction"}
#: pure modules that may use numpy: placement scores a fleet (10,000 members) with one vectorised pass, no device, no I/O
PURE_NUMERIC = {"fabric/transport/placement.py"}
IMPURE_IMPORTS = {"torch", "grpc", "socket", "numpy", "threading", "asyncio", "os", "subprocess"}


def _modules(top: str) -> list[Path]:
    return sorted(p for p in (ROOT / top).rglob("*.py") if "v1" not in p.relative_to(ROOT).parts)


#: the import name of each folder: setup.py installs fabric/ as adapter_fabric and node/ as adapter_fabric.node
FOLDER_PACKAGES = {"fabric": "adapter_fabric", "node": "adapter_fabric.node"}
PACKAGE = FOLDER_PACKAGES["fabric"]


def _module_name(path: Path) -> str:
    """fabric/store/manifest.py -> adapter_fabric.store.manifest; node/servicer.py -> adapter_fabric.node.servicer."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    parts = parts[:-1] if parts[-1] == "__init__" else parts
    return ".".join((FOLDER_PACKAGES[parts[0]], *parts[1:]))


def _package_of(module: str) -> str | None:
    """'adapter_fabric.store.manifest' -> 'store'; 'adapter_fabric.node.servicer' -> 'node'; 'adapter_fabric' -> None (the public API)."""
    parts = module.split(".")
    if parts[0] != PACKAGE or len(parts) == 1:
        return None
    return parts[1]


def _imports(path: Path) -> set[str]:
    """Every library module a file imports (``from adapter_fabric import wire`` counts as adapter_fabric.wire)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names if node.module in FOLDER_PACKAGES.values())
    return {m for m in found if m.split(".")[0] == PACKAGE}


def _edges() -> list[tuple[Path, str, str]]:
    """(file, its package, an imported package) for every cross-package import."""
    edges = []
    for path in _modules("fabric") + _modules("node"):
        mine = _package_of(_module_name(path))
        if mine is None:
            continue  # fabric/__init__.py: the public API re-exports from every layer
        for module in _imports(path):
            theirs = _package_of(module)
            if theirs is not None and theirs != mine and theirs in LAYERS:
                edges.append((path, mine, theirs))
    return edges


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in (ROOT / "fabric").iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    packages |= {p.stem for p in (ROOT / "fabric").glob("*.py") if p.stem != "__init__"}
    assert packages <= set(LAYERS), f"new package(s) {sorted(packages - set(LAYERS))}: give them a layer in LAYERS"


def test_tests_mirror_every_package() -> None:
    """tests/ has one folder per package of fabric/ (and node/), each a package holding at least one test module."""
    packages = [p.name for p in (ROOT / "fabric").iterdir() if (p / "__init__.py").is_file() and p.name != "v1"] + ["node"]
    for name in packages:
        folder = ROOT / "tests" / name
        assert (folder / "__init__.py").is_file(), f"tests/{name}/ is missing: tests/ mirrors fabric/'s packages"
        assert any(folder.glob("test_*.py")), f"tests/{name}/ holds no test module"


def test_imports_flow_down_the_layers() -> None:
    upward = [f"{path.relative_to(ROOT)}: {mine} (layer {LAYERS[mine]}) imports {theirs} (layer {LAYERS[theirs]})"
              for path, mine, theirs in _edges() if LAYERS[theirs] >= LAYERS[mine]]
    assert not upward, "\n".join(upward)


def test_the_library_never_imports_the_node_or_the_cli() -> None:
    bad = [str(path.relative_to(ROOT)) for path, mine, theirs in _edges() if theirs in ("node", "cli") and mine not in ("node", "cli")]
    assert not bad


def test_the_node_never_imports_the_harness() -> None:
    bad = [str(path.relative_to(ROOT)) for path, mine, theirs in _edges() if mine == "node" and theirs in ("harness", "cli")]
    assert not bad


@pytest.mark.parametrize("path", _modules("fabric") + _modules("node"), ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it along its seams"


@pytest.mark.parametrize("relative", PURE_MODULES)
def test_policy_stays_pure(relative: str) -> None:
    tree = ast.parse((ROOT / relative).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    impure = IMPURE_IMPORTS - ({"numpy"} if relative in PURE_NUMERIC else set())
    assert not imported & impure, f"{relative} imports {sorted(imported & impure)}"
    fabric_imports = {m for m in _imports(ROOT / relative)}
    assert fabric_imports <= PURE_MAY_IMPORT, fabric_imports


def test_public_api() -> None:
    """``from adapter_fabric import ...`` gives what a user needs; every public class and method says what it does."""
    import inspect

    import adapter_fabric as fabric

    for name in fabric.__all__:
        value = getattr(fabric, name)
        if name == "__version__":
            continue
        assert inspect.getdoc(value), f"fabric.{name} has no docstring"
        if inspect.isclass(value) and not issubclass(value, Exception):
            for attr, member in vars(value).items():
                if attr.startswith("_") or not callable(member) and not isinstance(member, property):
                    continue
                assert inspect.getdoc(member), f"fabric.{name}.{attr} has no docstring"


#: Python files that import the library: a folder name used as an import name passes from the clone
#: (the working directory is on sys.path) and fails in an engine's environment, where only adapter_fabric exists
IMPORTING = ("fabric", "node", "tests", "scripts")
FOLDER_NAME = re.compile(r"-m\s+(?:fabric|node)\b")


def _folder_name_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.split(".")[0] in FOLDER_PACKAGES]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and node.module.split(".")[0] in FOLDER_PACKAGES:
            found.append(node.module)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in ("__import__", "import_module"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and str(first.value).split(".")[0] in FOLDER_PACKAGES:
                found.append(f"{first.value} (dynamic)")
        elif isinstance(node, (ast.List, ast.Tuple)):
            values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            found += [f"-m {v}" for flag, v in zip(values, values[1:]) if flag == "-m" and str(v).split(".")[0] in FOLDER_PACKAGES]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and FOLDER_NAME.search(node.value):
            found.append(FOLDER_NAME.search(node.value).group(0))
    return found


def test_nothing_imports_the_folders_by_their_names() -> None:
    """``fabric`` and ``node`` are folder names; the import names are adapter_fabric and adapter_fabric.node (setup.py)."""
    files = [p for top in IMPORTING for p in sorted((ROOT / top).rglob("*.py")) if "__pycache__" not in p.parts]
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in files for name in _folder_name_imports(p)]
    texts = [ROOT / "Dockerfile", ROOT / "README.md", *sorted((ROOT / "deploy").iterdir()), *sorted((ROOT / "scripts").iterdir())]
    bad += [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in texts if p.is_file() and p.suffix != ".py" for m in FOLDER_NAME.finditer(p.read_text())]
    assert not bad, "\n".join(bad)


def test_import_fabric_stays_light() -> None:
    """The CLI imports ``adapter_fabric`` on every call: torch and grpc load only when a name needs them."""
    code = "import sys, adapter_fabric; print(sorted(m for m in ('torch', 'grpc', 'peft') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_a_store_only_node_never_imports_torch() -> None:
    """``fabric-node --model none`` loads no torch, numpy or peft: its start-up stays well under a second (torch alone
    takes 1-3 s to import); the model code loads when a node builds a model or serves a Generate."""
    code = (
        "import sys, adapter_fabric.node.main, adapter_fabric.node.server; "
        "print(sorted(m for m in ('torch', 'numpy', 'peft', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"


def test_version_is_the_package_version() -> None:
    from importlib.metadata import version

    import adapter_fabric as fabric

    assert fabric.__version__ == version("adapter-fabric")


# ------------------------------------------------------------ module graph: no circles, no private names across modules


LIBRARY = {_module_name(p): p for p in _modules("fabric") + _modules("node")}


def _resolve(module: str, name: str | None = None) -> str | None:
    """The library module an import statement loads: ``from adapter_fabric.store import manifest`` -> adapter_fabric.store.manifest."""
    if name is not None and f"{module}.{name}" in LIBRARY:
        return f"{module}.{name}"
    return module if module in LIBRARY else None


def _module_imports(path: Path) -> list[tuple[str, str | None]]:
    """(imported library module, the name taken from it or None) for every import anywhere in a file.

    Imports inside functions and under ``TYPE_CHECKING`` count too: a circle drawn lazily is still a circle in the design.
    """
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(m, None) for alias in node.names if (m := _resolve(alias.name))]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                target = _resolve(node.module, alias.name)
                if target is not None:
                    found.append((target, None if target != node.module else alias.name))
    return found


def _graph() -> dict[str, set[str]]:
    # fabric/__init__.py is the public API: it re-exports (lazily) from every layer, and no library module imports it.
    return {name: {m for m, _ in _module_imports(path) if m != name and m != PACKAGE} for name, path in LIBRARY.items() if name != PACKAGE}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_circle_finder_finds_circles() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_between_library_modules() -> None:
    circles = _circles(_graph())
    assert not circles, "import circles (each line one circle; cut it by handing a collaborator in):\n" + "\n".join(" <-> ".join(c) for c in circles)


def test_no_private_name_is_imported_across_modules() -> None:
    """Not by the library, and not by tests or scripts either: what they need of a module is its public face."""
    importers = [*LIBRARY.values(), *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "scripts").glob("*.py"))]
    leaks = [
        f"{path.relative_to(ROOT)} imports {name} from {module}"
        for path in importers
        for module, name in _module_imports(path)
        if name is not None and name.startswith("_") and not name.startswith("__")
    ]
    assert not leaks, "\n".join(leaks)
