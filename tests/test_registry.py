"""Each optimizer declared once (fused_zero/algorithms/registry.py; docs/design-optimizers.md, "One declaration
per optimizer"), and everything else asking it:

- no module of checkpoint/ or pipeline/ compares an optimizer's kind with a name (``algo.kind == "sgd"``,
  or a name bound to ``algo.kind`` and compared later): they ask the interface (algorithms/interface.py);
- no module of the package probes an algorithm for a member it may lack (``getattr(algo, ...)``,
  ``hasattr``, ``isinstance``): every member is declared, with a docstring, on ``Algorithm``;
- the public names (``fused_zero.__all__``, ``fused_zero.optimizer.__all__``, optimizer/twins.py's), the
  optimizer table and the tests' hyperparameters are the registry's, in its order.

Each check is also run on a planted violation, which it must name. Parsing only, and one import.
"""

import ast
import re
from pathlib import Path

import pytest
import torch
from scenarios import CONSTRUCTOR_ONLY, DEFAULT_HPARAMS

import fused_zero
import fused_zero.optimizer
from fused_zero.algorithms import interface, registry
from fused_zero.optimizer import twins
from fused_zero.optimizer.base import ShardedOptimizer

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fused_zero"
ASKING = ("checkpoint", "pipeline")
"""The parts that ask the interface about an optimizer, and never test which one it is."""


def _strings(node: ast.AST) -> bool:
    """A string constant, or a tuple, list or set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    return isinstance(node, ast.Tuple | ast.List | ast.Set) and bool(node.elts) and all(map(_strings, node.elts))


def _kind_names(tree: ast.AST) -> set[str]:
    """The names bound to an attribute ``kind`` (``kind = engine.algo.kind``), pair by pair in tuples."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple) and \
                isinstance(node.value, ast.Tuple) else [(target, node.value)]
            for name, value in pairs:
                if isinstance(name, ast.Name) and isinstance(value, ast.Attribute) and value.attr == "kind":
                    out.add(name.id)
    return out


def kind_comparisons(source: str) -> list[str]:
    """Each comparison of an attribute ``kind`` (or a name bound to one) with a string, and each ``match``
    on one: a branch on which optimizer it is."""
    tree = ast.parse(source)
    names = _kind_names(tree)

    def is_kind(node):
        return (isinstance(node, ast.Attribute) and node.attr == "kind") or \
            (isinstance(node, ast.Name) and node.id in names)

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(is_kind, operands)) and any(map(_strings, operands)):
                out.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Match) and is_kind(node.subject):
            out.append(f"line {node.lineno}: match {ast.unparse(node.subject)}")
    return out


_ALGORITHM = re.compile(r"(^|\.)_?algo(rithm)?$")
"""How the package names an algorithm: ``algo``, ``member.algo``, ``opt._algorithm``, ``algorithm``."""


def algorithm_probes(source: str) -> list[str]:
    """Each ``getattr``, ``hasattr`` or ``isinstance`` whose first argument is an algorithm."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr", "isinstance") and node.args and \
                _ALGORITHM.search(ast.unparse(node.args[0])):
            out.append(f"line {node.lineno}: {ast.unparse(node)}")
    return out


def _modules(*parts: str) -> list[Path]:
    folders = [PACKAGE / part for part in parts] or [PACKAGE]
    return sorted(path for folder in folders for path in folder.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(*ASKING), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_branch_on_an_optimizers_kind(path):
    assert kind_comparisons(path.read_text()) == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_probe_of_an_algorithm(path):
    assert algorithm_probes(path.read_text()) == []


@pytest.mark.parametrize("source,found", [
    ('if engine.algo.kind == "sgd":\n    pass\n', "engine.algo.kind == 'sgd'"),
    ('ok = target.algo.kind in ("sgd", "muon")\n', "in ('sgd', 'muon')"),
    ('kind = target.algo.kind\nneeds = ["step"] if kind == "adam" else []\n', "kind == 'adam'"),
    ('kind, other = algo.kind, 1\nif "muon" != kind:\n    pass\n', "'muon' != kind"),
    ('match self.algo.kind:\n    case "adam":\n        pass\n', "match self.algo.kind"),
])
def test_a_kind_comparison_is_named(source, found):
    """The check itself can fail: each of these branches on a kind's name."""
    got = kind_comparisons(source)
    assert len(got) == 1 and found in got[0], got


def test_what_is_not_a_kind_comparison_passes():
    """A message's kind (checkpoint/server.py), and a kind looked up rather than compared."""
    source = ('kind, src = msg["kind"], msg.get("src")\nif kind == "stop":\n    pass\n'
              'same = registry.KINDS.get(saved["kind"]) is not type(algo)\n')
    assert kind_comparisons(source) == []


