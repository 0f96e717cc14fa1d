"""`mlx-cluster sync`: copy each host exactly the model files its ranks read, once per file.

A pipeline rank reads only the safetensors holding its layers (cluster.core.shards decides, for the
ranks and for this copy alike), plus the config and tokenizer files; a tensor rank reads all.
Each host runs a receiver (cluster.rig.transfer, started over SSH); the laptop streams the files
through OpenSSH's own client (or a plain TCP stream with a one-time token, `--transport tcp`) to
the first host, which passes them on to the next over the rig's own links (`--fan-out chain`),
so the laptop sends each file once. Bytes are hashed as they pass: one read at the source, one
write at each destination. A file goes first to ``NAME.part`` and takes its name once its sha256
matches the source's, so an interrupted copy is never mistaken for a whole one, and the next sync
resumes it. Each host keeps a manifest, so an unchanged file is skipped without being read.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.core.hostfile import Host, Hostfile, model_name, split_weights
from cluster.core.modelcheck import ModelError, looks_like_repo, read_config
from cluster.core.shards import rank_weight_files
from cluster.rig import transfer

TRANSPORTS = ("ssh", "tcp")
FAN_OUTS = ("chain", "direct")
CONTROL_TIMEOUT = 30.0  # seconds for a receiver to listen or connect (hashing has no limit)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".h5", ".msgpack")


class Stopped(Exception):
    """Ctrl-C during a copy: what was sent stays in .part files for the next sync."""


# --- the source: a directory, the Hugging Face cache, or a download -------------------------


def source_dir(model: str, offline: bool = False) -> Path:
    """A local model directory, or a repo's snapshot: its config and tokenizer files from the
    local Hugging Face cache, else downloaded (the weights come later: only those needed)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if not looks_like_repo(model):
        raise ModelError(f"{model}: no such model directory")
    from huggingface_hub import snapshot_download

    offline = offline or _hub_offline()
    meta = [f"*{suffix}" for suffix in WEIGHT_SUFFIXES] + ["*/*"]
    try:
        snapshot = Path(snapshot_download(model, local_files_only=True, ignore_patterns=meta))
    except Exception:  # the hub client raises several kinds; all mean "not in the cache"
        if offline:
            raise ModelError(
                f"{model}: not a local directory and not in the local Hugging Face cache, and "
                "--offline (or HF_HUB_OFFLINE) forbids downloading it; download it where there "
                f"is internet (`hf download {model}`) and pass its directory"
            ) from None
        snapshot = Path(_download(model, ignore_patterns=meta))
    single = not (snapshot / "model.safetensors.index.json").exists()
    if single and not any(snapshot.glob("model*.safetensors")) and not offline:
        snapshot = Path(_download(model, allow_patterns=["model*.safetensors"]))  # every rank's
    return snapshot


