"""torch.compile with fused_zero, on 2 gloo ranks: nanoGPT's order (``torch.compile(model)``, then
``DDP(compiled)``, then ``opt.attach(ddp)``) and ``torch.compile(ddp)`` (below), each against torch.optim
on the same compiled DDP model, compared by torch.equal after every step, losses too. The steps cover
DDP's bucket rebuild after the first iteration (fused_zero rebinds the parameters to new flat
buffers under the compiled graph; dropping the state's move there fails every case at step 1) and
``param_sync="forward"``, whose all-gather waits are forward pre-hooks on the compiled modules (on
gloo CPU the gathers are complete by the next forward, so this case would not catch a wait that
never runs).

backend="aot_eager": dynamo's graph capture, DDP's graph splitting at bucket boundaries
(``optimize_ddp``) and AOT autograd's backward are what meets fused_zero's hooks and buffers; inductor
would add only its C++ code generation, tens of seconds per graph on a loaded 2-core machine.

``torch.compile(ddp)`` under each value of ``torch._dynamo.config.optimize_ddp``, one test each, on a
model class of the user's (DDP's forward breaks the graph before calling the module, and dynamo then
compiles the module's forward only where it is not torch's own: ``torch.compile(DDP(nn.Sequential))``
compiles nothing): ``"ddp_optimizer"`` (the default: dynamo splits the graph at DDP's bucket
boundaries, here three buckets of a 2 MB model, three graphs), ``False`` (one graph, DDP's C++ reducer
after it) and ``"python_reducer"`` with compiled autograd (``compiled_autograd._enable`` around the
backward, as torch's own tests run it: DDP's per-parameter hooks traced into the compiled backward,
no buckets; fused_zero registers no comm hook there and updates at ``step()`` from DDP's averaged
``param.grad``, pipeline/local.py). Before that change the python reducer raised ``TypeError: index
expected at least 1 argument, got 0`` from inside the comm hook."""

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

CASES = [
    # (what is compiled, sharding options)
    ("model", dict()),
    ("model", dict(overlap="step", max_grad_norm=0.5)),
    ("model", dict(overlap="bucket", param_sync="forward")),
]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def _wrap(what):
    model = _model()
    if what == "model":  # nanoGPT: compile, then wrap
        return model, DDP(torch.compile(model, backend="aot_eager"))
    return model, torch.compile(DDP(model), backend="aot_eager")


def _loss(module, step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
    return F.mse_loss(module(x), y)


def compiled_matches_torch(rank, world):
    torch._dynamo.reset()
    out = []
    for what, options in CASES:
        model, wrapped = _wrap(what)
        ref_model, ref_wrapped = _wrap(what)
        ddp = wrapped if what == "model" else wrapped._orig_mod
        opt = fused_zero.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, ddp=ddp, **options)
        ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
        clip = options.get("max_grad_norm")
        differing = []
        for step in range(5):
            loss = _loss(wrapped, step, rank)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = _loss(ref_wrapped, step, rank)
            ref_loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
            ref_opt.step()
            ref_opt.zero_grad()
            opt.synchronize()
            exact = clip is None  # clipping's global norm is summed in another order (scenarios._exact)
            same = torch.equal if exact else (lambda a, b: torch.allclose(a, b, rtol=2e-5, atol=2e-6))
            differing += [(step, "loss")] if not same(loss.detach(), ref_loss.detach()) else []
            differing += [(step, n) for (n, p), q in zip(model.named_parameters(), ref_model.parameters())
                          if not same(p.detach(), q.detach())]
        out.append((what, options, opt._engine.layout_changes, differing))
    return out


def test_torch_compile_trains_as_torch_optim():
    for results in run_ranks(compiled_matches_torch, 2, fresh=True):
        for what, options, layout_changes, differing in results:
            assert differing == [], f"torch.compile({what}) with {options}: differs at {differing[:4]}"
            assert layout_changes >= 1, f"torch.compile({what}) with {options}: DDP's buckets never rebuilt"


# ------------------------------------------------------------------ torch.compile(ddp), each optimize_ddp

SETTINGS = {"ddp_optimizer": True, "False": False, "python_reducer": "python_reducer"}


