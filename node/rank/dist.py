"""Joining the job's distributed group over the backend the launcher names (spec.backend)."""

from __future__ import annotations

import mlx.core as mx

from cluster.core.backends import BACKENDS, RING, Backend
from cluster.core.modelcheck import SetupError
from node.rank.numbers import host_float, host_ints

_joined: Backend = RING  # the backend this process joined: MLX joins one group per process


def control_stream() -> mx.Device:
    """Where the small collectives (shared requests, stop flags, barriers) run: the CPU, so
    they never queue behind the model's work, except over a backend whose collectives run on
    the GPU's streams only (nccl)."""
    return mx.Device(mx.gpu if _joined.collectives_on_gpu else mx.cpu)


def init_group(world_size: int, backend: str) -> mx.distributed.Group:
    """The job's group over ``backend`` (a name in cluster.core.backends); a 1-rank job gets
    MLX's singleton group without any backend."""
    global _joined
    wanted = BACKENDS[backend]
    if world_size == 1:
        _joined = wanted
        return mx.distributed.init()
    if not mx.distributed.is_available(backend=wanted.mlx):  # not joined: nothing changes
        raise SetupError(wanted.missing or f"MLX on this host has no {backend} backend")
    group = mx.distributed.init(backend=wanted.mlx, strict=True)
    _joined = wanted
    if group.size() != world_size:
        raise RuntimeError(
            f"joined a group of {group.size()} ranks but the job has {world_size}; "
            "check MLX_HOSTFILE / MLX_IBV_DEVICES"
        )
    return group


def barrier(group: mx.distributed.Group) -> None:
    """Every rank reaches this point before any leaves it."""
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=control_stream()))


def rank0_stopped(stopped: bool, group, gen_stream) -> bool:
    """Every rank learns whether rank 0 has stopped: a one-number all_sum (rank 0 gives 1).

    First wait for the step the generator has in flight: its sends and all-reduces run on the
    generation stream's thread, and a collective on another stream at the same time would
    interleave with them on the same sockets (garbled hidden states, not an error)."""
    mx.synchronize(gen_stream)
    flag = mx.array(1.0 if stopped else 0.0)
    flag = mx.distributed.all_sum(flag, group=group, stream=control_stream())
    return host_float(flag) > 0


def gather_ints(value: int, group) -> list[int]:
    """Every rank's ``value`` (int32), on every rank: one all_sum of a vector with a slot
    per rank."""
    if group is None or group.size() == 1:
        return [value]
    slots = mx.zeros((group.size(),), dtype=mx.int32)
    slots[group.rank()] = value
    return host_ints(mx.distributed.all_sum(slots, group=group, stream=control_stream()))
