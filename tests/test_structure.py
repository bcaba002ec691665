"""House rules of the source tree, checked on the syntax trees (no module is imported, no jax):

* no function (or method, or nested function) in ``polestar_jax/`` longer than :data:`MAX_FUNCTION_LINES`
  lines, from its ``def`` line to its last line;
* no private name used across modules in ``polestar_jax/`` or ``kernels/`` (installed as
  ``polestar_jax.kernels``): neither ``from polestar_jax.x import _y`` nor ``x._y`` on an imported module;
* each module imports only its own folder, the core modules and folders of lower layers
  (:data:`LAYERS`: models, kernels, io < decode < engine < serving < the faces at the top);
* no module of ours imported under a one-to-three-letter capitalised alias (``M``, ``R``, ``Dr``, ``OF``,
  ``PSt``, ...: the PyTorch code's habit; ``R`` was the commit module where R means window rows): a module
  is imported under its own name, or its functions are imported by name.
"""
from __future__ import annotations

import ast
import sys
import re
from pathlib import Path
from typing import Iterator, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
#: Source folder -> the package it is installed as (pyproject.toml ``package-dir``).
PACKAGES = {"polestar_jax": REPO / "polestar_jax", "polestar_jax.kernels": REPO / "kernels"}
MAX_FUNCTION_LINES = 80
#: Functions allowed over the limit for now, each with the reason; an entry that is no longer over the
#: limit fails the test (remove it then).
LONG_FUNCTION_EXCEPTIONS: dict[str, str] = {}
PYTORCH_ALIAS = re.compile(r"^[A-Z][A-Za-z]{0,2}$")


def _modules(package: str) -> Iterator[tuple[str, Path]]:
    """``(module name, path)`` of every module in ``package``'s folder and its sub-folders."""
    root = PACKAGES[package]
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


MODULES = dict(m for pkg in PACKAGES for m in _modules(pkg))
KNOWN = set(MODULES) | set(PACKAGES)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _ours(module: Optional[str]) -> bool:
    return module is not None and (module == "polestar_jax" or module.startswith("polestar_jax."))


