"""The import graph of our three packages obeys the layering of issue 11:

    pallas_kernels (a leaf: imports nothing of ours)  <-  sharding (never ling_jax)  <-  ling_jax

and has no cycle, between modules or between the packages. Inside ling_jax (issue 21, "Layering"):

* the host side of serving imports no jax, flax or orbax, not even through what it imports: the
  scheduler, the prefix cache, the page allocator, the request parameters and the checks they use
  (`HOST_ONLY`); importing them at run time leaves jax unloaded (the packages' faces included);
* the engine's device side (`ling_jax.serve.runner`) imports none of the request lifecycle (the
  engine, the scheduler, the prefix cache, the request parameters);
* `ling_jax.checkpoint` is storage only: of ling_jax it imports itself, `ling_jax.config` and
  `ling_jax.checks`, so neither the model, the loader nor the HF -> Orbax conversion; the conversion
  (`ling_jax.convert`, a use of the loader) sits above the loader, which never reaches it.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import deque
from pathlib import Path

PACKAGES = ("ling_jax", "pallas_kernels", "sharding")
ROOT = Path(__file__).resolve().parents[1]
HOST_ONLY = ("ling_jax.checks", "ling_jax.sampling_params", "ling_jax.serve.allocator", "ling_jax.serve.request",
             "ling_jax.serve.scheduler", "ling_jax.serve.prefix_cache", "ling_jax.serve.slot_sampling",
             "ling_jax.serve.prefill_policy", "ling_jax.serve.buckets")
DEVICE_LIBRARIES = frozenset({"jax", "jaxlib", "flax", "orbax", "optax"})


# ---------------------------------------------------------------------------- the graph builder

def discover(root: Path, packages=PACKAGES) -> dict[str, tuple[str, bool]]:
    """{module name: (source, is_package)} for every .py file under root/<package>/."""
    modules = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            modules[name] = (path.read_text(encoding="utf-8"), is_package)
    return modules


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str:
    """The absolute name a (possibly relative) `from <dots><module> import ...` refers to."""
    if level == 0:
        return module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    if level - 1 >= len(base):
        raise ValueError(f"{importer}: relative import beyond the top-level package (level {level})")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imported_names(importer: str, source: str, is_package: bool, members: bool = True) -> list[str]:
    """Every absolute name an import statement of `source` mentions, anywhere in the file.

    `import a.b` gives "a.b"; `from a.b import c` gives "a.b" and, with `members`, "a.b.c" (c may be
    a submodule or an attribute; the graph keeps it only if it is one of our modules)."""
    names = []
    for node in ast.walk(ast.parse(source, filename=importer)):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(importer, is_package, node.level, node.module)
            names.append(base)
            if members:
                names.extend(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def build_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: modules of ours that its imports execute} (see the module docstring)."""
    graph = {}
    for name, (source, is_package) in modules.items():
        own = set(_ancestors(name)) | {name}
        targets = set()
        for imported in imported_names(name, source, is_package):
            for m in _ancestors(imported) + [imported]:
                if m in modules and m not in own:
                    targets.add(m)
        graph[name] = targets
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to top-level packages (edges between different packages only)."""
    top = lambda m: m.split(".")[0]  # noqa: E731
    out: dict[str, set[str]] = {}
    for a, targets in graph.items():
        out.setdefault(top(a), set()).update(top(b) for b in targets if top(b) != top(a))
    return out


def forbidden_imports(modules, package: str, banned) -> list[tuple[str, str]]:
    """(module, imported module) for every import in `package` of a module under one of `banned`."""
    return sorted({(name, imported) for name, (source, is_package) in modules.items()
                   if name.split(".")[0] == package
                   for imported in imported_names(name, source, is_package, members=False)
                   if imported.split(".")[0] in banned})


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """`start` and every module its imports execute, directly or through others (enclosing packages
    left out, as in `build_graph`)."""
    seen, todo = {start}, [start]
    while todo:
        for m in graph.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def library_imports(modules, graph, start: str, libraries) -> list[tuple[str, str]]:
    """(module, imported name) for every import of one of `libraries` (top-level names, e.g. "jax")
    by `start` or by a module of ours it reaches."""
    return sorted({(m, imported) for m in reachable(graph, start)
                   for imported in imported_names(m, modules[m][0], modules[m][1], members=False)
                   if imported.split(".")[0] in libraries})


def _sccs(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan)."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle [a, b, ..., a] per strongly connected component that has a cycle."""
    cycles = []
    for comp in _sccs(graph):
        members = set(comp)
        start = comp[0]
        if len(comp) == 1 and start not in graph.get(start, ()):
            continue
        prev, queue = {}, deque([start])
        while queue:  # BFS inside the component back to `start`
            v = queue.popleft()
            if start in graph.get(v, ()):
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                cycles.append(path[::-1] + [start])
                break
            for w in sorted(graph.get(v, ())):
                if w in members and w not in prev and w != start:
                    prev[w] = v
                    queue.append(w)
    return cycles


