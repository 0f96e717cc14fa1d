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