def fetch_missing(model: str, source: Path, names: list[str], offline: bool) -> Path:
    """Download the files of ``names`` the snapshot lacks (only those): the rest of a big
    checkpoint never crosses the internet when the ranks do not read it."""
    missing = sorted(n for n in names if not (source / n).exists())
    if not missing:
        return source
    if offline or _hub_offline() or not looks_like_repo(model):
        raise ModelError(
            f"{model}: {len(missing)} of the files the ranks need are not in {source} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
            + (
                "run without --offline to download them"
                if looks_like_repo(model)
                else "the model directory is incomplete"
            )
        )
    return Path(_download(model, allow_patterns=missing))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def _download(model: str, **patterns) -> str:
    """snapshot_download with its own progress bars (stderr), errors said plainly."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        return snapshot_download(model, **patterns)
    except GatedRepoError:
        raise ModelError(
            f"{model}: a gated repo; accept its terms on the Hub and log in (`hf auth login`)"
        ) from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"{model}: no such repo on {endpoint} (or it is private: log in with `hf auth login`)"
        ) from None
    except Exception as e:
        raise ModelError(
            f"{model}: cannot download it from {endpoint} ({type(e).__name__}: {e}); without "
            f"internet here, download it elsewhere (`hf download {model}`), copy the directory "
            "over and pass it to --model"
        ) from None


def host_files(
    model_dir: Path,
    hostfile: Hostfile,
    mode: str,
    split: list[int] | None,
    weights: list[float] | None,
) -> dict[int, list[str]]:
    """Per host index, the files its ranks need: every non-weight file at the top of the model
    directory, and the weight files of its ranks."""
    config = read_config(model_dir, require_weights=False)
    per_rank = rank_weight_files(model_dir, config, mode, hostfile.world_size, split, weights)
    meta = sorted(
        p.name
        for p in model_dir.iterdir()
        if p.is_file() and p.suffix not in WEIGHT_SUFFIXES and not p.name.startswith(".")
    )
    files: dict[int, set[str]] = {}
    for host, names in zip(hostfile.rank_hosts(), per_rank, strict=True):
        files.setdefault(host.index, set(meta)).update(names)
    return {index: sorted(names) for index, names in files.items()}


class SourceHashes:
    """sha256 of each source file, computed at most once, and remembered across runs (by
    path, size and mtime) in ~/.cache/mlx-cluster: an unchanged model is not read again.
    A file in the Hugging Face cache needs no reading at all: its blob is named by it."""

    def __init__(self, model_dir: Path, stop: threading.Event, verify: bool):
        self.model_dir = model_dir
        self.stop = stop
        self.verify = verify
        cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        self.path = cache / "mlx-cluster" / "sha256.json"
        try:
            self.cache = {} if verify else json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.cache = {}
        self.lock = threading.Lock()
        self.locks: dict[str, threading.Lock] = {}

    def _key(self, name: str) -> tuple[str, dict]:
        path = self.model_dir / name
        st = path.stat()
        return str(path), {"size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def known(self, name: str) -> str | None:
        blob = (self.model_dir / name).resolve().name
        if not self.verify and len(blob) == 64 and all(c in "0123456789abcdef" for c in blob):
            return blob
        key, stat = self._key(name)
        entry = self.cache.get(key)
        if entry and {k: entry[k] for k in stat} == stat:
            return entry["sha256"]
        return None

    def record(self, name: str, sha: str) -> None:
        key, stat = self._key(name)
        with self.lock:
            self.cache[key] = {**stat, "sha256": sha}

    def __call__(self, name: str) -> str:
        with self.lock:
            lock = self.locks.setdefault(name, threading.Lock())
        with lock:
            sha = self.known(name)
            if sha is None:
                path = self.model_dir / name
                sha = transfer.hash_prefix(str(path), path.stat().st_size, self.stop).hexdigest()
                self.record(name, sha)
            return sha

    def save(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            current = json.loads(self.path.read_text()) if self.path.exists() else {}
            current.update(self.cache)
            tmp = self.path.with_suffix(f".{os.getpid()}")
            tmp.write_text(json.dumps(current))
            os.replace(tmp, self.path)
        except (OSError, ValueError):
            pass  # only a cache: the next sync hashes again


# --- the receivers, and how the bytes reach them ---------------------------------------------


class ReceiverHandle:
    """cluster.rig.transfer running on one host, driven in JSON lines over its stdin and stdout
    (an OpenSSH session, or a local pipe). Progress lines move the host's bar; the rest queue."""

    def __init__(self, host: Host, hostfile: Hostfile, directory: str, accept_new: bool = False):
        self.host = host
        code = Path(transfer.__file__).read_bytes()
        bootstrap = f"import sys; exec(sys.stdin.buffer.read({len(code)}))"
        args = ["receive", directory, str(host.index)]
        if host.is_local:
            argv = [sys.executable, "-u", "-c", bootstrap, *args]
            self.transport = "local"
        else:
            from cluster.job.ssh import openssh_argv

            python = host.python or hostfile.python or "python3"
            command = shlex.join([python, "-u", "-c", bootstrap, *args])
            argv = openssh_argv(host, hostfile, command, accept_new)
            self.transport = "ssh"
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # Ctrl-C reaches the laptop's sync, which stops these
        )
        if sys.platform == "linux":
            transfer.widen_pipe(self.proc.stdin.fileno())
        self.replies: queue.Queue = queue.Queue()
        self.advance: Callable[[int], None] = lambda n: None
        self.midstream = False  # a stream to it began and did not end: no command may follow
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.proc.stdin.write(code)
        self.proc.stdin.flush()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                self.stderr.append(line.decode(errors="replace").strip())
                continue
            if message.get("op") == "progress":
                self.advance(message["n"])
            else:
                self.replies.put(message)
        self.replies.put(None)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line.decode(errors="replace").rstrip())
            del self.stderr[:-5]

    def send(self, **command) -> None:
        try:
            self.proc.stdin.write((json.dumps(command) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            pass  # the receiver is gone; expect() says why

    def receive(self, source: str) -> None:
        """Start its stream (from ``stdin`` or ``socket``): from here on, no command."""
        self.send(op="receive", **{"from": source})
        self.midstream = True

    def expect(self, op: str, timeout: float | None = None) -> dict:
        """The next reply, which must be ``op``; an error reply, an exit or no answer within
        ``timeout`` raises OSError."""
        try:
            message = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise OSError(f"no answer to `{op}` within {timeout:.0f} s") from None
        self.raise_if_failed(message)
        if message["op"] != op:
            raise OSError(f"unexpected reply {message}")
        return message

    def raise_if_failed(self, message: dict | None) -> None:
        """An error reply, or the end of the receiver (None): OSError with its reason."""
        if message is None:
            self.proc.wait()
            why = "; ".join(line for line in self.stderr if line) or f"exit {self.proc.returncode}"
            raise OSError(f"the receiver stopped: {why}")
        if message["op"] == "error":
            raise OSError(message["error"])

    def stop(self, now: bool = True) -> None:
        """At once (Ctrl-C, a failure), or once it has read to the end of its stdin."""
        if not now:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class FileResult:
    name: str
    size: int
    sent: int = 0
    action: str = "skipped"  # skipped (already equal), sent, resumed, resent (bad partial copy)


@dataclass
class HostResult:
    host: Host
    dest: str | None = None
    files: list[FileResult] = field(default_factory=list)
    error: str | None = None
    same_as: int | None = None  # another entry of the same host and directory did the copy
    transport: str | None = None  # local, ssh or tcp: how the bytes reached this host
    upstream: int | None = None  # the host that passed the files on (None: this machine)
    address: str | None = None  # where the upstream host reached this one
    stored_sha256: dict[str, str | None] = field(default_factory=dict)  # as the host computed

    @property
    def bytes_sent(self) -> int:
        return sum(f.sent for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host.target,
            "index": self.host.index,
            "dest": self.dest,
            "bytes_sent": self.bytes_sent,
            "files": [vars(f) for f in self.files],
            "error": self.error,
            "same_as": self.same_as,
            "transport": self.transport,
            "upstream": self.upstream,
            "address": self.address,
        }


@dataclass
class CopyPlan:
    """What each file needs: the hosts that want it, and from which offset each can resume."""

    to: dict[str, dict[int, int]] = field(default_factory=dict)  # name -> host -> offset
    digests: dict[tuple[str, int], Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def offset(self, name: str, chain: list[int]) -> int:
        """A stream through several hosts starts where the least advanced of them is."""
        return min(offset for i, offset in self.to[name].items() if i in chain)

    def digest(self, source: Path, name: str, offset: int, stop: threading.Event):
        """sha256 of the source's first ``offset`` bytes, read once per file and offset."""
        with self.lock:
            if (name, offset) not in self.digests:
                self.digests[name, offset] = transfer.hash_prefix(str(source / name), offset, stop)
            return self.digests[name, offset].copy()


@dataclass
class SyncSettings:
    transport: str = "ssh"
    fan_out: str = "chain"
    streams: int = 2
    verify: bool = False
    offline: bool = False
    accept_new: bool = False


def decide(
    source: Path, result: HostResult, state: dict, names: list[str], hashes: SourceHashes
) -> dict[str, int]:
    """Per file this host lacks, the offset it can resume from; fills in its skipped files."""
    wanted = {}
    for name in names:
        size = (source / name).stat().st_size
        info = state[name]
        if info["size"] == size and info["sha256"] == hashes(name):
            result.files.append(FileResult(name, size))
            continue
        offset, action = 0, "sent"
        part = info["part"]
        if part:
            action = "resent"
            if part <= size:
                digest = transfer.hash_prefix(str(source / name), part, hashes.stop)
                if digest.hexdigest() == info["part_sha256"]:
                    offset, action = part, "resumed"
        result.files.append(FileResult(name, size, action=action))
        wanted[name] = offset
    return wanted


def partition(names: list[str], sizes: dict[str, int], lanes: int) -> list[list[str]]:
    """Files over parallel streams, biggest first onto the least loaded."""
    loads = [[0, []] for _ in range(max(1, min(lanes, len(names))))]
    for name in sorted(names, key=lambda n: -sizes[n]):
        lane = min(loads, key=lambda x: x[0])
        lane[0] += sizes[name]
        lane[1].append(name)
    return [sorted(lane[1]) for lane in loads]


def relay_addresses(host: Host) -> list[str]:
    """Where a host listens for the previous host of a chain: its rig addresses (the cables)
    first, the one the laptop reaches it on last."""
    return list(dict.fromkeys([*host.ips, socket.gethostbyname(host.hostname)]))


class Copy:
    """One sync: receivers on every host, a stream per lane through a chain of hosts."""

    def __init__(self, hostfile, source, names, dests, settings, hashes, progress, stop):
        self.hostfile = hostfile
        self.source = source
        self.names = names  # host index -> its files
        self.dests = dests  # host index -> directory
        self.settings = settings
        self.hashes = hashes
        self.progress = progress
        self.stop = stop
        self.receivers: list[ReceiverHandle] = []
        self.results = {i: HostResult(self.host(i), transport=None) for i in names}
        self.lock = threading.Lock()

    def host(self, index: int) -> Host:
        return self.hostfile.hosts[index]

    def start(self, index: int) -> ReceiverHandle:
        r = ReceiverHandle(
            self.host(index), self.hostfile, self.dests[index], self.settings.accept_new
        )
        with self.lock:
            self.receivers.append(r)
        if self.stop.is_set():
            raise Stopped
        return r

    def stop_all(self, now: bool = True) -> None:
        for r in self.receivers:
            r.stop(now)

    def fail(self, index: int, error: str) -> None:
        if self.results[index].error is None:
            self.results[index].error = error

    def run(self) -> dict[int, HostResult]:
        hosts = list(self.names)
        sizes = {n: (self.source / n).stat().st_size for ns in self.names.values() for n in ns}
        bars = {i: self.progress(self.host(i), sum(sizes[n] for n in self.names[i])) for i in hosts}
        first: dict[int, ReceiverHandle] = {}
        plan = CopyPlan()
        if not hosts:
            return self.results
        with ThreadPoolExecutor(max_workers=min(8, len(hosts))) as pool:
            for i, receiver in zip(hosts, pool.map(self.prepare, hosts), strict=True):
                if receiver is None:
                    continue
                first[i] = receiver
                receiver.advance = bars[i]
                for f in self.results[i].files:
                    bars[i](f.size if f.action == "skipped" else 0)
        for i, receiver in first.items():
            for name, offset in receiver.wanted.items():
                plan.to.setdefault(name, {})[i] = offset
        local = [i for i in first if self.host(i).is_local and plan_needs(plan, i)]
        remote = [i for i in first if not self.host(i).is_local and plan_needs(plan, i)]
        if self.settings.fan_out == "chain" and remote:
            chains = [remote]
        else:
            chains = [[i] for i in remote]
        chains += [[i] for i in local]
        jobs = []
        for chain in chains:
            names = sorted(n for n in plan.to if set(plan.to[n]) & set(chain))
            lanes = partition(names, sizes, self.settings.streams)
            for lane, lane_names in enumerate(lanes):
                jobs.append((chain, lane_names, first if lane == 0 else None, bars))
        if jobs:
            with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                for future in [pool.submit(self.stream, plan, *job) for job in jobs]:
                    future.result()
        if self.stop.is_set():
            raise Stopped
        for receiver in first.values():
            if not receiver.midstream:
                receiver.send(op="bye")
        self.stop_all(now=False)
        return self.results

    def prepare(self, index: int) -> ReceiverHandle | None:
        """Start the host's first receiver and learn what it holds; None when it failed."""
        host, result = self.host(index), self.results[index]
        try:
            receiver = self.start(index)
            sizes = {n: (self.source / n).stat().st_size for n in self.names[index]}
            receiver.send(op="state", sizes=sizes, verify=self.settings.verify)
            state = receiver.expect("state")
        except Stopped:
            return None
        except Exception as e:
            self.fail(index, self.diagnose(host, e))
            return None
        result.dest = state["dir"]
        result.transport = "local" if host.is_local else self.settings.transport
        names = self.names[index]
        receiver.wanted = decide(self.source, result, state["files"], names, self.hashes)
        return receiver

    def diagnose(self, host: Host, error: Exception) -> str:
        """Why a receiver did not start: when SSH itself failed, connect() names the cause
        (host key, login, reachability) and what to do; otherwise the receiver's own words."""
        if not host.is_local and self.stop.is_set() is False:
            from cluster.job.ssh import SSHError, connect

            try:
                connect(host, self.hostfile, accept_new=False).close()
            except SSHError as e:
                return str(e).removeprefix(f"{host.label}: ")
        return str(error)

    def stream(self, plan: CopyPlan, chain: list[int], names: list[str], first, bars) -> None:
        """One lane: the laptop streams ``names`` to the chain's head, each host passes the
        stream on to the next; each host reports what it stored."""
        try:
            receivers = [first[i] if first else self.start(i) for i in chain]
            for i, r in zip(chain, receivers, strict=True):
                r.advance = bars[i]
                bars[i](sum(plan.offset(n, chain) for n in names if i in plan.to[n]))
            out, sock = self.connect_chain(chain, receivers)
        except Stopped:
            return
        except OSError as e:
            for i in chain:
                self.fail(i, str(e))
            return
        collectors = [
            threading.Thread(target=self.collect, args=(i, r), daemon=True)
            for i, r in zip(chain, receivers, strict=True)
        ]
        for t in collectors:
            t.start()
        try:
            for name in names:
                to = [i for i in plan.to[name] if i in chain]
                offset, st = plan.offset(name, chain), (self.source / name).stat()
                entry = {
                    "name": name,
                    "offset": offset,
                    "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns,
                    "to": to,
                }
                known = self.hashes.known(name)
                digest = plan.digest(self.source, name, offset, self.stop)
                sha = transfer.send_file(
                    out, str(self.source / name), entry, digest, known, lambda n: None, self.stop
                )
                if known is None:
                    self.hashes.record(name, sha)
            transfer.end_stream(out)
            if sock is not None:
                sock.shutdown(socket.SHUT_WR)
            for r in receivers:
                r.midstream = False
        except KeyboardInterrupt:
            return
        except ConnectionError:
            pass  # a receiver went away: its collector says why
        except OSError as e:  # this side failed (the source, a stalled link): end the chain
            for i in chain:
                self.fail(i, f"the copy broke off: {e}")
            for r in receivers:
                r.stop()
        for t in collectors:
            t.join()
        for i in chain:
            self.check_stored(i)

    def check_stored(self, index: int) -> None:
        """Each file a host stored, against the sha256 this machine computed of the source:
        the host checked its copy against the stream's trailer, which a TCP link between hosts
        carries along with the bytes; its own sha256 comes back over SSH."""
        result = self.results[index]
        for name, theirs in result.stored_sha256.items():
            ours = self.hashes.known(name)
            if ours is not None and theirs is not None and theirs != ours:
                self.fail(index, f"{name}: the copy's sha256 ({theirs[:12]}...) is not the "
                                 f"source's ({ours[:12]}...): the stream was changed on its "
                                 "way; check the rig's links and run sync again (the copy "
                                 "is sent again)")  # fmt: skip
                return

    def connect_chain(self, chain: list[int], receivers: list[ReceiverHandle]):
        """Each host after the first listens on its rig addresses for the one before it, with
        a one-time token that only travels over SSH; the head reads the laptop's stream from
        SSH, or from TCP (with its own token) when the transport is tcp."""
        for k in range(1, len(chain)):
            host, token = self.host(chain[k]), secrets.token_hex(16)
            receivers[k].send(op="listen", addresses=relay_addresses(host), token=token)
            ports = receivers[k].expect("listening", timeout=CONTROL_TIMEOUT)["ports"]
            if not ports:
                raise OSError(f"{host.label}: has none of the addresses {host.ips} to listen on")
            candidates = [[a, p] for a, p in ports.items()]
            receivers[k - 1].send(
                op="forward", candidates=candidates, token=token, downstream=chain[k:]
            )
            try:
                address = receivers[k - 1].expect("forwarding", timeout=CONTROL_TIMEOUT)["address"]
            except OSError as e:
                raise OSError(
                    f"{self.host(chain[k - 1]).label} cannot pass the files on to {host.label}"
                    f" ({e}); check the rig's links, or sync with --fan-out direct"
                ) from None
            self.results[chain[k]].upstream = chain[k - 1]
            self.results[chain[k]].address = address
            if self.results[chain[k]].transport != "local":
                self.results[chain[k]].transport = "tcp"
        for receiver in receivers[1:]:  # only now: a receiver reads no command once it receives
            receiver.receive("socket")
        head, receiver = self.host(chain[0]), receivers[0]
        if head.is_local or self.settings.transport == "ssh":
            receiver.receive("stdin")
            return receiver.proc.stdin, None
        token = secrets.token_hex(16)
        address = socket.gethostbyname(head.hostname)
        receiver.send(op="listen", addresses=[address], token=token)
        ports = receiver.expect("listening", timeout=CONTROL_TIMEOUT)["ports"]
        receiver.receive("socket")
        for address, port in ports.items():
            try:
                sock = socket.create_connection((address, port), timeout=transfer.CONNECT_TIMEOUT)
            except OSError:
                continue
            sock.settimeout(transfer.IO_TIMEOUT)
            sock.sendall((token + "\n").encode())
            return sock, sock
        raise OSError(f"{head.label}: cannot open a TCP stream to {address} (ports {ports})")

    def collect(self, index: int, receiver: ReceiverHandle) -> None:
        """The host's replies until its stream is done: which files it stored, or its error."""
        result = self.results[index]
        by_name = {f.name: f for f in result.files}
        try:
            while True:
                message = receiver.replies.get()
                receiver.raise_if_failed(message)
                if message["op"] == "done":
                    return
                if message["op"] == "stored":
                    by_name[message["name"]].sent = message["sent"]
                    result.stored_sha256[message["name"]] = message.get("sha256")
                elif message["op"] == "bad":
                    raise OSError(f"{message['name']}: {message['error']}")
        except OSError as e:
            if not self.stop.is_set():
                self.fail(index, str(e))


def plan_needs(plan: CopyPlan, index: int) -> bool:
    return any(index in to for to in plan.to.values())


def result_or_interrupt(future: Future):
    """``future.result()`` that Ctrl-C can cut short. The kernel may hand SIGINT to any of the
    copy's threads, and then a main thread blocked for good on the future never runs Python's
    handler (seen here: a copy ran 2 s to its end after Ctrl-C); a bounded wait lets it."""
    while not future.done():
        wait([future], timeout=0.05)
    return future.result()


def run_sync(
    hostfile: Hostfile,
    model: str,
    mode: str,
    split: list[int] | None,
    dest: str | None,
    accept_new: bool,
    progress,
    settings: SyncSettings | None = None,
) -> tuple[Path, list[HostResult]]:
    """Sync every host; ``progress(host, total_bytes)`` gives each host's advance callback.
    Ctrl-C stops every copy (KeyboardInterrupt) and leaves the .part files."""
    settings = settings or SyncSettings()
    settings.accept_new = accept_new
    if shutil.which("ssh") is None and any(not h.is_local for h in hostfile.hosts):
        raise ModelError("sync needs OpenSSH's `ssh` client on this machine; install it")
    source = source_dir(model, settings.offline)
    files = host_files(source, hostfile, mode, split, split_weights(hostfile))
    source = fetch_missing(model, source, sorted(set().union(*files.values())), settings.offline)
    name = model_name(str(source) if Path(model).expanduser().is_dir() else model)
    leaders: dict[tuple, Host] = {}  # one copy per host and directory, whatever the entries
    same: dict[int, Host] = {}
    results: dict[int, HostResult] = {}
    dests: dict[int, str] = {}
    for h in hostfile.hosts:
        key = destination(hostfile, h, dest)
        if key is None:
            results[h.index] = HostResult(
                h,
                error="no model_dir for this host in the hostfile; add `model_dir:` (for every "
                "host or this one) or pass --dest DIR",
            )
        elif key in leaders:
            same[h.index] = leaders[key]
            lead = leaders[key].index
            files[lead] = sorted(set(files[lead]) | set(files[h.index]))
        else:
            leaders[key] = h
            dests[h.index] = f"{key[-1]}/{name}"
    for h in list(leaders.values()):
        if h.is_local and Path(dests[h.index]).expanduser().resolve() == source:
            del leaders[destination(hostfile, h, dest)]
            results[h.index] = HostResult(
                h,
                dests[h.index],
                [FileResult(n, (source / n).stat().st_size) for n in files[h.index]],
                transport="local",
            )
    stop = threading.Event()
    hashes = SourceHashes(source, stop, settings.verify)
    copy = Copy(
        hostfile,
        source,
        {h.index: files[h.index] for h in leaders.values()},
        dests,
        settings,
        hashes,
        progress,
        stop,
    )
    worker = ThreadPoolExecutor(max_workers=1)
    future = worker.submit(copy.run)
    try:
        results.update(result_or_interrupt(future))
    except (KeyboardInterrupt, Stopped):
        stop.set()
        copy.stop_all()
        worker.shutdown(wait=True, cancel_futures=True)
        hashes.save()
        raise KeyboardInterrupt from None
    finally:
        copy.stop_all()
        worker.shutdown()
    hashes.save()
    for i, leader in same.items():
        lead = results[leader.index]
        results[i] = HostResult(
            hostfile.hosts[i], lead.dest, error=lead.error, same_as=leader.index
        )
    return source, [results[h.index] for h in hostfile.hosts]


def destination(hostfile: Hostfile, host: Host, dest: str | None) -> tuple | None:
    """Which machine and directory a host entry's copy goes to (None: it has none)."""
    root = dest or hostfile.model_dir_of(host)
    if root is None:
        return None
    where = ("this machine",) if host.is_local else (host.hostname, host.port, host.user)
    return (*where, root.rstrip("/"))
