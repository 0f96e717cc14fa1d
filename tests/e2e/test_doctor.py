"""`mlx-cluster doctor` on loopback: a local host and a host reached over SSH."""

import json
import subprocess
import sys

from tests.support.processes import run_cli


def hostfile(sshd, tmp_path, python_for_ssh_host=None):
    ssh_python = f"    python: {python_for_ssh_host}\n" if python_for_ssh_host else ""
    path = tmp_path / "hosts.yaml"
    path.write_text(
        sshd.hostfile(
            "  - ssh: localhost\n"
            f"  - ssh: 127.0.0.1:{sshd.port}\n    ips: [127.0.0.1]\n    memory_gb: 16\n"
            + ssh_python,
            sys.executable,
        )
    )
    return path


def test_all_ok_on_loopback(sshd, models, tmp_path):
    p = run_cli("doctor", "--hostfile", hostfile(sshd, tmp_path), "--model", models["llama"])
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].split()[:4] == ["HOST", "RANKS", "SSH", "PYTHON"]
    assert lines[1].startswith("0 localhost") and lines[1].rstrip().endswith("ok")
    assert lines[2].startswith(f"1 127.0.0.1:{sshd.port}") and " ok " in lines[2] + " "
    assert len(lines) == 3  # no problem lines

    p = run_cli(
        "doctor", "--json", "--hostfile", hostfile(sshd, tmp_path), "--model", models["llama"]
    )
    report = json.loads(p.stdout)
    assert report["ok"] is True
    local, remote = report["hosts"]
    assert remote["ssh"] == "ok" and local["ssh"] == "local"
    assert local["versions"] == remote["versions"]
    from cluster.core.blas import find_openblas

    for host in (local, remote):  # the BLAS the ranks will use there, measured as they run it
        assert host["blas"]["library"] == find_openblas() and host["blas"]["gflops"] > 0
    assert set(local["versions"]) == {"mlx", "mlx-lm", "mlx-cluster"}
    assert remote["memory_bytes"] == 16_000_000_000
    assert (
        0
        < remote["model_share_bytes"]
        < sum(f.stat().st_size for f in models["llama"].glob("*.safetensors"))
    )


def test_version_mismatch_is_a_failure(sshd, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    p = run_cli("doctor", "--hostfile", hostfile(sshd, tmp_path, bare / "bin" / "python"))
    assert p.returncode == 1
    assert f"host 1 (127.0.0.1:{sshd.port}): mlx is not installed for {bare}/bin/python" in p.stdout
    assert "mlx-cluster is not installed" in p.stdout
    assert "FAIL" in p.stdout.splitlines()[2]


def test_model_that_does_not_fit(sshd, models, tmp_path):
    path = tmp_path / "h.yaml"
    path.write_text("hosts:\n  - ssh: localhost\n    slots: 2\n    memory_gb: 0.0001\n")
    p = run_cli("doctor", "--hostfile", path, "--model", models["llama"])
    assert p.returncode == 1
    assert "does not fit in 85% of 0.0 GB" in p.stdout


def test_busy_port_and_missing_rdma(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        p = run_cli("doctor", "--starting-port", port)
    assert p.returncode == 1
    assert f"ring port 127.0.0.1:{port} (Address already in use) is in use" in p.stdout
    jaccl = tmp_path / "j.yaml"
    jaccl.write_text(
        "backend: jaccl\nhosts:\n  - {ssh: localhost, rdma: [null, rdma_en3]}\n"
        "  - {ssh: 127.0.0.1, rdma: [rdma_en3, null]}\n"
    )
    p = run_cli("doctor", "--hostfile", jaccl)
    assert p.returncode == 1
    assert "JACCL needs macOS 26.2+ with Thunderbolt 5; this host runs Linux" in p.stdout
