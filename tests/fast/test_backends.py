"""Per-rank environments and files, checked against the formats in MLX's documentation."""

import json

import pytest

from cluster.core.hostfile import HostfileError, local_hostfile, parse_hostfile
from cluster.job.backends import rank_envs, ring_addresses


def remote(n, backend="ring", rdma=None):
    hosts = []
    for i in range(n):
        h = {"ssh": f"mac{i}", "ips": [f"10.0.0.{i + 1}"]}
        if rdma is not None:
            h["rdma"] = rdma[i]
        hosts.append(h)
    return parse_hostfile({"backend": backend, "hosts": hosts}, "h.yaml")


def test_ring_hostfile_is_a_list_of_ip_port_lists():
    envs = rank_envs(remote(3), starting_port=5000, connections_per_ip=2)
    ring = json.loads(envs[0].files["MLX_HOSTFILE"])
    assert ring == [
        ["10.0.0.1:5000", "10.0.0.1:5001"],
        ["10.0.0.2:5002", "10.0.0.2:5003"],
        ["10.0.0.3:5004", "10.0.0.3:5005"],
    ]
    assert [e.env["MLX_RANK"] for e in envs] == ["0", "1", "2"]
    assert all(e.files == envs[0].files for e in envs)


def test_ring_local_ports_are_free_and_distinct():
    ring = ring_addresses(local_hostfile(4))
    ports = [a[0].rsplit(":", 1)[1] for a in ring]
    assert len(set(ports)) == 4 and all(a[0].startswith("127.0.0.1:") for a in ring)


def test_one_rank_needs_no_backend():
    (only,) = rank_envs(local_hostfile(1))
    assert only.env == {} and only.files == {}


def test_ring_needs_ips():
    hf = parse_hostfile(
        {"hosts": [{"ssh": "mac0"}, {"ssh": "mac1", "ips": ["10.0.0.2"]}]}, "h.yaml"
    )
    with pytest.raises(
        HostfileError, match=r"host 0 \(mac0\): field 'ips' is required by the ring"
    ):
        rank_envs(hf)


def test_jaccl_env_and_matrix():
    rdma = [
        [None, "rdma_en3", "rdma_en4"],
        ["rdma_en3", None, "rdma_en4"],
        ["rdma_en3", ["rdma_en4", "rdma_en5"], None],
    ]
    envs = rank_envs(remote(3, "jaccl", rdma), starting_port=6000)
    assert envs[2].env == {"MLX_JACCL_COORDINATOR": "10.0.0.1:6000", "MLX_RANK": "2"}
    assert json.loads(envs[0].files["MLX_IBV_DEVICES"]) == rdma


def test_jaccl_ring_needs_neighbours_only():
    rdma = [
        [None, "a", None, "d"],
        ["a", None, "b", None],
        [None, "b", None, "c"],
        ["d", None, "c", None],
    ]
    envs = rank_envs(remote(4, "jaccl-ring", rdma))
    assert envs[0].env["MLX_JACCL_RING"] == "1"
    with pytest.raises(HostfileError, match=r"mac0 -> mac2 \(rdma\[0\]\[2\]\)"):
        rank_envs(remote(4, "jaccl", rdma))


def test_jaccl_diagonal_must_be_null():
    with pytest.raises(HostfileError, match="the entry for the host itself must be null"):
        rank_envs(remote(2, "jaccl", [["x", "y"], ["y", None]]))


def test_port_in_use_means_a_listener_not_a_time_wait():
    """A port left in TIME_WAIT by a job that just ended is free for MLX's ring (it binds
    with SO_REUSEADDR); a port another process listens on is not."""
    import socket

    from cluster.job.backends import free_port_run, port_in_use

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    assert port_in_use("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the side that closes first keeps the port in TIME_WAIT
    client.close()
    listener.close()
    assert not port_in_use("127.0.0.1", port)
    first = free_port_run("127.0.0.1", 3)
    assert not any(port_in_use("127.0.0.1", p) for p in range(first, first + 3))


def mlx_launch_nccl(hosts: str, n: int, port: int) -> list[dict[str, str]]:
    """What ``mlx.launch --hosts HOSTS -n N --backend nccl --nccl-port PORT`` gives each rank:
    MLX's own launch_nccl, with the step that starts processes replaced by one that keeps
    their environment (its list, plus MLX_RANK, which its launch script exports last)."""
    import argparse

    from mlx._distributed_utils import launch
    from mlx._distributed_utils.common import Hostfile

    got: list[dict[str, str]] = []

    def keep(command_class, arguments, verbose):
        for (rank, _host, _python, _cwd, _files, env, _command), _ in arguments:
            got.append(dict(e.split("=", 1) for e in env) | {"MLX_RANK": str(rank)})

    args = argparse.Namespace(nccl_port=port, env=[], cwd=None, verbose=False, python=None,
                              repeat_hosts=n)  # fmt: skip
    saved = launch._launch_with_io
    launch._launch_with_io = keep
    try:
        launch.launch_nccl(argparse.ArgumentParser(), Hostfile.from_list(hosts, n).hosts, args,
                           ["python", "job.py"])  # fmt: skip
    finally:
        launch._launch_with_io = saved
    return got


@pytest.mark.parametrize("host", [{"gpus": 4}, {"slots": 4}, {"gpus": [0, 1, 2, 3]}])
def test_nccl_env_is_exactly_mlx_launchs(host):
    """One host, four GPUs: the same variables and values as mlx.launch -n 4, rank by rank."""
    hf = parse_hostfile({"backend": "nccl", "hosts": [{"ssh": "gpu0", "ips": ["10.0.0.1"],
                                                        **host}]}, "h.yaml")  # fmt: skip
    ours = [e.env for e in rank_envs(hf, starting_port=12345)]
    assert ours == mlx_launch_nccl("10.0.0.1", 4, 12345)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in ours] == ["0", "1", "2", "3"]
    assert ours[3] == {"NCCL_HOST_IP": "10.0.0.1", "NCCL_PORT": "12345", "MLX_WORLD_SIZE": "4",
                       "MLX_RANK": "3", "CUDA_VISIBLE_DEVICES": "3"}  # fmt: skip
    assert rank_envs(parse_hostfile(
        {"backend": "nccl", "hosts": [{"ssh": "gpu0", "ips": ["10.0.0.1"], **host}]}, "h"
    ))[0].env["NCCL_PORT"] == "12345"  # mlx.launch's default port  # fmt: skip