class Wide(nn.Module):
    """2.1 MB of fp32 parameters: three DDP buckets at 1 MB (and three graphs with the DDPOptimizer). A
    class of the user's: dynamo compiles the module DDP calls only where its forward is not torch's own
    (under ``torch.compile(ddp)`` an ``nn.Sequential`` runs eagerly, with no graph at all)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = nn.Linear(8, 512), nn.Linear(512, 512), nn.Linear(512, 512), nn.Linear(512, 4)

    def forward(self, x):
        return self.d(F.gelu(self.c(F.gelu(self.b(F.gelu(self.a(x)))))))


def _backward(loss, setting):
    """The backward; with the python reducer under compiled autograd, as torch's own DDP tests run it."""
    if setting != "python_reducer":
        return loss.backward()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):  # torch 2.11 to 2.15
        loss.backward()


def compiled_ddp_matches_torch(rank, world, setting):
    from torch._dynamo.utils import counters

    value = SETTINGS[setting]
    saved = torch._dynamo.config.optimize_ddp
    torch._dynamo.config.optimize_ddp = value  # DDP reads it when built, dynamo when it compiles
    try:
        torch._dynamo.reset()
        out = []
        for options in (dict(), dict(overlap="bucket", param_sync="forward")):
            model, ref_model = Wide(), Wide()
            ddp, ref_ddp = DDP(model, bucket_cap_mb=1), DDP(ref_model, bucket_cap_mb=1)
            wrapped = torch.compile(ddp, backend="aot_eager")
            ref_wrapped = torch.compile(ref_ddp, backend="aot_eager")
            opt = fused_zero.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, ddp=ddp, **options)
            ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=0.02, weight_decay=0.1, foreach=False)
            differing, graphs = [], {}
            for step in range(3):  # DDP rebuilds its buckets at the second
                for w, o in ((ref_wrapped, ref_opt), (wrapped, opt)):
                    before = counters["aot_autograd"]["total"]
                    loss = _loss(w, step, rank)
                    _backward(loss, setting)
                    o.step()
                    o.zero_grad()
                    graphs[o is opt] = graphs.get(o is opt, 0) + counters["aot_autograd"]["total"] - before
                    if o is ref_opt:
                        ref_loss = loss.detach()
                opt.synchronize()
                differing += [(step, "loss")] if not torch.equal(loss.detach(), ref_loss) else []
                differing += [(step, n) for (n, p), q in zip(model.named_parameters(), ref_model.parameters())
                              if not torch.equal(p.detach(), q.detach())]
            out.append((options, differing, opt._engine.layout_changes, graphs, len(ddp._comm_hooks),
                        counters["compiled_autograd"]["captures"]))
        refused = None
        if setting == "python_reducer":  # the one option the python reducer cannot take: refused, naming settings
            try:
                model = Wide()
                fused_zero.AdamW(model.parameters(), ddp=DDP(model), grad_reduce_dtype=torch.bfloat16)
            except ValueError as e:
                refused = str(e)
        return out, refused
    finally:
        torch._dynamo.config.optimize_ddp = saved


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_compiled_ddp_each_optimize_ddp(setting):
    for out, refused in run_ranks(compiled_ddp_matches_torch, 2, setting, fresh=True):
        for options, differing, layout_changes, graphs, hooks, captures in out:
            where = f"torch.compile(ddp), optimize_ddp={SETTINGS[setting]!r}, {options}"
            assert differing == [], f"{where}: differs at {differing[:4]}"
            if setting == "python_reducer":  # no buckets: the update reads DDP's averaged param.grad at step()
                assert hooks == 0 and captures >= 1, f"{where}: {hooks} comm hooks, {captures} compiled backwards"
                assert refused and "python_reducer" in refused and "optimize_ddp = 'ddp_optimizer'" in refused, \
                    f"grad_reduce_dtype with the python reducer: {refused!r}"
            else:
                assert layout_changes >= 1, f"{where}: DDP's buckets never rebuilt"
                # DDP's three buckets: the reference's forward in three graphs where dynamo splits at them
                assert graphs[False] == (3 if setting == "ddp_optimizer" else 1), f"{where}: graphs {graphs}"
                assert graphs[True] >= graphs[False], f"{where}: graphs compiled {graphs}"
