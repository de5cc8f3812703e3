"""The package's layering (docs/architecture.md): which module may import which.

Imports are read from the source (every ``import`` / ``from`` statement, also inside functions),
so a lazy import cannot hide a dependency that points upwards.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "megatron_hcp"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> dict[str, bool]:
    """Project modules imported by ``path`` -> True when imported at module level."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    found: dict[str, bool] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("megatron_hcp") and target in MODULES:
                found[target] = found.get(target, False) or id(node) in top
    return found


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}
GRAPH = {name: _imports(path) for name, path in MODULES.items()}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


# The floors of the package, lowest first (docs/architecture.md draws them). A module imports
# modules of its own floor and of the floors below it, never one of a floor above (lazy imports
# included); packages that share a floor do not import each other.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("config", "sharding", "files", "group_release", "command_line")),
    ("harness", ("harness",)),
    ("process groups", ("parallel_state",)),
    ("attention and dynamic CP", ("attention", "dynamic_cp", "layers")),
    ("patches", ("patching",)),
    ("clients", ("training", "bridge")),
    ("planner", ("planner",)),
    ("tools", ("functional",)),
    ("command line", ("cli",)),
]
# the foundation imports nothing of the project but this
FOUNDATION_IMPORTS = {# what every subcommand shares reads with the foundation's own readers
                      ("megatron_hcp.command_line", "megatron_hcp.config"),
                      ("megatron_hcp.command_line", "megatron_hcp.files.bounded_read"),
                      ("megatron_hcp.command_line", "megatron_hcp.files.atomic_write")}
# the package root: the package's own __init__ and at most this many modules; the rest lives in
# subpackages that say what they hold
ROOT_MODULES_MAX = 6
# the product modules that use the harness (local ranks, the emulated GPU): to start ranks
# (verify-groups, the functional launcher, the device audit); any other use fails
# test_the_product_uses_the_harness_only_to_start_ranks
HARNESS_USERS = {
    ("megatron_hcp.parallel_state.command", "megatron_hcp.harness.local_world"),
    ("megatron_hcp.functional.audit", "megatron_hcp.harness.local_world"),
    ("megatron_hcp.functional.audit", "megatron_hcp.harness.virtual_cuda"),
    ("megatron_hcp.functional.forked", "megatron_hcp.harness.local_world"),
    ("megatron_hcp.functional.launch", "megatron_hcp.harness.gloo_device"),
}
# imports between packages of one floor that are known and still to be moved (with the reason)
KNOWN_SIDEWAYS: dict[tuple[str, str], str] = {}


def _place(name: str) -> tuple[int, str]:
    """(floor, top-level package or module) of a project module."""
    top = name.split(".")[1]
    floors = [i for i, (_, members) in enumerate(LAYERS) if top in members]
    assert len(floors) == 1, f"{name}: put {top!r} on exactly one floor of LAYERS"
    return floors[0], top


def test_every_module_is_on_one_floor():
    for name in MODULES:
        if name != "megatron_hcp":
            _place(name)
    assert not GRAPH["megatron_hcp"], "the root package imports nothing of the project"


def test_the_package_root_holds_few_modules():
    root = sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")
    assert len(root) <= ROOT_MODULES_MAX, root


def test_the_product_uses_the_harness_only_to_start_ranks():
    users = {(src, dst) for src, deps in GRAPH.items() if not _under(src, "megatron_hcp.harness")
             for dst in deps if _under(dst, "megatron_hcp.harness")}
    assert users == HARNESS_USERS, sorted(users ^ HARNESS_USERS)


def test_no_module_imports_a_higher_floor():
    bad = sorted(f"{src} ({LAYERS[_place(src)[0]][0]}) -> {dst} ({LAYERS[_place(dst)[0]][0]})"
                 for src, deps in GRAPH.items() if src != "megatron_hcp"
                 for dst in deps if _place(dst)[0] > _place(src)[0])
    assert bad == [], "\n".join(bad)


def test_packages_of_one_floor_do_not_import_each_other():
    sideways = {(src, dst) for src, deps in GRAPH.items() if src != "megatron_hcp"
                for dst in deps if _place(dst)[0] == _place(src)[0]
                and _place(dst)[1] != _place(src)[1]}
    foundation = {(s, d) for s, d in sideways if _place(s)[0] == 0}
    assert foundation == FOUNDATION_IMPORTS, sorted(foundation)
    assert sideways - foundation == set(KNOWN_SIDEWAYS), sorted(sideways - foundation)


@pytest.mark.parametrize("lower, upper", [
    ("megatron_hcp.training.data", "megatron_hcp.attention"),
])
def test_finer_rules_inside_a_floor(lower, upper):
    bad = sorted((src, dst) for src, deps in GRAPH.items() if _under(src, lower)
                 for dst in deps if _under(dst, upper))
    assert not bad, bad


def test_sharding_and_config_import_nothing_of_the_project():
    """sharding imports nothing of the project; config's modules import only config's."""
    assert not GRAPH["megatron_hcp.sharding"], GRAPH["megatron_hcp.sharding"]
    outside = sorted((src, dst) for src, deps in GRAPH.items() if _under(src, "megatron_hcp.config")
                     for dst in deps if not _under(dst, "megatron_hcp.config"))
    assert outside == [], outside


# megatron_hcp.config's modules, lowest first: each imports only those before it
CONFIG_ORDER = ["errors", "values", "flags", "topology", "rules"]


def test_config_modules_import_only_lower_ones():
    """The value parsers never import the rules (nor the flag readers): the lowest layer."""
    rank = {f"megatron_hcp.config.{m}": i for i, m in enumerate(CONFIG_ORDER)}
    assert sorted(rank) == sorted(n for n in MODULES if _under(n, "megatron_hcp.config")
                                  and n != "megatron_hcp.config"), "place every config module"
    bad = sorted((src, dst) for src in rank for dst in GRAPH[src]
                 if dst == "megatron_hcp.config" or rank.get(dst, -1) >= rank[src])
    assert bad == [], bad


