"""`mlx-cluster sync` against OpenSSH's scp and cp, and the chain fan-out against every host
pulling from the laptop, in one run each (docs/benchmarks.md has the numbers).

    python -m tests.bench.sync_bench loopback --gb 1 --reps 3      # a loopback sshd, started here
    python -m tests.bench.sync_bench fanout --mb 256 --lan 200mbit --cables 2gbit   # needs root

Both build their own model directory (a tiny model's config and tokenizer plus one file of
random bytes) and remove what they made. Times are wall-clock seconds of the whole command as
a user runs it (start-up included), the median of the repetitions, with the page cache warm
for the source and written-back (`sync`) before each run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
CLI = shutil.which("mlx-cluster", path=str(Path(sys.executable).parent)) or "mlx-cluster"


def model_dir(base: Path, size: int) -> Path:
    """The embedded default model's config and tokenizer, and one weights file of random
    bytes (sync never parses it)."""
    model = base / "model"
    model.mkdir(parents=True)
    for f in (ROOT / "node" / "default_model").iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, model / f.name)
    with open(model / "model.safetensors", "wb") as f:
        for _ in range(size // (64 << 20)):
            f.write(os.urandom(64 << 20))
        f.write(os.urandom(size % (64 << 20)))
    return model


def timed(argv: list[str], env: dict | None = None) -> float:
    os.sync()
    start = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})})
    took = time.perf_counter() - start
    if p.returncode != 0:
        sys.exit(f"{' '.join(map(str, argv))} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return took


def report(rows: list[tuple[str, list[float]]], size: int, baseline: str) -> None:
    base = statistics.median(dict(rows)[baseline])
    print(f"| method | median s (runs) | MB/s | rate vs {baseline} |")
    print("|---|---|---|---|")
    for name, runs in rows:
        m = statistics.median(runs)
        print(
            f"| {name} | {m:.2f} ({', '.join(f'{t:.2f}' for t in runs)}) | "
            f"{size / m / 1e6:.0f} | {base / m:.2f}x |"
        )


def loopback(args) -> None:
    from tests.support.sshd import start_sshd

    work = Path(tempfile.mkdtemp(prefix="sync-bench-"))
    server = start_sshd(work / "sshd")
    try:
        size = int(args.gb * (1 << 30))
        model = model_dir(work, size)
        dest = work / "dest"
        hostfile = work / "rig.yaml"
        hostfile.write_text(
            server.hostfile(
                f"  - ssh: 127.0.0.1:{server.port}\n    ips: [127.0.0.1]\n    model_dir: {dest}\n",
                sys.executable,
            )
        )
        ssh_opts = ["-i", str(server.user_key), "-o", f"UserKnownHostsFile={server.known_hosts}"]
        scp = ["scp", "-q", *ssh_opts, "-P", str(server.port), str(model / "model.safetensors")]
        target = f"root@127.0.0.1:{dest}/scp/"
        sync = [CLI, "sync", "--hostfile", str(hostfile), "--model", str(model)]
        cache = work / "cache"
        methods = {
            "mlx-cluster sync (ssh; source hashed as sent)": lambda: timed(
                sync, {"XDG_CACHE_HOME": str(cache / str(time.monotonic()))}
            ),
            "mlx-cluster sync (ssh; source hash known)": lambda: timed(
                sync, {"XDG_CACHE_HOME": str(cache / "warm")}
            ),
            "mlx-cluster sync --transport tcp": lambda: timed(
                [*sync, "--transport", "tcp"], {"XDG_CACHE_HOME": str(cache / "warm")}
            ),
            "scp (OpenSSH default cipher)": lambda: timed([*scp, target]),
            "scp -c aes128-gcm@openssh.com": lambda: timed(
                [*scp[:1], "-c", "aes128-gcm@openssh.com", *scp[1:], target]
            ),
            "cp": lambda: timed(["cp", str(model / "model.safetensors"), f"{dest}/scp/"]),
        }
        timed([*sync, "--dest", str(work / "warmup")], {"XDG_CACHE_HOME": str(cache / "warm")})
        runs: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.reps):
            for name, run in methods.items():
                shutil.rmtree(dest, ignore_errors=True)
                (dest / "scp").mkdir(parents=True)
                runs[name].append(run())
        print(f"\n{args.gb:g} GiB file, loopback sshd, {os.cpu_count()} cores\n")
        report(list(runs.items()), size, "scp (OpenSSH default cipher)")
    finally:
        server.proc.terminate()
        server.proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def fanout(args) -> None:
    import netrig

    work = Path(tempfile.mkdtemp(prefix="sync-fanout-"))
    rig = netrig.up(3, cables=True, prefix="mcs", lan="10.232.0")
    try:
        size = int(args.mb * (1 << 20))
        model = model_dir(work, size)
        data = rig.hostfile()
        for i, h in enumerate(data["hosts"]):
            h["model_dir"] = str(work / f"h{i}")
        one = dict(data, hosts=data["hosts"][:1])
        for name, d in (("rig.yaml", data), ("one.yaml", one)):
            (work / name).write_text(yaml.safe_dump(d, sort_keys=False))
        rig.shape(0, netrig.Shape(rate_bps=netrig.bits_per_s(args.lan)))  # the laptop's link
        for ns, ifaces in rig.cable_ifaces.items():
            for iface in ifaces:
                subprocess.run(
                    [
                        "ip",
                        "netns",
                        "exec",
                        ns,
                        "tc",
                        "qdisc",
                        "replace",
                        "dev",
                        iface,
                        "root",
                        "tbf",
                        "rate",
                        args.cables,
                        "burst",
                        "1mbit",
                        "latency",
                        "50ms",
                    ],
                    check=True,
                )
        sync = [CLI, "sync", "--model", str(model), "--mode", "tensor"]
        host = data["hosts"][0]
        scp = [
            "scp",
            "-q",
            "-i",
            data["ssh"]["identity_file"],
            "-o",
            f"UserKnownHostsFile={data['ssh']['known_hosts']}",
            str(model / "model.safetensors"),
            f"root@{host['ssh']}:{work}/scp/",
        ]
        env = {"XDG_CACHE_HOME": str(work / "cache")}
        methods = {
            "scp to 1 host": lambda: timed(scp),
            "sync to 1 host": lambda: timed([*sync, "--hostfile", str(work / "one.yaml")], env),
            "sync to 3 hosts, --fan-out direct (all pull from the laptop)": lambda: timed(
                [*sync, "--hostfile", str(work / "rig.yaml"), "--fan-out", "direct"], env
            ),
            "sync to 3 hosts, --fan-out chain (hosts pass it on over the cables)": lambda: timed(
                [*sync, "--hostfile", str(work / "rig.yaml")], env
            ),
        }
        runs: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.reps):
            for name, run in methods.items():
                for d in ("h0", "h1", "h2", "scp"):
                    shutil.rmtree(work / d, ignore_errors=True)
                (work / "scp").mkdir()
                runs[name].append(run())
        print(
            f"\n{args.mb} MiB, 3 hosts, laptop link {args.lan}, cables {args.cables}, "
            f"tensor mode (every host needs every byte)\n"
        )
        report(list(runs.items()), size, "sync to 1 host")
    finally:
        netrig.down(prefix="mcs")
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    lo = sub.add_parser("loopback", help="sync, scp and cp of one big file over a loopback sshd")
    lo.add_argument("--gb", type=float, default=1.0)
    lo.add_argument("--reps", type=int, default=3)
    fo = sub.add_parser("fanout", help="3 hosts on a namespace rig: chain against direct")
    fo.add_argument("--mb", type=int, default=256)
    fo.add_argument("--lan", default="200mbit", help="the laptop's link rate")
    fo.add_argument("--cables", default="2gbit", help="each host-to-host cable's rate (tbf)")
    fo.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    loopback(args) if args.cmd == "loopback" else fanout(args)


if __name__ == "__main__":
    main()
