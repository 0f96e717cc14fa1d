"""A stand-in `nvidia-smi` that answers as a host with two H100s does, for the GPU checks of
doctor and of the ranks on a machine without a GPU."""

from __future__ import annotations

import os
from pathlib import Path

FAKE_SMI = """#!/bin/sh
# nvidia-smi as an H100 box answers (two GPUs)
case "$*" in
  *--query-gpu*) printf '0, NVIDIA H100 80GB HBM3, 81559, 80000, 580.159.04\\n'
                 printf '1, NVIDIA H100 80GB HBM3, 81559, 81000, 580.159.04\\n' ;;
  *) printf '| NVIDIA-SMI 580.159.04   Driver Version: 580.159.04   CUDA Version: 13.0 |\\n' ;;
esac
"""


def fake_nvidia_smi(folder: Path) -> str:
    """Write the stand-in under ``folder``/bin; returns a PATH with it first."""
    smi = folder / "bin" / "nvidia-smi"
    smi.parent.mkdir(parents=True, exist_ok=True)
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    return f"{smi.parent}:{os.environ['PATH']}"