def _resolve(node: ast.ImportFrom, here: str, is_package: bool) -> Optional[str]:
    """The absolute module name of a ``from ... import`` (relative levels resolved against ``here``)."""
    if not node.level:
        return node.module
    parts = here.split(".") if is_package else here.split(".")[:-1]
    base = parts[: len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _module_bindings(tree: ast.Module, here: str, is_package: bool) -> dict[str, str]:
    """Local names bound to modules of ours (anywhere in the file: imports inside functions count)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name):
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(node, here, is_package)
            for a in node.names:
                if _ours(src) and f"{src}.{a.name}" in KNOWN:
                    out[a.asname or a.name] = f"{src}.{a.name}"
    return out


def _dotted(node: ast.Attribute) -> Optional[list[str]]:
    parts = [node.attr]
    value = node.value
    while isinstance(value, ast.Attribute):
        parts.append(value.attr)
        value = value.value
    if not isinstance(value, ast.Name):
        return None
    return [value.id] + parts[::-1]


def _private_uses(here: str, path: Path) -> list[str]:
    tree = _tree(path)
    is_package = path.stem == "__init__"
    bound = _module_bindings(tree, here, is_package)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _resolve(node, here, is_package)
            if _ours(src) and src != here:
                found |= {f"{here}:{node.lineno}: from {src} import {a.name}" for a in node.names if _private(a.name)}
        elif isinstance(node, ast.Attribute):
            chain = _dotted(node)
            if not chain or chain[0] not in bound:
                continue
            module, rest = bound[chain[0]], chain[1:]
            while rest and f"{module}.{rest[0]}" in KNOWN:  # polestar_jax.kernels.refresh._x
                module, rest = f"{module}.{rest[0]}", rest[1:]
            if rest and _private(rest[0]) and module != here:
                used = ".".join(chain[: len(chain) - len(rest) + 1])
                found.add(f"{here}:{node.lineno}: {used} (a private name of {module})")
    return sorted(found)


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def function_lengths(package: str = "polestar_jax") -> dict[str, int]:
    """``"module:qualified.name" -> lines`` of every function of the modules in ``package``'s folder."""
    out = {}
    for here, path in _modules(package):
        for name, node in _functions(_tree(path)):
            out[f"{here}:{name}"] = node.end_lineno - node.lineno + 1
    return out


def test_sources_found():
    """The rules below look at real files (a wrong path would make them pass vacuously)."""
    assert {"polestar_jax.engine.engine", "polestar_jax.decode.block", "polestar_jax.kernels.kl_drift"} <= set(MODULES)
    assert len(function_lengths()) > 200


def test_no_long_functions():
    lengths = function_lengths()
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    offenders = sorted((n, name) for name, n in long.items() if name not in LONG_FUNCTION_EXCEPTIONS)
    assert not offenders, "functions over %d lines: %s" % (
        MAX_FUNCTION_LINES, ", ".join(f"{name} ({n} lines)" for n, name in reversed(offenders)))
    stale = [name for name in LONG_FUNCTION_EXCEPTIONS if lengths.get(name, 0) <= MAX_FUNCTION_LINES]
    assert not stale, f"no longer over the limit (remove from LONG_FUNCTION_EXCEPTIONS): {stale}"


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_private_cross_module_use(package):
    found = [use for here, path in _modules(package) for use in _private_uses(here, path)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_no_pytorch_style_module_aliases(package):
    found = []
    for here, path in _modules(package):
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                src = _resolve(node, here, path.stem == "__init__") if isinstance(node, ast.ImportFrom) else None
                for a in node.names:
                    full = a.name if isinstance(node, ast.Import) else f"{src}.{a.name}"
                    if a.asname and full in KNOWN and PYTORCH_ALIAS.match(a.asname):
                        found.append(f"{here}:{node.lineno}: {full} as {a.asname}")
    assert not found, "modules imported under PyTorch-style aliases:\n" + "\n".join(found)


def test_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    """The checkers themselves: each flags a planted offence and accepts the allowed form."""
    src = tmp_path / "polestar_jax"
    src.mkdir()
    (src / "a.py").write_text("def _h():\n    pass\n")
    (src / "b.py").write_text(
        "from polestar_jax import a as A\nfrom polestar_jax import a\nfrom polestar_jax.a import _h\n"
        "import polestar_jax.a\n\n\ndef f():\n" + "    x = 1\n" * 81
        + "    return a._h, A.__name__, polestar_jax.a._h, a.__doc__\n")
    monkeypatch.setitem(PACKAGES, "polestar_jax", src)
    monkeypatch.setattr(sys.modules[__name__], "KNOWN", {"polestar_jax", "polestar_jax.a", "polestar_jax.b"})
    assert function_lengths() == {"polestar_jax.a:_h": 2, "polestar_jax.b:f": 83}
    uses = _private_uses("polestar_jax.b", src / "b.py")
    assert len(uses) == 3 and all("_h" in u for u in uses), uses
    assert _private_uses("polestar_jax.a", src / "a.py") == []
    with pytest.raises(AssertionError, match="polestar_jax.a as A"):
        test_no_pytorch_style_module_aliases("polestar_jax")


def import_graph(modules: Optional[dict] = None) -> dict[str, set[str]]:
    """module -> the package modules it imports, anywhere in its body (inside functions too)."""
    modules = MODULES if modules is None else modules
    graph = {}
    for here, path in modules.items():
        deps = set()
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
            elif isinstance(node, ast.ImportFrom):
                mod = _resolve(node, here, path.stem == "__init__")
                if mod in modules:
                    deps.add(mod)
                deps |= {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in modules}
        deps.discard(here)
        graph[here] = deps
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_cycles():
    """No two package modules import each other, directly or through others (imports inside functions
    count: a cycle hidden in a function is still a cycle)."""
    graph = import_graph()
    assert graph["polestar_jax.decode.polestar.policy"] >= {"polestar_jax.decode.policy", "polestar_jax.decode.state"}  # the graph is real
    assert import_cycles(graph) == []


def test_cycle_finder_finds_cycles(tmp_path):
    for name, body in (("a", "import x\nfrom pkg import b\n"), ("b", "def f():\n    from pkg.c import g\n"),
                       ("c", "from pkg import a\n"), ("d", "from pkg import a\n")):
        (tmp_path / f"{name}.py").write_text(body)
    mods = {f"pkg.{n}": tmp_path / f"{n}.py" for n in "abcd"}
    assert import_cycles(import_graph(mods)) == [["pkg.a", "pkg.b", "pkg.c"]]


#: The package's layers, lowest first: a module imports its own folder, the core modules and lower layers
#: only. Folders of one layer do not import each other. ``faces`` are the top-level modules that are not core
#: (the commands and the Python API) and ``polestar_jax.convert``.
LAYERS = {"models": 1, "kernels": 1, "io": 1, "decode": 2, "engine": 3, "serving": 4, "faces": 5}
#: Top-level modules every layer may import; they import only each other.
CORE = {"config", "errors", "compat", "axes", "sharding", "registry"}


def layer_of(module: str) -> str:
    """The layer (a key of :data:`LAYERS`) or ``"core"`` of a package module name."""
    parts = module.split(".")
    if len(parts) == 1:
        return "core"  # polestar_jax/__init__.py: re-exports core names, loaded on first use
    if parts[1] in LAYERS:
        return parts[1]
    if parts[1] == "convert":
        return "faces"
    return "core" if parts[1] in CORE else "faces"


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b (layer -> layer)"`` for every import of ``graph`` that breaks the layer rule."""
    out = []
    for here, deps in graph.items():
        mine = layer_of(here)
        for dep in sorted(deps):
            theirs = layer_of(dep)
            if theirs == mine and mine != "faces" or theirs == "core" or mine == "faces":
                continue
            if mine == "core" or LAYERS[theirs] >= LAYERS[mine]:
                out.append(f"{here} -> {dep} ({mine} -> {theirs})")
    return out


def test_layers_import_only_downwards():
    """models, kernels, io < decode < engine < serving < faces: no folder imports a folder above it or beside
    it, and the core modules import only each other (so the engine, say, needs nothing of the CLI)."""
    graph = import_graph()
    assert {layer_of(m) for m in graph} == {"core", *LAYERS}  # every layer has modules: the rule is real
    assert layer_violations(graph) == []


def test_layer_rule_flags_upward_imports():
    graph = {"polestar_jax.engine.engine": {"polestar_jax.cli", "polestar_jax.decode.block", "polestar_jax.config"},
             "polestar_jax.models.llada": {"polestar_jax.io.checkpoint", "polestar_jax.kernels.refresh"},
             "polestar_jax.config": {"polestar_jax.models.family"},
             "polestar_jax.serving.app": {"polestar_jax.serving.scheduler", "polestar_jax.engine.engine"},
             "polestar_jax.generate": {"polestar_jax.serving.app", "polestar_jax.api"}}
    assert layer_violations(graph) == [
        "polestar_jax.engine.engine -> polestar_jax.cli (engine -> faces)",
        "polestar_jax.models.llada -> polestar_jax.io.checkpoint (models -> io)",
        "polestar_jax.models.llada -> polestar_jax.kernels.refresh (models -> kernels)",
        "polestar_jax.config -> polestar_jax.models.family (core -> models)"]
