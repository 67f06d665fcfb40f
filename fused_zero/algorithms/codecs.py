"""The state formats of kernels/codecs.py on the host and the CPU path, with torch's own ops: the same
integer recipes, so the CPU path computes the kernels' bits, and a state moved (resharding) or loaded
(checkpoints) is encoded exactly as an update would encode it.

A *region* here is a shard's state tensor of one moment (region-shaped: one slot per element) in its
storage dtype, with, for 8-bit moments, one fp32 scale per row of the shard's kernel table (a block:
``kernels.row_table``). ``values`` decodes a whole region to fp32, ``store_values`` encodes one.
"""

from __future__ import annotations

import torch

FORMATS = ("fp32", "bf16", "8bit")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}
SIGNED = {"exp_avg": True, "momentum_buffer": True, "exp_avg_sq": False, "max_exp_avg_sq": False}
"""Which moments take the signed 8-bit code (the others are never negative)."""


def decode8(code: torch.Tensor, signed: bool) -> torch.Tensor:
    c = code.to(torch.int32)
    if signed:
        e = (c >> 3) & 15
        bits = torch.where(e == 0, 0, ((e + 112) << 23) | ((c & 7) << 20))
    else:
        e = c >> 3
        bits = torch.where(e == 0, 0, ((e + 96) << 23) | ((c & 7) << 20))
    value = bits.to(torch.int32).view(torch.float32)
    return torch.where((c >> 7) == 1, -value, value) if signed else value  # negation: the sign bit


_DECODE_TABLES = {signed: decode8(torch.arange(256, dtype=torch.uint8, device="cpu"), signed)
                  for signed in (True, False)}


def decode_table(signed: bool) -> torch.Tensor:
    """``decode8`` of every code, a host fp32 table of 256: the CPU update decodes by ``index_select``
    into it, one pass instead of decode8's dozen (its values are decode8's, bit for bit)."""
    return _DECODE_TABLES[signed]


def decode(code: torch.Tensor, signed: bool) -> torch.Tensor:
    """``decode8``'s values of codes (uint8, or their values in another dtype): looked up in
    ``decode_table`` on the CPU, computed by decode8's formula on an accelerator (where its elementwise
    passes are cheap and the lookup would first copy the table there)."""
    if code.device.type == "cpu":
        return decode_table(signed).index_select(0, code.to(torch.int32).reshape(-1)).view(code.shape)
    return decode8(code.to(torch.uint8), signed)


