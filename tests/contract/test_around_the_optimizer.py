"""What training scripts do around the optimizer once it exists (the contract suite: conftest.py).

- Copies of the model: ``copy.deepcopy`` (torch.optim.swa_utils.AveragedModel's EMA, an evaluation
  snapshot), ``torch.save`` and ``pickle``, before the first forward and mid-training, in every mode: the
  copy is a plain module (its own storage, none of fused_zero's hooks, trainable by anything, a pickle
  that loads without fused_zero's objects), the original trains on bit for bit, and the EMA updated after
  every step equals DDP + torch.optim's (with ``param_sync="forward"`` after ``opt.synchronize()``,
  docs/usage.md; the stream-order checker shows the stale read it prevents:
  tests/pipeline/comm/test_stream_order.py).
- Weights written after construction (pipeline/reducing/weight_watch.py): ``model.load_state_dict`` of
  other weights, ``p.copy_`` under ``no_grad``, ``nn.init``, ``p.data = t``, on a bf16 module (whose
  fp32 masters must follow) and an fp32 one, in every mode, against DDP + torch.optim with fp32 masters
  started from the written bf16 values; a write between backward and ``step()`` (honored by
  overlap="step", refused on every rank by the modes whose update ran in the backward); a write on one
  rank only, refused on every rank.
"""

from __future__ import annotations

import copy
import io
import itertools
import pickle

import pytest
import torch
import torch.nn.functional as F
from distributed import run_ranks
from harness import Run, optimizer, ours_alone, refused, same, twin
from scenarios import VOCAB, _compare_low, batch, twin_models
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.pipeline.reducing import hooks

MODES = list(itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce")))


def _step(run: Run, step: int) -> None:
    run.loss(step).backward()
    for o in run.opts:
        o.step()
    for o in run.opts:
        o.zero_grad()


# ------------------------------------------------------------------------------------------- copies


def _plain(copy_of, original) -> list[str]:
    """What makes ``copy_of`` not a plain module: fused_zero's hooks, storage shared with ``original``."""
    out = []
    for m in copy_of.modules():
        if m._forward_pre_hooks or hooks.forward_pre_hooks_of(m):
            out.append(f"forward pre-hooks on {type(m).__name__}")
        if any(isinstance(h, hooks.Synchronize) for h in m._state_dict_pre_hooks.values()):
            out.append(f"a state_dict pre-hook on {type(m).__name__}")
    ptrs = {p.untyped_storage().data_ptr() for p in original.parameters()}
    out += [f"{n} shares the original's storage" for n, p in copy_of.named_parameters()
            if p.untyped_storage().data_ptr() in ptrs]
    return out


def _copies(rank, world, overlap, reduce, sync):
    """The EMA (AveragedModel, built before the first forward and updated after every step), a deepcopy
    trained by torch.optim.SGD, torch.save and pickle mid-training; both runs alike."""
    found = []

    def make(model, ddp, fused, run):
        opts = [optimizer("AdamW", list(ddp.parameters()), fused, **(
            dict(ddp=ddp, overlap=overlap, grad_reduce=reduce, param_sync=sync) if fused else {}))]
        run.keep["ema"] = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
        run.keep["model"] = model
        return opts

    def loop(run, step):
        _step(run, step)
        if run.fused and sync == "forward":
            run.opts[0].synchronize()  # what reads the parameters outside a forward waits for them (usage.md)
        run.keep["ema"].update_parameters(run.keep["model"])
        run.keep.setdefault("emas", []).append([p.detach().clone() for p in run.keep["ema"].module.parameters()])
        if step == 2:
            model = run.keep["model"]
            snapshot = copy.deepcopy(model)
            if run.fused:
                found.extend(_plain(snapshot, model) + _plain(run.keep["ema"].module, model))
            trained = torch.optim.SGD(snapshot.parameters(), lr=0.1)  # trainable by anything
            F.cross_entropy(snapshot(batch(9, 0, run.rank)[0]).reshape(-1, VOCAB), batch(9, 0, run.rank)[1]
                            .reshape(-1)).backward()
            trained.step()
            buf = io.BytesIO()
            torch.save(model, buf)
            loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
            pickled = pickle.loads(pickle.dumps(model))
            for other in (loaded, pickled):
                if run.fused:
                    found.extend(_plain(other, model))
                for (n, p), q in zip(model.named_parameters(), other.parameters()):
                    if not torch.equal(p.detach(), q.detach()):
                        found.append(f"{n}: the saved copy differs from the module it was saved from")

    out = twin(rank, world, loop, make, steps=5)
    for step, (mine, theirs) in enumerate(zip(out["keep"]["emas"], out["ref_keep"]["emas"]), 1):
        for i, (a, b) in enumerate(zip(mine, theirs)):
            same(a, b, f"rank {rank} step {step}: EMA parameter {i}")
    assert not found, found


@pytest.mark.parametrize("overlap, reduce", MODES)
def test_copies_of_the_model_are_plain_and_the_ema_is_torch_optims(overlap, reduce):
    run_ranks(_copies, 2, overlap, reduce, "step")


def test_copies_with_param_sync_forward():
    run_ranks(_copies, 2, "bucket", "reduce_scatter", "forward")


# ------------------------------------------------------------------------------- weights written later


def _write(model, how: str, step: int) -> list[int]:
    """Write new weights into ``model`` as a user does (the same values on every rank and in both runs);
    returns the indices (in ``model.parameters()``) of the parameters written."""
    g = torch.Generator().manual_seed(100 + step)
    params = list(model.parameters())
    with torch.no_grad():
        if how == "load":  # other weights altogether: a rollback, pretrained weights loaded after setup
            other = {k: (torch.randn(v.shape, generator=g) * 0.2).to(v.dtype) for k, v in model.state_dict().items()}
            model.load_state_dict(other)
            return list(range(len(params)))
        if how == "copy":
            params[1].copy_(torch.randn(params[1].shape, generator=g))
            return [1]
        if how == "init":
            torch.nn.init.normal_(params[3], std=0.3, generator=g)
            return [3]
        params[2].data = torch.randn(params[2].shape, generator=g).to(params[2].dtype)  # "data"
        return [2]


def _written(rank, world, overlap, reduce, dtype, how, when):
    """Train 6 steps, writing the weights (``how``) before the forward of step 3 (``when="before"``) or
    between its backward and step() (``"after"``); ours against DDP + torch.optim on fp32 masters started
    from the written values. Returns each step's worst difference in the parameters' own ulps."""
    model, ref = twin_models(dtype=dtype)
    ddp, ref_ddp = (DDP(m, bucket_cap_mb=0.0001) for m in (model, ref))
    opt = fused_zero.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1, ddp=ddp, overlap=overlap,
                           grad_reduce=reduce)
    params = [p for p in ref.parameters() if p.requires_grad]
    masters = [p.detach().float().requires_grad_() for p in params]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=False)
    try:
        for step in range(1, 7):
            written = []
            if step == 3 and when == "before":
                written = [_write(m, how, step) for m in (model, ref)][1]
            for d in (ref_ddp, ddp):
                x, y = batch(step, 0, rank)
                F.cross_entropy(d(x, use_branch=True).float().reshape(-1, VOCAB), y.reshape(-1)).backward()
            if step == 3 and when == "after":
                written = [_write(m, how, step) for m in (model, ref)][1]
            with torch.no_grad():  # DDP + torch.optim: the written parameters' masters start from them
                for i in written:
                    if i < len(params):
                        masters[i].copy_(params[i])
            for p, m in zip(params, masters):
                m.grad = p.grad.float()
                p.grad = None
            ref_opt.step()
            ref_opt.zero_grad()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            opt.step()
            opt.zero_grad()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                where = f"rank {rank} step {step} {name}"
                if dtype == torch.float32:
                    same(p.detach(), q.detach(), where)
                else:
                    _compare_low(p.detach().float(), q.detach().float(), where, dtype)
    finally:
        opt._engine.close()


