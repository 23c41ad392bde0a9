"""The one place a step's Python lists become device tensors.

Every per-step input (token ids, positions, attention metadata, the sampler's batch) is
built by `ModelRunner._prepare` through `to_device`, so the host-to-device traffic of a
step has one shape: on CUDA a pinned host buffer and an asynchronous copy (the CPU goes on
preparing while the copy runs, and no sync is forced before the forward), elsewhere a plain
tensor made on the device. Keeping it in one place is also what a CUDA-graph capture of the
decode step needs: fixed input buffers can then be filled here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def to_device(values: Iterable, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A (possibly nested, rectangular) list -> a tensor on device."""
    data = values if isinstance(values, list) else list(values)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    # The caching host allocator keeps the pinned buffer alive until the copy has run.
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
