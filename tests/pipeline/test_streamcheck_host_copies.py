"""The checker's pageable-host-memory rule and the copies to the host: a blocking copy from the device
into pageable memory is one CUDA makes (the checkpoint server's reads, checkpoint/serving.py, each
waited for by its thread), so it is not reported; a non-blocking one into pageable memory is (CUDA makes
it synchronous, or the buffer is read before the copy lands: streams.py's downloads go to pinned memory).
The server's case runs in a thread of its own on its own stream, as in serving.py."""

import threading

import torch

from fused_zero.streamcheck import StreamChecker
from fused_zero.streamcheck.clocks import HOST_READ
from fused_zero.streamcheck.device import ModeledStreams

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
