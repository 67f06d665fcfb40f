"""The package's import direction (docs/design.md opens with the map): every module of fused_zero and of
kernels/ (installed as fused_zero.kernels: pyproject.toml's package-dir) is parsed, its imports resolved,
and each import checked against what its part may import.

    kernels      nothing of fused_zero, and nothing of torch.distributed
    options      nothing of fused_zero
    params       options (the parameters an optimizer updates, collected and checked)
    versions     nothing of fused_zero (the tested torch and Triton range, checked at import)
    checkout     nothing of fused_zero (a source checkout's pyproject.toml: its version, its package-dir)
    algorithms   kernels (each optimizer's maths and declaration)
    pipeline     kernels, options, params, algorithms
    checkpoint   kernels, options, params, algorithms, pipeline
    testing      kernels, options, algorithms, pipeline (the stream-order checker the tests run the engine
                 under: fused_zero/testing/streamcheck/)
    optimizer    options, params, algorithms, pipeline, checkpoint
    root         (fused_zero/__init__.py) optimizer, versions, checkout
    integrations (lightning, accelerate, transformers) root, optimizer, options, and each other
    demo         root, optimizer, options

So the pipeline never imports checkpoints, integrations or the demo, nothing imports the demo, and
only the integrations import their frameworks. No two modules import each other, however far round:
the imports of the package's modules make no circle (imports under ``if TYPE_CHECKING:`` and inside
functions count too). Also held here: no module over 400 lines, no class over 250, and no module outside
pipeline/comm/ calls a torch.distributed collective (COLLECTIVES_ELSEWHERE names the exceptions and why).

Inside pipeline/ the same holds between its rooms (sub-packages), from the bottom up: comm, gathering,
buckets, reducing, updating, step_end, then the modules directly in pipeline/ (the engine and what sits beside
it, at most 8). A room imports only the rooms below it, never one above, nor the engine's modules.

Narrow faces: a module outside pipeline/ reads at most 8 attributes of the engine or of a member's view;
inside it, at most 8 of the engine or of a face (the types in PIPELINE_FACES) and writes none, and the
engine hands itself to no stage. The integrations read no private attribute of fused_zero's objects.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTEGRATIONS = ("lightning", "accelerate", "transformers")
FRAMEWORKS = ("lightning", "pytorch_lightning", "accelerate", "transformers")
ALLOWED = {
    "kernels": set(),
    "options": set(),
    "params": {"options"},
    "versions": set(),
    "checkout": set(),
    "algorithms": {"kernels"},
    "pipeline": {"kernels", "options", "params", "algorithms"},
    "checkpoint": {"kernels", "options", "params", "algorithms", "pipeline"},
    "testing": {"kernels", "options", "algorithms", "pipeline"},
    "optimizer": {"options", "params", "algorithms", "pipeline", "checkpoint"},
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
    ("fused_zero.algorithms.fused", "from ..optimizer import AdamW\n", "algorithms"),
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
                                                   "    from fused_zero.algorithms import fused\n", False),
               "fused_zero.algorithms.fused": ("def f():\n    from ..pipeline import engine\n", False),
               "fused_zero.kernels": ("import fused_zero.options\n", True)}
    found = circles(import_graph(sources))
    assert ["fused_zero.options", "fused_zero.versions", "fused_zero.options"] in found, found
    assert ["fused_zero.algorithms.fused", "fused_zero.pipeline.engine", "fused_zero.checkpoint.canonical",
            "fused_zero.algorithms.fused"] in found, found
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


COMM = "fused_zero.pipeline.comm"
COLLECTIVE_PREFIXES = ("all_reduce", "all_gather", "all_to_all", "broadcast", "reduce", "scatter", "gather",
                       "barrier", "monitored_barrier", "send", "recv", "isend", "irecv", "batch_isend_irecv",
                       "_all_gather", "_reduce_scatter")
"""torch.distributed's collectives (and point-to-point calls) by their names' beginnings: every variant of
them (``reduce_scatter_tensor``, ``all_gather_single``, ``broadcast_object_list``, ``send_object_list``)."""
GROUP_METHODS = ("allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "_allgather_base",
                 "allgather_into_tensor_coalesced", "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base",
                 "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "gather", "scatter", "send", "recv",
                 "recv_anysource", "barrier")
"""The same, as methods of a ProcessGroup (``group.send([t], peer, tag)``), called on a name ending in
``group`` or ``pg``."""
COLLECTIVES_ELSEWHERE = {
    "fused_zero.checkpoint.serving.channel": "the checkpoint server's point-to-point messages, on a gloo group of "
                                     "its own, from its own thread, each with a deadline (a protocol beside "
                                     "the training's collectives: docs/design-checkpoints.md)",
    "fused_zero.demo.run": "the demo's training loop: its all-reduce of the logged losses is the user's own",
    "fused_zero.demo.spawn": "the demo's launcher: the barrier before tearing its process group down is the "
                             "user's own",
}
"""The modules outside pipeline/comm/ that may call a torch.distributed collective, and why."""


def _distributed_aliases(tree: ast.AST) -> dict[str, str]:
    """Each name bound to torch, torch.distributed or something of it, by any import of the module."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    out[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """What a name or an attribute chain refers to, through the module's imports (None: not torch's)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, aliases)
        return f"{base}.{node.attr}" if base is not None else None
    return None


