"""The checker's pageable-host-memory rule in the checkpoint server's thread (checkpoint/serving/peers.py: a
thread of its own, its own stream; modeled here the same way). A blocking copy from the device into
pageable memory is one CUDA makes (the server's reads, each waited for by its thread), so it is not
reported; a non-blocking one into pageable memory is (CUDA makes it synchronous, or the buffer is read
before the copy lands: streams.py's downloads go to pinned memory). The server's host work on host
tables (algorithms/codecs.py's 8-bit block numbers) is ordered with its stream, but is no device
operation: not reported either."""

import threading

import torch

from fused_zero.testing.streamcheck import StreamChecker
from fused_zero.testing.streamcheck.clocks import HOST_READ
from fused_zero.testing.streamcheck.device import ModeledStreams

CPU = torch.device("cpu")


def _host_reads(copy) -> list:
    with StreamChecker() as checker:
        api = ModeledStreams(checker, CPU)
        stream = api.copy_stream()
        value = torch.ones(4, dtype=torch.float32, device=CPU)  # device memory, on the compute stream

        def serve():
            with api.use(stream):
                copy(api, value)

        server = threading.Thread(target=serve)
        server.start()
        server.join()
    return [h for h in checker.hazards() if h.kind == HOST_READ]


def test_a_blocking_copy_into_pageable_memory_is_not_reported():
    assert _host_reads(lambda api, t: api.to_host_blocking(t)) == []


def test_a_non_blocking_copy_into_pageable_memory_is():
    found = _host_reads(lambda api, t: api.to_host(t, torch.empty(4, dtype=torch.float32)))
    assert found and "copy device->host (non_blocking)" in str(found[0]), found


def test_the_servers_host_work_on_pageable_memory_is_not_reported():
    def host_work(api, t):
        table = torch.zeros(2, 8, dtype=torch.int64)  # a host table, as formats._blocks reads
        return table[:, [0, 1, 7]].tolist()
    assert _host_reads(host_work) == []
