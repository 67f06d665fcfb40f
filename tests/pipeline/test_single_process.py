"""One process, no DDP, no process group (nanoGPT's ``python train.py``): a plain module passed as
``ddp=model`` or ``opt.attach(model)`` trains as the same torch.optim class does on the same data,
compared by torch.equal after every step (pipeline/local.py). In-process: nothing to spawn."""

import warnings

import doc_blocks
import pytest
import torch
import torch.distributed as dist
from torch import nn

import fused_zero

STEPS = 10


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh())
        self.head = nn.Linear(12, 3)
        self.unused = nn.Linear(2, 2)  # never in the forward: its .grad stays None, torch.optim skips it

    def forward(self, x):
        return self.head(self.body(x))


def _model():
    torch.manual_seed(0)
    return _Net()


def _groups(model):
    """Two param groups, the second with its own lr and weight decay."""
    head = list(model.head.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in head)]
    return [{"params": rest}, {"params": head, "lr": 3e-2, "weight_decay": 0.0}]


def _batch(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def _backward(model, step, micro, scale=1.0):
    x, y = _batch(step, micro)
    loss = nn.functional.mse_loss(model(x), y) * scale
    loss.backward()
    return loss


def _train(model, opt, steps, *, accumulate=2, clip=None, sched=None, start=0):
    """``accumulate`` backwards per step, gradients summing in param.grad as torch.optim expects."""
    for step in range(start, start + steps):
        for micro in range(accumulate):
            _backward(model, step, micro, 1.0 / accumulate)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
        yield step


def _assert_same(ref, test, step, exact=True):
    for i, (a, b) in enumerate(zip(ref.parameters(), test.parameters())):
        if exact:
            assert torch.equal(a, b), f"step {step}, parameter {i}: max diff {(a - b).abs().max().item():.3e}"
        else:
            torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-6,
                                       msg=lambda m, i=i: f"step {step}, parameter {i}: {m}")


def _pair(torch_cls, fused_cls, hparams, attach=False, **options):
    ref, test = _model(), _model()
    ref_opt = torch_cls(_groups(ref), **hparams)
    if attach:
        opt = fused_cls(_groups(test), **hparams, **options)
        opt.attach(test)
    else:
        opt = fused_cls(_groups(test), **hparams, ddp=test, **options)
    return ref, ref_opt, test, opt


def _scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("torch_cls,fused_cls,hparams,attach", [
    (torch.optim.AdamW, fused_zero.AdamW, dict(lr=1e-2, weight_decay=0.1), False),
    (torch.optim.AdamW, fused_zero.AdamW, dict(lr=1e-2, amsgrad=True), True),
    (torch.optim.Adam, fused_zero.Adam, dict(lr=1e-2, weight_decay=0.01), False),
    (torch.optim.SGD, fused_zero.SGD, dict(lr=5e-2, momentum=0.9, nesterov=True), True),
], ids=["adamw", "adamw-amsgrad-attach", "adam-l2", "sgd-nesterov-attach"])
def test_parity_with_accumulation_groups_and_scheduler(torch_cls, fused_cls, hparams, attach):
    assert not dist.is_initialized()
    ref, ref_opt, test, opt = _pair(torch_cls, fused_cls, hparams, attach)
    ref_sched, sched = _scheduler(ref_opt), _scheduler(opt)
    for step, _ in zip(_train(ref, ref_opt, STEPS, sched=ref_sched), _train(test, opt, STEPS, sched=sched)):
        _assert_same(ref, test, step)
    assert opt.param_groups[1]["lr"] == ref_opt.param_groups[1]["lr"] != opt.param_groups[0]["lr"]
    assert test.unused.weight.grad is None and len(opt.state) == len(ref_opt.state)


def test_max_grad_norm_matches_clip_grad_norm():
    """max_grad_norm clips inside the update as clip_grad_norm_ + torch.optim does (its global norm is
    summed in another order, so the coefficient may differ in the last bit, as in tests/scenarios.py's
    _exact); a clip_grad_norm_ of the user's own between backward and step() is honored, bit for bit
    (the update reads param.grad then)."""
    hp = dict(lr=1e-1)
    ref, ref_opt, test, opt = _pair(torch.optim.AdamW, fused_zero.AdamW, hp, max_grad_norm=0.05)
    own_ref, own_ref_opt, own, own_opt = _pair(torch.optim.AdamW, fused_zero.AdamW, hp)
    for step, _, _, _ in zip(_train(ref, ref_opt, STEPS, clip=0.05), _train(test, opt, STEPS),
                             _train(own_ref, own_ref_opt, STEPS, clip=0.05), _train(own, own_opt, STEPS, clip=0.05)):
        _assert_same(ref, test, step, exact=False)
        _assert_same(own_ref, own, step)
    assert not torch.equal(ref.head.weight, _model().head.weight)


def test_state_dict_round_trip_through_torch_optim():
    """fused_zero's state_dict() loads into torch.optim, which trains on identically; torch.optim's
    state loads back into a fresh fused_zero optimizer, which trains on identically again."""
    hp = dict(lr=1e-2, weight_decay=0.1)
    ref, ref_opt, test, opt = _pair(torch.optim.AdamW, fused_zero.AdamW, hp)
    for _ in zip(_train(ref, ref_opt, 4), _train(test, opt, 4)):
        pass
    into_torch = torch.optim.AdamW(_groups(test), **hp)
    into_torch.load_state_dict(opt.state_dict())
    for step, _ in zip(_train(ref, ref_opt, 3, start=4), _train(test, into_torch, 3, start=4)):
        _assert_same(ref, test, step)
    back = fused_zero.AdamW(_groups(test), **hp, ddp=test)
    back.load_state_dict(into_torch.state_dict())
    for step, _ in zip(_train(ref, ref_opt, 3, start=7), _train(test, back, 3, start=7)):
        _assert_same(ref, test, step)
    sd, ref_sd = back.state_dict(), ref_opt.state_dict()
    assert sd["state"].keys() == ref_sd["state"].keys()
    for pid, entry in ref_sd["state"].items():
        for name, value in entry.items():
            assert torch.equal(sd["state"][pid][name], value), f"parameter {pid}: {name}"


