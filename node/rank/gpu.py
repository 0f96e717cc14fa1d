"""The NVIDIA GPU this rank's MLX device is, as nvidia-smi names it (``protocol.Gpu``), so the
launcher can tell the user when ranks of one job share one GPU (cluster.core.gpus)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable

from cluster.core.protocol import Event, Gpu

QUERY = "--query-gpu=index,name,memory.total,memory.free,driver_version"  # as doctor's probe


def this_gpu(mlx_cuda: bool) -> Gpu | None:
    """The GPU CUDA gives this rank first (CUDA_VISIBLE_DEVICES's first entry, else device
    0); None on a host without nvidia-smi or where it lists no such GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    first = (visible if visible is not None else "0").split(",")[0].strip()
    if not first or first == "-1":
        return None  # no GPU visible to this rank
    try:
        p = subprocess.run(["nvidia-smi", QUERY, "--format=csv,noheader,nounits", f"--id={first}"],
                           capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for line in p.stdout.strip().splitlines() if p.returncode == 0 else []:
        fields = [x.strip() for x in line.split(",")]
        if len(fields) < 3 or (first.isdigit() and fields[0] != first):
            continue
        try:
            return Gpu(int(fields[0]), fields[1], float(fields[2]) / 1024, mlx_cuda)
        except ValueError:
            continue
    return None


def report_gpu(emit: Callable[[Event], None], device: str = "") -> None:
    """Say this rank's GPU (if any) from a thread of its own: nvidia-smi can take a second,
    which the rank's start need not wait for."""
    import mlx.core as mx

    if device == "cpu":  # the hostfile put it on the CPU: it uses no GPU of the host's
        return

    def report() -> None:
        gpu = this_gpu(mx.cuda.is_available())
        if gpu is not None:
            emit(gpu)

    threading.Thread(target=report, daemon=True, name="gpu").start()


def use_device(device: str) -> None:
    """A hostfile's ``device: cpu``: this rank computes on the CPU where MLX would take the GPU
    (a CUDA host's rank that decodes for its GPU's prefill, say). Before mlx-lm is imported:
    its generation stream is made on the default device."""
    if device == "cpu":
        import mlx.core as mx

        mx.set_default_device(mx.cpu)
