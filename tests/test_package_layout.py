"""The package's import direction (docs/design.md opens with the map): every module of fused_zero and of
kernels/ (installed as fused_zero.kernels: pyproject.toml's package-dir) is parsed, its imports resolved,
and each import checked against what its part may import.

    kernels      nothing of fused_zero, and nothing of torch.distributed
    options      nothing of fused_zero
    versions     nothing of fused_zero (the tested torch and Triton range, checked at import)
    checkout     nothing of fused_zero (a source checkout's pyproject.toml: its version, its package-dir)
    update       kernels
    pipeline     kernels, options, update
    checkpoint   kernels, options, update, pipeline
    testing      kernels, options, update, pipeline (the stream-order checker the tests run the engine
                 under: fused_zero/testing/streamcheck/)
    optimizer    options, update, pipeline, checkpoint
    root         (fused_zero/__init__.py) optimizer, versions, checkout
    integrations (lightning, accelerate, transformers) root, optimizer, options, and each other
    demo         root, optimizer, options

So the pipeline never imports checkpoints, integrations or the demo, nothing imports the demo, and
only the integrations import their frameworks. No two modules import each other, however far round:
the imports of the package's modules make no circle (imports under ``if TYPE_CHECKING:`` and inside
functions count too). Also held here: no module over 400 lines, no class over 250.

Inside pipeline/ the same holds between its rooms (sub-packages), from the bottom up: comm, buckets,
reducing, updating, step_end, then the modules directly in pipeline/ (the engine and what sits beside
it, at most 8). A room imports only the rooms below it, never one above, nor the engine's modules.
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
    "checkout": set(),
    "update": {"kernels"},
    "pipeline": {"kernels", "options", "update"},
    "checkpoint": {"kernels", "options", "update", "pipeline"},
    "testing": {"kernels", "options", "update", "pipeline"},
    "optimizer": {"options", "update", "pipeline", "checkpoint"},
    "root": {"optimizer", "versions", "checkout"},
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


def source_folders() -> dict[str, Path]:
    """Each package a wheel installs with a source folder of its own (dotted name -> folder): fused_zero,
    and what pyproject.toml's package-dir maps outside it (fused_zero.kernels: kernels/), read from there
    as setuptools and fused_zero/checkout.py read it."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {"fused_zero": ROOT / "fused_zero",
            **{name: ROOT / folder for name, folder in config.get("package-dir", {}).items()}}


def modules():
    """(dotted name, path) of every module of the installed package, from its source folders."""
    out = []
    for package, folder in source_folders().items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            out.append((".".join((package, *rel.parts)).removesuffix(".__init__"), path))
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
    """Whether a dotted name under fused_zero is a module or package of the source folders."""
    names = dotted.split(".")
    for package, folder in sorted(source_folders().items(), key=lambda item: -len(item[0])):
        head = package.split(".")
        if names[:len(head)] == head:
            path = folder.joinpath(*names[len(head):])
            return path == folder or path.with_suffix(".py").exists() or (path / "__init__.py").exists()
    return False


@pytest.mark.parametrize("module,path", modules(), ids=[m for m, _ in modules()])
def test_imports_follow_the_map(module, path):
    assert violations(module, path.read_text(), path.name == "__init__.py") == []


