"""The ``torch_only`` marker is true: a test module that carries it, and every module of the
project or of the tests it imports (lazily too, transitively), imports neither megatron-core nor
Megatron-Bridge. CI runs those modules on one stack only (both stacks pin torch 2.13.0), so a
megatron import creeping into them would leave that code untested on the other stack."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _path(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports (module level or inside functions), absolute names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    if path.name == "__init__.py":
        package = ".".join(path.relative_to(ROOT).parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""])
            else:
                base = node.module or ""
            found.add(base.rstrip("."))
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _megatron_imports(start: Path) -> dict[str, str]:
    """megatron module -> the project or test module importing it, over ``start``'s closure."""
    seen: set[Path] = set()
    todo, bad = [start], {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imported(path):
            if name == "megatron" or name.startswith("megatron."):
                bad[name] = str(path.relative_to(ROOT))
            elif name.split(".")[0] in ("megatron_hcp", "tests"):
                target = _path(name)
                if target is not None:
                    todo.append(target)
    return bad


def _marked() -> list[Path]:
    return sorted(p for p in (ROOT / "tests").rglob("test_*.py")
                  if "pytest.mark.torch_only" in p.read_text(encoding="utf-8")
                  and p.name != Path(__file__).name)


def test_torch_only_modules_exist():
    assert len(_marked()) >= 6, _marked()


@pytest.mark.parametrize("path", _marked(), ids=lambda p: p.stem)
def test_a_torch_only_module_imports_no_megatron(path):
    assert _megatron_imports(path) == {}


def test_the_check_finds_a_megatron_import():
    """A module that imports megatron-core (here: the patches' test) is found."""
    bad = _megatron_imports(ROOT / "tests/unit/patching/test_moe_router_patch.py")
    assert any(name.startswith("megatron.core") for name in bad), bad
