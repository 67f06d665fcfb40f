"""Lightning runs on every rank (imported only inside spawned ranks: Lightning's import is slow).

Each case fits the same small model twice on the same data, with Lightning + torch.optim.AdamW under
plain DDP and with FusedZeroStrategy + fused_zero.AdamW, and records every parameter after every
training batch; a rank returns what differs.
"""

from __future__ import annotations

import os
import warnings

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expect import refusal
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import DDPStrategy
from memory import peak_bytes, state_bytes, tensor_bytes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fused_zero
from fused_zero.lightning import FusedZeroStrategy

BATCH = 4


class Net(pl.LightningModule):
    def __init__(self, optimizer: str = "fused", scheduler: bool = False, inject: int | None = None, hidden: int = 33,
                 **opt_kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2, self.l3 = nn.Linear(8, hidden), nn.Linear(hidden, 17), nn.Linear(17, 5)
        self.optimizer, self.scheduler, self.opt_kwargs = optimizer, scheduler, opt_kwargs
        self.inject = inject  # the batch at which the last rank's loss (so its gradient) turns infinite

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.tanh(self.l2(torch.tanh(self.l1(x.to(self.l1.weight.dtype)))))
        loss = F.cross_entropy(self.l3(h).float(), y)
        if batch_idx == self.inject and self.global_rank == self.trainer.world_size - 1:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        cls = fused_zero.AdamW if self.optimizer == "fused" else torch.optim.AdamW
        extra = self.opt_kwargs if self.optimizer == "fused" else {"foreach": False}
        opt = cls(self.parameters(), lr=0.02, weight_decay=0.1, **extra)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Record(pl.Callback):
    """Every parameter after every training batch."""

    def __init__(self):
        self.params, self.scales = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.params.append([p.detach().float().clone() for p in pl_module.parameters()])
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scales.append(None if scaler is None else scaler.get_scale())


def loader(batches_per_rank: int, world: int) -> DataLoader:
    g = torch.Generator().manual_seed(7)
    n = batches_per_rank * BATCH * world
    data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g))
    return DataLoader(data, batch_size=BATCH, shuffle=False)


def fp16_plugin() -> MixedPrecision:
    """``precision="16-mixed"`` as Lightning builds it on a GPU (a GradScaler; on CPU it would run bf16
    without one), with a small scale that grows every 3 steps."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                                          growth_interval=3))


def fit(model, strategy, world, tmp, *, batches, epochs=1, callbacks=(), ckpt_path=None, scales=None,
        **trainer_kw):
    record = Record()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_epochs=epochs,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                         num_sanity_val_steps=0, default_root_dir=tmp, callbacks=[record, *callbacks],
                         **trainer_kw)
    trainer.fit(model, loader(batches, world), ckpt_path=ckpt_path)
    if scales is not None:
        scales.extend(record.scales)
    return record.params


class MeasuredCheckpoint(ModelCheckpoint):
    """ModelCheckpoint recording what each save costs this rank: the peak of torch's allocations during
    it, the tensor bytes of the optimizer states in the checkpoint dict Lightning built here (written
    on rank 0, dropped elsewhere), and ``memory.state_bytes``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.saves, self._held = [], None

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self._held = tensor_bytes(checkpoint["optimizer_states"])

    def _save_checkpoint(self, trainer, filepath):
        save = super()._save_checkpoint
        peak = peak_bytes(lambda: save(trainer, filepath))
        self.saves.append({"peak": peak, "held": self._held, **state_bytes(trainer.optimizers[0])})


BF16_ULP = 2.0 ** -8  # relative spacing of bf16 values


def differences(ours, ref, rank, exact=True, ulps=None):
    """What differs after each batch: bit for bit (``exact``), to fp32 rounding, or (``ulps``) within
    that many bf16 ulps of the tensor's largest magnitude."""
    assert len(ours) == len(ref) > 0, (len(ours), len(ref))
    out = []
    for step, (a, b) in enumerate(zip(ours, ref)):
        for i, (p, q) in enumerate(zip(a, b)):
            if ulps is not None:
                same = bool((p - q).abs().max() <= ulps * BF16_ULP * max(p.abs().max(), q.abs().max()))
            else:
                same = torch.equal(p, q) if exact else torch.allclose(p, q, rtol=1e-5, atol=1e-6)
            if not same:
                out.append(f"rank {rank} batch {step} param {i}: max diff {float((p - q).abs().max()):.3g}")
    return out



def launched(rank: int, world: int) -> None:
    """What a launcher (torchrun, Lightning's own) sets; the process group is already initialized."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), RANK=str(rank))
    warnings.filterwarnings("ignore")


def checkpoint(rank: int, world: int, tmp: str) -> list[dict]:
    """One training batch, then ModelCheckpoint's save: what it cost each rank (MeasuredCheckpoint)."""
    launched(rank, world)
    measured = MeasuredCheckpoint(dirpath=os.path.join(tmp, "ckpt"))
    fit(Net(hidden=1024), FusedZeroStrategy(), world, tmp, batches=1, callbacks=[measured])  # shards far above
    # Lightning's own small tensors
    return measured.saves


