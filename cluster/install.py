"""`mlx-cluster install`: this checkout as a wheel on every host, in that host's python.

A host's python is the hostfile's (per host, else top level, else ``python3``). When that path
does not exist yet and looks like a venv's (``.../bin/python``), the venv is made first. mlx and
mlx-lm are pinned to the versions installed here, so that doctor finds the same everywhere; the
hosts fetch the dependencies from their own package index.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from .hostfile import Host, Hostfile
from .process import rank_python

PINNED = ("mlx", "mlx-lm")
VENV_PYTHON = re.compile(r"^(?P<venv>.+)/bin/python[0-9.]*$")


class InstallError(RuntimeError):
    """What stopped an install; the message names the host and what to do."""


@dataclass
class HostInstall:
    host: Host
    python: str
    action: str = ""  # installed, created venv and installed, skipped
    error: str | None = None


def project_root() -> Path:
    root = Path(__file__).resolve().parent.parent
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


def steps(python: str, wheel: str, base: str, system_site: bool, make_venv: bool) -> list[str]:
    """The shell commands that install ``wheel`` for ``python`` on a host."""
    q = shlex.quote
    commands = []
    if make_venv:
        venv = VENV_PYTHON.match(python)["venv"]
        flag = " --system-site-packages" if system_site else ""
        commands.append(f"{q(base)} -m venv{flag} {q(venv)}")
    pip = f"{q(python)} -m pip install -q --disable-pip-version-check"
    commands.append(f"{pip} {q(wheel)} {' '.join(q(p) for p in pins())}")
    # the same version number with other code: our package alone, again, from this wheel
    commands.append(f"{pip} --no-deps --force-reinstall {q(wheel)}")
    return commands


def install_host(
    hostfile: Hostfile,
    host: Host,
    wheel: Path,
    base: str,
    system_site: bool,
    accept_new: bool,
) -> HostInstall:
    python = rank_python(host, hostfile.python)
    result = HostInstall(host, python)
    if host.is_local and Path(python).resolve() == Path(sys.executable).resolve():
        result.action = "skipped (the python running this command)"
        return result
    try:
        if host.is_local:
            _install_local(result, wheel, base, system_site)
        else:
            _install_remote(result, hostfile, wheel, base, system_site, accept_new)
    except InstallError as e:
        result.error = str(e)
    return result


def _needs_venv(exists: bool, python: str) -> bool:
    if exists:
        return False
    if VENV_PYTHON.match(python) is None:
        raise InstallError(
            f"python {python} is not found, and it is not a venv path (…/bin/python) that "
            "install could create; set the host's python: in the hostfile"
        )
    return True


def _install_local(result: HostInstall, wheel: Path, base: str, system_site: bool) -> None:
    found = (
        subprocess.run(
            ["sh", "-c", f"command -v {shlex.quote(result.python)}"], capture_output=True
        ).returncode
        == 0
    )
    make_venv = _needs_venv(found, result.python)
    for command in steps(result.python, str(wheel), base, system_site, make_venv):
        p = subprocess.run(["sh", "-c", command], capture_output=True, text=True)
        if p.returncode != 0:
            raise InstallError(f"`{command}` failed: {tail(p.stderr)}")
    result.action = "created venv, installed" if make_venv else "installed"


def _install_remote(result, hostfile, wheel, base, system_site, accept_new) -> None:
    from .ssh import SSHError, connect, run

    try:
        client = connect(result.host, hostfile, accept_new)
    except SSHError as e:
        raise InstallError(str(e).removeprefix(f"{result.host.label}: ")) from None
    try:
        status, home, err = run(client, 'printf %s "$HOME"')
        python = result.python
        if python.startswith("~/"):
            python = home + python[1:]
        found = run(client, f"command -v {shlex.quote(python)}")[0] == 0
        make_venv = _needs_venv(found, python)
        remote_dir = f"{home}/.cache/mlx-cluster/wheels"
        run(client, f"mkdir -p {shlex.quote(remote_dir)}")
        remote_wheel = f"{remote_dir}/{wheel.name}"
        sftp = client.open_sftp()
        try:
            sftp.put(str(wheel), remote_wheel)
        finally:
            sftp.close()
        for command in steps(python, remote_wheel, base, system_site, make_venv):
            status, _, err = run(client, command, timeout=1800)
            if status != 0:
                raise InstallError(f"`{command}` failed: {tail(err)}")
        result.action = "created venv, installed" if make_venv else "installed"
    finally:
        client.close()


def run_install(
    hostfile: Hostfile, base: str, system_site: bool, accept_new: bool
) -> list[HostInstall]:
    with tempfile.TemporaryDirectory(prefix="mlx-cluster-wheel-") as tmp:
        wheel = build_wheel(Path(tmp))
        with ThreadPoolExecutor(max_workers=min(8, len(hostfile.hosts))) as pool:
            return list(
                pool.map(
                    lambda h: install_host(hostfile, h, wheel, base, system_site, accept_new),
                    hostfile.hosts,
                )
            )