def _names_a_collective(dotted: str | None) -> bool:
    return dotted is not None and dotted.startswith("torch.distributed.") and \
        dotted.rpartition(".")[2].startswith(COLLECTIVE_PREFIXES)


def collective_uses(source: str) -> list[str]:
    """``line: what`` for each torch.distributed collective the source names (called or not, by attribute,
    by an imported name or by ``getattr``) and each collective method called on a process group."""
    tree = ast.parse(source)
    return _uses(tree, _distributed_aliases(tree))


def _uses(root: ast.AST, aliases: dict[str, str]) -> list[str]:
    out = []
    for node in ast.walk(root):
        if isinstance(node, (ast.Name, ast.Attribute)) and _names_a_collective(_dotted(node, aliases)):
            out.append(f"{node.lineno}: {_dotted(node, aliases)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and \
                len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and \
                _names_a_collective(f"{_dotted(node.args[0], aliases)}.{node.args[1].value}"):
            out.append(f"{node.lineno}: getattr({_dotted(node.args[0], aliases)}, {node.args[1].value!r})")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in GROUP_METHODS:
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name.endswith(("group", "pg")):
                out.append(f"{node.lineno}: {name}.{node.func.attr} (a process group's method)")
    return out


def test_every_collective_goes_through_comm():
    """No module outside pipeline/comm/ calls a torch.distributed collective: each goes through
    comm/collectives.py, where the stream-order checker stands in for it and knows what it reads and
    writes. The exceptions (COLLECTIVES_ELSEWHERE) are named, and each still uses one."""
    found = {module: collective_uses(path.read_text()) for module, path in modules()
             if not module.startswith(COMM)}
    outside = {m: uses for m, uses in found.items() if uses and m not in COLLECTIVES_ELSEWHERE}
    assert not outside, f"torch.distributed collectives called outside pipeline/comm/: {outside}"
    stale = [m for m in COLLECTIVES_ELSEWHERE if not found.get(m)]
    assert not stale, f"named as exceptions but calling no collective: {stale}"


@pytest.mark.parametrize("source,expected", [
    ("import torch.distributed as dist\ndist.all_reduce(t, op=dist.ReduceOp.MAX)\n", "torch.distributed.all_reduce"),
    ("import torch\ntorch.distributed.barrier()\n", "torch.distributed.barrier"),
    ("from torch.distributed import broadcast_object_list as b\nb(x)\n", "broadcast_object_list"),
    ("import torch.distributed.distributed_c10d as c10d\nc10d.all_gather_into_tensor(o, i)\n",
     "distributed_c10d.all_gather_into_tensor"),
    ("import torch.distributed as dist\nf = getattr(dist, 'reduce_scatter_single', None)\n",
     "reduce_scatter_single"),
    ("def f(self, t):\n    return self.group.send([t], 1, 0)\n", "group.send"),
])
def test_a_collective_outside_comm_is_named(source, expected):
    """The check itself can fail: each of these names a collective; a ReduceOp, a world size or torch's own
    ``gather`` do not."""
    found = collective_uses(source)
    assert len(found) == 1 and expected in found[0], found
    assert collective_uses("import torch\nimport torch.distributed as dist\n"
                           "x = dist.ReduceOp.MAX, dist.get_world_size(g), torch.gather(t, 0, i)\n") == []


def declared_collectives(source: str) -> tuple[set[str], set[str]]:
    """``(issuing, declared)`` of comm/collectives.py: its public functions that issue a torch.distributed
    collective (themselves, through a module-level alias of one, or through another function of the
    module), and those that declare their facts (``@_declare``)."""
    tree = ast.parse(source)
    aliases = _distributed_aliases(tree)
    issuing = {t.id for node in tree.body if isinstance(node, ast.Assign) and _uses(node, aliases)
               for t in node.targets if isinstance(t, ast.Name)}
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    while True:
        more = {name for name, fn in functions.items() if name not in issuing and (_uses(fn, aliases) or any(
            isinstance(n, ast.Name) and n.id in issuing for n in ast.walk(fn)))}
        if not more:
            break
        issuing |= more
    declared = {name for name, fn in functions.items() for d in fn.decorator_list
                if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "_declare"}
    return {name for name in issuing if name in functions and not name.startswith("_")}, declared


def test_every_collective_declares_its_facts():
    """Each wrapper of comm/collectives.py that issues a collective declares what it reads and writes
    (collectives.FACTS): the stream-order checker models exactly those; an undeclared one would run
    unseen."""
    issuing, declared = declared_collectives((ROOT / "fused_zero/pipeline/comm/collectives.py").read_text())
    assert issuing == declared, f"undeclared: {sorted(issuing - declared)}; issuing none: {sorted(declared - issuing)}"


def test_an_undeclared_collective_is_named():
    source = ("import torch.distributed as dist\n_rs = getattr(dist, 'reduce_scatter_single')\n"
              "@_declare(reads=(0,), writes=(0,))\ndef all_reduce(t, g):\n    return dist.all_reduce(t, group=g)\n"
              "def reduce_scatter(o, i, g):\n    return _rs(o, i, group=g)\n"
              "def _helper(t, g):\n    return dist.broadcast(t, 0, group=g)\n"
              "def broadcast(t, g):\n    return _helper(t, g)\n"
              "def backend_of(g, device):\n    return dist.get_backend_config(g)\n")
    assert declared_collectives(source) == ({"all_reduce", "reduce_scatter", "broadcast"}, {"all_reduce"})


def test_no_package_folder_is_a_link():
    """A package's folders are real ones (a sub-package outside fused_zero/ is mapped by pyproject.toml's
    package-dir): import readers and clone scanners do not follow a symbolic link."""
    links = [str(p.relative_to(ROOT)) for folder in source_folders().values()
             for p in [folder, *folder.rglob("*")] if p.is_symlink()]
    assert not links, f"symbolic links in the package's source folders: {links}"


PIPELINE = ROOT / "fused_zero" / "pipeline"
PIPELINE_ROOMS = ("comm", "gathering", "buckets", "reducing", "updating", "step_end")
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
    ("fused_zero.pipeline.buckets.shard", "from ..updating.launches import Unit\n", "(buckets)"),
    ("fused_zero.pipeline.gathering.gather", "from ..buckets.shard import BucketShard\n", "(gathering)"),
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


def serving_violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Each import of checkpoint/serving/ by a module of checkpoint/ outside it: the state's forms (the
    room above) never depend on the rank-0 serving protocol (the room below), which reads them."""
    if not module.startswith("fused_zero.checkpoint") or module.startswith("fused_zero.checkpoint.serving"):
        return []
    return [f"{module} imports {target}: checkpoint/'s forms never import its serving room"
            for target in imports(module, source, is_package) if target.startswith("fused_zero.checkpoint.serving")]


@pytest.mark.parametrize("module,path", [(m, p) for m, p in modules() if m.startswith("fused_zero.checkpoint")],
                         ids=[m for m, _ in modules() if m.startswith("fused_zero.checkpoint")])
def test_the_checkpoint_forms_never_import_the_serving_room(module, path):
    assert serving_violations(module, path.read_text(), path.name == "__init__.py") == []


def test_a_form_importing_the_serving_room_is_named():
    found = serving_violations("fused_zero.checkpoint.canonical", "from .serving.published import Published\n")
    assert found and "never import its serving room" in found[0], found


ENGINE_FACES = 8
"""The most attributes a module reads of the engine or of a face of it (outside pipeline/: a member's view;
inside: PIPELINE_FACES)."""
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


# ---------------------------------------------------------------------- inside pipeline/: narrow faces

PIPELINE_FACES = ("Engine", "ParamTable", "ShardingOptions", "HookTargets", "MemberView", "StateLayout",
                  "ParamTable", "Ranks")
"""The engine and the faces a stage is built with in its place, by type name: the parameter table
(pipeline/buckets/param_table.py), the options, the hooks' targets (pipeline/reducing/hooks.py), and a
member's view and its parts (pipeline/members.py)."""


