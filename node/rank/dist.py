"""Joining the job's distributed group, with the backend chosen from the environment."""

from __future__ import annotations

import os

import mlx.core as mx

from cluster.core.modelcheck import SetupError


def backend_from_env(env: dict[str, str] | None = None) -> str:
    """jaccl when the launcher gave a coordinator and an IBV device matrix, nccl when it gave
    NCCL's host and port, ring otherwise."""
    env = os.environ if env is None else env
    if env.get("MLX_JACCL_COORDINATOR") and env.get("MLX_IBV_DEVICES"):
        return "jaccl"
    if env.get("NCCL_HOST_IP") and env.get("NCCL_PORT") and env.get("MLX_WORLD_SIZE"):
        return "nccl"
    return "ring"


def control_stream() -> mx.Stream | mx.Device:
    """Where the small collectives (shared requests, stop flags, barriers) run: the CPU, so
    they never queue behind the model's work, except over nccl, whose collectives run on the
    GPU's streams only."""
    return mx.gpu if backend_from_env() == "nccl" else mx.cpu


def init_group(world_size: int) -> mx.distributed.Group:
    """The job's group; a 1-rank job gets MLX's singleton group without any backend."""
    if world_size == 1:
        return mx.distributed.init()
    backend = backend_from_env()
    if backend == "nccl" and not mx.distributed.is_available(backend="nccl"):
        raise SetupError(
            "MLX on this host has no nccl backend (it is MLX's CPU or Metal build): install "
            "mlx-cluster[cuda] here, then MLX's CUDA build last (docs/setup.md, `mlx-cluster "
            "install` does both), or use backend: ring"
        )
    group = mx.distributed.init(backend=backend, strict=True)
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
    return flag.item() > 0