@pytest.mark.parametrize("module,source,expected", [
    ("fused_zero.pipeline.engine", "from ..checkpoint import canonical\n", "pipeline"),
    ("fused_zero.pipeline.reducing.hooks", "import fused_zero.lightning\n", "integrations"),
    ("fused_zero.pipeline.reducing.hooks", "import lightning.pytorch as pl\n", "only the integrations"),
    ("fused_zero.checkpoint.sharded", "from ..demo.spawn import run_ranks\n", "checkpoint"),
    ("fused_zero.kernels.adam", "from fused_zero.pipeline.buckets import layout\n", "kernels"),
    ("fused_zero.kernels.norm", "import torch.distributed as dist\n", "torch.distributed"),
    ("fused_zero.update.algorithms", "from ..optimizer import AdamW\n", "update"),
])
def test_a_forbidden_import_is_named(module, source, expected):
    """The check itself can fail: each of these imports breaks the map and is reported."""
    found = violations(module, source)
    assert found and expected in found[0], found


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """Module -> the modules among ``sources`` (dotted name -> (source, is_package)) it imports."""
    return {module: {t for t in imports(module, source, is_package) if t in sources and t != module}
            for module, (source, is_package) in sources.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle ``[a, b, ..., a]`` for each group of modules that import each other (a strongly
    connected component of more than one module: Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, groups = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.add(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        groups.append(group)
    return [_circle_through(graph, group) for group in groups]


def _circle_through(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest circle from the group's first module back to itself, inside the group."""
    first = min(group)
    came_from, frontier = {first: None}, [first]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & group):
                if target == first:
                    path = [node]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), first]
                if target not in came_from:
                    came_from[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"no circle in {sorted(group)}")


def test_no_import_circle():
    """No module imports one that (directly or further round) imports it back: a circle is two modules
    that can be neither read nor changed apart, and whose import order decides whether either loads."""
    sources = {module: (path.read_text(), path.name == "__init__.py") for module, path in modules()}
    found = circles(import_graph(sources))
    assert not found, "import circles in the package: " + "; ".join(" -> ".join(c) for c in found)


def test_an_import_circle_is_named():
    """The circle check itself can fail: two modules importing each other, and three in a ring."""
    sources = {"fused_zero.options": ("import fused_zero.versions\n", False),
               "fused_zero.versions": ("from .options import Options\n", False),
               "fused_zero.pipeline.engine": ("from ..checkpoint import canonical\n", False),
               "fused_zero.checkpoint.canonical": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                                   "    from fused_zero.update import algorithms\n", False),
               "fused_zero.update.algorithms": ("def f():\n    from ..pipeline import engine\n", False),
               "fused_zero.kernels": ("import fused_zero.options\n", True)}
    found = circles(import_graph(sources))
    assert ["fused_zero.options", "fused_zero.versions", "fused_zero.options"] in found, found
    assert ["fused_zero.checkpoint.canonical", "fused_zero.update.algorithms", "fused_zero.pipeline.engine",
            "fused_zero.checkpoint.canonical"] in found, found
    assert len(found) == 2, found


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
    found = {module for module, path in modules() if path.name == "__init__.py"}
    assert found == set(config["packages"]), (
        f"missing from pyproject.toml's packages: {sorted(found - set(config['packages']))}; "
        f"listed without a folder: {sorted(set(config['packages']) - found)}")


def test_no_package_folder_is_a_link():
    """A package's folders are real ones (a sub-package outside fused_zero/ is mapped by pyproject.toml's
    package-dir): import readers and clone scanners do not follow a symbolic link."""
    links = [str(p.relative_to(ROOT)) for folder in source_folders().values()
             for p in [folder, *folder.rglob("*")] if p.is_symlink()]
    assert not links, f"symbolic links in the package's source folders: {links}"


PIPELINE = ROOT / "fused_zero" / "pipeline"
PIPELINE_ROOMS = ("comm", "buckets", "reducing", "updating", "step_end")
"""pipeline/'s rooms from the bottom up; the modules directly in pipeline/ (the engine's) stand above them."""
PIPELINE_TOP_MODULES = 8


def _room_rank(module: str) -> int | None:
    """Where a dotted module name stands in pipeline/: its room's place in PIPELINE_ROOMS, the top's
    (len(PIPELINE_ROOMS)) for pipeline/ itself and the modules directly in it; None outside pipeline/."""
    names = module.split(".")
    if names[:2] != ["fused_zero", "pipeline"]:
        return None
    if len(names) > 2 and names[2] in PIPELINE_ROOMS:
        return PIPELINE_ROOMS.index(names[2])
    return len(PIPELINE_ROOMS)


def _room_name(rank: int) -> str:
    return PIPELINE_ROOMS[rank] if rank < len(PIPELINE_ROOMS) else "pipeline's own modules"