@pytest.mark.parametrize("source,found", [
    ('finish = getattr(e.members[m].algo, "finish", None)\n', "e.members[m].algo"),
    ('order = getattr(getattr(self.engine.algo, "spec", None), "order", ("step",))\n', "self.engine.algo"),
    ('if hasattr(algo, "has_state"):\n    pass\n', "hasattr(algo"),
    ('kept = list(getattr(opt._algorithm, "kept_names", ()))\n', "opt._algorithm"),
    ('if isinstance(member.algo, MuonAlgorithm):\n    pass\n', "isinstance(member.algo"),
])
def test_a_probe_is_named(source, found):
    """The check itself can fail: each of these probes an algorithm."""
    got = algorithm_probes(source)
    assert got and found in got[0], got


def test_other_getattrs_pass():
    """Not an algorithm: lightning.py's clip algorithm setting."""
    source = 'a = getattr(trainer.gradient_clip_algorithm, "value", None)\nb = getattr(gradient_clip_algorithm, "v")\n'
    assert algorithm_probes(source) == []


NAMES = [d.name for d in registry.DECLARATIONS]


def name_differences(public: list[str], extra: tuple[str, ...] = ()) -> list[str]:
    """How a list of public names differs from the registry's optimizers (in its order) plus ``extra``."""
    optimizers = [n for n in public if n not in extra]
    out = [f"{n} is not declared in algorithms/registry.py" for n in optimizers if n not in NAMES]
    out += [f"{n} is declared but not public" for n in NAMES if n not in optimizers]
    if not out and optimizers != NAMES:
        out.append(f"{optimizers} are not in the registry's order {NAMES}")
    out += [f"{n} is missing" for n in extra if n not in public]
    return out


def test_the_public_names_are_the_registrys():
    assert name_differences(fused_zero.__all__, ("__version__",)) == []
    assert name_differences(fused_zero.optimizer.__all__, ("NO_TWIN", "OPTIMIZERS", "TWINS", "ShardedOptimizer")) \
        == []
    generic = [d.name for d in registry.DECLARATIONS if d.generic]
    assert [n for n in twins.__all__ if n not in ("CLASSES", "NO_TWIN", "TWINS", "optimizer_table")] == generic
    for d in registry.DECLARATIONS:
        cls = getattr(fused_zero, d.name)
        assert cls is fused_zero.optimizer.OPTIMIZERS[d.name] and issubclass(cls, ShardedOptimizer), d.name
        assert cls.__name__ == d.name and d.torch_class.__name__ == d.name, d.name
    rows = [line.split("`")[1] for line in twins.optimizer_table().splitlines()[2:] if line.startswith("| `")]
    assert rows == NAMES
    assert list(DEFAULT_HPARAMS) == NAMES
    assert not set(twins.NO_TWIN) & set(NAMES), "an optimizer with a twin is still listed in NO_TWIN"


@pytest.mark.parametrize("public,found", [
    (["AdamW", "Adam", "SGD", "Muon", "Lion", *NAMES[4:], "__version__"], "Lion is not declared"),
    ([*NAMES[:-1], "__version__"], f"{NAMES[-1]} is declared but not public"),
    ([*NAMES[1:], NAMES[0], "__version__"], "registry's order"),
    (NAMES, "__version__ is missing"),
])
def test_a_name_difference_is_named(public, found):
    """The check itself can fail: a public name not declared, a declared one not public, another order."""
    got = name_differences(public, ("__version__",))
    assert got and found in got[0], got


@pytest.mark.parametrize("declared", registry.DECLARATIONS, ids=lambda d: d.name)
def test_each_declaration_holds(declared):
    """Its algorithm is a registered kind, its hyperparameters are torch's own (its constructor takes
    them), and those torch reads at construction only are among them."""
    algorithm = declared.algorithm
    assert registry.KINDS[algorithm.kind] is algorithm and issubclass(algorithm, interface.Algorithm)
    stand_in = [torch.zeros((2, 2), requires_grad=True)]
    for hparams in (declared.test, declared.bench or {}):
        declared.torch_class(stand_in, **hparams)
    assert set(declared.constructor_only) <= set(declared.test)
    assert CONSTRUCTOR_ONLY.get(declared.name, ()) == declared.constructor_only


def undocumented_members(source: str, cls: str = "Algorithm") -> list[str]:
    """The members of class ``cls`` in ``source`` without a docstring (a method's own, or the string
    after an attribute's declaration)."""
    body = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls).body
    out = []
    for i, node in enumerate(body):
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) is None:
            out.append(node.name)
        elif isinstance(node, ast.AnnAssign | ast.Assign):
            following = body[i + 1] if i + 1 < len(body) else None
            if not (isinstance(following, ast.Expr) and _strings(following.value)):
                target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
                out.append(ast.unparse(target))
    return out


def test_every_member_of_the_interface_says_what_it_is():
    assert undocumented_members((PACKAGE / "algorithms" / "interface.py").read_text()) == []


def test_an_undocumented_member_is_named():
    source = ('class Algorithm:\n    kind: str\n    """Its name."""\n    runs = 1\n\n'
              '    def state_names(self):\n        return []\n')
    assert undocumented_members(source) == ["runs", "state_names"]
