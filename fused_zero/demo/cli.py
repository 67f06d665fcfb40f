"""The ``fused-zero`` console script."""

from __future__ import annotations

import argparse
import sys

import torch

import fused_zero


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fused-zero", description=__doc__)
    parser.add_argument("--version", action="version", version=f"fused-zero {fused_zero.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small GPT with torch.optim and fused_zero side by side")
    default_world = torch.cuda.device_count() if torch.cuda.is_available() else 2
    demo.add_argument("--world-size", type=int, default=default_world,
                      help="ranks to spawn (default: one per GPU, else 2 CPU ranks on gloo)")
    demo.add_argument("--steps", type=int, default=150,
                      help="training steps of each optimizer (default: 150)")
    demo.add_argument("--optimizer", type=_optimizer_name, choices=OPTIMIZERS, default="AdamW",
                      help="the torch.optim algorithm and its fused_zero twin, any case (default: AdamW; SGD "
                           "with momentum 0.9; Muon: Muon at lr 0.02 for the blocks' matrices beside AdamW "
                           "for the rest, two optimizers over one DDP module)")
    demo.add_argument("--overlap", choices=["bucket", "backward", "step"], default="bucket",
                      help="when fused_zero's updates run: each bucket as it is reduced, once the backward's "
                           "last bucket is reduced, or in step() (default: bucket)")
    demo.add_argument("--grad-reduce", choices=["reduce_scatter", "all_reduce"], default="reduce_scatter",
                      help="ZeRO-2 (each rank receives its slice) or ZeRO-1 traffic (default: reduce_scatter)")
    demo.add_argument("--bucket-cap-mb", type=float, default=0.1,
                      help="DDP bucket size; small so that the small model spans several buckets")
    demo.add_argument("--lr", type=float, default=3e-3, help="learning rate of both optimizers (default: 3e-3)")
    demo.add_argument("--batch-size", type=int, default=16,
                      help="sequences of 64 characters per rank and step (default: 16)")
    demo.add_argument("--seed", type=int, default=0,
                      help="seed of the models' initialization and of the batches (default: 0)")
    demo.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto",
                      help="update implementation (auto: Triton on CUDA, torch's ops on CPU)")
    demo.add_argument("--profile", metavar="DIR", default=None,
                      help="write a torch.profiler trace of rank 0 (steps 4-6) to DIR; its path is printed")
    sub.add_parser("options", help="print fused_zero's optimizers and their keyword-only options as markdown tables")
    return parser


OPTIMIZERS = ["AdamW", "Adam", "SGD", "Muon"]


def _optimizer_name(name: str) -> str:
    """``muon`` as ``Muon``: the class names, in any case."""
    return next((o for o in OPTIMIZERS if o.lower() == name.lower()), name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "options":
        from ..optimizer.twins import optimizer_table
        from ..options import option_table

        print(optimizer_table())
        print()
        print(option_table())
        return 0
    from .run import DemoConfig, run

    cfg = DemoConfig(world_size=args.world_size, steps=args.steps, optimizer=args.optimizer,
                     overlap=args.overlap, grad_reduce=args.grad_reduce, bucket_cap_mb=args.bucket_cap_mb,
                     lr=args.lr, batch_size=args.batch_size, seed=args.seed, backend=args.backend,
                     profile_dir=args.profile)
    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
