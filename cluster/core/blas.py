"""An optimized BLAS for Linux ranks.

The ``mlx[cpu]`` wheel bundles the reference (netlib) BLAS; libmlx resolves ``cblas_sgemm``
dynamically, so preloading the host's OpenBLAS makes its matmuls about 25x faster. A rank on
the launcher's machine gets the environment below from the launcher; a remote rank decides on
its own host (``node.__main__`` re-executes itself with it), and doctor's probe looks for the
library with the same list. OpenBLAS gets the host's cores shared by the ranks on it: with its
default (every core per rank) two ranks on one host run slower than with one thread each.
"""

from __future__ import annotations

import os
import sys

# Debian/Ubuntu's libopenblas0-pthread (then -openmp, -serial), Fedora's openblas-threads
OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
INSTALL_HINT = "install Debian/Ubuntu's libopenblas0-pthread (apt-get install libopenblas0-pthread)"
MODES = ("auto", "reference")
MARK = "MLX_CLUSTER_BLAS"  # set in the environment once the choice is made (no second re-exec)


def find_openblas(paths: tuple[str, ...] = OPENBLAS_PATHS) -> str | None:
    return next((p for p in paths if os.path.exists(p)), None)


def blas_env(
    mode: str, ranks_on_host: int, env: dict[str, str], platform: str, cores: int | None
) -> dict[str, str] | None:
    """The variables to add for a rank on this host, or None when nothing changes: not Linux,
    ``reference`` asked for, the choice already made, or no OpenBLAS here."""
    if platform != "linux" or mode != "auto" or MARK in env:
        return None
    library = find_openblas()
    if library is None:
        return None
    preload = " ".join(x for x in (env.get("LD_PRELOAD"), library) if x)
    threads = max(1, (cores or 1) // max(1, ranks_on_host))
    return {
        "LD_PRELOAD": preload,
        "OPENBLAS_NUM_THREADS": env.get("OPENBLAS_NUM_THREADS", str(threads)),
        MARK: library,
    }


def blas_env_here(mode: str, ranks_on_host: int, env: dict[str, str]) -> dict[str, str] | None:
    """``blas_env`` for a rank on the machine this runs on: its platform, and the cores this
    process may use (its CPU affinity where the OS has one)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return blas_env(mode, ranks_on_host, env, sys.platform, cores)
