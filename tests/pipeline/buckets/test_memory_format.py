"""Parameters keep their memory format: a convolution net moved to ``channels_last`` trains exactly as
DDP + torch.optim does, in every overlap mode x both reductions, with and without
``find_unused_parameters`` (where DDP never rebuilds its buckets, so the gradient keeps the layout it
had at construction), and its weights stay channels_last. DDP lays such a gradient into its bucket
with the parameter's strides (pipeline/buckets/strides.py); reading it in row-major order updated every element
with another element's gradient (off by a whole step after one step).

Also: the canonical state dict holds the moments in the parameter's shape and strides, equal to
torch.optim's, and loads back; the sharded (DCP) form refuses a load into another memory format.
"""

import itertools
import traceback

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero

CL = torch.channels_last
MODES = list(itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce")))


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3)
        self.c2 = nn.Conv2d(8, 6, 3)
        self.side = nn.Conv2d(8, 6, 3)  # used on some steps only (find_unused_parameters)
        self.head = nn.Linear(6 * 4 * 4, 5)

    def forward(self, x, use_side: bool):
        h = F.relu(self.c1(x))
        h = self.c2(h) + (self.side(h) if use_side else 0)
        return self.head(h.flatten(1))


def _models(find_unused: bool):
    torch.manual_seed(7)
    model, ref = ConvNet(), ConvNet()
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):
        m.to(memory_format=CL)
    kw = dict(bucket_cap_mb=0.005, find_unused_parameters=find_unused)
    return model, DDP(model, **kw), ref, DDP(ref, **kw)


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 3, 8, 8, generator=g).to(memory_format=CL), torch.randint(0, 5, (4,), generator=g)


OPTS = {"SGD": dict(lr=0.05, momentum=0.9, weight_decay=0.01), "AdamW": dict(lr=1e-2, weight_decay=0.1)}


def one_case(rank, opt_name, overlap, grad_reduce, find_unused, steps=5):
    model, ddp, ref, ref_ddp = _models(find_unused)
    opt = getattr(fused_zero, opt_name)(ddp.parameters(), ddp=ddp, overlap=overlap, grad_reduce=grad_reduce,
                                        **OPTS[opt_name])
    ref_opt = getattr(torch.optim, opt_name)(ref_ddp.parameters(), foreach=False, **OPTS[opt_name])
    where = f"{opt_name} {overlap} {grad_reduce} find_unused={find_unused}"
    try:
        for step in range(1, steps + 1):
            x, y = _batch(step, rank)
            use_side = not find_unused or (step + rank) % 2 == 0
            for d, o in ((ref_ddp, ref_opt), (ddp, opt)):
                F.cross_entropy(d(x, use_side), y).backward()
                o.step()
                o.zero_grad()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                assert torch.equal(p, q), f"{where} step {step} {name}: largest difference " \
                                          f"{(p - q).abs().max().item():.3e}"
                if p.dim() == 4:
                    assert p.is_contiguous(memory_format=CL), f"{where} {name} lost channels_last"
        sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
        for i, entry in ref_sd["state"].items():
            for key, value in entry.items():
                ours = sd["state"][i][key]
                assert torch.equal(ours, value), f"{where} state {i} {key} differs"
                if value.dim() == 4:
                    assert ours.stride() == value.stride(), f"{where} state {i} {key}: strides {ours.stride()}"
        opt.load_state_dict(ref_sd)  # torch.optim's dict, channels_last moments, loads back
        assert torch.equal(opt.state_dict()["state"][0][key], ref_sd["state"][0][key])
    finally:
        opt._engine.close()


def run_all(rank, world):
    failures = []
    for opt_name, (overlap, grad_reduce), find_unused in itertools.product(OPTS, MODES, (False, True)):
        try:
            one_case(rank, opt_name, overlap, grad_reduce, find_unused)
        except Exception:
            failures.append(traceback.format_exc(limit=-3))
    return failures


@pytest.fixture(scope="module")
def results():
    return run_ranks(run_all, 2)


def test_channels_last_matches_torch_optim_everywhere(results):
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {len(failures)} cases failed; first:\n{failures[0]}"


def test_dense_strides_are_required():
    """A parameter that does not fill its storage densely (a slice with gaps) is refused at construction."""
    import torch.distributed as dist

    from fused_zero.demo.spawn import _free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        model = nn.Linear(4, 3)
        model.weight = nn.Parameter(torch.zeros(3, 8)[:, :4])  # a strided slice: gaps in its storage
        ddp = DDP(model)
        with pytest.raises(ValueError, match="does not fill its storage densely"):
            fused_zero.SGD(ddp.parameters(), lr=0.1, ddp=ddp)
    finally:
        dist.destroy_process_group()
