"""torch's own optimizer test database against fused_zero: every input torch tests its optimizers with.

``torch.testing._internal.common_optimizers.optim_db`` holds, per torch.optim optimizer, the
hyperparameter inputs torch's own test/test_optim.py runs (``optim_inputs_func``) and the inputs its
constructor (or its first step) must refuse, with the error type and a regex of the message
(``optim_error_inputs_func``). Each fused_zero optimizer with a torch.optim counterpart (AdamW, Adam, SGD,
Muon, the twins, Adafactor; LBFGS and SparseAdam have none: optimizer/twins.py's NO_TWIN) is held here
to every one of them, at world size 1 on the CPU, in one process (a plain module passed as ``ddp=``,
pipeline/local.py):

- a hyperparameter input trains two copies of a small model on the same batches, one with
  torch.optim.<Name>(**kwargs), one with fused_zero.<Name>(**kwargs); every parameter is compared bit
  for bit after every step, and every state entry of ``state_dict()`` at the end. So are the inputs the
  database keeps for CUDA (tensor lr and betas, with ``capturable=True``), ``capturable`` dropped, and
  tensor hyperparameters beyond it (``BEYOND``);
- an error input is given to fused_zero.<Name> as torch's test gives it to torch.optim.<Name>: the same
  params (plain tensors, as the database makes them) and keyword arguments, unattached (torch's
  optimizer has no module either). A construction error must be torch's type with a message the
  database's regex finds (a warning: torch's warning); a step error too, raised by the time fused_zero's
  first step would run: its checks of the parameters run before anything is laid out, at construction
  (Muon's and Adafactor's refusal of complex parameters) or when it is attached to the module.

No input is left out: fused_zero gives torch's result or torch's error for every one. The inputs are read
from the installed torch, so a torch release that adds inputs (or an optimizer) adds tests. The database
imports ``expecttest`` (the ``test`` extra). About 10 s on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db

import fused_zero
from fused_zero.optimizer.twins import NO_TWIN

STEPS = 4
INFOS = {info.name: info for info in optim_db if info.name not in NO_TWIN}


def _inputs():
    for name, info in INFOS.items():
        for i, optim_input in enumerate(info.optim_inputs_func(device="cpu")):
            yield pytest.param(name, i, id=f"{name}-{i}-{optim_input.desc}")


def _error_inputs():
    for name, info in INFOS.items():
        for i, error in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            when = "step" if error.error_on == OptimizerErrorEnum.STEP_ERROR else "construction"
            yield pytest.param(name, i, id=f"{name}-{i}-{when}-{error.optimizer_error_input.desc}")


class _Net(nn.Module):
    """A matrix of each shape (tall, wide) and, where the optimizer takes them, biases; Muon takes
    2-D parameters only."""

    def __init__(self, matrices_only: bool):
        super().__init__()
        self.a = nn.Linear(5, 7, bias=not matrices_only)
        self.b = nn.Linear(7, 3, bias=not matrices_only)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _model(name: str) -> _Net:
    torch.manual_seed(0)
    return _Net(matrices_only=name == "Muon")


def _backward(model: _Net, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def _kwargs(name: str, i: int, device: str = "cpu") -> dict:
    """Input ``i``'s keyword arguments, made afresh (a tensor lr is the optimizer's own, as in torch's test)."""
    return dict(INFOS[name].optim_inputs_func(device=device)[i].kwargs)


def _train_both(name: str, make_kwargs, groups=None, schedule=None) -> None:
    """torch.optim.<name> and fused_zero.<name>, each with ``make_kwargs()`` over its copy of the model
    (``groups(model)``: its param groups; ``schedule``: an LR scheduler stepped after each step), compared
    after every step and at the end."""
    ref, model = _model(name), _model(name)
    params = groups or (lambda m: m.parameters())
    ref_opt = getattr(torch.optim, name)(params(ref), **make_kwargs())
    opt = getattr(fused_zero, name)(params(model), **make_kwargs(), ddp=model)
    scheds = [schedule(o) for o in (ref_opt, opt)] if schedule else []
    for step in range(STEPS):
        for m, o in ((ref, ref_opt), (model, opt)):
            _backward(m, step)
            o.step()
            o.zero_grad()
        for sched in scheds:
            sched.step()
        for (n, a), b in zip(ref.named_parameters(), model.parameters()):
            assert torch.equal(a, b), f"step {step}, {n}: max diff {(a - b).abs().max().item():.3e}"
    want, got = ref_opt.state_dict()["state"], opt.state_dict()["state"]
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].keys() == got[k].keys(), f"parameter {k}"
        for entry in want[k]:
            a, b = torch.as_tensor(want[k][entry]), torch.as_tensor(got[k][entry])
            assert torch.equal(a, b), f"parameter {k}, state {entry!r}"


@pytest.mark.parametrize("name, i", _inputs())
def test_hyperparameter_input_gives_torchs_bits(name, i):
    _train_both(name, lambda: _kwargs(name, i))


