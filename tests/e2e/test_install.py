"""`mlx-cluster install`'s refusals over the loopback sshd. The install itself, into fresh
venvs on two hosts that reach the package index only through this machine, then a job from
those venvs, is tested on the rig (test_rig.py)."""

from pathlib import Path

from tests.support.processes import run_cli


def rig(sshd, tmp_path, python: str) -> Path:
    path = tmp_path / "rig.yaml"
    hosts = f"  - ssh: 127.0.0.1:{sshd.port}\n    ips: [127.0.0.1]\n    slots: 2\n"
    path.write_text(sshd.hostfile(hosts, python))
    return path


def test_install_names_a_python_it_cannot_make(sshd, tmp_path):
    hf = rig(sshd, tmp_path, "/nowhere/python3-custom")
    p = run_cli("install", "--hostfile", hf)
    assert p.returncode == 1
    assert (
        f"host 0 (127.0.0.1:{sshd.port}): FAILED: python /nowhere/python3-custom is not found"
        in p.stdout
    )
    assert "set the host's python: in the hostfile" in p.stdout