ENGINE_NAMES_INSIDE = ("engine", "_engine", "e")
"""The names the engine goes by inside pipeline/ (a member's view there is typed: ``view`` is a tensor's)."""


def _is_face(annotation) -> bool:
    """Whether an annotation names the engine or a face (``ParamTable``, ``"ParamTable | None"``)."""
    if annotation is None:
        return False
    text = annotation.value if isinstance(annotation, ast.Constant) else ast.unparse(annotation)
    return isinstance(text, str) and any(name in PIPELINE_FACES for name in re.findall(r"\w+", text))


def _pairs(node):
    """(target, value) of an assignment, tuples element by element."""
    if isinstance(node, ast.Assign):
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple) \
                    and len(target.elts) == len(node.value.elts):
                yield from zip(target.elts, node.value.elts)
            else:
                yield target, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        yield node.target, node.value


def _holds(node, names: set, attrs: set) -> bool:
    """Whether ``node`` is a name holding a face, or ``self.<attribute holding one>``."""
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self" \
        and node.attr in attrs


def _face_names(function, attrs: set) -> set[str]:
    """The names holding a face in ``function``: its parameters annotated with one, the names the engine
    goes by (ENGINE_NAMES_INSIDE: ``engine = self.engine()``), the local names annotated with one (``targets:
    HookTargets = self.targets()``), and those assigned from any of these (``f = self.table``)."""
    args = function.args
    names = {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)
             if a.arg not in ("self", "cls") and (a.arg in ENGINE_NAMES_INSIDE or _is_face(a.annotation))}
    names |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and n.id in ENGINE_NAMES_INSIDE}
    names |= {n.target.id for n in ast.walk(function)
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and _is_face(n.annotation)}
    for _ in range(2):  # e = engine; f = e
        for node in ast.walk(function):
            for target, value in _pairs(node):
                if isinstance(target, ast.Name) and _holds(value, names, attrs):
                    names.add(target.id)
    return names


