"""A rig of separate hosts on this machine: network namespaces, each with its own address, its
own sshd on port 22 and a shaped link.

    python -m tests.support.netrig up 3 --rtt 300us --rate 10gbit  # hosts 10.231.0.1-3, a hostfile
    python -m tests.support.netrig shape 2 --loss 5 --jitter 2ms      # host 2's link, while up
    python -m tests.support.netrig link 2 down                        # pull host 2's cable
    python -m tests.support.netrig down

Each host is a namespace ``mcr<i>``. Its LAN port ``eth0`` (10.231.0.<i>/24) is a TAP device
whose other end is the *wire*: a small switch in user space (``Wire`` below, its own process)
that also joins this machine's root namespace (10.231.0.254, the "laptop"). This kernel has no
``netem``, so the wire applies each host's link shaping itself: one-way delay and jitter (in
order, like netem with a rate), rate, and random loss, on frames the host sends. Two hosts thus
see a round trip of twice the delay; ``--rtt`` sets delay = rtt / 2. A link goes down for real
(``ip link set eth0 down`` inside the host).

With ``--cables`` the hosts are also joined in a ring by point-to-point veth "Thunderbolt
cables", one /30 each, addressed by ``cluster.rig.topology.plan_rig`` as ``hostfile discover`` plans
them (``en1`` to the next host, ``en2`` to the previous one); the hostfile's ``ips`` are then
the cable addresses and the LAN carries only SSH.

Addresses live only inside namespaces made here and removed by ``down``; traffic flows only
between them and the root namespace's 10.231.0.254.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

PREFIX = "mcr"  # namespaces mcr1.., devices mcrtap0..; the tests use their own
LAN = "10.231.0"  # host i is LAN.i, the root namespace LAN.254; cables in A.B.128.0/20
STATE = Path("/tmp/mlx-cluster-netrig")
MTU = 9000  # a jumbo frame, as Thunderbolt bridges use: fewer frames through the wire
SSHD = shutil.which("sshd") or "/usr/sbin/sshd"

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def available() -> str | None:
    """Why a rig cannot be built here, or None."""
    if os.geteuid() != 0:
        return "the rig needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "the rig needs iproute2's `ip`"
    if not os.path.exists("/dev/net/tun"):
        return "the rig needs /dev/net/tun"
    if not os.path.exists(SSHD):
        return "the rig needs OpenSSH's sshd"
    return None


# ---------------------------------------------------------------- link shaping

UNITS_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
UNITS_BIT = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def seconds(text: str) -> float:
    """'300us', '2ms', '0.5s' or a bare number of seconds."""
    m = re.fullmatch(r"([0-9.]+)\s*(s|ms|us)?", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"not a time: {text!r} (say 300us, 2ms)")
    return float(m.group(1)) * UNITS_S[m.group(2) or "s"]


def bits_per_s(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*(bit|kbit|mbit|gbit)?", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (say 1gbit, 100mbit)")
    return float(m.group(1)) * UNITS_BIT[m.group(2) or "bit"]


@dataclass
class Shape:
    """What a host's link does to the frames the host sends."""

    delay_s: float = 0.0
    jitter_s: float = 0.0
    rate_bps: float = 0.0  # 0: as fast as the wire goes
    loss: float = 0.0  # percent


# ---------------------------------------------------------------- the wire


def open_tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


@dataclass
class Port:
    name: str
    fd: int
    shape: Shape = field(default_factory=Shape)
    free_at: float = 0.0  # when the link has sent what it holds (rate)
    last_arrival: float = 0.0  # frames arrive in order


