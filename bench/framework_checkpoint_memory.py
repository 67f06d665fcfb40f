"""Host memory per rank during one framework checkpoint: Lightning's ``Trainer.save_checkpoint`` and
Accelerate's ``save_state`` (both build the checkpoint on every rank and write it from rank 0), with a
fused_zero AdamW over an MLP of ``layers`` ``hidden``-wide fp32 layers, after one training step.

Run: ``python bench/framework_checkpoint_memory.py [--world 4] [--hidden 2048] [--layers 4]``. Each
framework saves twice on every rank; measured per rank, printed as JSON:

- ``rss_growth_mb``: the first save, with nothing measuring inside it: how far the process's peak RSS
  (``getrusage``'s ``ru_maxrss``) rose during it. A lower bound: freed heap memory can be reused;
- ``peak_alloc_mb``: the second save, under torch's profiler: the peak of torch's CPU allocations on the
  training thread during it, above its start (the dict, its slices, serialization buffers);
- ``held_mb``: the tensor bytes of the optimizer state the framework got on this rank (written on
  rank 0, dropped on the others);
- ``own_mb`` and ``full_mb``: this rank's shards of the state, and the whole state (every parameter's
  fp32 moments).

Before/after a change, run it once against each checkout (``PYTHONPATH=<checkout>``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fused_zero.demo.spawn import _free_port, run_ranks

MB = 2 ** 20


def _peak_alloc(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    now = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]"):
        now += n
        peak = max(peak, now)
    return peak


def _tensor_bytes(obj) -> int:
    seen, total, todo = set(), 0, [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in seen:
            seen.add(o.untyped_storage().data_ptr())
            total += o.untyped_storage().nbytes()
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
    return total


def _rss_growth(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # KB on Linux


def _mlp(hidden: int, layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)])


def _sizes(opt) -> dict:
    shards = opt._engine.shards()
    return {"own_mb": sum(s.state_bytes() for s in shards) / MB,
            "full_mb": sum(s.layout.numel * 4 * len(s.names) for s in shards) / MB}


def _lightning(rank, world, hidden, layers, tmp) -> dict:
    import lightning.pytorch as pl

    import fused_zero
    from fused_zero.lightning import FusedZeroStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    held = []

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(hidden, layers)

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[0])

        def configure_optimizers(self):
            return fused_zero.AdamW(self.parameters(), lr=1e-4)

        def on_save_checkpoint(self, checkpoint):
            held.append(_tensor_bytes(checkpoint["optimizer_states"]))

    data = torch.utils.data.TensorDataset(torch.randn(8 * world, hidden))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=FusedZeroStrategy(), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=8))
    path = os.path.join(tmp, "lightning.ckpt")
    rss = _rss_growth(lambda: trainer.save_checkpoint(path))
    peak = _peak_alloc(lambda: trainer.save_checkpoint(path))
    return {"rss_growth_mb": rss / MB, "peak_alloc_mb": peak / MB, "held_mb": held[-1] / MB,
            **_sizes(trainer.optimizers[0])}


def _accelerate(rank, world, port, hidden, layers, tmp) -> dict:
    import accelerate.checkpointing
    from accelerate import Accelerator

    import fused_zero
    import fused_zero.accelerate

    dist.destroy_process_group()  # Accelerate initializes its own from the launcher's environment
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    accelerator = Accelerator(cpu=True)
    model = _mlp(hidden, layers)
    opt = fused_zero.AdamW(model.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(model, opt)
    fused_zero.accelerate.attach(accelerator, model, opt)
    x = torch.randn(8, hidden)
    accelerator.backward(F.mse_loss(model(x), x))
    opt.step()
    held, save = [], accelerate.checkpointing.save

    def recorded(obj, f, **kwargs):
        if os.path.basename(f).startswith("optimizer"):
            held.append(_tensor_bytes(obj))
        return save(obj, f, **kwargs)

    accelerate.checkpointing.save = recorded
    rss = _rss_growth(lambda: accelerator.save_state(os.path.join(tmp, "accelerate-1")))
    peak = _peak_alloc(lambda: accelerator.save_state(os.path.join(tmp, "accelerate-2")))
    return {"rss_growth_mb": rss / MB, "peak_alloc_mb": peak / MB, "held_mb": held[-1] / MB, **_sizes(opt.optimizer)}


def _measure(rank, world, port, hidden, layers, tmp):
    warnings.filterwarnings("ignore")
    out = {"rank": rank, "lightning": _lightning(rank, world, hidden, layers, tmp)}
    out["accelerate"] = _accelerate(rank, world, port, hidden, layers, tmp)
    return out


def main():
    import tempfile

    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds for the whole spawn")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_measure, args.world, _free_port(), args.hidden, args.layers, tmp, backend="gloo",
                            timeout=args.timeout)
    rounded = [{k: {m: round(v, 2) for m, v in r.items()} if isinstance(r, dict) else r for k, r in res.items()}
               for res in results]
    print(json.dumps({"torch": torch.__version__, "world": args.world, "hidden": args.hidden, "layers": args.layers,
                      "results": rounded}, indent=1))


if __name__ == "__main__":
    main()
