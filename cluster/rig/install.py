"""`mlx-cluster install`: this checkout as a wheel on every host, in that host's python.

A host's python is the hostfile's (per host, else top level, else ``python3``). When that path
does not exist yet and looks like a venv's (``.../bin/python``), the venv is made first. mlx and
mlx-lm are pinned to the versions installed here, so that doctor finds the same everywhere; the
hosts fetch the dependencies from their own package index, or, with ``index_via_here``, from
the index through this machine (``indexproxy``: for hosts with no internet).

A Linux host with an NVIDIA GPU (the hostfile gives it ``gpus``, the backend is nccl, or
``nvidia-smi -L`` answers there) gets ``mlx-cluster[cuda]``: MLX's CUDA build beside the CPU
one that every Linux install has. Both ship the same library file (mlx/lib/libmlx.so), so the
CUDA build is installed once more, alone, last: its file is the one left.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from cluster.core.backends import BACKENDS
from cluster.core.hostfile import Host, Hostfile
from cluster.job.process import rank_python
from cluster.rig.indexproxy import IndexTunnels, forward_index

PINNED = ("mlx", "mlx-lm")
CUDA_BUILD = "mlx-cuda-13"  # what mlx[cuda13] pulls (mlx-cluster[cuda]): CUDA 13, driver 580+
VENV_PYTHON = re.compile(r"^(?P<venv>.+)/bin/python[0-9.]*$")


class InstallError(RuntimeError):
    """What stopped an install; the message names the host and what to do."""


@dataclass
class HostInstall:
    host: Host
    python: str
    action: str = ""  # installed, created venv and installed, skipped
    cuda: bool = False  # installed with MLX's CUDA build
    error: str | None = None
    tunnels: IndexTunnels | None = None  # with index_via_here: what the host's pip opened


def project_root() -> Path:
    root = Path(__file__).resolve().parents[2]
    if not (root / "pyproject.toml").exists():
        raise InstallError(
            f"{root} is not an mlx-cluster source checkout (no pyproject.toml); install builds "
            "its wheel from one: git clone the project and `pip install -e .` there"
        )
    return root


def build_wheel(out_dir: Path) -> Path:
    """A wheel of this checkout (no dependencies bundled)."""
    root = project_root()
    p = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out_dir), str(root)],
        capture_output=True,
        text=True,
    )
    wheels = sorted(out_dir.glob("mlx_cluster-*.whl"))
    if p.returncode != 0 or not wheels:
        raise InstallError(f"building the wheel of {root} failed: {tail(p.stderr)}")
    return wheels[-1]


def pins() -> list[str]:
    """mlx and mlx-lm at this machine's versions, when it has them."""
    out = []
    for name in PINNED:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return out


def tail(text: str, lines: int = 3) -> str:
    kept = [line for line in text.strip().splitlines() if not line.startswith("WARNING:")]
    return " | ".join(kept[-lines:]) or "no output"


def steps(
    python: str,
    wheel: str,
    base: str,
    system_site: bool,
    make_venv: bool,
    proxy_port: int | None = None,
    cuda: bool = False,
) -> list[str]:
    """The shell commands that install ``wheel`` for ``python`` on a host (with ``cuda``:
    MLX's CUDA build too); its pip goes through ``proxy_port`` on the host's 127.0.0.1 when
    given."""
    q = shlex.quote
    commands = []
    if make_venv:
        venv = VENV_PYTHON.match(python)["venv"]
        flag = " --system-site-packages" if system_site else ""
        commands.append(f"{q(base)} -m venv{flag} {q(venv)}")
    # --no-compile (uv's default): a rank compiles the few modules it imports, on first use,
    # instead of pip compiling every module of every package (half of a fresh venv's install)
    pip = f"{q(python)} -m pip install -q --disable-pip-version-check --no-compile"
    if proxy_port is not None:
        pip += f" --proxy http://127.0.0.1:{proxy_port}"
    target = f"{wheel}[cuda]" if cuda else wheel
    commands.append(f"{pip} {q(target)} {' '.join(q(p) for p in pins())}")
    # the same version number with other code: our package alone, again, from this wheel
    commands.append(f"{pip} --no-deps --force-reinstall {q(wheel)}")
    if cuda:  # mlx-cpu and mlx-cuda-13 both write mlx/lib/libmlx.so: the CUDA one last
        mlx = next((p for p in pins() if p.startswith("mlx==")), None)
        version = mlx.removeprefix("mlx==") if mlx else None
        cuda_build = f"{CUDA_BUILD}=={version}" if version else CUDA_BUILD
        commands.append(f"{pip} --no-deps --force-reinstall {q(cuda_build)}")
    return commands


