"""`mlx-cluster hostfile discover`: a hostfile from the Thunderbolt cables between Macs.

As `mlx.distributed_config` does: each host's ``system_profiler SPThunderboltDataType -json``
says which Thunderbolt port leads to which other Mac (by domain UUID), ``networksetup
-listallhardwareports`` names the network interface of each port, and ``ibv_devices`` lists the
RDMA devices when RDMA is enabled. From that: the cables, then a ring or a full mesh, one /30
subnet per cable, and the hostfile plus the network commands that give each interface its
address. Only parsing and planning live here; running the commands is the CLI's job.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass, field
from itertools import permutations

from cluster.core.backends import BACKENDS

DEFAULT_SUBNETS = "10.200.0.0/16"
NETMASK = "255.255.255.252"
COMMANDS = {  # what each host is asked, and the file name its output is saved under
    "thunderbolt": ("system_profiler SPThunderboltDataType -json", "system_profiler.json"),
    "ports": ("networksetup -listallhardwareports", "networksetup.txt"),
    "rdma": ("ibv_devices", "ibv_devices.txt"),
    "address": ("ipconfig getifaddr en0 || ipconfig getifaddr en1", "ipconfig.txt"),
}


class TopologyError(ValueError):
    """The outputs cannot be read, or the cables do not make the topology asked for."""


@dataclass
class Port:
    iface: str  # en2, ...
    uuid: str  # this port's Thunderbolt domain UUID
    peer_uuid: str | None  # the domain UUID of the Mac at the other end


@dataclass
class Node:
    name: str  # the host as given (ssh target)
    ports: list[Port]
    rdma: list[str] = field(default_factory=list)  # ibv_devices
    address: str | None = None  # en0's address: where the JACCL coordinator listens
    others: list[str] = field(default_factory=list)  # non-Mac devices seen on the bus


@dataclass
class Link:
    """One cable: node a's interface to node b's."""

    a: int
    a_iface: str
    b: int
    b_iface: str
    a_ip: str = ""
    b_ip: str = ""


def parse_hardware_ports(text: str, host: str) -> dict[str, str]:
    """``networksetup -listallhardwareports``: {"Thunderbolt 1": "en2", ...}."""
    ports, name = {}, None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and name is not None:
            ports[name] = line.split(":", 1)[1].strip()
            name = None
    if not ports:
        raise TopologyError(
            f"{host}: `networksetup -listallhardwareports` listed no hardware ports; is this a Mac?"
        )
    return ports


def parse_ibv_devices(text: str) -> list[str]:
    """``ibv_devices``: the RDMA device names (a header of two lines, then one per line)."""
    return [w for line in text.splitlines() for w in line.split()[:1] if w.startswith("rdma_")]


def parse_thunderbolt(text: str, hardware_ports: dict[str, str], host: str) -> Node:
    """``system_profiler SPThunderboltDataType -json``: each bus of this Mac with the domain
    UUID of the Mac cabled to it. Devices without a domain UUID (docks, displays, disks) are
    not Macs: noted, not linked."""
    try:
        data = json.loads(text)
        buses = data["SPThunderboltDataType"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise TopologyError(
            f"{host}: `system_profiler SPThunderboltDataType -json` gave no Thunderbolt data "
            f"({type(e).__name__}: {e}); is this a Mac with Thunderbolt?"
        ) from None
    if not isinstance(buses, list):
        raise TopologyError(f"{host}: SPThunderboltDataType is not a list of buses")
    node = Node(host, [])
    for bus in buses:
        uuid = bus.get("domain_uuid_key") if isinstance(bus, dict) else None
        if uuid is None:
            continue
        tag = (bus.get("receptacle_1_tag") or {}).get("receptacle_id_key")
        if tag is None:
            continue
        iface = hardware_ports.get(f"Thunderbolt {tag}")
        if iface is None:
            raise TopologyError(
                f"{host}: Thunderbolt port {tag} has no network interface in `networksetup "
                f"-listallhardwareports` (no 'Thunderbolt {tag}' hardware port); add it in "
                "System Settings > Network, or reboot after plugging the cable"
            )
        peer = None
        for item in bus.get("_items") or []:
            if item.get("domain_uuid_key"):
                peer = peer or item["domain_uuid_key"]
            else:
                node.others.append(item.get("device_name_key") or item.get("_name") or "?")
        node.ports.append(Port(iface, uuid, peer))
    node.ports.sort(key=lambda p: p.iface)
    return node


def parse_node(host: str, outputs: dict[str, str | None]) -> Node:
    """A host's Node from its commands' outputs (keys as COMMANDS; rdma, address optional)."""
    if outputs.get("thunderbolt") is None or outputs.get("ports") is None:
        missing = [k for k in ("thunderbolt", "ports") if outputs.get(k) is None]
        raise TopologyError(
            f"{host}: no output of {', '.join(f'`{COMMANDS[k][0]}`' for k in missing)}"
        )
    node = parse_thunderbolt(
        outputs["thunderbolt"], parse_hardware_ports(outputs["ports"], host), host
    )
    node.rdma = parse_ibv_devices(outputs.get("rdma") or "")
    node.address = (outputs.get("address") or "").strip() or None
    return node


def find_links(nodes: list[Node]) -> tuple[list[Link], list[str]]:
    """The cables between the given Macs, each once; notes for what is cabled elsewhere."""
    owner = {p.uuid: (i, p) for i, n in enumerate(nodes) for p in n.ports}
    links, seen, notes = [], set(), []
    for i, n in enumerate(nodes):
        for p in n.ports:
            if p.peer_uuid is None or p.uuid in seen:
                continue
            if p.peer_uuid not in owner:
                notes.append(f"{n.name}: {p.iface} leads to a Mac that is not in --hosts")
                continue
            j, q = owner[p.peer_uuid]
            seen.update({p.uuid, q.uuid})
            links.append(Link(i, p.iface, j, q.iface))
    for n in nodes:
        if n.others:
            notes.append(f"{n.name}: not a Mac, ignored: {', '.join(sorted(set(n.others)))}")
    return links, notes


def cables(links: list[Link], i: int, j: int) -> list[Link]:
    """The cables between nodes i and j, as seen from i (a is i)."""
    out = []
    for link in links:
        if (link.a, link.b) == (i, j):
            out.append(link)
        elif (link.a, link.b) == (j, i):
            out.append(Link(i, link.b_iface, j, link.a_iface, link.b_ip, link.a_ip))
    return out


def find_ring(n: int, links: list[Link]) -> list[int] | None:
    """An order of the nodes in which each is cabled to the next and the last to the first,
    keeping the given order when it works (node 0 first)."""
    if n == 1:
        return [0]
    for rest in permutations(range(1, n)):
        order = [0, *rest]
        if all(cables(links, order[k], order[(k + 1) % n]) for k in range(n)):
            return order
    return None


def missing_pairs(nodes: list[Node], links: list[Link], pairs) -> list[str]:
    return [f"{nodes[i].name} - {nodes[j].name}" for i, j in pairs if not cables(links, i, j)]


def assign_addresses(links: list[Link], pool: str = DEFAULT_SUBNETS) -> None:
    """One /30 per cable from ``pool``: .1 on one end, .2 on the other."""
    try:
        subnets = ipaddress.ip_network(pool).subnets(new_prefix=30)
    except ValueError as e:
        raise TopologyError(f"--subnets {pool}: {e}") from None
    for link in links:
        try:
            net = next(subnets)
        except StopIteration:
            raise TopologyError(
                f"--subnets {pool} has too few /30 subnets for the cables"
            ) from None
        first, second = list(net.hosts())
        link.a_ip, link.b_ip = str(first), str(second)


@dataclass
class RigPlan:
    backend: str
    order: list[int]  # rank -> node index
    hosts: list[dict]  # hostfile host entries, in rank order
    commands: dict[str, list[str]]  # host name -> its network commands
    notes: list[str]


def plan_rig(nodes: list[Node], backend: str | None = None, pool: str = DEFAULT_SUBNETS) -> RigPlan:
    """The backend (as asked, else: JACCL mesh > JACCL ring > TCP ring), the rank order, the
    hostfile entries and each host's commands. Errors name the cables that are missing."""
    n = len(nodes)
    if n < 2:
        raise TopologyError("discover needs at least 2 hosts")
    links, notes = find_links(nodes)
    if not links:
        raise TopologyError(
            "no Thunderbolt cable joins any two of these Macs; check the cables (and that each "
            "Mac sees the other in System Information > Thunderbolt/USB4)"
        )
    all_pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    mesh = not missing_pairs(nodes, links, all_pairs)
    ring = find_ring(n, links)
    no_rdma = [x.name for x in nodes if not x.rdma]
    if backend is None:
        backend = ("jaccl" if mesh else "jaccl-ring") if not no_rdma else "ring"
    if backend == "jaccl" and not mesh:
        raise TopologyError(
            "jaccl needs a cable between every pair of Macs; missing: "
            + ", ".join(missing_pairs(nodes, links, all_pairs))
            + " (or use --backend jaccl-ring, or ring)"
        )
    if backend in ("ring", "jaccl-ring") and ring is None:
        raise TopologyError(_no_ring(nodes, links))
    if BACKENDS[backend].rdma and no_rdma:
        raise TopologyError(
            f"{backend} needs RDMA, but `ibv_devices` lists no rdma_ device on "
            f"{', '.join(no_rdma)}; enable it with `rdma_ctl enable` in Recovery (macOS 26.2+, "
            "Thunderbolt 5), or use --backend ring"
        )
    order = list(range(n)) if backend == "jaccl" else ring
    links, unused = even_cables(nodes, links, order, backend)
    notes += unused
    assign_addresses(links, pool)
    hosts = [_host_entry(nodes, links, order, rank, backend) for rank in range(n)]
    commands = {x.name: _commands(i, links) for i, x in enumerate(nodes)}
    return RigPlan(backend, order, hosts, commands, notes)


