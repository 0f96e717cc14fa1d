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

from cluster.core.backends import BACKENDS
from cluster.core.blas import INSTALL_HINT, OPENBLAS_PATHS
from cluster.core.gpus import shared_gpu_warning
from cluster.core.hostfile import Host, Hostfile
from cluster.core.links import link_problems
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
if sys.platform == "linux" and shutil.which("nvidia-smi"):  # NVIDIA GPUs, and MLX on them
    gpu = {"devices": [], "cuda_version": None, "mlx": None}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.free,"
                            "driver_version", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        for line in q.stdout.strip().splitlines():
            i, name, total, free, driver = [x.strip() for x in line.split(",")]
            gpu["devices"].append({"index": int(i), "name": name, "memory_mib": float(total),
                                   "free_mib": float(free), "driver": driver})
        head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        if "CUDA Version:" in head:
            gpu["cuda_version"] = head.split("CUDA Version:")[1].split()[0]
    except (subprocess.TimeoutExpired, OSError, ValueError) as e:
        gpu["error"] = str(e)
    bench = ("import json, time, mlx.core as mx\n"
             "out = {'cuda': mx.cuda.is_available(), 'device': str(mx.default_device())}\n"
             "if out['cuda']:\n"
             "    a = mx.random.normal((8192, 8192)).astype(mx.bfloat16); b = a.T\n"
             "    mx.eval(a @ b); mx.synchronize(); t = time.perf_counter()\n"
             "    for _ in range(10): mx.eval(a @ b)\n"
             "    out['tflops'] = 2 * 8192**3 * 10 / (time.perf_counter() - t) / 1e12\n"
             "    x = mx.zeros((2**28,), dtype=mx.float32); mx.eval(x + 1)\n"
             "    t = time.perf_counter()\n"
             "    for _ in range(10): mx.eval(x + 1)\n"
             "    out['gbps'] = 2 * 4 * 2**28 * 10 / (time.perf_counter() - t) / 1e9\n"
             "print(json.dumps(out))\n")
    env = dict(os.environ)
    if args["gpus"]:
        env["CUDA_VISIBLE_DEVICES"] = str(args["gpus"][0])  # the first rank's GPU
    try:
        p = subprocess.run([sys.executable, "-c", bench], env=env, capture_output=True,
                           text=True, timeout=120)
        gpu["mlx"] = json.loads(p.stdout) if p.returncode == 0 else {"error": p.stderr[-300:]}
    except (subprocess.TimeoutExpired, ValueError) as e:
        gpu["mlx"] = {"error": str(e)}
    out["gpu"] = gpu
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

    kind: str  # ssh, python, package, versions, ports, jaccl, gpu, memory
    message: str


@dataclass
class HostReport:
    host: Host
    ranks: list[int]
    ssh: str = "local"
    probe: dict[str, Any] | None = None
    share_bytes: int | None = None
    ranks_gpus: list[int] = field(default_factory=list)  # the CUDA devices its ranks use
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
            "gpu": p.get("gpu"),
            "ok": self.ok,
            "problems": [x.message for x in self.problems],
            "notes": self.notes,
        }

    def _memory(self) -> int | None:
        """What the host's ranks can hold: the hostfile's memory_gb; else the memory of the
        GPUs they use, when they use GPUs (ranks_gpus); else the host's RAM."""
        if self.host.memory_gb:
            return int(self.host.memory_gb * 1e9)
        devices = ((self.probe or {}).get("gpu") or {}).get("devices") or []
        used = [d for d in devices if d["index"] in self.ranks_gpus]
        if used:
            return int(sum(d["memory_mib"] for d in used) * 2**20)
        return (self.probe or {}).get("memory_bytes")


def probe_args(hostfile: Hostfile, host: Host, ports: list[tuple[str, int]]) -> str:
    return json.dumps(
        {
            "packages": PACKAGES,
            "ports": ports,
            "rdma": bool(host.rdma) or BACKENDS[hostfile.backend].rdma,
            "blas_paths": OPENBLAS_PATHS,
            "ranks": host.slots,
            "gpus": gpus_of(hostfile, host),
        }
    )