def test_process_group_code_lives_in_parallel_state():
    """Every call that creates or destroys a process group (other than a process's default
    group at exit) is under parallel_state/."""
    calls = re.compile(r"new_group\(|new_subgroups_by_enumeration\(|\.create_pg\(|"
                       r"destroy_process_group\(\s*[^)\s]")
    outside = sorted(name for name, path in MODULES.items()
                     if not _under(name, "megatron_hcp.parallel_state")
                     and calls.search(path.read_text(encoding="utf-8")))
    assert outside == [], outside


def test_no_import_cycle():
    """No cycle among module-level imports (a lazy import inside a function is allowed to point
    sideways, never to close a cycle at import time)."""
    graph = {n: [d for d, top in deps.items() if top and d != n] for n, deps in GRAPH.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in graph.get(node, []):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                # a package __init__ re-exporting its own submodules is not a cycle
                if not all(_under(m, cycle[0]) or _under(cycle[0], m) for m in cycle):
                    raise AssertionError(" -> ".join(cycle))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# circles that close only through lazy imports (inside functions), left to be cut: none (the
# last, attention/reference's blocks -> varlen -> kernels -> blocks, was cut by giving the masks,
# the block counter and the kernels' names modules of their own); any circle fails
# test_import_circles_through_lazy_imports_are_the_known_ones
KNOWN_LAZY_CIRCLES: set[frozenset[str]] = set()


def _circles(graph: dict[str, list[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in graph.get(node, []):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_import_circles_through_lazy_imports_are_the_known_ones():
    """Counting lazy imports too, the only circles are a package's ``__init__`` with its own
    submodules and :data:`KNOWN_LAZY_CIRCLES`."""
    graph = {n: [d for d in deps if d != n] for n, deps in GRAPH.items()}
    circles = [c for c in _circles(graph)
               if not any(all(_under(m, p) for m in c) for p in c)]
    assert {frozenset(c) for c in circles} == KNOWN_LAZY_CIRCLES


GPU_SEAM = "megatron_hcp.attention.reference.gpu"


def test_the_gpu_paths_are_reached_through_one_seam():
    """The attention's GPU-only paths (FlashAttention-2 varlen calls, the compiled merges and
    masks) are imported through their package alone, never one of its modules, so that the
    reference path reads on its own; the paths themselves import nothing above the reference
    path's kernels (no block, function or API module)."""
    through_modules = sorted((src, dst) for src, deps in GRAPH.items()
                             if not _under(src, GPU_SEAM)
                             for dst in deps if _under(dst, GPU_SEAM) and dst != GPU_SEAM)
    assert through_modules == [], through_modules
    reference = "megatron_hcp.attention.reference"
    allowed = {f"{reference}.{m}" for m in ("bands", "kernel_support", "pieces", "seq_layout",
                                            "switches")}
    up = sorted((src, dst) for src, deps in GRAPH.items() if _under(src, GPU_SEAM)
                for dst in deps if not _under(dst, GPU_SEAM) and _under(dst, reference)
                and dst not in allowed)
    assert up == [], up


def test_no_attention_module_makes_process_groups():
    """The attention takes its groups as arguments: no module of it imports parallel_state
    (the measuring proxies get a group maker from their caller)."""
    bad = sorted((src, dst) for src, deps in GRAPH.items()
                 if _under(src, "megatron_hcp.attention")
                 for dst in deps if _under(dst, "megatron_hcp.parallel_state"))
    assert bad == [], bad


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert _circles(graph) == [{"a", "b", "c"}]


def test_every_name_imported_from_config_exists():
    """``from megatron_hcp.config import X`` works for every X the repository imports (config is
    a package of modules; its ``__init__`` re-exports them)."""
    import megatron_hcp.config as config

    repo = PKG.parent
    wanted: dict[str, str] = {}
    for path in [p for d in ("megatron_hcp", "tests", "benchmarks", "patches")
                 for p in (repo / d).rglob("*.py")]:
        parts = path.relative_to(repo).with_suffix("").parts
        package = parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            if ".".join(base + ([node.module] if node.module else [])) == "megatron_hcp.config":
                wanted.update({a.name: str(path.relative_to(repo)) for a in node.names})
    assert {"CPConfig", "CPConfigError", "parse_value"} <= set(wanted)
    missing = sorted((name, where) for name, where in wanted.items() if not hasattr(config, name))
    assert missing == [], missing


# attention/reference's modules in layers, lowest first (docs/architecture.md draws them): a
# module imports only modules of its own layer or of lower ones
REFERENCE_LAYERS = [
    ("seq_layout", "switches", "kernel_support", "packing", "launches", "comm"),
    ("pieces", "bands", "block_counter"),
    ("gpu", "gpu.varlen", "gpu.fused"),
    ("masks", "kernels", "blocks", "merge", "grad_rows"),
    ("reorder", "functions", "repartition", "api"),
    ("oracle", "memory", "memory_proxy", "launch_proxy", "block_cost"),
]


def test_attention_reference_modules_import_only_lower_layers():
    reference = "megatron_hcp.attention.reference"
    layer = {f"{reference}.{m}": i for i, names in enumerate(REFERENCE_LAYERS) for m in names}
    placed = sorted(n for n in MODULES if _under(n, reference) and n != reference)
    assert sorted(layer) == placed, "place every attention/reference module in REFERENCE_LAYERS"
    up = sorted((src, dst) for src in layer for dst in GRAPH[src]
                if dst in layer and layer[dst] > layer[src])
    assert up == [], up
