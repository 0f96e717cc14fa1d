"""`mlx-cluster hostfile check | convert | discover`, as a user runs them.

discover reads saved outputs of macOS's commands (tests/fixtures/discover, written by its
make.py from the documented formats), and over the loopback sshd for the SSH path."""

import ipaddress
import json
import re
from pathlib import Path

import pytest

from cluster.core.hostfile import load_hostfile
from cluster.job.backends import rank_envs
from tests.support.processes import invoke

FIXTURES = Path(__file__).parent.parent / "support" / "fixtures" / "discover"


REPO = Path(__file__).parent.parent.parent


def discover(case: str, *args):
    hosts = ",".join(sorted(p.name for p in (FIXTURES / case).iterdir() if p.is_dir()))
    return invoke("hostfile", "discover", "--hosts", hosts, "--from", FIXTURES / case, *args)


def commands_of(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for host, command in re.findall(r"^#   (\w+): (.*)$", text, re.M):
        out.setdefault(host, []).append(command)
    return out


def addresses(commands: list[str]) -> dict[str, str]:
    """interface -> the address its ifconfig line gives it."""
    return dict(
        re.findall(r"ifconfig (en\d+) inet ([\d.]+) netmask 255\.255\.255\.252", " ".join(commands))
    )


@pytest.mark.parametrize(
    "case, backend, order",
    [
        ("two-ring", "ring", ["a", "b"]),
        ("three-ring", "ring", ["a", "b", "c"]),
        ("four-mesh", "jaccl", ["a", "b", "c", "d"]),
        ("missing-cable", "jaccl-ring", ["a", "b", "c", "d"]),
        ("dock", "ring", ["a", "b"]),
        ("double-cable", "ring", ["a", "b", "c", "d"]),
    ],
)
def test_discover_from_each_fixture(case, backend, order, tmp_path):
    out = tmp_path / "rig.yaml"
    p = discover(case, "-o", out)
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    hf = load_hostfile(out)
    assert hf.backend == backend and [h.target for h in hf.hosts] == order
    envs = rank_envs(hf)  # the backend accepts it
    commands = commands_of(text)
    assert p.stdout.split("\n")[0] == f"# {order[0]}"  # the commands, host by host
    assert all(c in p.stdout for cs in commands.values() for c in cs)
    every = [ip for cs in commands.values() for ip in addresses(cs).values()]
    assert len(every) == len(set(every))  # no address twice
    nets = {ipaddress.ip_network(f"{ip}/30", strict=False) for ip in every}
    assert len(nets) * 2 == len(every)  # each cable: its own /30, one address at each end
    for cs in commands.values():
        assert cs[0] == "sudo ifconfig bridge0 down"
        for iface, ip in addresses(cs).items():
            peer = next(
                q
                for q in every
                if q != ip
                and ipaddress.ip_address(q) in ipaddress.ip_network(f"{ip}/30", strict=False)
            )
            assert f"sudo route change {peer} -interface {iface}" in cs
    if backend == "ring":
        ring = json.loads(envs[0].files["MLX_HOSTFILE"])
        assert len(ring) == len(order)
        for rank, h in enumerate(hf.hosts):  # a rank listens on the cable to the rank before it
            before = commands[order[rank - 1]]
            (mine,) = h.ips
            assert any(
                ipaddress.ip_address(theirs) in ipaddress.ip_network(f"{mine}/30", strict=False)
                for theirs in addresses(before).values()
            )
            assert mine in addresses(commands[h.target]).values()
    else:
        assert [h.ips for h in hf.hosts] == [[f"192.168.1.{11 + k}"] for k in range(len(order))]
        matrix = json.loads(envs[0].files["MLX_IBV_DEVICES"])
        n = len(order)
        for i in range(n):
            for j in range(n):
                neighbours = j in ((i - 1) % n, (i + 1) % n)
                expected = i != j and (backend == "jaccl" or neighbours)
                assert (matrix[i][j] is not None) == expected, (i, j, matrix)
    if case == "dock":
        assert "a: not a Mac, ignored: TS4" in p.stderr
    if case == "double-cable":  # one cable per pair along the ring, the second a-b one unused
        assert "cable a:en3 - b:en3 left unused" in p.stderr
        assert all(len(h.ips) == 1 for h in hf.hosts)
        assert "en3" not in " ".join(commands["a"]) and "en3" not in " ".join(commands["b"])


def test_missing_cable_named_and_bad_fixtures_explained():
    p = discover("missing-cable", "--backend", "jaccl")
    assert p.returncode == 1 and "missing: a - c" in p.stderr and "jaccl-ring" in p.stderr
    p = discover("three-ring", "--backend", "jaccl")
    assert p.returncode == 1 and "lists no rdma_ device on a, b, c" in p.stderr
    p = discover("line")
    assert p.returncode == 1
    assert "do not close a ring through all 3 Macs (a has 1, c has 1 cable(s)" in p.stderr
    p = discover("broken-json")
    assert p.returncode == 1 and "b: `system_profiler SPThunderboltDataType -json` gave" in p.stderr
    p = discover("no-interface")
    assert p.returncode == 1
    assert "a: Thunderbolt port 1 has no network interface" in p.stderr
    p = invoke("hostfile", "discover", "--hosts", "a,a", "--from", FIXTURES / "two-ring")
    assert p.returncode == 2 and "repeated" in p.stderr
    p = invoke("hostfile", "discover", "--hosts", "a,z", "--from", FIXTURES / "two-ring")
    assert p.returncode == 1 and "no saved outputs for host z" in p.stderr


def test_check_names_the_problem_and_summarises(tmp_path):
    p = invoke("hostfile", "check", REPO / "hostfiles" / "jaccl-mesh.yaml")
    assert p.returncode == 0, p.stderr
    assert "ok: 3 hosts, 3 ranks, jaccl backend" in p.stdout
    assert (
        "host 1 (studio-2.local): rank 1; ips 192.168.10.2; rdma rdma_en3, -, rdma_en4" in p.stdout
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("backend: jaccl\nhosts:\n  - ssh: a\n    ips: [1.2.3.4]\n  - ssh: b\n")
    p = invoke("hostfile", "check", bad)
    assert (
        p.returncode == 2
        and "field 'rdma' is required by jaccl on host 0 (a), host 1 (b)" in p.stderr
    )
    bad.write_text("hosts:\n  - ssh: a\n    slot: 2\n")
    p = invoke("hostfile", "check", bad)
    assert p.returncode == 2 and "host 0 (a): unknown field(s) slot" in p.stderr


def test_discover_from_a_hostfile_keeps_how_hosts_are_reached(tmp_path):
    given = tmp_path / "given.yaml"
    given.write_text("ssh: {user: me, port: 2222}\nhosts:\n  - ssh: a\n  - ssh: b\n")
    out = tmp_path / "rig.yaml"
    p = invoke(
        "hostfile", "discover", "--hostfile", given, "--from", FIXTURES / "two-ring", "-o", out
    )
    assert p.returncode == 0, p.stderr
    hf = load_hostfile(out)
    assert (hf.ssh.user, hf.ssh.port) == ("me", 2222) and [h.ips for h in hf.hosts] == [
        ["10.200.0.1"],
        ["10.200.0.2"],
    ]


def test_convert_moves_a_port_out_of_the_ssh_name(tmp_path):
    """mlx.launch runs `ssh NAME`: a port cannot ride in it; the user is told where it goes."""
    src = tmp_path / "rig.yaml"
    src.write_text("hosts:\n  - {ssh: 'me@studio-1.local:2222', ips: [10.0.0.1]}\n  - studio-2\n")
    p = invoke("hostfile", "convert", src)
    assert p.returncode == 0, p.stderr
    assert [h["ssh"] for h in json.loads(p.stdout)["hosts"]] == ["me@studio-1.local", "studio-2"]
    assert "port 2222" in p.stderr and "Host studio-1.local / Port 2222" in p.stderr
