"""Compact optimizer state (``state_format`` "bf16" and "8bit", ``master_weights="stochastic"``) against its
oracle in every overlap mode x both reductions at 1, 2 and 4 ranks (formats_scenarios.py), per param
group in buckets that mix formats, the stochastic rounding's statistics and reproducibility,
checkpoints in both forms with a format change, and the refusals. The kernels' side of the formats is
test_kernel_exact.py."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from distributed import run_ranks
from expect import raises
from formats_scenarios import FormatCase, build, run_format_cases, train
from kernel_reference import decode8
from memory import peak_bytes
from torch.nn.parallel import DistributedDataParallel as DDP

import fused_zero
from fused_zero.algorithms.codecs import BlockTable, decode_table, encode8, encode_blocks, round_stochastic
from fused_zero.kernels import row_table

MODES = list(itertools.product(("bucket", "backward", "step"), ("reduce_scatter", "all_reduce")))
TWO = ([FormatCase(state_format=f, opt=o, overlap=m, grad_reduce=r) for f in ("bf16", "8bit") for o in ("AdamW", "SGD")
        for m, r in MODES]
       + [FormatCase(state_format="8bit", amsgrad=True, overlap="step"),
          FormatCase(state_format="fp32", stochastic=True, overlap="bucket"),
          FormatCase(state_format="8bit", stochastic=True, overlap="backward", grad_reduce="all_reduce"),
          FormatCase(state_format="bf16", stochastic=True, opt="SGD", overlap="step"),
          FormatCase(state_format="8bit", overlap="backward", backend="triton"),
          FormatCase(state_format="8bit", opt="SGD", stochastic=True, overlap="step", backend="triton"),
          FormatCase(state_format="bf16", amsgrad=True, overlap="bucket", grad_reduce="all_reduce", backend="triton")])
ONE_AND_FOUR = [FormatCase(state_format=f, overlap=m, grad_reduce=r) for f in ("bf16", "8bit") for m, r in MODES[::2]] \
    + [FormatCase(state_format="8bit", stochastic=True, overlap="step", grad_reduce="all_reduce")]


def test_formats_two_ranks():
    names = [c.name() for c in TWO]
    assert run_ranks(run_format_cases, 2, TWO) == [names, names]


@pytest.mark.parametrize("world", [1, 4])
def test_formats_one_and_four_ranks(world):
    names = [c.name() for c in ONE_AND_FOUR]
    assert run_ranks(run_format_cases, world, ONE_AND_FOUR) == [names] * world


SHARDED = [FormatCase(state_format="8bit", overlap="bucket", shard=2),
           FormatCase(state_format="bf16", opt="SGD", overlap="backward", grad_reduce="all_reduce", shard=2),
           FormatCase(state_format="8bit", stochastic=True, overlap="step", shard=2)]


def test_formats_in_shard_groups():
    """Four ranks in two shard groups of two: each replica's rank holds the same slice, so the same
    blocks and, with stochastic rounding, the same bits (the element's index, not the rank, draws them)."""
    names = [c.name() for c in SHARDED]
    assert run_ranks(run_format_cases, 4, SHARDED) == [names] * 4


# per param group: parameter i in group i % k, so DDP's buckets (500 fp32 elements) mix the formats
MIXED = ([FormatCase(groups=("8bit", "bf16", None), state_format="fp32", overlap=m, grad_reduce=r, bucket_cap_mb=0.002)
          for m, r in MODES]
         + [FormatCase(opt="SGD", groups=("bf16", "8bit"), overlap="step", bucket_cap_mb=0.002),
            FormatCase(groups=("8bit", None), state_format="bf16", stochastic=True, overlap="backward",
                       bucket_cap_mb=0.002),
            FormatCase(groups=("8bit", "bf16", None), state_format="fp32", overlap="backward", backend="triton",
                       bucket_cap_mb=0.002),
            FormatCase(groups=(None, "8bit"), state_format="bf16", amsgrad=True, overlap="step",
                       grad_reduce="all_reduce", backend="triton", bucket_cap_mb=0.002),
            FormatCase(groups=("8bit", "bf16"), overlap="bucket")])  # DDP's smallest buckets


def _mixed(rank, world, cases):
    out = []
    for case in cases:
        opt = train(case, rank, world)[2]
        out.append((case.name(), max(len(s.parts) for s in opt._engine.shards())))
        opt._engine.close()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_formats_per_param_group(world):
    """Each group's moments in its own format, its oracle's, in every overlap mode and both reductions
    (at 2 ranks; a few at 1 and 4), with DDP's buckets holding several formats at once."""
    cases = MIXED if world == 2 else MIXED[::3]
    outs = run_ranks(_mixed, world, cases)
    for out in outs:
        assert [name for name, _ in out] == [c.name() for c in cases]
        for (name, most), case in zip(out, cases):
            if case.bucket_cap_mb > 0.001 and world == 2:  # some rank's region holds every format
                assert most == len(set(f or case.state_format for f in case.groups)), (name, most)


def _oracle_off(rank, world):
    built = build(FormatCase(state_format="8bit", steps=2))
    try:
        train(FormatCase(state_format="bf16", steps=2), rank, world, built=built)
    except AssertionError as e:
        return str(e).splitlines()[0]
    finally:
        built[2]._engine.close()
    return None


def test_the_oracle_sees_a_format_that_is_off():
    """An 8-bit moment encoded with one fraction bit less would train nearly as well; the comparison
    must still fail: here the oracle keeps bf16 moments while fused_zero keeps 8 bits."""
    assert all(found is not None for found in run_ranks(_oracle_off, 2))


# ---------------------------------------------------------------------- stochastic rounding


def test_stochastic_rounding_is_unbiased():
    """Many roundings of one value (one per element index: the hash's input) average to it: within
    four standard deviations of the binomial mean, for values across a binade and of both signs."""
    n = 1 << 16
    elem = torch.arange(n)
    for x in (1.0 + 2 ** -9, 1.0 + 2 ** -8 - 2 ** -12, -3.14159, 7.3e-5, -1e4 - 3.0):
        value = torch.full((n,), x, dtype=torch.float32)
        lo = value.to(torch.bfloat16).float()  # a neighbour (nearest); the other one an ulp away
        rounded = round_stochastic(value, key=0x1234567, elem=elem).float()
        up = float((rounded != lo).float().mean())
        assert set(torch.unique(rounded).tolist()) <= {float(lo[0]), float(torch.nextafter(lo[:1].to(torch.bfloat16),
                                                         torch.tensor([math.copysign(math.inf, x - float(lo[0]))],
                                                                      dtype=torch.bfloat16)).float())}
        mean, ulp = float(rounded.double().mean()), float((rounded - lo).abs().max()) or 1.0
        p = abs(x - float(lo[0])) / ulp
        sigma = ulp * math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(mean - x) <= 4 * sigma + 1e-12 * abs(x), (x, mean, up, sigma)


def _same_data_run(rank, world):
    case = FormatCase(state_format="bf16", stochastic=True, overlap="bucket", grad_reduce="all_reduce",
                      same_data=True, steps=6)
    model, *_ = train(case, rank, world)
    return [p.detach().clone() for p in model.parameters()]


def test_stochastic_rounding_is_the_same_at_any_world_size():
    """Every rank on the same batches, so the reduced gradient is the single rank's exactly (a power of
    two divides exactly): the rounded bits must then be the same at 1, 2 and 4 ranks, though which rank
    updates which element changes. (bf16 moments: 8-bit blocks are cut by the layout, so their scales,
    and with them the moments, do change with the world size.)"""
    runs = {world: run_ranks(_same_data_run, world)[0] for world in (1, 2, 4)}
    for world in (2, 4):
        for a, b in zip(runs[1], runs[world]):
            assert torch.equal(a, b), f"world {world} rounded otherwise than world 1"


def _resume(rank, world):
    case = FormatCase(state_format="8bit", stochastic=True, overlap="step", steps=6)
    whole = train(case, rank, world)
    final = [p.detach().float() for p in whole[0].parameters()]
    whole[2]._engine.close()
    part = train(case, rank, world, steps=3)
    fresh = build(case)
    fresh[0].load_state_dict(part[0].state_dict())
    fresh[2].load_state_dict(part[2].state_dict())  # the 8-bit codes come back from the decoded dict
    fresh[3].load_state_dict(part[3].state_dict())
    fresh[5].load_state_dict(part[5].state_dict())
    for w, v in zip(fresh[7], part[7]):
        w.data.copy_(v)
    part[2]._engine.close()
    train(case, rank, world, built=fresh, start=4, steps=3, held=True)  # equal to the oracle at every step
    fresh[2]._engine.close()
    return max(float((a.detach().float() - b).abs().max()) for a, b in zip(fresh[0].parameters(), final))


def test_a_resume_continues_as_its_oracle():
    """Resumed from the canonical dict, the run equals its oracle bit for bit at every step, and the
    uninterrupted run at the end: its first iteration runs in DDP's first buckets with the loaded
    moments held in fp32, and DDP's rebuild encodes them once, in the blocks the uninterrupted run
    has (docs/compact-state.md). Before the hold it ended up to 1.2e-4 off the oracle, and off the
    uninterrupted run by less than one step's size."""
    assert run_ranks(_resume, 2) == [0.0, 0.0]


# ---------------------------------------------------------------------- checkpoints and refusals


def stored(opt) -> list[torch.Tensor]:
    """Every shard's stored state: codes (or bf16 moments) and scales."""
    return [t for s in opt._engine.shards() for t in s.tensors()]


def _checkpoints(rank, world, path):
    import torch.distributed.checkpoint as dcp
    out = {}
    int8 = FormatCase(state_format="8bit", steps=3)
    built = train(int8, rank, world)
    opt = built[2]

    def from_dcp(fmt: str, where: str, weights: bool):
        """A fresh optimizer of ``fmt`` (the saved model's weights loaded first, if ``weights``) that
        loaded the DCP checkpoint at ``where``."""
        fresh = build(FormatCase(state_format=fmt))
        if weights:
            fresh[0].load_state_dict(built[0].state_dict())
        target = fresh[2].sharded_state_dict()
        dcp.load(target, checkpoint_id=where)
        fresh[2].load_sharded_state_dict(target)
        return fresh

    sd = opt.state_dict()
    out["recorded"] = sd.get("fused_zero") == {"state_format": "8bit"}
    codes = [t.clone() for t in stored(opt)]
    opt.load_state_dict(sd)  # decoded, then encoded again: the same codes and scales
    out["same codes"] = all(torch.equal(a, b) for a, b in zip(codes, stored(opt)))
    # torch.optim loads the decoded dict as it is
    ref = torch.optim.AdamW([p.detach().clone() for p in built[0].parameters()], lr=1e-2)
    ref.load_state_dict(sd)
    out["torch.optim loads it"] = torch.equal(ref.state[ref.param_groups[0]["params"][0]]["exp_avg"],
                                              sd["state"][0]["exp_avg"])
    # a format change at load: the 8-bit dict into fp32 (exactly the decoded values), and back
    fp32 = build(FormatCase(state_format="fp32"))
    fp32[0].load_state_dict(built[0].state_dict())
    fp32[2].load_state_dict(sd)
    back = fp32[2].state_dict()
    out["into fp32"] = all(torch.equal(back["state"][i][k], v) for i, e in sd["state"].items() for k, v in e.items())
    opt.load_state_dict(back)  # back at the layout it was saved in: the same codes (blocks follow the layout)
    out["back to int8"] = all(torch.equal(a, b) for a, b in zip(codes, stored(opt)))
    again = build(FormatCase(state_format="8bit"))
    again[0].load_state_dict(built[0].state_dict())
    again[2].load_state_dict(back)
    # DCP holds the codes and the scales: loaded into a fresh int8 optimizer, the same codes as the
    # canonical dict gives there (``again``: the same layout); into fp32, the values the dict holds;
    # into bf16, those rounded to bf16
    dcp.save(opt.sharded_state_dict(), checkpoint_id=path)
    third = from_dcp("8bit", path, weights=True)
    out["dcp int8"] = all(torch.equal(a, b) for a, b in zip(stored(again[2]), stored(third[2])))
    # saved while that load still holds the moments in fp32 (DDP's rebuild to come): fp32 on disk, the
    # same values loaded
    dcp.save(third[2].sharded_state_dict(), checkpoint_id=path + "-held")
    held = from_dcp("8bit", path + "-held", weights=True)
    out["dcp while held"] = all(torch.equal(held[2].state_dict()["state"][i][k], v)
                                for i, e in third[2].state_dict()["state"].items() for k, v in e.items())
    fp32_dcp = from_dcp("fp32", path, weights=False)  # the codes decoded with the saved scales: the values
    out["dcp int8 into fp32"] = all(torch.equal(fp32_dcp[2].state_dict()["state"][i][k], v)
                                    for i, e in sd["state"].items() for k, v in e.items())
    # and the reverse: an fp32 checkpoint (as format 2 saved every format) into an 8-bit optimizer
    dcp.save(fp32_dcp[2].sharded_state_dict(), checkpoint_id=path + "-fp32")
    fourth = from_dcp("8bit", path + "-fp32", weights=True)
    out["dcp fp32 into int8"] = all(torch.equal(a, b) for a, b in zip(stored(again[2]), stored(fourth[2])))
    bf16 = from_dcp("bf16", path, weights=False)
    out["dcp int8 into bf16"] = all(torch.equal(bf16[2].state_dict()["state"][i][k], v.bfloat16().float())
                                    for i, e in sd["state"].items() for k, v in e.items() if k != "step")
    # bf16 moments are saved as bf16: into an fp32 optimizer, exactly those values
    dcp.save(bf16[2].sharded_state_dict(), checkpoint_id=path + "-bf16")
    fifth = from_dcp("fp32", path + "-bf16", weights=False)
    out["dcp bf16 into fp32"] = all(torch.equal(fifth[2].state_dict()["state"][i][k], v)
                                    for i, e in bf16[2].state_dict()["state"].items() for k, v in e.items())
    for b in (built, fp32, again, third, held, fp32_dcp, fourth, bf16, fifth):
        b[2]._engine.close()
    return out


def test_checkpoints_in_both_forms(tmp_path):
    for out in run_ranks(_checkpoints, 2, str(tmp_path / "8bit")):
        assert all(v is True for v in out.values()), [(k, v) for k, v in out.items() if v is not True]


def _save(rank, world, case, path):
    import torch.distributed.checkpoint as dcp
    built = train(dataclasses.replace(case, steps=3), rank, world)
    dcp.save(built[2].sharded_state_dict(), checkpoint_id=path)
    out = (built[0].state_dict(), built[2].state_dict())
    built[2]._engine.close()
    return out


def _load_both_ways(rank, world, case, path, weights, canonical_sd):
    """The DCP checkpoint and the canonical dict of one run, loaded here: the same stored state."""
    import torch.distributed.checkpoint as dcp
    by_dict, by_dcp = build(case), build(case)
    for b in (by_dict, by_dcp):
        b[0].load_state_dict(weights)
    by_dict[2].load_state_dict(canonical_sd)
    target = by_dcp[2].sharded_state_dict()
    dcp.load(target, checkpoint_id=path)
    by_dcp[2].load_sharded_state_dict(target)
    same = all(torch.equal(a, b) for a, b in zip(stored(by_dict[2]), stored(by_dcp[2])))
    for b in (by_dict, by_dcp):
        b[2]._engine.close()
    return same


@pytest.mark.parametrize("case", [FormatCase(state_format="bf16"), FormatCase(state_format="8bit"), MIXED[0]],
                         ids=lambda c: c.name())
def test_dcp_loads_at_another_world_size(tmp_path, case):
    """Saved at 2 ranks, loaded at 1 and 4: what the canonical dict of the same run loads to."""
    path = str(tmp_path / "checkpoint")
    weights, sd = run_ranks(_save, 2, case, path)[0]
    for world in (1, 4):
        assert run_ranks(_load_both_ways, world, case, path, weights, sd) == [True] * world


def test_dcp_of_shard_groups_loads_flat(tmp_path):
    """8-bit moments saved at 4 ranks in shard groups of 2 (each group gathers its blocks' scales; the
    replicas write the same chunks and one ``fused_zero`` entry is kept), loaded flat at 2 ranks and at 1:
    what the canonical dict of the same run loads to."""
    path = str(tmp_path / "checkpoint")
    weights, sd = run_ranks(_save, 4, FormatCase(state_format="8bit", shard=2), path)[0]
    for world in (1, 2):
        assert run_ranks(_load_both_ways, world, FormatCase(state_format="8bit"), path, weights, sd) == [True] * world


def _mixed_checkpoint(rank, world):
    """Per param group: the canonical dict records each group's format, loads into an fp32 optimizer
    as it is, and comes back to the same codes; the groups keep their own formats through a load."""
    case = dataclasses.replace(MIXED[0], steps=3)
    built = train(case, rank, world)
    opt = built[2]
    sd = opt.state_dict()
    out = {"recorded": sd.get("fused_zero") == {"state_format": ["8bit", "bf16", "fp32"]}}
    codes = [t.clone() for t in stored(opt)]
    fp32 = build(dataclasses.replace(case, groups=(None, None, None)))
    fp32[0].load_state_dict(built[0].state_dict())
    fp32[2].load_state_dict(sd)
    back = fp32[2].state_dict()
    out["into fp32"] = all(torch.equal(back["state"][i][k], v) for i, e in sd["state"].items() for k, v in e.items())
    out["fp32 stays fp32"] = "fused_zero" not in back and all("state_format" not in g for g in back["param_groups"])
    opt.load_state_dict(back)
    out["back, the same codes"] = all(torch.equal(a, b) for a, b in zip(codes, stored(opt)))
    out["groups keep their formats"] = [g.get("state_format") for g in opt.param_groups] == ["8bit", "bf16", None]
    train(case, rank, world, built=built, start=4, steps=2)  # and it trains on as its oracle
    for b in (built, fp32):
        b[2]._engine.close()
    return out


def test_per_group_formats_through_the_canonical_dict():
    for out in run_ranks(_mixed_checkpoint, 2):
        assert all(v is True for v in out.values()), [(k, v) for k, v in out.items() if v is not True]


def _edited_then_attached(model, ddp):
    opt = fused_zero.AdamW(model.parameters())
    opt.param_groups[0]["state_format"] = "fp8"
    opt.attach(ddp)


def _refusals(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ddp = DDP(model)
    out = [raises(lambda: fused_zero.AdamW(ddp.parameters(), ddp=ddp, state_format="fp8"), ValueError, "state_format"),
           raises(lambda: fused_zero.AdamW(ddp.parameters(), ddp=ddp, master_weights="stochastic"), ValueError,
                  "master_weights='stochastic' rounds fp32 results to bf16"),
           raises(lambda: fused_zero.AdamW(ddp.parameters(), ddp=ddp, master_weights="stochastic", seed=-1),
                  ValueError, "seed"),
           # a param group's own format is checked when the group is added, before any DDP
           raises(lambda: fused_zero.AdamW([{"params": [model.weight]},
                                            {"params": [model.bias], "state_format": "int4"}]),
                  ValueError, "param group 1 sets state_format='int4': choose one of 'fp32', 'bf16', '8bit'"),
           # and again at attach: a group's key edited since
           raises(lambda: _edited_then_attached(model, ddp), ValueError,
                  "param group 0: state_format='fp8' is not one of 'fp32', 'bf16', '8bit'"),
           raises(lambda: fused_zero.AdamW([{"params": [model.weight]},
                                            {"params": [model.bias], "master_weights": "stochastic"}]),
                  ValueError, "pass master_weights=... to the optimizer")]
    return out


class Wide(torch.nn.Module):
    """About a million parameters, sizes multiples of 4: blocks of 2048 elements, as in real models."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(2048, 256)
        self.up = torch.nn.Linear(256, 1024)
        self.down = torch.nn.Linear(1024, 256)

    def forward(self, x):
        return self.emb(x) + self.down(torch.relu(self.up(self.emb(x))))


def _dcp_bytes(rank, world, path):
    import os

    import torch.distributed.checkpoint as dcp
    out = {}
    for fmt in ("fp32", "bf16", "8bit"):
        torch.manual_seed(0)
        model = Wide()
        ddp = DDP(model)
        opt = fused_zero.AdamW(ddp.parameters(), ddp=ddp, lr=1e-3, state_format=fmt, _backend="torch")
        for step in range(2):
            x = torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(step * 2 + rank))
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        where = f"{path}/{fmt}"
        peak = peak_bytes(lambda: dcp.save(opt.sharded_state_dict(), checkpoint_id=where))  # noqa: B023
        elements = 2 * sum(p.numel() for p in model.parameters())  # exp_avg and exp_avg_sq
        out[fmt] = sum(os.path.getsize(os.path.join(where, f)) for f in os.listdir(where)) / elements
        out[f"{fmt} save peak / own state"] = peak / sum(s.state_bytes() for s in opt._engine.shards())
        opt._engine.close()
    return out


def test_dcp_holds_compact_moments_as_stored(tmp_path):
    """On disk, an 8-bit moment is its codes (1 byte an element) and its blocks' first elements and
    scales (12 bytes per block of 2048), a bf16 one 2 bytes: measured over the checkpoint's files."""
    per_element = run_ranks(_dcp_bytes, 2, str(tmp_path))[0]
    print(f"\nDCP bytes per moment element, 2 ranks, 1.05M parameters: {per_element}")
    assert per_element["8bit"] <= 1.2 and per_element["bf16"] <= 2.2 and per_element["fp32"] >= 4
    # the save copies the rank's own state as stored, not decoded to fp32 (4x the 8-bit state)
    assert per_element["8bit save peak / own state"] < 2


def test_refusals():
    assert all(v.startswith("ok") for v in run_ranks(_refusals, 1)[0])


def test_the_block_table_is_the_row_tables_blocks():
    """formats.BlockTable, cached with a part's row table, gives every slot the block a row-by-row fill
    of that table gives (-1 where no row covers it), on row tables with gaps before, between and after
    the rows, ragged and split rows, rows listed out of slot order, and none; and its host rows are the
    table's. Overlapping rows are refused where the table is built."""
    cases = [([(3, 5000, 1, 7, 0, 0), (5010, 70, 5001, 5001, 1, 0), (6001, 300, 6000, 6000, 2, 9)], 6400),
             ([(0, 4096, 0, 0, 0, 0), (4096, 1, 4096, 4096, 1, 0)], 4097),  # back to back, no gap at all
             ([(700, 33, 0, 0, 1, 0), (64, 600, 40, 40, 0, 5)], 800),  # out of slot order
             ([], 96)]
    for pieces, size in cases:
        table = row_table(pieces)
        fill = torch.full((size,), -1, dtype=torch.int64, device="cpu")
        for so, n, block in table[:, [0, 1, 7]].tolist():
            fill[so:so + n] = block
        blocks = BlockTable(table, size, torch.device("cpu"))
        assert torch.equal(blocks.slots(), fill), (pieces, (blocks.slots() != fill).nonzero()[:4].tolist())
        assert blocks.slots() is blocks.slots() and blocks.count == table.shape[0]
        assert blocks.rows == [tuple(r) for r in table[:, [0, 1, 2, 3, 4, 5, 7]].tolist()]
    raises(lambda: BlockTable(row_table([(0, 100, 0, 0, 0), (90, 20, 100, 100, 1)]), 200, torch.device("cpu")),
           ValueError, "rows overlap or reach past the 200 slots")
    raises(lambda: BlockTable(row_table([(0, 100, 0, 0, 0)]), 99, torch.device("cpu")), ValueError, "99 slots")


def _recipe(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """kernels/codecs.py's encode8 transcribed with torch.where, as the CPU path wrote it before."""
    bits = y.view(torch.int32)
    mag = bits & 0x7FFFFFFF
    r = mag + 0x7FFFF + ((mag >> 20) & 1)
    e = (r >> 23) - (112 if signed else 96)
    if signed:
        code = torch.where(e >= 1, (e << 3) | ((r >> 20) & 7), 0)
        code = torch.where(code != 0, code | (((bits >> 31) & 1) << 7), 0)
    else:
        code = torch.where(e >= 1, (e << 3) | ((r >> 20) & 7), torch.where(mag != 0, 8, 0))
    return code.to(torch.uint8)


def test_the_cpu_codec_is_the_kernels_recipe():
    """The CPU path's 8-bit codec (algorithms/codecs.py, written without ``where`` for speed) gives the
    kernels' recipe's codes for every kind of fp32 bit pattern (a stride through all 2^32, NaN, inf,
    subnormals, both zeros), its decode table the definition's value of each code, and its blocks
    the masked ``where(s > 0, x / s, 0)`` of the kernels, blocks of zeros, NaN and inf included."""
    g = torch.Generator().manual_seed(0)
    patterns = torch.cat([torch.arange(-2**31, 2**31, 4093, dtype=torch.int64, device="cpu"),
                          torch.randint(-2**31, 2**31, (2**18,), generator=g, dtype=torch.int64)]).to(torch.int32)
    y = torch.cat([patterns.view(torch.float32),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, math.inf, -math.inf, math.nan, 1e-45, 2.0**-17],
                                dtype=torch.float32, device="cpu")])
    codes = torch.arange(256, dtype=torch.uint8, device="cpu")
    for signed in (True, False):
        wrong = (encode8(y, signed) != _recipe(y, signed)).nonzero()[:3].view(-1)
        assert not len(wrong), (signed, y[wrong].tolist())
        assert torch.equal(decode_table(signed).view(torch.int32), decode8(codes, signed).view(torch.int32))
    local = torch.randint(24, (6000,), generator=g, dtype=torch.int64)
    x = torch.randn(6000, generator=g, dtype=torch.float32)
    for block, value in ((0, 0.0), (1, -0.0), (2, 1e-42), (3, math.nan), (4, math.inf), (5, -math.inf)):
        x[(local == block).nonzero()[:None if block < 3 else 1]] = value
    s = torch.zeros(24, dtype=torch.float32, device="cpu").scatter_reduce_(0, local, x.abs(), "amax")
    per = s[local]
    for signed in (True, False):
        mine, scales = encode_blocks(x, local, 24, signed)
        assert torch.equal(scales.view(torch.int32), s.view(torch.int32))
        assert torch.equal(mine, _recipe(torch.where(per > 0, x / torch.where(per > 0, per, 1.0), 0.0), signed))
