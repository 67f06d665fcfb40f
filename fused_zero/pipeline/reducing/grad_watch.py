"""Notices a user's change to ``param.grad`` between the backward and ``step()``.

nanoGPT-style loops call ``torch.nn.utils.clip_grad_norm_`` (or ``scaler.unscale_``) there. Most
fused_zero modes cannot honor that: the update already ran in the backward, or it reads its own
reduced slices, not ``param.grad``. Silently ignoring the clip would change training, so ``step()``
compares every gradient with what it was once DDP had finished the backward: the same tensor, at the
same version counter (every in-place op bumps it; gradient views of one DDP bucket share their
bucket's counter). That costs a host loop over the parameters and no pass over memory.

"Once DDP has finished" is later than our last comm hook: with ``gradient_as_bucket_view=False`` DDP
copies the buckets into ``param.grad`` in its own end-of-backward callback, queued after our last
hook. The hook therefore queues a callback that queues the recording one: autograd runs callbacks
queued while its callbacks run at the end of the same list, after DDP's.

Every gradient view of one DDP bucket shares the bucket's version counter, so another optimizer over the
module zeroing its own gradients in place moves the counter of this one's too: fused_zero's optimizers say
so (``excuse``, from their ``zero_grad``). A torch.optim optimizer over parameters in the same buckets
cannot: its ``zero_grad(set_to_none=False)`` before a fused_zero optimizer's ``step()`` reads as an edit
(torch's default, ``set_to_none=True``, replaces the tensor and moves no counter).
"""

from __future__ import annotations

import torch


def _queue(fn) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class GradWatch:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.seen: list | None = None

    def arm(self) -> None:
        """From the comm hook of the backward's last bucket: record the gradients after DDP is done."""
        self.seen = None
        _queue(lambda: _queue(self._record))

    def _record(self) -> None:
        self.seen = [(g, g._version) if (g := p.grad) is not None else None for p in self.params]

    def record_again(self) -> None:
        """DDP wrote the reduced gradients back later than its callback (``ddp.finalize_backward()``,
        pipeline/reducing/hooks.py ``FinalizeWatch``): what it wrote is the backward's, not an edit. Before the
        recording callback has run, nothing to do: it records after this."""
        if self.seen is not None:
            self._record()

    def edited(self, pids) -> list[int]:
        """Which of the parameters ``pids`` (indices) had their ``.grad`` changed since it was recorded:
        each optimizer over the module asks for its own at its ``step()``, before its ``zero_grad()``
        (which another optimizer's later ``step()`` must not take for an edit)."""
        if self.seen is None:
            return []
        out = []
        for i in pids:
            p, rec = self.params[i], self.seen[i]
            g = p.grad
            if rec is None:
                if g is not None:
                    out.append(i)
            elif g is not rec[0] or g._version != rec[1]:
                out.append(i)
        return out

    def versions(self) -> list[int | None]:
        """Every recorded gradient's version counter now (None where none is recorded, or ``.grad`` is another
        tensor): what ``excuse`` compares."""
        if self.seen is None:
            return []
        return [rec[1] if rec is not None and p.grad is rec[0] and (rec[1] == p.grad._version) else None
                for p, rec in zip(self.params, self.seen)]

    def excuse(self, before: list[int | None], zeroed) -> None:
        """Another optimizer over the module zeroed its own gradients in place (``zero_grad(set_to_none=
        False)``): gradient views of one DDP bucket share its version counter, so that moved the counter of
        every gradient of its buckets. Record the new version of each gradient of the other members that
        was unedited just before (``before``, from ``versions``); one edited before stays edited. ``zeroed``:
        the indices of the zeroing optimizer's own parameters, whose records stay as they were."""
        if self.seen is None or not before:
            return
        own = {int(i) for i in zeroed}
        for i, (p, rec, version) in enumerate(zip(self.params, self.seen, before)):
            if version is not None and i not in own and p.grad is rec[0]:
                self.seen[i] = (rec[0], rec[0]._version)

    def clear(self) -> None:
        self.seen = None
