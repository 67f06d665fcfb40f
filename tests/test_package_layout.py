"""The package's import direction (docs/design.md opens with the map): every module of fused_zero and of
kernels/ is parsed, its imports resolved, and each import checked against what its part may import.

    kernels      nothing of fused_zero, and nothing of torch.distributed
    options      nothing of fused_zero
    versions     nothing of fused_zero (the tested torch and Triton range, checked at import)
    update       kernels
    pipeline     kernels, options, update
    checkpoint   kernels, options, update, pipeline
    testing      kernels, options, update, pipeline (the stream-order checker the tests run the engine
                 under: fused_zero/testing/streamcheck/)
    optimizer    options, update, pipeline, checkpoint
    root         (fused_zero/__init__.py) optimizer, versions
    integrations (lightning, accelerate, transformers) root, optimizer, options, and each other
    demo         root, optimizer, options

So the pipeline never imports checkpoints, integrations or the demo, nothing imports the demo, and
only the integrations import their frameworks. Also held here: no module over 400 lines, no class over
250.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ("lightning", "accelerate", "transformers")
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")
ALLOWED = {
    "kernels": set(),
    "options": set(),
    "versions": set(),
    "update": {"kernels"},
    "pipeline": {"kernels", "options", "update"},
    "checkpoint": {"kernels", "options", "update", "pipeline"},
    "testing": {"kernels", "options", "update", "pipeline"},
    "optimizer": {"options", "update", "pipeline", "checkpoint"},
    "root": {"optimizer", "versions"},
    "integrations": {"root", "optimizer", "options", "integrations"},
    "demo": {"root", "optimizer", "options"},
}


def _part(module: str) -> str:
    """The part of the package a dotted module name belongs to."""
    names = module.split(".")
    if names == ["fused_zero"]:
        return "root"
    head = names[1]
    return "integrations" if head in INTEGRATIONS else head


def modules():
    """(dotted name, path) of every module of the installed package, from its source folders."""
    out = []
    for path in sorted((ROOT / "fused_zero").rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        out.append((".".join(rel.parts).removesuffix(".__init__"), path))
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        rel = path.relative_to(ROOT / "kernels").with_suffix("")
        out.append((".".join(("fused_zero", "kernels", *rel.parts)).removesuffix(".__init__"), path))
    return out


def imports(module: str, source: str, is_package: bool):
    """Every module ``source`` imports (absolute dotted names; ``from x import y`` gives x.y where that is
    a module, else x)."""
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            for alias in node.names:  # ``from x import y``: module x.y where y is one, else x
                full = f"{target}.{alias.name}"
                yield full if target.startswith("fused_zero") and _is_module(full) else target


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    part = _part(module)
    out = []
    for target in imports(module, source, is_package):
        top = target.split(".")[0]
        if top in FRAMEWORKS and part != "integrations":
            out.append(f"{module} imports {target}: only the integrations import their frameworks")
        if part == "kernels" and target.startswith("torch.distributed"):
            out.append(f"{module} imports {target}: the kernels know nothing of torch.distributed")
        if top != "fused_zero" or (target == "fused_zero" and part == "root"):
            continue
        other = _part(target)
        if other != part and other not in ALLOWED[part]:
            out.append(f"{module} ({part}) imports {target} ({other}); {part} may import "
                       f"{sorted(ALLOWED[part]) or 'nothing of fused_zero'}")
    return out


def _is_module(dotted: str) -> bool:
    if dotted == "fused_zero":
        return True
    rel = dotted.split(".")[1:]
    base = ROOT / "kernels" if rel[0] == "kernels" else ROOT / "fused_zero"
    parts = rel[1:] if rel[0] == "kernels" else rel
    path = base.joinpath(*parts) if parts else base
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


@pytest.mark.parametrize("module,path", modules(), ids=[m for m, _ in modules()])
def test_imports_follow_the_map(module, path):
    assert violations(module, path.read_text(), path.name == "__init__.py") == []


@pytest.mark.parametrize("module,source,expected", [
    ("fused_zero.pipeline.engine", "from ..checkpoint import canonical\n", "pipeline"),
    ("fused_zero.pipeline.hooks", "import fused_zero.lightning\n", "integrations"),
    ("fused_zero.pipeline.hooks", "import lightning.pytorch as pl\n", "only the integrations"),
    ("fused_zero.checkpoint.sharded", "from ..demo.spawn import run_ranks\n", "checkpoint"),
    ("fused_zero.kernels.adam", "from fused_zero.pipeline import layout\n", "kernels"),
    ("fused_zero.kernels.norm", "import torch.distributed as dist\n", "torch.distributed"),
    ("fused_zero.update.algorithms", "from ..optimizer import AdamW\n", "update"),
])
def test_a_forbidden_import_is_named(module, source, expected):
    """The check itself can fail: each of these imports breaks the map and is reported."""
    found = violations(module, source)
    assert found and expected in found[0], found


def test_every_part_is_a_known_one():
    assert {_part(m) for m, _ in modules()} == set(ALLOWED)


MODULE_LINES, CLASS_LINES = 400, 250
"""Files that fit in one's head: no module over 400 lines, no class over 250."""


@pytest.mark.parametrize("module,path", modules(), ids=[m for m, _ in modules()])
def test_modules_and_classes_stay_small(module, path):
    source = path.read_text()
    assert len(source.splitlines()) <= MODULE_LINES, f"{module}: split it by responsibility"
    big = [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
           if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES]
    assert not big, f"{module}: classes over {CLASS_LINES} lines: {big}"


def test_every_package_is_installed():
    """pyproject.toml names the packages a wheel holds: a package directory missing from that list
    imports in an editable checkout and is absent from ``pip install .`` (CI installs that way)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set()
    for init in [*ROOT.glob("fused_zero/**/__init__.py"), *ROOT.glob("kernels/**/__init__.py")]:
        rel = init.parent.relative_to(ROOT).parts
        found.add(".".join(["fused_zero", *rel] if rel[0] == "kernels" else rel))
    assert found == set(config["packages"]), (
        f"missing from pyproject.toml's packages: {sorted(found - set(config['packages']))}; "
        f"listed without a folder: {sorted(set(config['packages']) - found)}")
