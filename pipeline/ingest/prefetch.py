"""Host-to-device copies that overlap the step: each batch is copied one step ahead on a side CUDA stream.

Ray Data's own device transfer (``iter_torch_batches(device=...)``) copies on the fetching thread's current
stream, the default stream, which runs in order with the step's kernels: the copy and the compute take
turns. Here the collate step's pinned (page-locked) host tensors are copied with ``non_blocking=True`` on a
stream of their own, issued right after the previous step was queued, and the step's stream waits for
the copy's stream on the device (``wait_stream``: no host wait). On a CPU device batches pass through.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
    }


def device_batches(batches: Iterable[Mapping[str, Any]], device: torch.device) -> Iterator[dict[str, Any]]:
    """``batches`` on ``device``; on CUDA, batch k+1's copy is in flight while step k runs.

    The generator resumes when the caller asks for the next batch, i.e. after it queued the step on the
    current one: that is when the copy of the following batch starts, and while the device works on the
    step the host fetches the batch after that.
    """
    it = iter(batches)
    if device.type != "cuda":
        yield from (dict(b) for b in it)
        return
    copy_stream = torch.cuda.Stream(device)
    host = next(it, None)
    while host is not None:
        with torch.cuda.stream(copy_stream):
            ready = to_device(host, device)
        host = next(it, None)  # fetched while the device runs the previous step and this copy
        compute = torch.cuda.current_stream(device)
        compute.wait_stream(copy_stream)
        for v in ready.values():
            if isinstance(v, torch.Tensor):
                v.record_stream(compute)  # the allocator must not reuse it before the step is done with it
        yield ready