def even_cables(
    nodes: list[Node], links: list[Link], order: list[int], backend: str
) -> tuple[list[Link], list[str]]:
    """The cables the job uses, and a note for each one left unused. MLX's ring needs as many
    connections to the left of every rank as to its right, and JACCL the same count between
    every pair it joins: keep the smallest cable count along the ring (or over every pair of
    a mesh), as ``mlx.distributed_config`` does."""
    n = len(order)
    if backend == "jaccl":
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    else:
        pairs = sorted({tuple(sorted((order[k], order[(k + 1) % n]))) for k in range(n)})
    per_pair = {p: sorted(cables(links, *p), key=lambda c: c.a_iface) for p in pairs}
    keep = min(len(c) for c in per_pair.values())
    kept, notes = [], []
    for (i, j), found in per_pair.items():
        kept += found[:keep]
        notes += [
            f"cable {nodes[i].name}:{c.a_iface} - {nodes[j].name}:{c.b_iface} left unused: "
            f"every pair of neighbours must have the same number of cables ({keep} here)"
            for c in found[keep:]
        ]
    return kept, notes


def _no_ring(nodes: list[Node], links: list[Link]) -> str:
    n = len(nodes)
    counts = [sum(1 for link in links if i in (link.a, link.b)) for i in range(n)]
    few = [f"{nodes[i].name} has {c}" for i, c in enumerate(counts) if c < 2]
    detail = f" ({', '.join(few)} cable(s); each Mac of a ring needs 2)" if few else ""
    cabled = ", ".join(f"{nodes[x.a].name} - {nodes[x.b].name}" for x in links)
    return f"the cables do not close a ring through all {n} Macs{detail}; cabled: {cabled}"


