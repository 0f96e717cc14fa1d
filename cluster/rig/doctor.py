"""`mlx-cluster doctor`: is every host of a hostfile ready to run a job?

One probe per host (a short Python program run with the host's own interpreter, locally or over
SSH) reports versions, memory, busy ports, RDMA devices and, on Linux, the BLAS the ranks will
use with a measured GFLOP/s; the checks compare them across hosts and against the model's share
(split as launch splits it). The probe imports nothing of ours, so it also works where
mlx-cluster is missing or broken.
"""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.core.blas import INSTALL_HINT, OPENBLAS_PATHS
from cluster.core.hostfile import Host, Hostfile
from cluster.core.modelcheck import looks_like_repo
from cluster.core.protocol import LinkReport
from cluster.job.backends import rank_envs, ring_ports
from cluster.job.memory import model_shares
from cluster.job.process import rank_python, shell_command

PACKAGES = ("mlx", "mlx-lm", "mlx-cluster")
JACCL_MIN_MACOS = (26, 2)
FIT_FRACTION = 0.85  # of a host's memory a rank's weights may take
# Problem kinds that `install` reports after installing (the others are the rig's, not its)
INSTALL_PROBLEMS = ("python", "package", "versions")

PROBE = r"""
import json, os, platform, shutil, socket, subprocess, sys
from importlib import metadata
args = json.loads(sys.argv[1])
out = {"python": sys.executable, "python_version": platform.python_version(),
       "system": platform.system(), "macos": platform.mac_ver()[0] or None, "packages": {}}
for name in args["packages"]:
    try:
        out["packages"][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out["packages"][name] = None
try:
    out["memory_bytes"] = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    out["memory_bytes"] = None
busy = []
for ip, port in args["ports"]:
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as MLX's ring binds
    try:
        s.bind((ip, port))
    except OSError as e:
        busy.append(f"{ip}:{port} ({e.strerror})")
    finally:
        s.close()
out["busy_ports"] = busy
if sys.platform == "linux":  # the BLAS the ranks will use (cluster.core.blas), and its speed
    lib = next((p for p in args["blas_paths"] if os.path.exists(p)), None)
    env = dict(os.environ)
    if lib:
        env["LD_PRELOAD"] = lib
        env["OPENBLAS_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args["ranks"]))
    bench = ("import time, mlx.core as mx\n"
             "a = mx.random.normal((256, 1024)); b = mx.random.normal((1024, 1024))\n"
             "mx.eval(a @ b)\n"
             "t = time.perf_counter(); n = 3\n"
             "for _ in range(n): mx.eval(a @ b)\n"
             "print(2 * 256 * 1024 * 1024 * n / (time.perf_counter() - t) / 1e9)\n")
    try:
        p = subprocess.run([sys.executable, "-c", bench], env=env, capture_output=True,
                           text=True, timeout=60)
        gflops = float(p.stdout.strip()) if p.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError):
        gflops = None
    out["blas"] = {"library": lib, "gflops": gflops}
if args["rdma"]:
    exe = shutil.which("ibv_devices")
    if exe is None:
        out["ibv_devices"] = None
    else:
        lines = subprocess.run([exe], capture_output=True, text=True).stdout.splitlines()
        out["ibv_devices"] = [l.split()[0] for l in lines[2:] if l.strip()]
print(json.dumps(out))
"""


@dataclass
class Problem:
    """What keeps a host from running a job; ``kind`` says which check found it."""

    kind: str  # ssh, python, package, versions, ports, jaccl, memory
    message: str