def room_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Each import of a module of pipeline/ that reaches a room above its own."""
    rank = _room_rank(module)
    if rank is None:
        return []
    out = []
    for target in imports(module, source, is_package):
        other = _room_rank(target)
        if other is not None and other > rank:
            out.append(f"{module} ({_room_name(rank)}) imports {target} ({_room_name(other)}): a room of "
                       f"pipeline/ imports only the rooms below it ({', '.join(PIPELINE_ROOMS)}, bottom up)")
    return out


def pipeline_modules(folder: Path = PIPELINE) -> list[str]:
    """The modules directly in pipeline/ (its __init__.py not counted)."""
    return sorted(p.name for p in folder.glob("*.py") if p.name != "__init__.py")


def test_pipeline_holds_few_modules():
    """pipeline/ holds the engine and what sits beside it; every stage lives in a room of its own."""
    found = pipeline_modules()
    assert len(found) <= PIPELINE_TOP_MODULES, f"{len(found)} modules directly in pipeline/: {found}"


def test_a_crowded_pipeline_is_named(tmp_path):
    """The count itself can fail: nine modules directly in a pipeline folder are too many."""
    for i in range(PIPELINE_TOP_MODULES + 1):
        (tmp_path / f"m{i}.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    assert len(pipeline_modules(tmp_path)) > PIPELINE_TOP_MODULES


def test_every_room_is_declared():
    """Each sub-package of pipeline/ has its place in PIPELINE_ROOMS, and its __init__.py is a docstring
    and nothing else (what the room holds and which rooms it may import)."""
    rooms = sorted(p.parent.name for p in PIPELINE.glob("*/__init__.py"))
    assert rooms == sorted(PIPELINE_ROOMS)
    for room in rooms:
        body = ast.parse((PIPELINE / room / "__init__.py").read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant), room


@pytest.mark.parametrize("module,path", [(m, p) for m, p in modules() if _room_rank(m) is not None],
                         ids=[m for m, _ in modules() if _room_rank(m) is not None])
def test_rooms_import_only_below(module, path):
    assert room_violations(module, path.read_text(), path.name == "__init__.py") == []


@pytest.mark.parametrize("module,source,expected", [
    ("fused_zero.pipeline.buckets.shard", "from ..updating.packed_gather import PackedGather\n", "(buckets)"),
    ("fused_zero.pipeline.comm.collectives", "from ..buckets import layout\n", "(comm)"),
    ("fused_zero.pipeline.updating.launches", "def f():\n    from ..step_end.step_graph import StepGraph\n",
     "(updating)"),
    ("fused_zero.pipeline.step_end.stepping", "from .. import engine\n", "pipeline's own modules"),
    ("fused_zero.pipeline.reducing.hooks", "import fused_zero.pipeline.members\n", "pipeline's own modules"),
])
def test_an_upward_import_is_named(module, source, expected):
    """The room check itself can fail: each of these imports reaches a room above the module's own."""
    found = room_violations(module, source)
    assert found and expected in found[0], found


ENGINE_FACES = 8
"""The most attributes a module outside pipeline/ reads of the engine or of a member's view of it."""
ENGINE_NAMES = ("engine", "_engine", "e", "view", "_view", "target")
"""The names the engine and the checkpoint side's views go by (pipeline/members.MemberView, and
checkpoint/loading.Target, which stands in for it before the engine exists)."""


def engine_attributes(tree: ast.AST) -> set[str]:
    """The distinct attributes read of a name in ENGINE_NAMES (or of ``self.<name>``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name in ENGINE_NAMES:
                out.add(node.attr)
    return out


def test_outside_the_pipeline_a_module_reads_few_of_the_engines_attributes():
    """A collaborator gets narrow faces (the checkpoint side: a member's optimizer, algorithm, parameter
    table, ranks, state layout and step counts), not the engine to read at will: at most ENGINE_FACES
    distinct attributes per module outside pipeline/ (and testing/, which models the device under it)."""
    wide = {}
    for module, path in modules():
        parts = module.split(".")
        if len(parts) > 1 and parts[1] in ("pipeline", "testing"):
            continue
        names = engine_attributes(ast.parse(path.read_text()))
        if len(names) > ENGINE_FACES:
            wide[module] = sorted(names)
    assert not wide, f"modules reading more than {ENGINE_FACES} attributes of the engine or its views: {wide}"


def test_the_engine_attribute_count_sees_a_wide_reader():
    wide = "def f(engine, view):\n    return engine.a, engine.b(), view.c, self.engine.d\n"
    assert engine_attributes(ast.parse(wide)) == {"a", "b", "c", "d"}
