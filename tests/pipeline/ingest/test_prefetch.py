"""Host-to-device batches: the same batches in order; on CUDA, copied one step ahead on a side stream."""

from __future__ import annotations

import pytest
import torch

from pipeline.ingest.prefetch import device_batches


def _source(n: int, taken: list[int]):
    for i in range(n):
        taken.append(i)
        yield {"images": torch.full((2, 4, 4, 3), i, dtype=torch.uint8), "tokens": torch.tensor([[i, 1]])}


def test_cpu_batches_pass_through_in_order_and_lazily() -> None:
    taken: list[int] = []
    it = device_batches(_source(3, taken), torch.device("cpu"))
    assert taken == []  # nothing is read before the loop asks
    first = next(it)
    assert taken == [0] and int(first["tokens"][0, 0]) == 0
    assert [int(b["tokens"][0, 0]) for b in it] == [1, 2]


@pytest.mark.gpu
def test_cuda_batches_are_copied_one_ahead_and_equal_the_host_ones() -> None:
    taken: list[int] = []
    device = torch.device("cuda")
    it = device_batches((dict(b, images=b["images"].pin_memory()) for b in _source(4, taken)), device)
    first = next(it)
    assert taken == [0, 1]  # the next batch was fetched (and its copy is issued on resume)
    assert first["images"].is_cuda and int(first["images"].float().mean()) == 0
    rest = list(it)
    assert [int(b["tokens"][0, 0]) for b in rest] == [1, 2, 3] and all(b["tokens"].is_cuda for b in rest)
