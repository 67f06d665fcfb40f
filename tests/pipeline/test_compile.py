"""torch.compile with fused_zero, on 2 gloo ranks: nanoGPT's order (``torch.compile(model)``, then
``DDP(compiled)``, then ``opt.attach(ddp)``) and ``torch.compile(ddp)``, each against torch.optim on
the same compiled DDP model, compared by torch.equal after every step, losses too. The steps cover
DDP's bucket rebuild after the first iteration (fused_zero rebinds the parameters to new flat
buffers under the compiled graph; dropping the state's move there fails every case at step 1) and
``param_sync="forward"``, whose all-gather waits are forward pre-hooks on the compiled modules (on
gloo CPU the gathers are complete by the next forward, so this case would not catch a wait that
never runs).

backend="aot_eager": dynamo's graph capture, DDP's graph splitting at bucket boundaries
(``optimize_ddp``) and AOT autograd's backward are what meets fused_zero's hooks and buffers; inductor
would add only its C++ code generation, tens of seconds per graph on a loaded 2-core machine."""

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
    ("ddp", dict()),
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
