"""Per-rank environment for MLX's distributed backends, as data.

Each backend returns, for every rank, the environment variables and the files the rank needs on
its host (``files`` maps an env var to the text of the file its value must point at: the process
layer writes the file on the host and sets the variable to its path, as ``mlx.launch`` does).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.core.backends import BACKENDS
from cluster.core.hostfile import Host, Hostfile, HostfileError


@dataclass
class RankEnv:
    rank: int
    host: Host
    env: dict[str, str] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)


def _bind_free(ip: str) -> socket.socket:
    """A socket bound to a port the OS says is free on ``ip``; closing it frees the port."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.bind((ip, 0))
    return s


def port_in_use(ip: str, port: int) -> bool:
    """Another socket listens on it. Bound with SO_REUSEADDR as MLX's ring binds, so the
    TIME_WAIT left by a job that just ended does not count (MLX can use the port)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError:
            return True
    return False


def free_port_run(ip: str, count: int, attempts: int = 50) -> int:
    """A first port such that it and the ``count - 1`` after it are free on ``ip`` (for a
    launcher that counts ports up from a start, as mlx.launch does)."""
    for _ in range(attempts):
        with _bind_free(ip) as s:
            first = s.getsockname()[1]
        if first + count <= 65536 and not any(
            port_in_use(ip, p) for p in range(first, first + count)
        ):
            return first
    raise RuntimeError(f"found no {count} consecutive free ports on {ip}")


def ring_addresses(
    hostfile: Hostfile, starting_port: int | None = None, connections_per_ip: int = 1
) -> list[list[str]]:
    """The ``MLX_HOSTFILE`` list: for each rank, ``ip:port`` per ip and connection.

    With ``starting_port`` the ports count up from it as in ``mlx.launch``; without it, ranks on
    this machine get ports the OS reports free and remote ranks count up from 32323.
    """
    ranks = hostfile.rank_hosts()
    for h in hostfile.hosts:
        if not h.ips:
            raise HostfileError(
                f"{hostfile.path or '<hostfile>'}: {h.label}: field 'ips' is required by the "
                "ring backend (the address the other ranks connect to)"
            )
    if connections_per_ip < 1:
        raise HostfileError(f"--connections-per-ip must be at least 1, got {connections_per_ip}")
    port = starting_port if starting_port is not None else 32323
    addresses = []
    held = []  # keep each picked port bound until all are picked, so none is picked twice
    try:
        for host in ranks:
            node = []
            for ip in host.ips:
                for _ in range(connections_per_ip):
                    if starting_port is None and host.is_local:
                        held.append(_bind_free(ip))
                        node.append(_join(ip, held[-1].getsockname()[1]))
                    else:
                        node.append(_join(ip, port))
                        port += 1
            addresses.append(node)
    finally:
        for s in held:
            s.close()
    return addresses


def ring_ports(files: dict[str, str], rank: int) -> list[tuple[str, int]]:
    """(ip, port) pairs that ``rank`` binds, read back from its MLX_HOSTFILE text."""
    if "MLX_HOSTFILE" not in files:
        return []
    pairs = []
    for address in json.loads(files["MLX_HOSTFILE"])[rank]:
        ip, _, port = address.rpartition(":")
        pairs.append((ip.strip("[]"), int(port)))
    return pairs


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def ring_env(
    hostfile: Hostfile,
    starting_port: int | None = None,
    connections_per_ip: int = 1,
    verbose: bool = False,
) -> list[RankEnv]:
    """TCP ring: each rank's addresses in MLX_HOSTFILE; a rank on a host with ``gpus`` on its
    own GPU (CUDA_VISIBLE_DEVICES)."""
    ranks = hostfile.rank_hosts()
    one = len(ranks) == 1  # MLX's singleton group: no ring
    ring = "" if one else json.dumps(ring_addresses(hostfile, starting_port, connections_per_ip))
    out = []
    for rank, (host, gpu) in enumerate(zip(ranks, rank_gpus(hostfile), strict=True)):
        env = {} if one else {"MLX_RANK": str(rank)}
        if verbose and not one:
            env["MLX_RING_VERBOSE"] = "1"
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        out.append(RankEnv(rank, host, env, {} if one else {"MLX_HOSTFILE": ring}))
    return out


def jaccl_env(
    hostfile: Hostfile, starting_port: int | None = None, *_ring: object
) -> list[RankEnv]:
    """JACCL over RDMA (Thunderbolt 5): coordinator = rank 0's first ip, the IBV device matrix.
    (``_ring``: ring's options, which have no meaning here.)"""
    where = hostfile.path or "<hostfile>"
    hosts = hostfile.hosts
    n = len(hosts)
    ring = BACKENDS[hostfile.backend].pairs == "ring"
    if hostfile.world_size == 1:
        return [RankEnv(0, hosts[0])]
    multi = [h.label for h in hosts if h.slots > 1]
    if multi:
        raise HostfileError(
            f"{where}: {', '.join(multi)}: field 'slots': {hostfile.backend} "
            "runs one rank per host (each needs its own RDMA devices); "
            "use the ring backend for several ranks on one machine"
        )
    if not hosts[0].ips:
        raise HostfileError(
            f"{where}: {hosts[0].label}: field 'ips' is required for rank 0 "
            "(the JACCL coordinator address)"
        )
    if not all(h.rdma for h in hosts):
        lacking = ", ".join(h.label for h in hosts if not h.rdma)
        raise HostfileError(f"{where}: field 'rdma' is required by {hostfile.backend} on {lacking}")
    diagonal = [h.label for i, h in enumerate(hosts) if h.rdma[i] is not None]
    if diagonal:
        raise HostfileError(
            f"{where}: {', '.join(diagonal)}: field 'rdma': the entry for the "
            "host itself must be null"
        )
    missing = [
        (i, j)
        for i, h in enumerate(hosts)
        for j in (sorted({(i - 1) % n, (i + 1) % n}) if ring else range(n))
        if i != j and hosts[i].rdma[j] is None
    ]
    if missing:
        pairs = ", ".join(
            f"{hosts[i].target} -> {hosts[j].target} (rdma[{i}][{j}])" for i, j in missing
        )
        raise HostfileError(f"{where}: field 'rdma': no device for {pairs}")
    port = starting_port if starting_port is not None else 32323
    common = {"MLX_JACCL_COORDINATOR": _join(hosts[0].ips[0], port)}
    if ring:
        common["MLX_JACCL_RING"] = "1"
    matrix = json.dumps([h.rdma for h in hosts])
    return [
        RankEnv(rank, h, dict(common, MLX_RANK=str(rank)), {"MLX_IBV_DEVICES": matrix})
        for rank, h in enumerate(hosts)
    ]


NCCL_PORT = 12345  # mlx.launch's --nccl-port default


def rank_gpus(hostfile: Hostfile) -> list[int | None]:
    """Each rank's CUDA device: the i-th of its host's ``gpus`` for the host's i-th rank; None
    where the host lists none."""
    return [None if h.gpus is None else h.gpus[i] for h in hostfile.hosts for i in range(h.slots)]


def nccl_env(hostfile: Hostfile, starting_port: int | None = None, *_ring: object) -> list[RankEnv]:
    """NCCL over the hosts' GPUs, one rank per GPU, as mlx.launch --backend nccl sets it:
    NCCL_HOST_IP (rank 0's first ip: rank 0 hands out NCCL's id there), NCCL_PORT,
    MLX_WORLD_SIZE, MLX_RANK and CUDA_VISIBLE_DEVICES."""
    where = hostfile.path or "<hostfile>"
    first = hostfile.hosts[0]
    if hostfile.world_size > 1 and not first.ips:
        raise HostfileError(
            f"{where}: {first.label}: field 'ips' is required for rank 0 by nccl (the "
            "address the other ranks fetch NCCL's id from)"
        )
    port = starting_port
    if port is None:  # a job on this machine takes a free port; elsewhere mlx.launch's
        port = free_port_run("127.0.0.1", 1) if first.is_local else NCCL_PORT
    common = {
        "NCCL_HOST_IP": first.ips[0] if first.ips else "127.0.0.1",
        "NCCL_PORT": str(port),
        "MLX_WORLD_SIZE": str(hostfile.world_size),
    }
    ranks, gpus = hostfile.rank_hosts(), rank_gpus(hostfile)
    out = []
    for rank, host in enumerate(ranks):
        # no gpus listed: the host's i-th rank on GPU i, as mlx.launch -n N does (rank % N)
        gpu = gpus[rank] if gpus[rank] is not None else sum(h is host for h in ranks[:rank])
        env = dict(common, MLX_RANK=str(rank), CUDA_VISIBLE_DEVICES=str(gpu))
        out.append(RankEnv(rank, host, env))
    return out


def rank_envs(
    hostfile: Hostfile,
    starting_port: int | None = None,
    connections_per_ip: int = 1,
    verbose: bool = False,
) -> list[RankEnv]:
    """Environment and files for every rank, for the hostfile's backend."""
    return RANK_ENVS[hostfile.backend](hostfile, starting_port, connections_per_ip, verbose)


# each backend's environment (cluster.core.backends describes the rest)
RANK_ENVS: dict[str, Callable[..., list[RankEnv]]] = {
    "ring": ring_env,
    "jaccl": jaccl_env,
    "jaccl-ring": jaccl_env,
    "nccl": nccl_env,
}
