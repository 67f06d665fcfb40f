"""The stream-order checker's free rule covers communication streams: since torch 2.8 a tensor handed to
a collective is no longer ``record_stream``ed on the process group's stream (TORCH_NCCL_AVOID_RECORD_STREAMS
became the default), so a buffer freed into its allocating stream's pool before that stream is ordered
after the collective (a Work's wait) may be handed out again while NCCL still reads or writes it. The
matrix in test_stream_order.py runs with the rule on and reports zero: no engine buffer relies on the
exemption the checker used to make. And a buffer two threads read (the checkpoint server's and the
training loop's) belongs to the thread that made it, whichever reads it first."""

import torch

from fused_zero.testing.streamcheck import StreamChecker


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


def _block_index_read_by_the_server_first() -> list:
    """A CPU BlockTable (the checker's device memory) built by the training thread; the checkpoint
    server's thread reads its slot index first, on its own stream, into a host copy it waits for; the
    training thread's next collective orders it after what the server read (``served``), then it reads
    the index too; then the table goes."""
    import threading

    from fused_zero.algorithms.codecs import BlockTable
    from fused_zero.kernels import row_table
    from fused_zero.testing.streamcheck.device import ModeledStreams

    with StreamChecker() as checker:
        streams = ModeledStreams(checker, torch.device("cpu"))
        server = streams.copy_stream()
        tables = [BlockTable(row_table([(0, 40, 0, 0, 0, 0), (48, 16, 40, 40, 1, 0)]), 64, torch.device("cpu"))]

        def serve():
            with streams.use(server):
                streams.to_host_blocking(tables[0].slots().clamp(min=0))
        thread = threading.Thread(target=serve)
        thread.start()
        thread.join()
        checker.clocks.merge(checker.compute, checker.served)  # a Work's wait, as ModeledWork.wait makes it
        tables[0].slots().clamp(min=0)
        tables.clear()
    return [str(h) for h in checker.hazards() if h.kind == "freed while in use"]


def test_the_cpu_block_index_belongs_to_the_thread_that_built_its_table():
    """codecs.BlockTable's slot index on a CPU device is made with the table, by the thread laying the
    state out: cached at its first call instead, it belonged, in the checker's model, to whichever thread
    asked first, and a checkpoint server asking first made the training thread's reads look like uses of
    the server stream's memory (the 8-bit configurations' intermittent "freed while in use")."""
    assert _block_index_read_by_the_server_first() == []