def test_nccl_gpus_pick_the_devices_and_rank_0_needs_an_address():
    hf = parse_hostfile({"backend": "nccl", "hosts": [
        {"ssh": "box", "ips": ["10.0.0.1"], "gpus": [2, 3]},
        {"ssh": "spark", "ips": ["10.0.0.2"]}]}, "h.yaml")  # fmt: skip
    envs = rank_envs(hf, starting_port=7000)
    assert [(e.host.target, e.env["CUDA_VISIBLE_DEVICES"], e.env["MLX_RANK"]) for e in envs] == [
        ("box", "2", "0"), ("box", "3", "1"), ("spark", "0", "2")]  # fmt: skip
    assert {e.env["NCCL_HOST_IP"] for e in envs} == {"10.0.0.1"}
    assert {e.env["MLX_WORLD_SIZE"] for e in envs} == {"3"} and not envs[0].files
    nameless = parse_hostfile({"backend": "nccl", "hosts": [{"ssh": "box", "gpus": 2}]}, "h.yaml")
    with pytest.raises(HostfileError, match=r"host 0 \(box\): field 'ips' is required for rank 0"):
        rank_envs(nameless)


def test_a_cuda_host_in_a_ring_puts_each_rank_on_its_own_gpu():
    mac = {"ssh": "mac", "ips": ["10.0.0.1"]}
    hf = parse_hostfile({"hosts": [mac, {"ssh": "box", "ips": ["10.0.0.2"], "gpus": [1, 0]}]}, "h")
    envs = rank_envs(hf, starting_port=5000)
    assert ["CUDA_VISIBLE_DEVICES" in e.env for e in envs] == [False, True, True]
    assert [e.env.get("CUDA_VISIBLE_DEVICES") for e in envs[1:]] == ["1", "0"]
    assert len(json.loads(envs[0].files["MLX_HOSTFILE"])) == 3


@pytest.mark.parametrize(
    ("gpus", "slots", "message"),
    [(0, None, "field 'gpus' must be at least 1"),
     ([0, 0], None, "a list of distinct GPU indices"),
     ([-1], None, "a list of distinct GPU indices"),
     ("all", None, "a number of GPUs or a list"),
     (True, None, "a number of GPUs or a list"),
     (2, 3, r"fields 'slots' \(3\) and 'gpus' \(2 GPUs\) disagree")],
)  # fmt: skip
def test_gpus_are_checked(gpus, slots, message):
    host = {"ssh": "box", "ips": ["10.0.0.1"], "gpus": gpus}
    if slots is not None:
        host["slots"] = slots
    with pytest.raises(HostfileError, match=r"h.yaml: host 0 \(box\): .*" + message):
        parse_hostfile({"backend": "nccl", "hosts": [host]}, "h.yaml")


def test_a_rank_without_its_backend_in_mlx_says_what_to_do():
    """The rank joins the backend the launcher names (spec.backend), and refuses one its MLX
    lacks with the description's advice (MLX's CPU build has no nccl)."""
    from cluster.core.modelcheck import SetupError
    from node.rank.dist import init_group

    with pytest.raises(SetupError, match=r"no nccl backend .* install mlx-cluster\[cuda\]"):
        init_group(2, "nccl")


def test_every_backend_is_described_and_has_its_rank_environment():
    """A backend is its description (cluster.core.backends) and its environment function
    (cluster.job.backends): the hostfile, --backend, doctor, install and the ranks read
    the first; the launcher builds ranks from the second."""
    from cluster.core.backends import BACKENDS
    from cluster.job.backends import RANK_ENVS

    assert set(BACKENDS) == set(RANK_ENVS)
    for b in BACKENDS.values():
        assert b.help and b.pairs in ("ring", "mesh", "none") and b.modes
        assert b.refused or set(b.modes) == {"pipeline", "tensor"}, b.name
        assert b.missing or b.name == "ring", b.name


def test_pipeline_over_nccl_is_refused_with_the_reason(tmp_path):
    """Before any rank starts: exit 2, why, and what to do instead."""
    from tests.support.processes import invoke

    hostfile = tmp_path / "gpus.yaml"
    hostfile.write_text("backend: nccl\nhosts:\n  - ssh: localhost\n    gpus: 2\n")
    p = invoke("launch", "--hostfile", hostfile, "--max-tokens", 4, "hi")
    assert p.returncode == 2
    assert "pipeline mode cannot run over the nccl backend" in p.stderr
    assert "send/recv" in p.stderr and "Use --mode tensor with nccl" in p.stderr
