"""What each distributed backend is, in one place: the launcher, the ranks, doctor, install
and the hostfile checks read it from here.

A backend's per-rank environment (addresses, device matrices, ports) is built by the
launcher (cluster.job.backends, one function per backend); everything else about it is
here. Adding a backend: a ``Backend`` below and its environment function there.
"""

from __future__ import annotations

from dataclasses import dataclass

PIPELINE, TENSOR = "pipeline", "tensor"


@dataclass(frozen=True)
class Backend:
    """One collective backend as the hostfile names it."""

    name: str  # the hostfile's ``backend:`` and --backend
    mlx: str  # what mx.distributed.init(backend=...) takes
    help: str  # one line for --help and errors
    pairs: str  # the rank pairs it sends between: "ring" (neighbours), "mesh" (all), "none"
    modes: tuple[str, ...] = (PIPELINE, TENSOR)  # the job modes it carries
    refused: str = ""  # why the other modes cannot run over it, and what to do instead
    rdma: bool = False  # every host needs RDMA devices (doctor checks ibv_devices)
    gpus: bool = False  # one rank per NVIDIA GPU (install puts MLX's CUDA build there)
    collectives_on_gpu: bool = False  # its collectives run only on the GPU's streams
    missing: str = ""  # what to do when MLX on a host lacks it

    def link_pairs(self, n: int) -> list[tuple[int, int]]:
        """The pairs of ranks (low, high) that exchange data directly, for ``doctor --links``."""
        if n < 2 or self.pairs == "none":
            return []
        if self.pairs == "mesh":
            return [(a, b) for a in range(n) for b in range(a + 1, n)]
        return sorted({(min(k, (k + 1) % n), max(k, (k + 1) % n)) for k in range(n)})


RING = Backend(
    "ring",
    "ring",
    "TCP between neighbours in a ring (any network; Thunderbolt bridges, Ethernet, loopback)",
    pairs="ring",
)
JACCL = Backend(
    "jaccl",
    "jaccl",
    "RDMA over Thunderbolt 5, every host cabled to every other (macOS 26.2+)",
    pairs="mesh",
    rdma=True,
    missing="MLX on this host has no jaccl backend: it needs macOS 26.2 or later with RDMA "
    "enabled (rdma_ctl enable in recovery mode) and a recent MLX; or use backend: ring",
)
JACCL_RING = Backend(
    "jaccl-ring",
    "jaccl",
    "RDMA over Thunderbolt 5, each host cabled to its two neighbours in a ring",
    pairs="ring",
    rdma=True,
    missing=JACCL.missing,
)
NCCL = Backend(
    "nccl",
    "nccl",
    "NVIDIA GPUs, one rank per GPU, tensor mode only",
    pairs="none",  # MLX 0.32.4's nccl backend has all_sum but no send/recv
    modes=(TENSOR,),
    refused="pipeline mode cannot run over the nccl backend: its stages hand activations "
    "from rank to rank with send/recv, which MLX's nccl backend does not carry in the CUDA "
    "build this project was measured with (MLX 0.32.4), and MLX cannot split an nccl group "
    "(so stages over ring between hosts with tensor mode over nccl inside each is not "
    "possible either). Use --mode tensor with nccl, or backend: ring for pipeline mode (ring "
    "runs on CUDA hosts too, one rank per GPU with gpus:)",
    gpus=True,
    collectives_on_gpu=True,
    missing="MLX on this host has no nccl backend (it is MLX's CPU or Metal build): install "
    "mlx-cluster[cuda] here, then MLX's CUDA build last (docs/setup.md, `mlx-cluster "
    "install` does both), or use backend: ring",
)

BACKENDS: dict[str, Backend] = {b.name: b for b in (RING, JACCL, JACCL_RING, NCCL)}


def backend(name: str) -> Backend:
    """The backend a hostfile names (names are checked when the hostfile is read)."""
    return BACKENDS[name]