@dataclass
class HostReport:
    host: Host
    ranks: list[int]
    ssh: str = "local"
    probe: dict[str, Any] | None = None
    share_bytes: int | None = None
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # worth knowing; does not fail the host

    def problem(self, kind: str, message: str) -> None:
        self.problems.append(Problem(kind, message))

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        p = self.probe or {}
        return {
            "host": self.host.target,
            "index": self.host.index,
            "ranks": self.ranks,
            "ssh": self.ssh,
            "python": p.get("python"),
            "python_version": p.get("python_version"),
            "macos": p.get("macos"),
            "versions": p.get("packages"),
            "memory_bytes": self._memory(),
            "model_share_bytes": self.share_bytes,
            "busy_ports": p.get("busy_ports"),
            "ibv_devices": p.get("ibv_devices"),
            "blas": p.get("blas"),
            "ok": self.ok,
            "problems": [x.message for x in self.problems],
            "notes": self.notes,
        }

    def _memory(self) -> int | None:
        if self.host.memory_gb:
            return int(self.host.memory_gb * 1e9)
        return (self.probe or {}).get("memory_bytes")


def probe_args(hostfile: Hostfile, host: Host, ports: list[tuple[str, int]]) -> str:
    return json.dumps(
        {
            "packages": PACKAGES,
            "ports": ports,
            "rdma": bool(host.rdma) or hostfile.backend != "ring",
            "blas_paths": OPENBLAS_PATHS,
            "ranks": host.slots,
        }
    )


def run_probe(hostfile: Hostfile, host: Host, ports, accept_new: bool) -> HostReport:
    report = HostReport(host, [])
    python = rank_python(host, hostfile.python)
    command = [python, "-c", PROBE, probe_args(hostfile, host, ports)]
    try:
        if host.is_local:
            p = subprocess.run(command, capture_output=True, text=True, timeout=60)
            status, out, err = p.returncode, p.stdout, p.stderr
        else:
            from cluster.job.ssh import SSHError, connect, run

            try:
                client = connect(host, hostfile, accept_new)
            except SSHError as e:
                report.ssh = "failed"
                report.problem("ssh", str(e).removeprefix(f"{host.label}: "))
                return report
            report.ssh = "ok"
            try:
                status, out, err = run(client, shell_command(command), timeout=60)
            finally:
                client.close()
    except FileNotFoundError:
        status, out, err = 127, "", f"{python}: not found"
    except subprocess.TimeoutExpired:
        status, out, err = 124, "", "the probe did not finish within 60 s"
    if status != 0:
        last = err.strip().splitlines()[-1] if err.strip() else f"exit status {status}"
        report.problem("python", f"python {python} does not run: {last}")
        return report
    report.probe = json.loads(out)
    return report


def planned_ports(
    hostfile: Hostfile, starting_port: int | None, connections_per_ip: int = 1
) -> dict[int, list]:
    """Per host, the ring ports its ranks will bind (when known before the job starts)."""
    if hostfile.backend != "ring" or hostfile.world_size == 1:
        return {}
    ports: dict[int, list] = {}
    for env in rank_envs(hostfile, starting_port, connections_per_ip):
        ports.setdefault(env.host.index, []).extend(ring_ports(env.files, env.rank))
    return ports


def diagnose(
    hostfile: Hostfile,
    model: str | None = None,
    mode: str = "pipeline",
    starting_port: int | None = None,
    accept_new: bool = False,
    connections_per_ip: int = 1,
    split: list[int] | None = None,
) -> list[HostReport]:
    ports = planned_ports(hostfile, starting_port, connections_per_ip)
    with ThreadPoolExecutor(max_workers=min(16, len(hostfile.hosts))) as pool:
        reports = list(
            pool.map(
                lambda h: run_probe(hostfile, h, ports.get(h.index, []), accept_new), hostfile.hosts
            )
        )
    rank = 0
    for report in reports:
        report.ranks = list(range(rank, rank + report.host.slots))
        rank += report.host.slots

    probed = [r for r in reports if r.probe]
    for name in PACKAGES:
        versions = {r.probe["packages"][name] for r in probed}
        for r in probed:
            if r.probe["packages"][name] is None:
                r.problem("package", f"{name} is not installed for {r.probe['python']}")
        if len(versions - {None}) > 1:
            seen = ", ".join(f"{r.host.target}: {r.probe['packages'][name]}" for r in probed)
            for r in probed:
                r.problem("versions", f"{name} versions differ across hosts ({seen})")
    for r in probed:
        for busy in r.probe.get("busy_ports") or []:
            r.problem("ports", f"ring port {busy} is in use; pass another --starting-port")
        if hostfile.backend != "ring":
            _check_jaccl(r)
        _check_blas(r)

    if model and not looks_like_repo(model) and Path(model).expanduser().exists():
        shares = model_shares(model, mode, hostfile, split)
        for r in reports:
            r.share_bytes = sum(shares[k] for k in r.ranks)
            memory = r._memory()
            if memory and r.share_bytes > FIT_FRACTION * memory:
                r.problem(
                    "memory",
                    f"the model's share for ranks {r.ranks} ({r.share_bytes / 1e9:.1f} GB in "
                    f"{mode} mode) does not fit in {FIT_FRACTION:.0%} of "
                    f"{memory / 1e9:.1f} GB; add hosts or use a smaller quantization",
                )
    return reports