class Wire:
    """An Ethernet switch between TAP devices: learns MAC addresses, floods the unknown, and
    delivers each frame after its sender's link delay. One thread, a heap of due frames."""

    def __init__(self, ports: list[Port], control: socket.socket):
        self.ports = ports
        self.by_fd = {p.fd: p for p in ports}
        self.macs: dict[bytes, Port] = {}
        self.due: list[tuple[float, int, Port, bytes]] = []
        self.seq = 0
        self.control = control
        self.rng = random.Random()

    def run(self) -> None:
        fds = [p.fd for p in self.ports] + [self.control.fileno()]
        while True:
            now = time.monotonic()
            while self.due and self.due[0][0] <= now:
                _, _, port, frame = heapq.heappop(self.due)
                try:
                    os.write(port.fd, frame)
                except OSError:
                    pass  # the host's link is down: the frame is lost, as on a real cable
            timeout = max(0.0, self.due[0][0] - time.monotonic()) if self.due else None
            readable, _, _ = select.select(fds, [], [], timeout)
            for fd in readable:
                if fd == self.control.fileno():
                    self.on_control()
                    continue
                src = self.by_fd[fd]
                for _ in range(64):  # drain a burst
                    try:
                        frame = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    self.forward(src, frame)

    def forward(self, src: Port, frame: bytes) -> None:
        s = src.shape
        if s.loss and self.rng.random() * 100 < s.loss:
            return
        now = time.monotonic()
        if s.rate_bps:
            src.free_at = max(now, src.free_at) + len(frame) * 8 / s.rate_bps
            sent = src.free_at
        else:
            sent = now
        jitter = self.rng.uniform(-s.jitter_s, s.jitter_s) if s.jitter_s else 0.0
        arrival = max(sent + max(0.0, s.delay_s + jitter), src.last_arrival)
        src.last_arrival = arrival
        self.macs[frame[6:12]] = src
        dst = frame[0:6]
        targets = [self.macs[dst]] if dst in self.macs else self.ports
        for port in targets:
            if port is not src:
                self.seq += 1
                heapq.heappush(self.due, (arrival, self.seq, port, frame))

    def on_control(self) -> None:
        """A datagram {"port": name, "shape": {...}} reshapes one port's link."""
        data = self.control.recv(4096)
        msg = json.loads(data)
        for p in self.ports:
            if p.name == msg["port"]:
                p.shape = Shape(**msg["shape"])


def run_wire(names: list[str], control_path: str, ready_fd: int) -> None:
    """The wire's process: make the TAPs, say so on ready_fd, then switch frames forever."""
    ports = [Port(n, open_tap(n)) for n in names]
    control = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if os.path.exists(control_path):
        os.unlink(control_path)
    control.bind(control_path)
    os.write(ready_fd, b"ok")
    os.close(ready_fd)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:  # the wire is the link: a frame must not wait for ranks that spin in a collective
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
    except (OSError, AttributeError):
        pass  # not root: the links are slower and noisier under load
    Wire(ports, control).run()


# ---------------------------------------------------------------- the rig


@dataclass
class RigHost:
    index: int  # 1-based
    ns: str
    address: str  # LAN
    cable_ips: list[str] = field(default_factory=list)  # ring backend's ips over cables
    sshd_pid: int | None = None