def _host_entry(nodes, links, order, rank, backend) -> dict:
    n = len(order)
    i = order[rank]
    entry: dict = {"ssh": nodes[i].name}
    if backend == "ring":  # a rank listens on its cable(s) to the rank before it
        entry["ips"] = [c.a_ip for c in cables(links, i, order[rank - 1])]
        return entry
    entry["ips"] = [nodes[i].address or nodes[i].name]  # the coordinator, over the LAN
    neighbours = {order[(rank - 1) % n], order[(rank + 1) % n]}
    rdma = []
    for other in order:
        if other == i or (backend == "jaccl-ring" and other not in neighbours):
            rdma.append(None)
            continue
        devices = [f"rdma_{c.a_iface}" for c in cables(links, i, other)]
        rdma.append(devices[0] if len(devices) == 1 else devices)
    entry["rdma"] = rdma
    return entry


def _commands(i: int, links: list[Link]) -> list[str]:
    """Give each Thunderbolt interface of node i its address, off the Thunderbolt bridge."""
    ours = [
        c for other in {x.a if x.b == i else x.b for x in links} for c in cables(links, i, other)
    ]
    if not ours:
        return []
    lines = ["sudo ifconfig bridge0 down"]
    for c in sorted(ours, key=lambda c: c.a_iface):
        lines.append(f"sudo ifconfig {c.a_iface} inet {c.a_ip} netmask {NETMASK}")
        lines.append(f"sudo route change {c.b_ip} -interface {c.a_iface}")
    return lines