def run_steps(run: Callable[[str], tuple[int, str, str]], commands: list[str]
              ) -> tuple[str, str] | None:  # fmt: skip
    """Run each install command in turn through ``run``; the first that fails and its stderr,
    or None. A pip command that fails is run once more, fetching afresh (``--no-cache-dir``):
    a download cut short reaches pip as a file whose hash does not match, and a dropped
    connection as an error, and either is gone the second time."""
    for command in commands:
        status, _, err = run(command)
        if status != 0 and " -m pip " in command:
            command = f"{command} --no-cache-dir"
            status, _, err = run(command)
        if status != 0:
            return command, err
    return None


def wants_cuda(hostfile: Hostfile, host: Host) -> bool:
    """The hostfile puts ranks on the host's GPUs (gpus, or a GPU backend: nccl)."""
    return host.gpus is not None or BACKENDS[hostfile.backend].gpus


def install_host(
    hostfile: Hostfile,
    host: Host,
    wheel: Path,
    base: str,
    system_site: bool,
    accept_new: bool,
    index_via_here: bool = False,
) -> HostInstall:
    from cluster.job.ssh import SSHError, host_shell

    python = rank_python(host, hostfile.python)
    result = HostInstall(host, python)
    if host.is_local and Path(python).resolve() == Path(sys.executable).resolve():
        result.action = "skipped (the python running this command)"
        return result
    try:
        with host_shell(host, hostfile, accept_new) as shell:
            home = shell.run('printf %s "$HOME"')[1]
            if python.startswith("~/"):
                python = home + python[1:]
            found = shell.run(f"command -v {shlex.quote(python)}")[0] == 0
            make_venv = _needs_venv(found, python)
            wheels = f"{home}/.cache/mlx-cluster/wheels"
            shell.run(f"mkdir -p {shlex.quote(wheels)}")
            shell.put(wheel, f"{wheels}/{wheel.name}")
            port = None
            if index_via_here and shell.client is not None:
                result.tunnels = IndexTunnels()
                port = forward_index(shell.client.get_transport(), result.tunnels)
            where = f"{wheels}/{wheel.name}"
            result.cuda = wants_cuda(hostfile, host) or (
                shell.run("uname -s")[1].strip() == "Linux"
                and shell.run("nvidia-smi -L")[0] == 0
            )  # fmt: skip
            commands = steps(python, where, base, system_site, make_venv, port, result.cuda)
            failed = run_steps(lambda command: shell.run(command, timeout=1800), commands)
            if failed is not None:
                command, err = failed
                raise InstallError(f"`{command}` failed: {tail(err)}{_refusals(result)}")
        result.action = "created venv, installed" if make_venv else "installed"
        if result.cuda:
            result.action += " with MLX's CUDA build"
    except SSHError as e:
        result.error = str(e).removeprefix(f"{host.label}: ")
    except InstallError as e:
        result.error = str(e)
    return result


def _refusals(result: HostInstall) -> str:
    if result.tunnels is None or not result.tunnels.refused:
        return ""
    return f" (this machine refused: {'; '.join(sorted(set(result.tunnels.refused)))})"


def _needs_venv(exists: bool, python: str) -> bool:
    if exists:
        return False
    if VENV_PYTHON.match(python) is None:
        raise InstallError(
            f"python {python} is not found, and it is not a venv path (…/bin/python) that "
            "install could create; set the host's python: in the hostfile"
        )
    return True


def run_install(
    hostfile: Hostfile,
    base: str,
    system_site: bool,
    accept_new: bool,
    index_via_here: bool = False,
) -> list[HostInstall]:
    with tempfile.TemporaryDirectory(prefix="mlx-cluster-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        with ThreadPoolExecutor(max_workers=min(8, len(hostfile.hosts))) as pool:
            return list(
                pool.map(
                    lambda h: install_host(
                        hostfile, h, wheel, base, system_site, accept_new, index_via_here
                    ),
                    hostfile.hosts,
                )
            )