def test_dcp_round_trip(tmp_path):
    """torch.distributed.checkpoint in one process: the sharded dict holds plain tensors (the whole state
    is this rank's), and a fresh optimizer that trained elsewhere trains on identically to torch.optim
    after loading it. No warning but DCP's own "assuming ... a single process"."""
    import torch.distributed.checkpoint as dcp
    hp = dict(lr=1e-2, weight_decay=0.1)
    ref, ref_opt, test, opt = _pair(torch.optim.AdamW, fused_zero.AdamW, hp)
    for _ in zip(_train(ref, ref_opt, 3), _train(test, opt, 3)):
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(opt.sharded_state_dict(), checkpoint_id=str(tmp_path))
        fresh = fused_zero.AdamW(_groups(test), lr=5e-2, ddp=test)
        weights = {k: v.clone() for k, v in test.state_dict().items()}
        for _ in _train(test, fresh, 2, start=100):
            pass
        test.load_state_dict(weights)
        sd = fresh.sharded_state_dict()
        assert type(sd["state"][0]["exp_avg"]) is torch.Tensor
        dcp.load(sd, checkpoint_id=str(tmp_path))
    fresh.load_sharded_state_dict(sd)
    for step, _ in zip(_train(ref, ref_opt, 3, start=3), _train(test, fresh, 3, start=3)):
        _assert_same(ref, test, step)


def test_refusals_name_the_parameter():
    model = _model()
    with pytest.raises(TypeError, match=r"ddp must be a torch.nn.parallel.DistributedDataParallel .*got builtins.list"):
        fused_zero.AdamW(model.parameters(), ddp=[model])
    opt = fused_zero.AdamW(model.parameters(), ddp=model)
    with pytest.raises(RuntimeError, match="already attached"):
        opt.attach(model)


@pytest.mark.parametrize("unscale_and_clip", [False, True], ids=["scaler", "nanogpt-unscale-clip"])
def test_grad_scaler_matches_torch(unscale_and_clip):
    """grad_scaler=scaler, stepped through scaler.step(opt): the same steps, skips (an inf loss at step
    3) and scale as torch.optim under the same GradScaler; with nanoGPT's scaler.unscale_(opt) and
    clip_grad_norm_ before scaler.step(opt), too."""
    ref, ref_opt, test, _ = _pair(torch.optim.AdamW, fused_zero.AdamW, dict(lr=1e-2))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2) for _ in range(2)]
    opt = fused_zero.AdamW(_groups(test), lr=1e-2, ddp=test, grad_scaler=scalers[1])
    for step in range(STEPS):
        for model, o, scaler in ((ref, ref_opt, scalers[0]), (test, opt, scalers[1])):
            for micro in range(2):
                x, y = _batch(step, micro)
                loss = nn.functional.mse_loss(model(x), y) * (float("inf") if (step, micro) == (3, 1) else 0.5)
                scaler.scale(loss).backward()
            if unscale_and_clip:
                scaler.unscale_(o)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(o)
            scaler.update()
            o.zero_grad()
        _assert_same(ref, test, step)
        assert scalers[0].get_scale() == scalers[1].get_scale()
    assert opt.skipped_steps == 1


def test_triton_kernels():
    """The fused Triton update (what runs on CUDA; here Triton's interpreter), close to torch.optim as in
    the distributed parity tests (its arithmetic is not torch's op for op)."""
    ref, ref_opt, test, opt = _pair(torch.optim.AdamW, fused_zero.AdamW, dict(lr=1e-2), backend="triton",
                                    max_grad_norm=0.05)
    for step, _ in zip(_train(ref, ref_opt, 3, clip=0.05), _train(test, opt, 3)):
        _assert_same(ref, test, step, exact=False)


def test_usage_block_runs():
    """docs/usage.md's "One process, no DDP" block, as written, in this process (no process group)."""
    [code] = [c for n, c in doc_blocks.python_blocks() if n.startswith("docs/usage.md,") and "ddp=model" in c]
    model = nn.Sequential(nn.Linear(16, 8))
    before = model[0].weight.detach().clone()
    xs = [torch.randn(8, 16, dtype=torch.float32, device="cpu") for _ in range(3)]
    ns = {"__name__": "__main__", "model": model, "loss_fn": nn.functional.cross_entropy,
          "loader": [(x, x[:, :8].argmax(dim=1)) for x in xs]}
    exec(compile(code, "docs/usage.md", "exec"), ns)
    assert ns["opt"].state_dict()["state"][0]["step"] == 3 and not torch.equal(before, model[0].weight)


def test_state_loaded_before_attach():
    """nanoGPT's resume order kept: load_state_dict() before attach(model), then training on as
    torch.optim does from the same state."""
    hp = dict(lr=1e-2, weight_decay=0.1)
    ref, ref_opt, test, _ = _pair(torch.optim.AdamW, fused_zero.AdamW, hp)
    for _ in _train(ref, ref_opt, 3):
        pass
    test.load_state_dict(ref.state_dict())
    opt = fused_zero.AdamW(_groups(test), **hp)
    opt.load_state_dict(ref_opt.state_dict())
    opt.attach(test)
    for step, _ in zip(_train(ref, ref_opt, 3, start=3), _train(test, opt, 3, start=3)):
        _assert_same(ref, test, step)
