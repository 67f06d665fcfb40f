"""Muon across W ranks, as fused_zero.Muon runs it (docs/design-optimizers.md, "Muon, sharded"), for
real model shapes on the meta device: each hidden matrix's Newton-Schulz (NS) runs once per step, on one
owner rank, and the momentum stays on the ranks' element slices. What a rank computes and sends per
step, against DDP + torch.optim.Muon (every rank runs every matrix's NS) and against ZeRO-1 AdamW's
collectives for the same parameters:

    python bench/muon_scale_model.py                 # the markdown tables of docs/performance-scale.md
    python bench/muon_scale_model.py --json out.json # the same numbers, every field

**Matrices.** Muon's: the 2-D parameters of the blocks (attention and MLP weights); embeddings, the
head, norms and biases stay with AdamW (torch's Muon documentation, KellerJordan/Muon). Buckets:
DDP's (scale_model.py's ``ddp_bucket_params``, 25 MiB); a rank's slice of a bucket is its even share
(``ceil(n / W)`` elements: the slice layout without its alignment and tail, which move a few elements).

**NS work** of an ``m x n`` matrix (``m <= n``, torch transposes tall ones): per iteration ``X X^T``
(``2 m^2 n`` FLOPs), ``b G + c G G`` (``2 m^3``) and ``a X + (..) X`` (``2 m^2 n``), times ``ns_steps``
= 5. **Owners**: fused_zero's own assignment (pipeline/updating/whole_matrix.owners), longest-processing-time
first: matrices by NS work, largest first, each to the rank with the least work so far; every rank
computes the same assignment (ties to the lowest rank).

**Bytes per rank and step** (one direction, bf16: 2 bytes an element; NS starts with ``bfloat16()``
and returns bf16, so both transfers are exact): the nesterov update ``u`` of each matrix's elements in a
rank's slices goes to the matrix's owner, and the NS result comes back to the slices, one
``all_to_all`` each: a rank sends the elements of its slices whose matrix it does not own, and receives
the rest of the matrices it owns, then the reverse. ZeRO-1's for the same elements: a ring
reduce-scatter and all-gather, ``2 (W - 1) / W`` of the matrices' bf16 bytes.
"""

from __future__ import annotations

import math

import numpy as np
from scale_model import WORLDS, _gb, build, ddp_bucket_params, run

from fused_zero.algorithms import muon
from fused_zero.pipeline.updating.whole_matrix import owners  # the assignment fused_zero.Muon makes

NS_STEPS = 5
ELEMENT_BYTES = 2  # bf16: u to the owner, the NS result back


def ns_flops(shape: tuple[int, int]) -> float:
    return muon.ns_flops(shape, NS_STEPS)


def muon_params(model) -> set[int]:
    """ids of the parameters Muon takes: 2-D weights of the blocks."""
    return {id(p) for name, p in model.named_parameters() if p.dim() == 2 and name.startswith("blocks.")}


def matrices(model) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]], list[int]]:
    """``(bucket, offset, numel)`` and the shape of every Muon matrix, and every bucket's numel, in
    DDP's buckets after its rebuild."""
    mine = muon_params(model)
    out, shapes, sizes = [], [], []
    for b, bucket in enumerate(ddp_bucket_params(model)):
        offset = 0
        for p in bucket:
            if id(p) in mine:
                out.append((b, offset, p.numel()))
                shapes.append(tuple(p.shape))
            offset += p.numel()
        sizes.append(offset)
    return out, shapes, sizes


def row(name: str, world: int) -> dict:
    mats, shapes, sizes = matrices(build(name))
    costs = [ns_flops(s) for s in shapes]
    own = owners(shapes, world)
    work = np.zeros(world)
    for i, r in enumerate(own):
        work[r] += costs[i]
    chunk = [math.ceil(n / world) for n in sizes]
    # elements of Muon matrices in each rank's slices, and each owner's share of its own matrices
    in_slices = np.zeros(world)
    owner_piece = np.zeros(len(mats))
    for i, (b, off, n) in enumerate(mats):
        c = chunk[b]
        first, last = off // c, (off + n - 1) // c
        ranks = np.arange(first, min(last, world - 1) + 1)
        lo = np.maximum(ranks * c, off)
        hi = np.minimum((ranks + 1) * c, off + n)
        np.add.at(in_slices, ranks, hi - lo)
        r = own[i]
        owner_piece[i] = max(0, min((r + 1) * c, off + n) - max(r * c, off))
    owned = np.zeros(world)
    owned_piece = np.zeros(world)
    for i, (_, _, n) in enumerate(mats):
        owned[own[i]] += n
        owned_piece[own[i]] += owner_piece[i]
    send = in_slices - owned_piece  # my slices' elements of matrices others own
    recv = owned - owned_piece  # the rest of the matrices I own
    extra = (send + recv) * ELEMENT_BYTES  # u out and in, then the result back: each direction
    elements = sum(n for _, _, n in mats)
    zero1 = 2 * (world - 1) / world * elements * ELEMENT_BYTES
    total = sum(costs)
    return dict(model=name, world=world, matrices=len(mats), muon_elements=elements,
                ns_flops_every_rank=total, ns_flops_max=float(work.max()), ns_flops_mean=total / world,
                balance=float(work.max() / (total / world)), largest_matrix_flops=max(costs),
                busy_ranks=int((work > 0).sum()), zero1_bytes=zero1, extra_bytes_max=float(extra.max()),
                extra_bytes_mean=float(extra.mean()), momentum_bytes=4 * elements / world)


def rows() -> list[dict]:
    return [row(name, world) for name in ("GPT-2 small", "Llama 7B") for world in WORLDS]


def markdown(table: list[dict]) -> str:
    lines = []
    for name in dict.fromkeys(r["model"] for r in table):
        mine = [r for r in table if r["model"] == name]
        lines += [f"**{name}** ({mine[0]['matrices']} Muon matrices, {mine[0]['muon_elements'] / 1e6:.4g}M "
                  "elements)", "",
                  "| W | NS GFLOP / rank: DDP + torch.optim.Muon | fused_zero: max (mean) | balance max/mean "
                  "| ranks with NS work | ZeRO-1 bytes / rank | Muon's extra bytes / rank: max (mean) "
                  "| momentum / rank |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in mine:
            lines.append(
                f"| {r['world']} | {r['ns_flops_every_rank'] / 1e9:.4g} | {r['ns_flops_max'] / 1e9:.4g} "
                f"({r['ns_flops_mean'] / 1e9:.3g}) | {r['balance']:.2f} | {r['busy_ranks']} | "
                f"{_gb(r['zero1_bytes'])} | {_gb(r['extra_bytes_max'])} ({_gb(r['extra_bytes_mean'])}) | "
                f"{_gb(r['momentum_bytes'])} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    run(__doc__, rows(), markdown, argv)


if __name__ == "__main__":
    main()