def _describe(cycles, graph=None) -> str:
    """One line per cycle; with `graph`, also every module that lies on some cycle with it."""
    lines = [" -> ".join(c) for c in cycles]
    if graph is not None:
        lines += ["  all mutually dependent: " + ", ".join(c) for c in _sccs(graph) if len(c) > 1]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the real tree

_MODULES = discover(ROOT)
_GRAPH = build_graph(_MODULES)


def test_every_package_was_read():
    tops = {m.split(".")[0] for m in _MODULES}
    assert tops == set(PACKAGES), tops
    assert "pallas_kernels.kda.reference" in _MODULES and "ling_jax.model" in _MODULES


def test_pallas_kernels_imports_nothing_of_ours():
    bad = forbidden_imports(_MODULES, "pallas_kernels", {"ling_jax", "sharding"})
    assert not bad, "pallas_kernels must be a leaf; it imports:\n" + "\n".join(f"{m}: {i}" for m, i in bad)


def test_sharding_does_not_import_ling_jax():
    bad = forbidden_imports(_MODULES, "sharding", {"ling_jax"})
    assert not bad, "sharding must not import ling_jax; it does in:\n" + "\n".join(f"{m}: {i}" for m, i in bad)


def test_no_module_import_cycle():
    cycles = find_cycles(_GRAPH)
    assert not cycles, "import cycles between modules:\n" + _describe(cycles, _GRAPH)


def test_no_package_import_cycle():
    cycles = find_cycles(package_graph(_GRAPH))
    assert not cycles, "import cycles between packages:\n" + _describe(cycles)


def test_host_side_of_serving_imports_no_jax():
    """The scheduler, prefix cache, page allocator and request parameters are host-only: none of them,
    nor anything of ours they import, imports a device library."""
    for name in HOST_ONLY:
        assert name in _MODULES, name
        bad = library_imports(_MODULES, _GRAPH, name, DEVICE_LIBRARIES)
        assert not bad, f"{name} must be host-only; it reaches:\n" + "\n".join(f"{m}: {i}" for m, i in bad)


def test_host_side_of_serving_loads_no_jax_at_run_time():
    """The same at run time, where importing a module first runs its packages' __init__ (ling_jax.serve
    names `Engine` lazily): a fresh interpreter importing every HOST_ONLY module has no jax loaded."""
    code = ("import sys\n" + "".join(f"import {m}\n" for m in HOST_ONLY)
            + f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(DEVICE_LIBRARIES)!r}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_model_runner_knows_no_request_lifecycle():
    """ling_jax.serve.runner (the engine's device side: programs, pools, shapes, warm-up) imports
    neither the engine nor the scheduler, the prefix cache's tree or the request parameters, and
    reaches no engine: the request lifecycle sits on top of the runner, never below it."""
    runner = "ling_jax.serve.runner"
    assert runner in _MODULES and runner in _GRAPH["ling_jax.serve.engine"]
    lifecycle = {"ling_jax.serve.engine", "ling_jax.serve.scheduler", "ling_jax.serve.prefix_cache",
                 "ling_jax.serve.request"}
    assert not lifecycle & _GRAPH[runner], sorted(lifecycle & _GRAPH[runner])
    assert "ling_jax.serve.engine" not in reachable(_GRAPH, runner)


def test_checkpoint_is_storage_only():
    """ling_jax.checkpoint imports, of ling_jax, only itself and the two leaves ling_jax.config and
    ling_jax.checks: not the model, the loader or the conversion."""
    bad = sorted((m, i) for m, targets in _GRAPH.items() if m.startswith("ling_jax.checkpoint")
                 for i in targets if i.split(".")[0] == "ling_jax"
                 and not (i in ("ling_jax.config", "ling_jax.checks") or i == "ling_jax.checkpoint"
                          or i.startswith("ling_jax.checkpoint.")))
    assert not bad, "ling_jax.checkpoint must be storage only; it imports:\n" + "\n".join(f"{m}: {i}" for m, i in bad)


