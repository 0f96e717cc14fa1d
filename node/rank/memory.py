"""A rank's memory limits, from its own device, set before it loads.

On a Mac the rank's share of a large model may come close to the unified memory: MLX's memory
limit at 85% of Metal's recommended working set makes it free cached buffers before the system
starts to swap, and the same wired limit keeps the weights resident (as mlx_lm.generate's
wired_limit does; released when the rank exits). On a CUDA GPU the same 85% applies to the
memory the GPU has free when the rank starts (MLX's device info, from NVML), as a memory limit
(CUDA has no wired memory). On a CPU there is nothing to set: the host's RAM is the plan's
(memory_gb) and the kernel's.
"""

from __future__ import annotations

import atexit
import functools

import mlx.core as mx

from cluster.core.modelcheck import MEMORY_FRACTION


def metal_limits(device_info: dict) -> int | None:
    """Bytes for both limits, from Metal's device info; None when it gives no working set."""
    recommended = device_info.get("max_recommended_working_set_size")
    if not recommended:
        return None
    return int(recommended * MEMORY_FRACTION)


def cuda_limit(device_info: dict) -> int | None:
    """Bytes for the memory limit on a CUDA GPU: 85% of what it has free (else of its total);
    None when MLX's device info gives neither."""
    free = device_info.get("free_memory") or device_info.get("total_memory")
    if not free:
        return None
    return int(free * MEMORY_FRACTION)


@functools.cache
def device_limit() -> tuple[str, int] | None:
    """The limit this rank's device calls for: ("Metal", bytes), ("CUDA", bytes) or None.
    Decided once, at the rank's start: a CUDA GPU's free memory shrinks as the weights load,
    and serve's cache budget must subtract them from the limit that was set, not a smaller one."""
    if mx.default_device() == mx.cpu:  # a CPU, or a host's ``device: cpu``: the host's RAM
        return None
    if mx.metal.is_available():
        limit = metal_limits(mx.device_info())
        return ("Metal", limit) if limit is not None else None
    if mx.cuda.is_available():
        limit = cuda_limit(mx.device_info())
        return ("CUDA", limit) if limit is not None else None
    return None


def apply_memory_limits() -> tuple[str, int] | None:
    """Set the device's limits (Metal: memory and wired; CUDA: memory); returns which and the
    bytes set (None: a CPU, nothing to do)."""
    found = device_limit()
    if found is None:
        return None
    kind, limit = found
    if kind == "Metal":
        previous = mx.set_wired_limit(limit)
        atexit.register(mx.set_wired_limit, previous)
    mx.set_memory_limit(limit)
    return found


def reapply_wired_limit() -> None:
    """mlx-lm's BatchGenerator sets the wired limit to the whole recommended working set when
    it starts; put ours back."""
    found = device_limit()
    if found is not None and found[0] == "Metal":
        mx.set_wired_limit(found[1])


def memory_left(ranks_on_host: int) -> float:
    """Bytes this rank may still fill once its weights are loaded: the device's limit (a Mac,
    a CUDA GPU) less what is in use, else the host's free memory shared by its ranks."""
    if (limit := device_limit()) is not None:
        return max(0.0, limit[1] - mx.get_active_memory())
    import os

    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8e9
    return free / max(1, ranks_on_host)
