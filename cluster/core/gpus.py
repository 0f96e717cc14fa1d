"""Ranks that share one NVIDIA GPU: what the user is told, by doctor (from the hostfile and
the host's nvidia-smi) and by the launcher (from the GPU each rank reports, ``protocol.Gpu``).

Several ranks of one job on one GPU take turns on it: each gets a share of its memory
bandwidth, and the collectives between them go through the host (ring over TCP), so the job
runs slower than one rank alone. The figures are the project's own, measured on one card
(docs/benchmarks.md, "GPU").
"""

from __future__ import annotations

# 2 ranks on one GPU against 1 rank, decode tokens/s: (pipeline, tensor over ring)
SHARED_MEASURED = (0.44, 0.06)
SHARED_CARD = "one NVIDIA H100"


def shared_gpu_warning(ranks: list[int], gpu: str, host: str, mlx_cuda: bool = True) -> str:
    """The line for ``ranks`` that would use the same ``gpu`` (its index and name) of
    ``host``; ``mlx_cuda``: whether MLX there runs on the GPU at all (its CUDA build)."""
    who = ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    if not mlx_cuda:
        return (f"ranks {who} on {host} run on its CPU, though it has {gpu}: MLX there is "
                "its CPU build; install mlx-cluster[cuda] there (`mlx-cluster install`) and "
                "give the host `gpus:` in the hostfile, one rank per GPU")  # fmt: skip
    pipeline, tensor = SHARED_MEASURED
    return (f"ranks {who} on {host} share {gpu}: each gets part of its memory bandwidth and "
            "they talk through the host (measured on "
            f"{SHARED_CARD}: 2 ranks decode at {pipeline:.2f}x one rank's tokens/s in pipeline "
            f"mode, {tensor:.2f}x in tensor mode over ring). Put one rank on each GPU: "
            "`-n 1` on a host with one GPU, or `gpus: [0, 1]` (one rank per GPU) with "
            "--backend nccl for tensor mode across GPUs")  # fmt: skip