def _check_blas(r: HostReport) -> None:
    """A Linux host's BLAS: a note, never a failure (the reference one is only slow)."""
    blas = r.probe.get("blas")
    if blas is not None and not blas.get("library"):
        r.notes.append(
            f"the ranks would use the reference BLAS bundled with mlx[cpu] ({blas_cell(blas)}), "
            f"about 25x slower than OpenBLAS; {INSTALL_HINT}"
        )


def blas_cell(blas: dict | None) -> str:
    """The BLAS a Linux host's ranks use and its measured speed; '-' elsewhere."""
    if blas is None:
        return "-"
    name = "openblas" if blas.get("library") else "reference"
    speed = f"{blas['gflops']:.0f} GFLOP/s" if blas.get("gflops") else "not measured"
    return f"{name} {speed}"


def _check_jaccl(r: HostReport) -> None:
    probe = r.probe
    macos = probe.get("macos")
    need = ".".join(map(str, JACCL_MIN_MACOS))
    if probe.get("system") != "Darwin":
        r.problem(
            "jaccl",
            f"JACCL needs macOS {need}+ with Thunderbolt 5; this host runs {probe.get('system')}",
        )
    elif tuple(int(x) for x in macos.split(".")[:2]) < JACCL_MIN_MACOS:
        r.problem("jaccl", f"JACCL needs macOS {need} or later; this host has {macos}")
    devices = probe.get("ibv_devices")
    wanted = {
        d for cell in r.host.rdma if cell for d in ([cell] if isinstance(cell, str) else cell)
    }
    if devices is None:
        r.problem(
            "jaccl",
            "ibv_devices not found: RDMA is not available (enable it with "
            "`rdma_ctl enable` in Recovery)",
        )
    else:
        missing = sorted(wanted - set(devices))
        if missing:
            r.problem(
                "jaccl",
                f"RDMA device(s) {', '.join(missing)} from the hostfile are not "
                f"in ibv_devices ({', '.join(devices) or 'none'})",
            )


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def render(reports: list[HostReport]) -> str:
    """The table on stdout, then one line per problem."""
    header = [
        "HOST",
        "RANKS",
        "SSH",
        "PYTHON",
        *(p.upper() for p in PACKAGES),
        "BLAS",
        "MEMORY",
        "MODEL SHARE",
        "STATUS",
    ]
    rows = [header]
    for r in reports:
        p = r.probe or {}
        versions = [(p.get("packages") or {}).get(name) or "-" for name in PACKAGES]
        memory = r._memory()
        rows.append(
            [
                f"{r.host.index} {r.host.target}",
                ",".join(map(str, r.ranks)),
                r.ssh,
                p.get("python_version") or "-",
                *versions,
                blas_cell(p.get("blas")),
                f"{memory / 1e9:.1f} GB" if memory else "-",
                f"{r.share_bytes / 1e9:.2f} GB" if r.share_bytes is not None else "-",
                "ok" if r.ok else "FAIL",
            ]
        )
    lines = table(rows)
    for r in reports:
        where = f"host {r.host.index} ({r.host.target})"
        lines.extend(f"{where}: {p.message}" for p in r.problems)
        lines.extend(f"{where}: note: {note}" for note in r.notes)
    return "\n".join(lines) + "\n"


