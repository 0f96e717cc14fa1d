"""`mlx-cluster install` into a fresh venv on a "remote" host (the loopback sshd), then a job
whose ranks run from that venv."""

import hashlib
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from conftest import reference, run_cli
from sshd import SSHD

pytestmark = pytest.mark.skipif(not Path(SSHD).exists(), reason="needs openssh-server")

REPO = Path(__file__).parent.parent
PROMPT = "Tell me about lists"


def rig(sshd, tmp_path, python: str) -> Path:
    path = tmp_path / "rig.yaml"
    hosts = f"  - ssh: 127.0.0.1:{sshd.port}\n    ips: [127.0.0.1]\n    slots: 2\n"
    path.write_text(sshd.hostfile(hosts, python))
    return path


@pytest.mark.e2e
def test_install_makes_the_venv_installs_this_checkout_and_ranks_run_from_it(
    sshd, models, tmp_path, request
):
    # a python under ~: each host's shell expands it (the sshd user's home is ours here)
    name = f".cache/mlx-cluster-test-venv-{tmp_path.name}"
    venv = Path.home() / name
    request.addfinalizer(lambda: shutil.rmtree(venv, ignore_errors=True))
    hf = rig(sshd, tmp_path, f"~/{name}/bin/python")
    base = sys._base_executable  # the sshd session's PATH may not have our python3
    p = run_cli("install", "--hostfile", hf, "--python-base", base, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"created venv, installed for ~/{name}/bin/python" in p.stdout
    ours = ", ".join(f"{n} {version(n)}" for n in ("mlx", "mlx-lm", "mlx-cluster"))
    assert f"doctor: {ours}" in p.stdout  # the same versions as here
    assert "problem" not in p.stdout

    installed = subprocess.run(
        [venv / "bin" / "python", "-c", "import cluster.install as m; print(m.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    path = Path(installed.stdout.strip())
    assert str(path).startswith(str(venv))  # the venv's copy, not this checkout
    digest = [
        hashlib.sha256(f.read_bytes()).hexdigest() for f in (path, REPO / "cluster/install.py")
    ]
    assert digest[0] == digest[1]

    p = run_cli("launch", "--hostfile", hf, "--model", models["llama"], "--max-tokens", 20, PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["llama"], PROMPT, 20)

    p = run_cli("install", "--hostfile", hf, timeout=900)  # again: the venv is there now
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"installed for ~/{name}/bin/python" in p.stdout and "created" not in p.stdout


@pytest.mark.e2e
def test_install_names_a_python_it_cannot_make(sshd, tmp_path):
    hf = rig(sshd, tmp_path, "/nowhere/python3-custom")
    p = run_cli("install", "--hostfile", hf)
    assert p.returncode == 1
    assert (
        f"host 0 (127.0.0.1:{sshd.port}): FAILED: python /nowhere/python3-custom is not found"
        in p.stdout
    )
    assert "set the host's python: in the hostfile" in p.stdout