def test_conversion_sits_above_the_loader():
    """ling_jax.convert (HF -> Orbax) is a use of the loader: it imports the loader, and neither the
    loader nor ling_jax.checkpoint reaches it."""
    assert "ling_jax.checkpoint.convert" not in _MODULES
    assert "ling_jax.loader" in _GRAPH["ling_jax.convert"]
    assert "ling_jax.convert" not in reachable(_GRAPH, "ling_jax.loader")
    assert not [m for m in _MODULES if m.startswith("ling_jax.checkpoint") and "ling_jax.convert" in _GRAPH[m]]


# ---------------------------------------------------------------------------- the builder can fail

def _synthetic(files: dict[str, str]) -> dict[str, tuple[str, bool]]:
    """{"pkg/__init__" or "pkg.mod": source} → the `discover` format."""
    return {name.removesuffix("/__init__"): (src, name.endswith("/__init__")) for name, src in files.items()}


def test_builder_finds_forbidden_imports_in_every_form():
    mods = _synthetic({
        "pallas_kernels/__init__": "",
        "pallas_kernels.clean": "import jax\nfrom pallas_kernels import other\n",
        "pallas_kernels.lazy": "def f():\n    from ling_jax.model import LingModel\n",
        "pallas_kernels.dotted": "import sharding.rules as r\n",
        "pallas_kernels.sub/__init__": "",
        "pallas_kernels.sub.rel": "from .. import clean\nclass A:\n    def m(self):\n        import ling_jax\n",
        "ling_jax/__init__": "", "ling_jax.model": "", "sharding/__init__": "", "sharding.rules": "",
    })
    bad = forbidden_imports(mods, "pallas_kernels", {"ling_jax", "sharding"})
    assert {m for m, _ in bad} == {"pallas_kernels.lazy", "pallas_kernels.dotted", "pallas_kernels.sub.rel"}
    assert ("pallas_kernels.lazy", "ling_jax.model") in bad and ("pallas_kernels.sub.rel", "ling_jax") in bad
    assert build_graph(mods)["pallas_kernels.sub.rel"] == {"pallas_kernels.clean", "ling_jax"}


def test_builder_finds_module_cycle_through_relative_dotted_and_lazy_imports():
    mods = _synthetic({
        "ling_jax/__init__": "from ling_jax.a import x\n",
        "ling_jax.a": "from . import b\n",
        "ling_jax.b": "import ling_jax.c.d\n",
        "ling_jax.c/__init__": "",
        "ling_jax.c.d": "def g():\n    from ..a import x\n",
    })
    graph = build_graph(mods)
    assert graph["ling_jax.b"] == {"ling_jax.c", "ling_jax.c.d"}
    assert find_cycles(graph) == [["ling_jax.a", "ling_jax.b", "ling_jax.c.d", "ling_jax.a"]]
    assert "ling_jax.a -> ling_jax.b -> ling_jax.c.d -> ling_jax.a" in _describe(find_cycles(graph))


def test_builder_finds_package_cycle_without_module_cycle():
    mods = _synthetic({
        "ling_jax/__init__": "", "ling_jax.x": "from sharding.y import f\n", "ling_jax.w": "",
        "sharding/__init__": "", "sharding.y": "", "sharding.z": "def h():\n    import ling_jax.w\n",
        "pallas_kernels/__init__": "",
    })
    graph = build_graph(mods)
    assert find_cycles(graph) == []
    assert find_cycles(package_graph(graph)) == [["ling_jax", "sharding", "ling_jax"]]
    assert forbidden_imports(mods, "sharding", {"ling_jax"}) == [("sharding.z", "ling_jax.w")]


def test_builder_accepts_a_package_init_importing_its_modules():
    mods = _synthetic({
        "sharding/__init__": "from sharding.mesh import m\nfrom sharding.load import l\n",
        "sharding.mesh": "from sharding import rules\n",
        "sharding.rules": "import jax\n",
        "sharding.load": "from .mesh import m\nfrom .rules import r\n",
    })
    graph = build_graph(mods)
    assert graph["sharding.mesh"] == {"sharding.rules"}
    assert find_cycles(graph) == [] and find_cycles(package_graph(graph)) == []


def test_library_imports_follow_our_imports_and_lazy_ones():
    mods = _synthetic({
        "ling_jax/__init__": "", "ling_jax.host": "from ling_jax import mid\nimport numpy\n",
        "ling_jax.mid": "def f():\n    import jax.numpy as jnp\n", "ling_jax.clean": "import json\n",
    })
    graph = build_graph(mods)
    assert reachable(graph, "ling_jax.host") == {"ling_jax.host", "ling_jax.mid"}
    assert library_imports(mods, graph, "ling_jax.host", DEVICE_LIBRARIES) == [("ling_jax.mid", "jax.numpy")]
    assert library_imports(mods, graph, "ling_jax.clean", DEVICE_LIBRARIES) == []