@dataclass
class Rig:
    n: int
    base: Path
    hosts: list[RigHost]
    cables: bool
    wire_pid: int
    user_key: Path
    known_hosts: Path
    cable_ifaces: dict[str, list[str]] = field(default_factory=dict)  # ns -> its cable ifaces
    prefix: str = PREFIX
    lan: str = LAN

    # -- what a test or a user does with it

    def hostfile(
        self,
        hosts: list[int] | None = None,
        python: str | None = None,
        over_cables: bool | None = None,
        **extra,
    ) -> dict:
        """A hostfile for these hosts (1-based, default all): one rank per host, the ring
        backend over the cables when there are any (all hosts then), else over the LAN."""
        over_cables = self.cables if over_cables is None else over_cables
        chosen = [self.hosts[i - 1] for i in (hosts or range(1, self.n + 1))]
        if over_cables and len(chosen) != self.n:
            raise ValueError("the cables make a ring through every host: use all of them")
        entries = [
            {"ssh": h.address, "ips": h.cable_ips if over_cables else [h.address]} for h in chosen
        ]
        # the hosts share this machine's cores: each rank's BLAS gets its share of them
        threads = str(max(1, (os.cpu_count() or 1) // len(chosen)))
        extra.setdefault("env", {}).setdefault("OPENBLAS_NUM_THREADS", threads)
        return {
            "backend": "ring",
            "python": python or sys.executable,
            "ssh": {
                "user": "root",
                "identity_file": str(self.user_key),
                "known_hosts": str(self.known_hosts),
            },
            "hosts": entries,
            **extra,
        }

    def shape(self, i: int, shape: Shape) -> None:
        msg = json.dumps({"port": tap_name(self.prefix, i), "shape": asdict(shape)}).encode()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.sendto(msg, str(self.base / "wire.sock"))

    def link(self, i: int, up: bool) -> None:
        ip("link", "set", "eth0", "up" if up else "down", ns=self.hosts[i - 1].ns)
        if up:  # the address and route come back with the link
            wait_for(lambda: reachable(self.hosts[i - 1].address), f"host {i}'s link")

    def cable(self, i: int, j: int, up: bool, silent: bool = False) -> None:
        """Pull (or plug back) the cable between host i and host j. ``silent``: the ports stay
        up and every frame is dropped (a cable that fails without a carrier change): a tbf
        whose burst is smaller than any frame (this kernel has no netem or drop action)."""
        a, b = self.hosts[i - 1], self.hosts[j - 1]
        for host, other in ((a, b), (b, a)):
            for iface in self.cable_ifaces.get(host.ns, []):
                if not iface.endswith(f"-{other.index}"):
                    continue
                if silent:
                    qdisc = ("tc", "qdisc", "replace" if not up else "del", "dev", iface, "root")
                    drop = ("tbf", "rate", "8bit", "burst", "1", "latency", "1ms")
                    cmd = ["ip", "netns", "exec", host.ns, *qdisc, *(drop if not up else ())]
                    subprocess.run(cmd, check=True, capture_output=True)
                else:
                    ip("link", "set", iface, "up" if up else "down", ns=host.ns)

    def power_off(self, i: int) -> None:
        """Every process in host i's namespace killed at once, as when a Mac loses power."""
        ns = self.hosts[i - 1].ns
        for pid in pids(ns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.hosts[i - 1].sshd_pid = None

    def power_on(self, i: int) -> None:
        self.hosts[i - 1].sshd_pid = start_sshd(self, self.hosts[i - 1])

    def kill_sshd(self, i: int) -> None:
        """sshd's listener only (its sessions live on, as with `launchctl stop` of sshd)."""
        pid = self.hosts[i - 1].sshd_pid
        if pid:
            os.kill(pid, signal.SIGKILL)
            self.hosts[i - 1].sshd_pid = None

    def rank_pids(self) -> dict[int, list[int]]:
        """host index -> the `python -m node` processes in its namespace."""
        return {h.index: [p for p in pids(h.ns) if is_rank(p)] for h in self.hosts}

    def save(self) -> None:
        d = asdict(self)
        d["base"], d["user_key"], d["known_hosts"] = map(
            str, (self.base, self.user_key, self.known_hosts)
        )
        (self.base / "rig.json").write_text(json.dumps(d, indent=1))

    @staticmethod
    def load(base: Path = STATE) -> Rig:
        d = json.loads((base / "rig.json").read_text())
        d["hosts"] = [RigHost(**h) for h in d["hosts"]]
        for k in ("base", "user_key", "known_hosts"):
            d[k] = Path(d[k])
        return Rig(**d)


def tap_name(prefix: str, i: int) -> str:
    return f"{prefix}tap{i}"  # i = 0: the root namespace's port


def pids(ns: str) -> list[int]:
    p = ip("netns", "pids", ns, check=False)
    return [int(x) for x in p.stdout.split()]


def is_rank(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"-m" in argv and b"node" in argv


def reachable(address: str, port: int = 22) -> bool:
    try:
        socket.create_connection((address, port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_for(ok, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:g} s")
        time.sleep(0.1)


def keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def start_sshd(rig: Rig, host: RigHost) -> int:
    d = rig.base / host.ns
    config = d / "sshd_config"
    config.write_text(
        f"Port 22\nListenAddress 0.0.0.0\nHostKey {d}/host_key\n"
        f"AuthorizedKeysFile {rig.base}/authorized_keys\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\n"
        f"UsePAM no\nPidFile {d}/sshd.pid\nSubsystem sftp internal-sftp\nMaxStartups 100\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)
    proc = subprocess.Popen(
        ["ip", "netns", "exec", host.ns, SSHD, "-D", "-e", "-f", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=open(d / "sshd.log", "a"),
        start_new_session=True,
    )

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd on {host.ns} ended: {(d / 'sshd.log').read_text()}")
        return reachable(host.address)

    wait_for(listening, f"sshd on {host.ns}")
    return proc.pid


def up(
    n: int,
    cables: bool = False,
    base: Path = STATE,
    shape: Shape | None = None,
    prefix: str = PREFIX,
    lan: str = LAN,
) -> Rig:
    """Build the rig (taking down what an earlier one of this prefix left)."""
    why = available()
    if why:
        raise RuntimeError(why)
    down(base, prefix)
    base.mkdir(parents=True)
    os.chmod(base, 0o700)
    keygen(base / "user_key")
    shutil.copy(base / "user_key.pub", base / "authorized_keys")

    names = [tap_name(prefix, i) for i in range(n + 1)]
    r, w = os.pipe()
    wire = subprocess.Popen(
        [sys.executable, __file__, "wire", str(base / "wire.sock"), str(w), *names],
        pass_fds=(w,),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=open(base / "wire.log", "w"),
    )
    os.close(w)
    if os.read(r, 2) != b"ok":
        raise RuntimeError(f"the wire did not start: {(base / 'wire.log').read_text()}")
    os.close(r)
    (base / "wire.pid").write_text(str(wire.pid))

    root = tap_name(prefix, 0)
    ip("link", "set", root, "mtu", str(MTU))
    ip("addr", "add", f"{lan}.254/24", "dev", root)
    ip("link", "set", root, "up")
    hosts = []
    for i in range(1, n + 1):
        ns = f"{prefix}{i}"
        ip("netns", "add", ns)
        ip("link", "set", "lo", "up", ns=ns)
        ip("link", "set", tap_name(prefix, i), "netns", ns)
        ip("link", "set", tap_name(prefix, i), "name", "eth0", ns=ns)
        ip("link", "set", "eth0", "mtu", str(MTU), ns=ns)
        ip("addr", "add", f"{lan}.{i}/24", "dev", "eth0", ns=ns)
        ip("link", "set", "eth0", "up", ns=ns)
        hosts.append(RigHost(i, ns, f"{lan}.{i}"))
        (base / ns).mkdir()
        keygen(base / ns / "host_key")

    rig = Rig(
        n, base, hosts, cables, wire.pid, base / "user_key", base / "known_hosts", {}, prefix, lan
    )
    if cables:
        lay_cables(rig)
    lines = []
    for h in hosts:
        key = (base / h.ns / "host_key.pub").read_text().split()
        lines.append(f"{h.address} {key[0]} {key[1]}\n")
    rig.known_hosts.write_text("".join(lines))
    for h in hosts:
        h.sshd_pid = start_sshd(rig, h)
        if shape:
            rig.shape(h.index, shape)
    rig.save()
    return rig


def cable_iface(i: int, j: int, n: int) -> str:
    """Host i's port to host j (0-based): en1 to the next host, en2 to the previous one."""
    return f"en{1 if j == (i + 1) % n else 2}-{j + 1}"


def lay_cables(rig: Rig) -> None:
    """A ring of veth cables, addressed as `hostfile discover` would: cluster.rig.topology.plan_rig
    over Thunderbolt ports that name their peers."""
    from cluster.rig.topology import Node, plan_rig
    from cluster.rig.topology import Port as TBPort

    n = rig.n
    nodes = []
    for i in range(n):
        ports = [
            TBPort(cable_iface(i, j, n), f"u{i}-{j}", f"u{j}-{i}")
            for j in sorted({(i + 1) % n, (i - 1) % n})
        ]
        nodes.append(Node(rig.hosts[i].address, ports))
    a, b, _ = rig.lan.split(".")
    p = plan_rig(nodes, "ring", f"{a}.{b}.128.0/20")
    for rank, entry in enumerate(p.hosts):
        rig.hosts[p.order[rank]].cable_ips = entry["ips"]
    ends = {}  # (host, iface) -> the address plan_rig() gives that end
    for name, commands in p.commands.items():
        for line in commands:
            if m := re.match(r"sudo ifconfig (\S+) inet (\S+) netmask", line):
                ends[(name, m.group(1))] = m.group(2)
    for i in range(n if n > 2 else 1):
        j = (i + 1) % n
        a, b = rig.hosts[i], rig.hosts[j]
        tmp_a, tmp_b = f"{rig.prefix}c{i + 1}x{j + 1}", f"{rig.prefix}c{j + 1}x{i + 1}"
        ip("link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b)
        for host, tmp, iface in (
            (a, tmp_a, cable_iface(i, j, n)),
            (b, tmp_b, cable_iface(j, i, n)),
        ):
            ip("link", "set", tmp, "netns", host.ns)
            ip("link", "set", tmp, "name", iface, ns=host.ns)
            ip("link", "set", iface, "mtu", str(MTU), ns=host.ns)
            ip("addr", "add", f"{ends[(host.address, iface)]}/30", "dev", iface, ns=host.ns)
            ip("link", "set", iface, "up", ns=host.ns)
            rig.cable_ifaces.setdefault(host.ns, []).append(iface)


def down(base: Path = STATE, prefix: str = PREFIX) -> None:
    """Remove every namespace, process and device a rig made (also a half-made one)."""
    names = ip("netns", "list", check=False).stdout.split("\n")
    for line in names:
        ns = line.split(" ")[0]
        if re.fullmatch(rf"{prefix}\d+", ns):
            for pid in pids(ns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            ip("netns", "del", ns, check=False)
    pidfile = base / "wire.pid"
    if pidfile.exists():
        try:
            os.kill(int(pidfile.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="build a rig of N hosts and print its hostfile")
    u.add_argument("n", type=int)
    u.add_argument("--cables", action="store_true", help="a ring of point-to-point cables too")
    for p in (u, s := sub.add_parser("shape", help="reshape host I's link")):
        p.add_argument("--rtt", type=seconds, default=0.0, help="host-to-host round trip")
        p.add_argument("--jitter", type=seconds, default=0.0, help="+- this on each delay")
        p.add_argument("--rate", type=bits_per_s, default=0.0, help="e.g. 10gbit")
        p.add_argument("--loss", type=float, default=0.0, help="percent of frames dropped")
    s.add_argument("i", type=int)
    k = sub.add_parser("link", help="take host I's LAN link down or up")
    k.add_argument("i", type=int)
    k.add_argument("state", choices=("up", "down"))
    sub.add_parser("down", help="remove the rig")
    w = sub.add_parser("wire")  # internal: the wire's own process
    w.add_argument("control")
    w.add_argument("ready_fd", type=int)
    w.add_argument("names", nargs="+")
    args = parser.parse_args()
    if args.cmd == "wire":
        run_wire(args.names, args.control, args.ready_fd)
    elif args.cmd == "down":
        down()
    elif args.cmd == "link":
        Rig.load().link(args.i, args.state == "up")
    else:
        shape = Shape(args.rtt / 2, args.jitter, args.rate, args.loss)
        if args.cmd == "up":
            import yaml

            rig = up(args.n, args.cables, shape=shape)
            sys.stdout.write(yaml.safe_dump(rig.hostfile(), sort_keys=False))
        else:
            Rig.load().shape(args.i, shape)


if __name__ == "__main__":
    main()
