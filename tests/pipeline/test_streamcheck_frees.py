"""The stream-order checker's free rule covers communication streams: since torch 2.8 a tensor handed to
a collective is no longer ``record_stream``ed on the process group's stream (TORCH_NCCL_AVOID_RECORD_STREAMS
became the default), so a buffer freed into its allocating stream's pool before that stream is ordered
after the collective (a Work's wait) may be handed out again while NCCL still reads or writes it. The
matrix in test_stream_order.py runs with the rule on and reports zero: no engine buffer relies on the
exemption the checker used to make."""

import torch

from fused_zero.streamcheck import StreamChecker


def _freed_after_a_collective(wait: bool) -> list:
    with StreamChecker() as checker:
        comm = checker._comm_stream(None)
        t = torch.ones(4, dtype=torch.float32, device=torch.device("cpu"))  # "device" memory, on compute
        checker.record("collectives.all_reduce", reads=[t], writes=[t], sid=comm)
        if wait:  # what Work.wait() does on NCCL: the waiting stream follows the collective
            checker.clocks.merge(checker.compute, checker.clocks.snapshot(comm))
        del t
    return [h for h in checker.hazards() if h.kind == "freed while in use"]


def test_a_buffer_freed_while_its_collective_runs_is_named():
    found = _freed_after_a_collective(wait=False)
    assert found and found[0].streams == ("communication stream 0", "compute stream"), found


def test_a_buffer_freed_after_its_wait_is_not():
    assert _freed_after_a_collective(wait=True) == []