def table(rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


# doctor --links: what makes a link worth naming (node/links.py measures)
SLOW_FACTOR = 3.0  # round trip this many times the best link's (and 100 us more), or bandwidth
LOSSY_FACTOR, LOSSY_MIN_US = 20.0, 50_000.0  # a worst round trip this far over the median:
# TCP's retransmission timeouts (at least 200 ms on Linux) show a link that drops packets


def link_problems(report: LinkReport, labels: list[str]) -> list[str]:
    """A corrupting, lossy or slow link named by its two ranks and hosts, with what to do."""
    problems = []
    links = report.links
    best_rtt = min((x["rtt_4b_us"] for x in links), default=0.0)
    best_gbps = max((x["gbps"] for x in links), default=0.0)
    for x in links:
        name = f"link rank {x['a']} ({labels[x['a']]}) - rank {x['b']} ({labels[x['b']]})"
        if x["bad_words"]:
            problems.append(
                f"{name}: {x['bad_words']:.0f} words of a 64 MB pattern arrived changed: the "
                "link corrupts data; reseat or replace the cable, and update macOS (JACCL had "
                "such bugs, ml-explore/mlx#3152)"
            )
        worst = max(x["rtt_4b_max_us"], x["rtt_8kb_max_us"])
        if worst > LOSSY_FACTOR * x["rtt_8kb_us"] and worst > LOSSY_MIN_US:
            problems.append(
                f"{name}: a round trip took {worst / 1000:.0f} ms against a median of "
                f"{x['rtt_8kb_us'] / 1000:.2f} ms: the link drops packets (retransmissions); "
                "check the cable, or move the job off a Wi-Fi or shared link"
            )
        if len(links) > 1 and (
            x["rtt_4b_us"] > SLOW_FACTOR * best_rtt and x["rtt_4b_us"] - best_rtt > 100
        ):
            problems.append(
                f"{name}: round trip {x['rtt_4b_us']:.0f} us, {x['rtt_4b_us'] / best_rtt:.1f}x "
                "the best link's: every collective waits for it; check that its ips are the "
                "Thunderbolt addresses, not the LAN"
            )
        elif len(links) > 1 and x["gbps"] * SLOW_FACTOR < best_gbps:
            problems.append(
                f"{name}: {x['gbps']:.2f} Gbit/s, under a third of the best link's "
                f"{best_gbps:.2f}: prefill and loading wait for it; check the cable and port"
            )
    if report.allsum_bad_words:
        problems.append(
            f"all_sum over every rank returned {report.allsum_bad_words:.0f} wrong words: the "
            "backend corrupts sums; update MLX and macOS on every host"
        )
    return problems


def render_links(report: LinkReport, labels: list[str]) -> str:
    rows = [["LINK", "HOSTS", "RTT 4 B", "RTT 8 KB", "WORST", "BANDWIDTH", "EXACT"]]
    for x in report.links:
        rows.append(
            [
                f"{x['a']}-{x['b']}",
                f"{labels[x['a']]} - {labels[x['b']]}",
                f"{x['rtt_4b_us']:.0f} us",
                f"{x['rtt_8kb_us']:.0f} us",
                f"{max(x['rtt_4b_max_us'], x['rtt_8kb_max_us']) / 1000:.1f} ms",
                f"{x['gbps']:.2f} Gbit/s",
                "yes" if not x["bad_words"] else f"NO ({x['bad_words']:.0f} words)",
            ]
        )
    exact = "yes" if not report.allsum_bad_words else "NO"
    lines = table(rows) + [
        f"all_sum over {len(labels)} ranks: {report.allsum_4b_us:.0f} us at 4 B, "
        f"{report.allsum_8kb_us:.0f} us at 8 KB; exact: {exact}"
    ]
    lines += link_problems(report, labels)
    return "\n".join(lines) + "\n"
