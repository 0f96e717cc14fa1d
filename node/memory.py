"""A rank's Metal memory limits, set before it loads and released when it exits.

On a Mac the rank's share of a large model may come close to the unified memory: MLX's memory
limit at 85% of Metal's recommended working set makes it free cached buffers before the system
starts to swap, and the same wired limit keeps the weights resident (as mlx_lm.generate's
wired_limit does). Without Metal (Linux, CPU) there is nothing to set.
"""

from __future__ import annotations

import atexit

import mlx.core as mx

from cluster.core.modelcheck import MEMORY_FRACTION


def metal_limits(device_info: dict) -> int | None:
    """Bytes for both limits, from Metal's device info; None when it gives no working set."""
    recommended = device_info.get("max_recommended_working_set_size")
    if not recommended:
        return None
    return int(recommended * MEMORY_FRACTION)


def apply_metal_limits() -> int | None:
    """Set the limits when Metal is here; returns the bytes set (None: nothing to do)."""
    if not mx.metal.is_available():
        return None
    limit = metal_limits(mx.device_info())
    if limit is None:
        return None
    previous = mx.set_wired_limit(limit)
    mx.set_memory_limit(limit)
    atexit.register(mx.set_wired_limit, previous)
    return limit


def reapply_wired_limit() -> None:
    """mlx-lm's BatchGenerator sets the wired limit to the whole recommended working set when
    it starts; put ours back."""
    if mx.metal.is_available() and (limit := metal_limits(mx.device_info())) is not None:
        mx.set_wired_limit(limit)
