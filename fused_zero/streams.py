"""Where the updates run: a side CUDA stream, or inline on the CPU.

On CUDA the updates and the all-gathers are queued on one side stream per optimizer, so the backward's
own stream never waits for communication; the side stream waits for each reduction's Work (a stream
wait, never a host wait). On the CPU every wait blocks the host and the updates run inline.
"""

from __future__ import annotations

import contextlib

import torch


class SideStream:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def run(self, follow_current: bool):
        """Context in which the updates are queued. ``follow_current`` orders the side stream after all
        work queued so far, needed when no collective orders it after the gradients (one rank)."""
        if self.stream is None:
            return contextlib.nullcontext()
        if follow_current:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def join(self) -> None:
        """Order the current stream after everything queued on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def upload(self, table: torch.Tensor) -> torch.Tensor:
        """A host table on the update's device, copied on the side stream (which reads it first)."""
        if self.stream is None:
            return table
        with self.run(follow_current=False):
            return table.pin_memory().to(self.device, non_blocking=True)
