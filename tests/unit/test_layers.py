"""The house's import contract and package maps, read from the sources (nothing is imported).

- Layers: every arrow between units of the library (a top-level module or subpackage of swarm, and the
  programs peer/ and coordinator/) goes from a higher layer to a lower one; units of one layer do not
  import each other. Type-only imports count: they are arrows of the design too.
- No import cycle among modules: no module imports one that imports it back, directly or not.
- Package maps: each package's __init__ docstring names every module of the package, and names no
  module that is not there.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("swarm", "peer", "coordinator")

# Lowest first. A unit may import units of lower layers only.
LAYERS: list[set[str]] = [
    {"swarm", "swarm.config", "swarm.envflags", "swarm.logs", "swarm.hivemind_internals", "swarm.tenure",
     "swarm.zero", "swarm.activations", "swarm.drain", "swarm.delays", "swarm.healthcheck", "swarm.metrics",
     "swarm.threads", "swarm.tasks"},
    {"swarm.traffic", "swarm.model", "swarm.data", "swarm.optim"},
    {"swarm.state", "swarm.dht", "swarm.protocol"},
    {"swarm.averaging", "swarm.checkpoint", "swarm.routing", "swarm.worker"},
    {"swarm.backend", "swarm.export", "swarm.trainer"},
    {"swarm.experts", "swarm.reference"},
    {"swarm.serving"},
    {"peer", "coordinator"},  # the programs: neither imports the other
]


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package's __init__)."""
    found = {}
    for top in TOPS:
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts = parts[:-1]
            found[".".join(parts)] = (path, package)
    return found


MODULES = _modules()


def _imports(name: str) -> set[str]:
    """The modules of ours `name` imports anywhere in its file (functions and TYPE_CHECKING blocks too)."""
    path, package = MODULES[name]
    here = name if package else name.rpartition(".")[0]
    named = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:  # `from pkg import module` is an arrow to the module, else to pkg
                named.add(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source)
    ours = set()
    for module in named:
        while module and module not in MODULES:
            module = module.rpartition(".")[0]
        if module and module != name:
            ours.add(module)
    return ours


GRAPH = {name: _imports(name) for name in MODULES}


def unit(module: str) -> str:
    parts = module.split(".")
    return f"swarm.{parts[1]}" if parts[0] == "swarm" and len(parts) > 1 else parts[0]


def layer(name: str) -> int:
    for rank, units in enumerate(LAYERS):
        if name in units:
            return rank
    raise AssertionError(f"{name} is in no layer of tests/unit/test_layers.py: add it to LAYERS")


def test_every_unit_has_a_layer():
    for module in MODULES:
        layer(unit(module))


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The arrows of `graph` from a unit to one of its own layer or above."""
    return sorted(f"{module} imports {target} ({unit(module)}: layer {layer(unit(module))}, {unit(target)}: "
                  f"layer {layer(unit(target))})"
                  for module, targets in graph.items() for target in targets
                  if unit(target) != unit(module) and layer(unit(target)) >= layer(unit(module)))


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each module from which a path of imports leads back to it, with one such path."""
    found = []
    for start in graph:  # depth-first from each module
        stack, seen = [(start, [start])], set()
        while stack:
            module, path = stack.pop()
            for target in graph.get(module, ()):
                if target == start:
                    found.append(" -> ".join(path + [start]))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, path + [target]))
    return sorted(set(found))


def test_arrows_go_down_the_layers():
    wrong = upward(GRAPH)
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def test_no_module_imports_one_that_imports_it_back():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(found)


def test_the_checks_find_an_upward_arrow_and_a_cycle():
    assert "swarm.config" in GRAPH["swarm.serving.stage"]  # the graph is read at all
    assert upward({"swarm.config": {"swarm.serving.stage"}, "swarm.serving.stage": {"swarm.config"}}) == [
        "swarm.config imports swarm.serving.stage (swarm.config: layer 0, swarm.serving: layer 6)"]
    assert upward({"swarm.dht.node": {"swarm.protocol.limits"}})  # one layer: neither may import the other
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a -> b -> c -> a", "b -> c -> a -> b",
                                                                        "c -> a -> b -> c"]
    assert cycles({"a": {"b"}, "b": set()}) == []


PACKAGES = sorted(name for name, (_, package) in MODULES.items() if package and name != "swarm")


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_map_names_its_modules_and_only_them(package):
    path, _ = MODULES[package]
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    members = sorted(name.rpartition(".")[2] for name in MODULES if name.rpartition(".")[0] == package)
    missing = [m for m in members
               if not re.search(rf"(\b{m}\.py\b|``{m}``|``{re.escape(package)}\.{m}``)", doc)]
    assert not missing, f"{package}/__init__.py's map does not name: {', '.join(missing)}"
    named = set(re.findall(r"\b(\w+)\.py\b", doc))
    gone = sorted(named - set(members) - {"__init__"})
    assert not gone, f"{package}/__init__.py's map names modules that are not there: {', '.join(gone)}"


def test_the_library_map_names_its_parts():
    path, _ = MODULES["swarm"]
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    parts = sorted({unit(name) for name in MODULES if name.startswith("swarm.")})
    missing = [p for p in parts if f"``{p}``" not in doc]
    assert not missing, f"swarm/__init__.py's map does not name: {', '.join(missing)}"