def encode8(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """The kernels' recipe (kernels/codecs.py), each ``where`` written as a mask of sign bits and
    every op after the first few in place: the same codes for every bit pattern of ``y`` (NaN and
    overflow included), without ``where`` (about 20 ns an element on this CPU build) or a fresh
    temporary per op. ``e`` lies within
    [-368, 143], so ``-e >> 31`` is -1 exactly where ``e >= 1``."""
    bits = y.contiguous().view(torch.int32)
    mag = bits & 0x7FFFFFFF
    r = (mag >> 20).bitwise_and_(1).add_(mag).add_(0x7FFFF)  # round to 3 bits, ties to even
    low = (r >> 20).bitwise_and_(7)
    e = r.__irshift__(23).sub_(112 if signed else 96)
    normal = e.neg().__irshift__(31)  # -1 where e >= 1
    code = e.__ilshift__(3).bitwise_or_(low).bitwise_and_(normal)  # 0 where e < 1
    if signed:  # the sign bit where the code is not 0
        code.bitwise_or_((bits >> 31).bitwise_and_(128).bitwise_and_(code.neg().__irshift__(31)))
    else:  # 8 (the smallest code) where e < 1 but y is not 0
        code.bitwise_or_(mag.neg_().__irshift__(31).bitwise_and_(8).bitwise_and_(normal.bitwise_not_()))
    return code.to(torch.uint8)


def encode_blocks(x: torch.Tensor, local: torch.Tensor, k: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks encoded as the kernels' ``store_moment`` encodes one (``local``: each element's block,
    0..k-1): every block's scale is its largest magnitude, its codes each element over that scale;
    a block whose scale is 0 or NaN gets +0.0 there (the kernels' ``where(s > 0, x / s, 0.0)``, made by
    masking the quotient's bits per block: no per-element compare or ``where``)."""
    s = torch.zeros(k, dtype=torch.float32, device=x.device).scatter_reduce_(0, local, x.abs(), "amax")
    ok = s > 0
    y = x / torch.where(ok, s, 1.0).index_select(0, local)
    y.view(torch.int32).bitwise_and_(ok.to(torch.int32).neg_().index_select(0, local))
    return encode8(y, signed), s


def round_stochastic(p: torch.Tensor, key: int, elem: torch.Tensor) -> torch.Tensor:
    """bf16 by stochastic rounding (kernels/codecs.py), ``elem`` each element's index in its parameter."""
    h = _mix32(key ^ ((elem * 0x9E3779B9) & 0xFFFFFFFF))
    bits = p.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    out = ((bits + (h >> 16)) >> 16).to(torch.int32).to(torch.int16)
    return torch.where(p != p, torch.full_like(out, 0x7FC0), out).view(torch.bfloat16)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


# ---------------------------------------------------------------------- whole regions


class BlockTable:
    """The 8-bit blocks of one row table (``kernels.row_table``: a block per row), derived once with
    the table and kept beside it (a shard's Part, an arena's Launch). A new layout builds new tables, so
    it is never stale. Everything a step or a store used to rebuild from the table: the CPU update's
    host rows, and each slot's block, made on the state's device from a per-block table (one op, no
    host tensor read there, no Python loop over the rows). Measured (docs/performance-compact-state.md): a store of
    a 905k-slot region 39-46 -> 28 ms; the CPU step's int8/fp32 ratio barely moved (10.2 against
    9.8-12.9), the codec's ``where`` was the cost (now 4.8-5.4 without it).

    Attributes:
        rows: the table's rows as host tuples ``(shard_off, length, param_off, grad_off, pid, elem,
            block)``, in table order (block ``i`` is row ``i``): what the CPU update merges into runs.
        count: blocks, the length of an 8-bit moment's scales.
        size: slots of the state the table indexes.
    """

    def __init__(self, table: torch.Tensor, size: int, device: torch.device, upload=None):
        """``upload``: how a host table reaches the device without a wait (as ``Segments.build``)."""
        self.rows = [tuple(r) for r in table[:, [0, 1, 2, 3, 4, 5, 7]].tolist()]
        self.count, self.size, self.device = table.shape[0], size, torch.device(device)
        order = torch.argsort(table[:, 0], stable=True)
        start, length, block = (table[order, c] for c in (0, 1, 7))
        end = start + length
        gap = start - torch.cat([torch.zeros(1, dtype=torch.int64, device="cpu"), end[:-1]])
        if bool((gap < 0).any()) or (self.count and int(end[-1]) > size):
            raise ValueError(f"rows overlap or reach past the {size} slots of their state; rebuild the table")
        # segments covering every slot in order: the gap before each row (block -1), the row, the tail
        tail = size - (int(end[-1]) if self.count else 0)
        host = torch.stack([torch.cat([torch.stack([torch.full_like(block, -1), block], 1).reshape(-1),
                                       torch.tensor([-1], dtype=torch.int64, device="cpu")]),
                            torch.cat([torch.stack([gap, length], 1).reshape(-1),
                                       torch.tensor([tail], dtype=torch.int64, device="cpu")])])
        self._segments = upload(host) if upload is not None else \
            torch.tensor(host.tolist(), dtype=torch.int64, device=self.device)
        # kept on the host, made here with the table rather than at the first call: a lazy cache is
        # filled by whichever thread asks first, the checkpoint server's as well as the training loop's
        self._slots = self._expand() if self.device.type == "cpu" else None

    def slots(self) -> torch.Tensor:
        """Each state slot's block, -1 where no row covers it (int64, on the table's device). Kept on
        the host, where the CPU update reads it every step (8 bytes per slot of host memory); made anew
        per call on an accelerator, where it is only read by loads and reshards and would cost 4x the
        device memory of a pair of 8-bit moments."""
        return self._slots if self._slots is not None else self._expand()

    def _expand(self) -> torch.Tensor:
        return torch.repeat_interleave(self._segments[0], self._segments[1], output_size=self.size)


def values(t: torch.Tensor, scale: torch.Tensor | None, blocks: BlockTable | None, name: str) -> torch.Tensor:
    """A region decoded to fp32 (slots no row covers: 0). Without boolean indexing, whose output size
    the host would wait for on CUDA."""
    if t.dtype == torch.float32:
        return t
    if t.dtype == torch.bfloat16:
        return t.float()
    if not scale.numel():
        return torch.zeros(t.numel(), dtype=torch.float32, device=t.device)
    block = blocks.slots()
    return torch.where(block >= 0, decode(t, SIGNED[name]) * scale.index_select(0, block.clamp(min=0)), 0.0)


def store_values(t: torch.Tensor, scale: torch.Tensor | None, blocks: BlockTable | None, name: str,
                 x: torch.Tensor) -> None:
    """Encode fp32 ``x`` (region-shaped, on the region's device) into the region, block by block for
    8-bit moments; slots no row covers keep their codes. A block's scale is the largest magnitude among
    its own slots: the uncovered slots, zeroed, count towards block 0 and change no maximum."""
    if t.dtype != torch.uint8:
        t.copy_(x)
        return
    if not scale.numel():
        return
    block = blocks.slots()
    covered = block >= 0
    codes, s = encode_blocks(torch.where(covered, x, 0.0), block.clamp(min=0), scale.numel(), SIGNED[name])
    t.copy_(torch.where(covered, codes, t))
    scale.copy_(s)