def run(rank: int, world: int, tmp: str) -> dict:
    launched(rank, world)
    out = {}
    steps = 6

    ref = fit(Net("torch"), DDPStrategy(), world, tmp, batches=steps)
    out["plain"] = differences(fit(Net(), FusedZeroStrategy(), world, tmp, batches=steps), ref, rank)

    ref = fit(Net("torch"), DDPStrategy(), world, tmp, batches=2 * steps, accumulate_grad_batches=2)
    ours = fit(Net(), FusedZeroStrategy(grad_reduce="all_reduce"), world, tmp, batches=2 * steps,
               accumulate_grad_batches=2)
    out["accumulate"] = differences(ours, ref, rank)

    ref = fit(Net("torch", scheduler=True), DDPStrategy(), world, tmp, batches=steps)
    ours = fit(Net(scheduler=True), FusedZeroStrategy(overlap="step"), world, tmp, batches=steps)
    out["scheduler"] = differences(ours, ref, rank)

    ref = fit(Net("torch"), DDPStrategy(), world, tmp, batches=steps, gradient_clip_val=0.05)
    ours = fit(Net(), FusedZeroStrategy(), world, tmp, batches=steps, gradient_clip_val=0.05)  # "auto": "backward"
    out["clip"] = differences(ours, ref, rank, exact=False)  # the norm is summed in another order
    out["clip_moved"] = not torch.equal(ours[-1][0], fit(Net(), FusedZeroStrategy(overlap="step"), world, tmp,
                                                          batches=steps)[-1][0])

    # ModelCheckpoint at the end of epoch 0 (3 steps); resume from it for epoch 1
    ckdir = os.path.join(tmp, "ckpt")
    whole = fit(Net(scheduler=True), FusedZeroStrategy(), world, tmp, batches=3, epochs=2,
                callbacks=[ModelCheckpoint(dirpath=ckdir, save_top_k=-1)])
    first = os.path.join(ckdir, "epoch=0-step=3.ckpt")
    resumed = fit(Net(scheduler=True), FusedZeroStrategy(), world, tmp, batches=3, epochs=2, ckpt_path=first)
    out["resume"] = differences(resumed, whole[3:], rank)

    # 16-mixed: Lightning's GradScaler steps both; the last rank's gradient is infinite at batch 2
    out["fp16"], out["fp16_scales"] = {}, {}
    for name, overlap, clip in (("backward", "backward", None), ("step-clip", "step", 0.05)):
        ref_scales, scales = [], []
        ref = fit(Net("torch", inject=2), DDPStrategy(), world, tmp, batches=steps, plugins=[fp16_plugin()],
                  gradient_clip_val=clip, scales=ref_scales)
        ours = fit(Net(inject=2), FusedZeroStrategy(overlap=overlap), world, tmp, batches=steps,
                   plugins=[fp16_plugin()], gradient_clip_val=clip, scales=scales)
        out["fp16"][name] = differences(ours, ref, rank, exact=clip is None)
        out["fp16_scales"][name] = (scales, ref_scales)

    # bf16-mixed: fp32 parameters under bf16 autocast, so torch.optim's own update, bit for bit
    ref = fit(Net("torch"), DDPStrategy(), world, tmp, batches=steps, precision="bf16-mixed")
    out["bf16_mixed"] = differences(fit(Net(), FusedZeroStrategy(), world, tmp, batches=steps,
                                        precision="bf16-mixed"), ref, rank)
    # bf16-true as torch.optim runs it: bf16 weights and moments, no master (torch computes op by op in
    # bf16, the kernel in fp32 rounded once): within 4 bf16 ulps of each tensor's scale over 3 batches,
    # where one lr-sized step missing or doubled is ~15 of them. Later the two part like any two bf16
    # runs whose weights differ by an ulp (half a learning rate apart after 6 batches).
    ref = fit(Net("torch"), DDPStrategy(), world, tmp, batches=3, precision="bf16-true")
    out["bf16_true"] = differences(fit(Net(master_weights=False, state_format="bf16"), FusedZeroStrategy(), world,
                                       tmp, batches=3, precision="bf16-true"), ref, rank, ulps=4)
    bf16 = fit(Net(), FusedZeroStrategy(), world, tmp, batches=3, precision="bf16-true")
    flat = torch.cat([p.reshape(-1) for p in bf16[-1]])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    out["bf16"] = [bool(flat.isfinite().all()), all(torch.equal(g, flat) for g in gathered),
                   not torch.equal(bf16[0][0], bf16[-1][0])]

    def fails(**kw):
        strategy = kw.pop("strategy", None) or FusedZeroStrategy()
        return lambda: fit(kw.pop("model", None) or Net(), strategy, world, tmp, batches=2, **kw)

    out["refusals"] = [
        refusal(fails(strategy=FusedZeroStrategy(overlap="bucket"), gradient_clip_val=1.0), ValueError,
                r"gradient_clip_val needs overlap='backward' or overlap='step' \(got overlap='bucket'\)"),
        refusal(fails(strategy=FusedZeroStrategy(overlap="step"), gradient_clip_val=1.0,
                      gradient_clip_algorithm="value"), ValueError, "gradient_clip_algorithm='value' is not supported"),
        refusal(fails(strategy=FusedZeroStrategy(overlap="bucket"), plugins=[fp16_plugin()]), ValueError,
                r"precision='16-mixed' \(a GradScaler.*\) needs overlap='backward' or overlap='step' "
                r"\(got overlap='bucket'\)"),
        refusal(fails(model=Net(overlap="step", grad_scaler=torch.amp.GradScaler("cpu")), plugins=[fp16_plugin()]),
                ValueError, "Lightning steps it through its own GradScaler: leave grad_scaler out"),
        refusal(fails(model=Net("torch")), TypeError, r"exactly one fused_zero optimizer .*\['AdamW'\]"),
        refusal(fails(model=Net(overlap="step"), strategy=FusedZeroStrategy(overlap="bucket")), ValueError,
                "given to attach.*give it once"),
    ]
    return out
