"""`mlx-cluster hostfile check | convert | discover`, as a user runs them.

discover reads saved outputs of macOS's commands (tests/fixtures/discover, written by its
make.py from the documented formats), and over the loopback sshd for the SSH path."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from tests.support.processes import run_cli

FIXTURES = Path(__file__).parent.parent / "support" / "fixtures" / "discover"


REPO = Path(__file__).parent.parent.parent


def test_discover_over_ssh_names_a_host_that_is_not_a_mac(sshd, tmp_path):
    hf = tmp_path / "hosts.yaml"
    hf.write_text(sshd.hostfile(f"  - ssh: 127.0.0.1:{sshd.port}\n", sys.executable))
    p = run_cli("hostfile", "discover", "--hostfile", hf, "--save", tmp_path / "saved")
    assert p.returncode == 1
    assert (
        f"host 0 (127.0.0.1:{sshd.port}): `system_profiler SPThunderboltDataType -json` failed"
        in p.stderr
    )
    assert "macOS hosts" in p.stderr


def test_convert_round_trip_and_mlx_launch_runs_the_json(tmp_path):
    src = REPO / "hostfiles" / "thunderbolt-ring.yaml"
    p = run_cli("hostfile", "convert", src)
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["backend"] == "ring" and data["envs"] == ["MLX_METAL_FAST_SYNCH=1"]
    assert [h["ssh"] for h in data["hosts"]] == ["studio-1.local", "studio-2.local"]
    assert "memory_gb" in p.stderr and "python (top level)" in p.stderr  # dropped, and said
    (tmp_path / "rig.json").write_text(p.stdout)
    p = run_cli("hostfile", "convert", tmp_path / "rig.json")
    back = yaml.safe_load(p.stdout)
    assert back == {
        "backend": "ring",
        "env": {"MLX_METAL_FAST_SYNCH": "1"},
        "hosts": [
            {"ssh": "studio-1.local", "ips": ["192.168.10.1"]},
            {"ssh": "studio-2.local", "ips": ["192.168.10.2"]},
        ],
    }

    # slots become one entry per rank, and mlx.launch itself runs a job from the JSON
    out = tmp_path / "local.json"
    p = run_cli("hostfile", "convert", REPO / "hostfiles" / "local.yaml", "-o", out)
    assert p.returncode == 0 and len(json.loads(out.read_text())["hosts"]) == 2
    # rank 0 alone prints: mlx.launch relays the ranks' output in chunks, and two ranks' lines
    # once came interleaved ("1 2 0 2 2"); a sum of 2 shows that rank 1 took part
    program = (
        "import mlx.core as mx; g = mx.distributed.init(); "
        "s = mx.distributed.all_sum(mx.array(1)).item(); "
        "g.rank() == 0 and print(g.rank(), g.size(), s)"
    )
    launch = Path(sys.executable).parent / "mlx.launch"
    p = subprocess.run(
        [launch, "--hostfile", out, "--", sys.executable, "-c", program],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[0] == "0 2 2", p.stdout


def test_apply_runs_each_hosts_commands_and_names_a_host_that_fails(tmp_path):
    """Two "hosts" on this machine; a stand-in sudo records what it is asked (no real network
    command runs) and refuses on one host, as a Mac without passwordless sudo does."""
    import shutil

    saved = tmp_path / "saved"
    for name, host in (("a", "localhost"), ("b", "127.0.0.1")):
        shutil.copytree(FIXTURES / "two-ring" / name, saved / host)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sudo.log"
    (bin_dir / "sudo").write_text(
        f'#!/bin/sh\necho "$*" >> {log}\n'
        f'case "$*" in *10.200.0.2*netmask*) echo "a password is required" >&2; exit 1;; esac\n'
    )
    (bin_dir / "sudo").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    args = ("hostfile", "discover", "--hosts", "localhost,127.0.0.1", "--from", saved)
    p = run_cli(*args, "-o", tmp_path / "rig.yaml", "--apply", env=env)
    assert p.returncode == 1
    assert "host 1 (127.0.0.1): the network commands failed (a password is required)" in p.stderr
    assert "passwordless sudo" in p.stderr and "host 0" not in p.stderr
    asked = log.read_text().splitlines()
    assert asked[:3] == [
        "-n ifconfig bridge0 down",
        "-n ifconfig en2 inet 10.200.0.1 netmask 255.255.255.252",
        "-n route change 10.200.0.2 -interface en2",
    ]
    assert asked[3:] == [
        "-n ifconfig bridge0 down",
        "-n ifconfig en2 inet 10.200.0.2 netmask 255.255.255.252",
    ]