def gpus_of(hostfile: Hostfile, host: Host) -> list[int]:
    """The CUDA devices the host's ranks will use ([] when they use none they were given)."""
    if host.gpus is not None:
        return list(host.gpus)
    return list(range(host.slots)) if BACKENDS[hostfile.backend].gpus else []


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
    if BACKENDS[hostfile.backend].mlx != "ring" or hostfile.world_size == 1:
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
        report.ranks_gpus = gpus_of(hostfile, report.host)
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
        if BACKENDS[hostfile.backend].rdma:
            _check_jaccl(r)
        _check_blas(r)
        _check_gpus(r, gpus_of(hostfile, r.host), hostfile.backend)

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


def _check_gpus(r: HostReport, wanted: list[int], backend: str) -> None:
    """The GPUs the hostfile gives a host's ranks are there, and MLX runs on them (its CUDA
    build); a host with GPUs that the hostfile does not use gets a note."""
    if r.host.device == "cpu":  # its ranks leave the host's GPUs alone
        return
    gpu = r.probe.get("gpu")
    mlx = (gpu or {}).get("mlx") or {}
    if not wanted:
        if gpu and gpu["devices"] and not BACKENDS[backend].gpus and len(r.ranks) > 1:
            d = gpu["devices"][0]  # MLX's default device: every rank of the host on it
            what = f"GPU {d['index']} ({d['name']}, {d['memory_mib'] / 1024:.0f} GB)"
            r.notes.append(shared_gpu_warning(r.ranks, what, r.host.target, bool(mlx.get("cuda"))))
        elif gpu and gpu["devices"] and not BACKENDS[backend].gpus:
            where = "its ranks run on MLX's default device" if mlx.get("cuda") else (
                "MLX here is its CPU build, so its ranks run on the CPU")  # fmt: skip
            r.notes.append(
                f"{len(gpu['devices'])} NVIDIA GPU(s) found; {where}; give the host `gpus:` "
                "in the hostfile to put one rank on each"
            )
        return
    if gpu is None or not gpu["devices"]:
        r.problem("gpu", f"the hostfile gives its ranks GPUs {wanted}, but nvidia-smi finds no "
                  "NVIDIA GPU here (is the driver installed?)")  # fmt: skip
        return
    have = {d["index"] for d in gpu["devices"]}
    missing = [g for g in wanted if g not in have]
    if missing:
        r.problem("gpu", f"GPU(s) {missing} from the hostfile are not here (nvidia-smi lists "
                  f"{sorted(have)})")  # fmt: skip
    if not mlx.get("cuda"):
        why = mlx.get("error", "").strip().splitlines()[-1:] or ["MLX here is its CPU build"]
        r.problem("gpu", f"MLX does not run on the GPU ({why[0]}): install the CUDA build with "
                  "`mlx-cluster install` (it puts mlx-cluster[cuda] on GPU hosts), or pip "
                  "install 'mlx-cluster[cuda]' and then pip install --no-deps "
                  "--force-reinstall mlx-cuda-13==<mlx's version>")  # fmt: skip


def gpu_cell(gpu: dict | None) -> str:
    """A Linux host's GPUs and what MLX measured on the first one its ranks use; '-' without."""
    if not gpu or not gpu.get("devices"):
        return "-"
    names = {d["name"].removeprefix("NVIDIA ") for d in gpu["devices"]}
    cell = f"{len(gpu['devices'])}x {', '.join(sorted(names))}"
    mlx = gpu.get("mlx") or {}
    if mlx.get("tflops"):
        cell += f", {mlx['tflops']:.0f} TFLOP/s bf16, {mlx['gbps']:.0f} GB/s"
    elif not mlx.get("cuda"):
        cell += ", not used by MLX"
    return cell


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
        "GPU",
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
                gpu_cell(p.get("gpu")),
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