@pytest.mark.parametrize("how", ["load", "copy", "init", "data"])
def test_bf16_weights_written_after_construction_are_what_training_continues_from(how):
    """Before: the next step started from the fp32 masters taken before the write (a parameter 0.31 from
    the loaded value one step later, where a step moves it about 0.002)."""
    for (overlap, reduce), dtype in zip(MODES if how == "load" else MODES[::2], itertools.cycle([torch.bfloat16])):
        run_ranks(_written, 2, overlap, reduce, dtype, how, "before")


def test_fp32_weights_rebound_with_p_data():
    """``p.data = t`` on an fp32 module: the parameter's data was no longer the bucket's buffer, which the
    update and the all-gather write."""
    for overlap, reduce in MODES[::3]:
        run_ranks(_written, 2, overlap, reduce, torch.float32, "data", "before")


def test_weights_written_between_backward_and_step():
    """Honored where the update runs in step() (overlap="step"); refused on every rank where it ran in the
    backward."""
    run_ranks(_written, 2, "step", "reduce_scatter", torch.bfloat16, "copy", "after")
    for rank_error in run_ranks(_refused_after, 2):
        assert "written between backward and optimizer.step()" in rank_error and "overlap='step'" in rank_error


def _refused_after(rank, world):
    try:
        _written(rank, world, "bucket", "reduce_scatter", torch.bfloat16, "copy", "after")
    except RuntimeError as e:
        return str(e)
    return "not refused"


def _one_rank_writes(rank, world):
    def make(model, ddp, fused, run):
        return [fused_zero.AdamW(ddp.parameters(), lr=1e-2, ddp=ddp)]

    def loop(run, step):
        if step == 2 and run.rank == 0:
            _write(run.ddp.module, "copy", step)
        _step(run, step)
    return refused(lambda: ours_alone(rank, world, loop, make, steps=3), "on some ranks and not on others")


def test_weights_written_on_one_rank_only_are_refused_on_every_rank():
    """DDP + torch.optim would train each rank's own weights apart; fused_zero's ranks update one slice each,
    from their own weights, which would mix them: refused on every rank, at the step that would."""
    assert len(run_ranks(_one_rank_writes, 2)) == 2