def face_access(tree: ast.AST) -> tuple[set[str], set[str]]:
    """The distinct attribute names a module reads, and those it writes, of the engine or a face: off a
    parameter annotated with one or named as the engine goes, a local name or a ``self`` attribute
    assigned from one, or a class field annotated with one. What a class builds itself (the engine its
    own faces) is its own, not read through a face."""
    reads, writes = set(), set()

    def count(function, attrs: set) -> None:
        names = _face_names(function, attrs)
        for node in ast.walk(function):
            if isinstance(node, ast.Attribute) and _holds(node.value, names, attrs):
                (reads if isinstance(node.ctx, ast.Load) else writes).add(node.attr)

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        attrs = {n.target.id for n in cls.body
                 if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and _is_face(n.annotation)}
        methods = [n for n in cls.body if isinstance(n, functions)]
        for method in methods:
            names = _face_names(method, attrs)
            for node in ast.walk(method):
                for target, value in _pairs(node):
                    if isinstance(target, ast.Attribute) and _holds(target, set(), {target.attr}) \
                            and _holds(value, names, attrs):
                        attrs.add(target.attr)
        for method in methods:
            count(method, attrs)
    for function in (n for n in ast.walk(tree) if isinstance(n, functions)):
        count(function, set())
    return reads, writes


def _pipeline_modules():
    return [(m, p) for m, p in modules() if m.split(".")[:2] == ["fused_zero", "pipeline"]]


@pytest.mark.parametrize("module,path", _pipeline_modules(), ids=[m for m, _ in _pipeline_modules()])
def test_inside_the_pipeline_a_module_reads_few_attributes_of_the_engine_or_a_face(module, path):
    """Each stage is built with what it uses (the parameter table, the options, the objects it calls), not
    the engine to read at will: at most ENGINE_FACES distinct attributes of the engine or of its faces per
    module of pipeline/, and none written (the engine's own module builds them: not counted)."""
    reads, writes = face_access(ast.parse(path.read_text()))
    assert len(reads) <= ENGINE_FACES, f"{module} reads {len(reads)} attributes of the engine or its faces: " \
                                       f"{sorted(reads)}"
    assert not writes, f"{module} writes attributes of the engine or its faces: {sorted(writes)}"