def _cuda_inputs():
    for name, info in INFOS.items():
        cpu = {optim_input.desc for optim_input in info.optim_inputs_func(device="cpu")}
        for i, optim_input in enumerate(info.optim_inputs_func(device="cuda")):
            if optim_input.desc not in cpu:
                yield pytest.param(name, i, id=f"{name}-{i}-{optim_input.desc}")


@pytest.mark.parametrize("name, i", _cuda_inputs())
def test_cuda_input_without_capturable_gives_torchs_bits_on_the_cpu(name, i):
    """The database's inputs for CUDA alone (tensor lr, tensor betas, each with ``capturable=True``, which
    torch.optim's step refuses for CPU parameters), ``capturable`` dropped: torch's arithmetic with those
    tensors, on the CPU."""
    def make():
        kwargs = _kwargs(name, i, device="cuda")
        kwargs.pop("capturable")
        return kwargs
    _train_both(name, make)


def _own_betas(model):
    return [{"params": model.a.parameters()}, {"params": model.b.parameters(), "betas": (torch.tensor(0.7), 0.9)}]


_F64 = torch.float64
BEYOND = {  # name, keyword arguments, param groups
    "float lr, tensor betas": ("AdamW", lambda: dict(lr=1e-2, betas=(torch.tensor(0.9), torch.tensor(0.99))), None),
    "float64 lr, float32 betas, amsgrad": ("Adam", lambda: dict(
        lr=torch.tensor(1e-2, dtype=_F64), betas=(torch.tensor(0.8), torch.tensor(0.95)), amsgrad=True), None),
    "float32 lr, float64 betas": ("AdamW", lambda: dict(
        lr=torch.tensor(3e-3), betas=(torch.tensor(0.85, dtype=_F64), torch.tensor(0.98, dtype=_F64))), None),
    "1-element lr, decoupled, tensor weight_decay and eps": ("Adam", lambda: dict(
        lr=torch.tensor([2e-2]), weight_decay=torch.tensor(0.1), eps=torch.tensor(1e-6),
        decoupled_weight_decay=True), None),
    "a group's own betas, a tensor and a float": ("AdamW", lambda: dict(lr=1e-2), _own_betas),
    "SGD tensor lr and weight_decay, nesterov": ("SGD", lambda: dict(
        lr=torch.tensor(0.05), weight_decay=torch.tensor(0.01), momentum=0.9, nesterov=True), None),
    "Muon float64 lr, AdamW's rms": ("Muon", lambda: dict(lr=torch.tensor(0.02, dtype=_F64),
                                                           adjust_lr_fn="match_rms_adamw"), None),
    "bfloat16 lr, float16 betas": ("AdamW", lambda: dict(
        lr=torch.tensor(1e-2, dtype=torch.bfloat16),
        betas=(torch.tensor(0.9, dtype=torch.float16), torch.tensor(0.99, dtype=torch.float16))), None),
    "float lr, bfloat16 betas": ("Adam", lambda: dict(
        lr=1e-2, betas=(torch.tensor(0.9, dtype=torch.bfloat16), torch.tensor(0.99, dtype=torch.bfloat16))), None),
    "Adagrad tensor lr": ("Adagrad", lambda: dict(lr=torch.tensor(0.05), lr_decay=0.01), None),
    "Adafactor tensor lr": ("Adafactor", lambda: dict(lr=torch.tensor(0.02)), None),
}


@pytest.mark.parametrize("schedule", [False, True], ids=["constant", "LinearLR"])
@pytest.mark.parametrize("case", BEYOND)
def test_tensor_hyperparameters_give_torchs_bits(case, schedule):
    """Beyond the database: each way torch's single-tensor Adam(W) computes its step size from a tensor lr
    or tensor betas (a float lr over tensor betas, mixed dtypes, a group's own betas), a tensor lr in SGD,
    Muon, Adagrad and Adafactor; with a scheduler that writes the lr (a tensor: in place) every step."""
    name, kwargs, groups = BEYOND[case]
    linear = (lambda o: torch.optim.lr_scheduler.LinearLR(o, 1.0, 0.25, STEPS)) if schedule else None
    _train_both(name, kwargs, groups, linear)


def _module_of(params) -> nn.Module:
    """A module whose parameters are ``params`` (the database's plain tensors, themselves), trainable."""
    module = nn.Module()
    for j, p in enumerate(params):
        p.requires_grad_(True)
        module._parameters[f"p{j}"] = p
    return module


@pytest.mark.parametrize("name, i", _error_inputs())
def test_error_input_gives_torchs_error(name, i):
    error = INFOS[name].optim_error_inputs_func(device="cpu", dtype=torch.float32)[i]
    params, kwargs = error.optimizer_error_input.params, error.optimizer_error_input.kwargs
    cls = getattr(fused_zero, name)
    expect = pytest.warns if issubclass(error.error_type, Warning) else pytest.raises
    if error.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR:
        with expect(error.error_type, match=error.error_regex):
            cls(params, **kwargs)
        return
    with expect(error.error_type, match=error.error_regex):
        opt = cls(params, **kwargs)
        opt.attach(_module_of(params))
        opt.step()