def test_the_face_count_sees_a_wide_reader():
    wide = ("class Stage:\n"
            "    table: ParamTable\n"
            "    def __init__(self, parameters: ParamTable, engine, other):\n"
            "        self.held, self.engine, self.plain = parameters, engine, other\n"
            "    def f(self, options: 'ShardingOptions | None'):\n"
            "        f = self.held\n"
            "        self.engine.g = self.plain.not_a_face\n"
            "        return f.a, self.engine.b(), self.held.c, options.d, self.table.h\n"
            "def free(view: MemberView, x):\n"
            "    held: HookTargets | None = x.deref()\n"
            "    engine = x.deref()\n"
            "    return view.i, x.not_a_face, held.j, engine.k\n")
    assert face_access(ast.parse(wide)) == ({"a", "b", "c", "d", "h", "i", "j", "k"}, {"g"})


def engine_handed_out(source: str) -> list[str]:
    """The calls in the Engine class that hand the engine (``self``) to another object, but for an
    algorithm's own check (``algo.check_engine``: algorithms/, outside pipeline/, held by the outside count)."""
    out = []
    for cls in (n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "Engine"):
        for node in (n for n in ast.walk(cls) if isinstance(n, ast.Call)):
            given = (*node.args, *(k.value for k in node.keywords))
            if any(isinstance(a, ast.Name) and a.id == "self" for a in given) \
                    and not ast.unparse(node.func).endswith(".check_engine"):
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def test_the_engine_hands_itself_to_no_stage():
    """No stage is built with the engine (Stepping among them: an object the engine owns, no mixin)."""
    source = (PIPELINE / "engine.py").read_text()
    assert engine_handed_out(source) == []
    bases = [ast.unparse(b) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == "Engine"
             for b in n.bases]
    assert bases == [], f"the Engine inherits {bases}: its parts are objects it owns"


def test_an_engine_handed_out_is_named():
    source = ("class Engine:\n    def __init__(self):\n"
              "        self.updates = Updates(self)\n        m.algo.check_engine(self, m)\n"
              "        self.policy = StepPolicy(engine=self)\n")
    assert [line.split(":")[0] for line in engine_handed_out(source)] == ["line 3", "line 5"]


# ---------------------------------------------------------------------- the integrations: public methods only

FRAMEWORK_PRIVATES = {
    "_optimizers": "accelerate.Accelerator's prepared optimizers (no public list)",
    "_models": "accelerate.Accelerator's prepared models (no public list)",
    "_optimizer": "lightning's LightningOptimizer's wrapped optimizer (no public name)",
}
"""The frameworks' own private attributes an integration must read, and why; names beginning with
``_fused_zero_`` are fused_zero's own marks on the frameworks' objects."""


def private_attributes(tree: ast.AST) -> set[str]:
    """The private attributes (one leading underscore) a module reads or writes of anything but ``self``,
    by dot or by name (``getattr(x, "_name")``), and the private names it imports from fused_zero, but
    for FRAMEWORK_PRIVATES and fused_zero's marks."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not (isinstance(node.value, ast.Name) and node.value.id == "self"):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("fused_zero")):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            found.add(node.args[1].value)
    return {name for name in found if name.startswith("_") and not name.startswith("__")
            and name not in FRAMEWORK_PRIVATES and not name.startswith("_fused_zero_")}


@pytest.mark.parametrize("name", INTEGRATIONS)
def test_the_integrations_call_public_methods_only(name):
    """A framework's wrapper of a fused_zero optimizer calls its public methods (optimizer/frameworks.py),
    never its internals (the engine, its options as kept)."""
    found = private_attributes(ast.parse((ROOT / "fused_zero" / f"{name}.py").read_text()))
    assert not found, f"fused_zero/{name}.py reads private attributes: {sorted(found)}"


def test_a_private_read_is_named():
    source = ("from .optimizer import _Hidden, ShardedOptimizer\n"
              "def f(opt, accelerator, optimizer):\n"
              "    accelerator._optimizers, self._mine, opt.__class__, opt._fused_zero_mark\n"
              "    return opt._engine.ddp, getattr(optimizer, '_optimizer', optimizer)._written(0)\n")
    assert private_attributes(ast.parse(source)) == {"_engine", "_written", "_Hidden"}
