"""`mlx-cluster sync`: copy each host exactly the model files its ranks read.

A pipeline rank reads only the safetensors holding its layers (cluster.shards decides, for the
ranks and for this copy alike), plus the config and tokenizer files; a tensor rank reads all.
A file goes first to ``NAME.part`` and is renamed once its size and sha256 match the source, so
an interrupted copy is never mistaken for a whole one and the next sync resumes it from where it
stopped. A file already there with the same size and hash is not sent again.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import shlex
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .hostfile import Host, Hostfile, model_name, split_weights
from .modelcheck import ModelError, looks_like_repo, read_config
from .shards import rank_weight_files

CHUNK = 1 << 20
PART = ".part"


class Stopped(Exception):
    """Ctrl-C during a copy: what was sent stays in .part files for the next sync."""


def source_dir(model: str) -> Path:
    """A local model directory, or a repo's snapshot in the local Hugging Face cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if not looks_like_repo(model):
        raise ModelError(f"{model}: no such model directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # the hub client raises several kinds; all mean "not in the cache"
        raise ModelError(
            f"{model}: not a local directory and not in the local Hugging Face cache; "
            f"download it on this machine first (`hf download {model}`) or pass its directory"
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
    config = read_config(model_dir)
    per_rank = rank_weight_files(model_dir, config, mode, hostfile.world_size, split, weights)
    meta = sorted(p.name for p in model_dir.iterdir() if p.is_file() and p.suffix != ".safetensors")
    files: dict[int, set[str]] = {}
    for host, names in zip(hostfile.rank_hosts(), per_rank, strict=True):
        files.setdefault(host.index, set(meta)).update(names)
    return {index: sorted(names) for index, names in files.items()}


class SourceHashes:
    """sha256 of each source file, computed once however many hosts ask."""

    def __init__(self, model_dir: Path, stop: threading.Event):
        self.model_dir = model_dir
        self.stop = stop
        self.hashes: dict[str, str] = {}
        self.locks: dict[str, threading.Lock] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str) -> str:
        with self.lock:
            lock = self.locks.setdefault(name, threading.Lock())
        with lock:
            if name not in self.hashes:
                self.hashes[name] = file_sha256(self.model_dir / name, self.stop)
            return self.hashes[name]


def file_sha256(path: Path, stop: threading.Event | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK * 8):
            if stop is not None and stop.is_set():
                raise Stopped
            digest.update(chunk)
    return digest.hexdigest()


class LocalTarget:
    """A destination directory on this machine."""

    def __init__(self, directory: str, stop: threading.Event):
        self.dir = str(Path(directory).expanduser())
        self.stop = stop

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def makedirs(self) -> None:
        os.makedirs(self.dir, exist_ok=True)

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None

    def sha256(self, path: str) -> str:
        return file_sha256(Path(path), self.stop)

    def append(self, path: str):
        return open(path, "ab")

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def remove(self, path: str) -> None:
        Path(path).unlink(missing_ok=True)

    def close(self) -> None:
        pass


class SFTPTarget:
    """A destination directory on another host: files over SFTP, hashes computed there."""

    def __init__(self, client, directory: str, label: str, stop: threading.Event):
        self.client = client
        self.label = label
        self.stop = stop
        self.sftp = client.open_sftp()
        home = self.sftp.normalize(".")
        if directory == "~" or directory.startswith("~/"):
            directory = home + directory[1:]
        elif not directory.startswith("/"):
            directory = f"{home}/{directory}"
        self.dir = directory

    def path(self, name: str) -> str:
        return posixpath.join(self.dir, name)

    def _run(self, command: str, timeout: float = 60.0) -> str:
        from .ssh import run

        status, out, err = run(self.client, command, timeout=timeout)
        if status != 0:
            raise OSError(f"{self.label}: `{command}` failed: {err.strip() or status}")
        return out

    def makedirs(self) -> None:
        self._run(f"mkdir -p {shlex.quote(self.dir)}")

    def size(self, path: str) -> int | None:
        try:
            return self.sftp.stat(path).st_size
        except FileNotFoundError:
            return None

    def sha256(self, path: str) -> str:
        """Hashed on the host (Linux has sha256sum, macOS shasum); Ctrl-C does not wait."""
        q = shlex.quote(path)
        command = f"{{ sha256sum {q} 2>/dev/null || shasum -a 256 {q}; }} | cut -d' ' -f1"
        channel = self.client.get_transport().open_session()
        try:
            channel.exec_command(command)
            while not channel.exit_status_ready():
                if self.stop.wait(0.1):
                    raise Stopped
            out = channel.makefile("rb").read().decode().strip()
            if channel.recv_exit_status() != 0 or len(out) != 64:
                err = channel.makefile_stderr("rb").read().decode().strip()
                raise OSError(f"{self.label}: cannot hash {path}: {err or out or 'no output'}")
            return out
        finally:
            channel.close()

    def append(self, path: str):
        f = self.sftp.open(path, "ab")
        f.set_pipelined(True)
        return f

    def rename(self, src: str, dst: str) -> None:
        self.sftp.posix_rename(src, dst)

    def remove(self, path: str) -> None:
        try:
            self.sftp.remove(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.sftp.close()
        self.client.close()


@dataclass
class FileResult:
    name: str
    size: int
    sent: int = 0
    action: str = "skipped"  # skipped (already equal), sent, resumed, resent (bad resume)


@dataclass
class HostResult:
    host: Host
    dest: str | None = None
    files: list[FileResult] = field(default_factory=list)
    error: str | None = None
    same_as: int | None = None  # another entry of the same host and directory did the copy

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
        }


def copy_file(
    source: Path,
    target,
    name: str,
    source_hash: Callable[[str], str],
    advance: Callable[[int], None],
    stop: threading.Event,
) -> FileResult:
    """One file to the target: skipped when equal, resumed from a partial copy, else sent."""
    size = (source / name).stat().st_size
    result = FileResult(name, size)
    final, part = target.path(name), target.path(name + PART)
    there = target.size(final)
    if there == size and target.sha256(final) == source_hash(name):
        advance(size)
        return result
    if there is not None and there < size:  # an interrupted or truncated copy: resume it
        target.rename(final, part)
    elif there is not None:
        target.remove(final)
    offset = target.size(part) or 0
    if offset > size:
        target.remove(part)
        offset = 0
    result.action = "resumed" if offset else "sent"
    advance(offset)
    result.sent += _send(source / name, target, part, offset, advance, stop)
    if target.sha256(part) != source_hash(name):
        if not offset:
            raise OSError(f"{name}: the copy's sha256 differs from the source's")
        target.remove(part)  # the kept part was not a prefix of this file: send it whole
        result.action = "resent"
        advance(-size)
        result.sent += _send(source / name, target, part, 0, advance, stop)
        if target.sha256(part) != source_hash(name):
            raise OSError(f"{name}: the copy's sha256 differs from the source's")
    target.rename(part, final)
    return result


def _send(path: Path, target, part: str, offset: int, advance, stop: threading.Event) -> int:
    sent = 0
    with open(path, "rb") as f, target.append(part) as out:
        f.seek(offset)
        while chunk := f.read(CHUNK):
            if stop.is_set():
                raise Stopped
            out.write(chunk)
            sent += len(chunk)
            advance(len(chunk))
    return sent


def sync_host(
    hostfile: Hostfile,
    host: Host,
    source: Path,
    name: str,
    names: list[str],
    dest_root: str | None,
    source_hash: SourceHashes,
    advance: Callable[[int], None],
    stop: threading.Event,
    accept_new: bool,
) -> HostResult:
    result = HostResult(host)
    root = dest_root or hostfile.model_dir_of(host)
    if root is None:
        result.error = (
            "no model_dir for this host in the hostfile; add `model_dir:` (for every host or "
            "this one) or pass --dest DIR"
        )
        return result
    try:
        if host.is_local:
            target = LocalTarget(f"{root.rstrip('/')}/{name}", stop)
        else:
            from .ssh import connect

            client = connect(host, hostfile, accept_new)
            target = SFTPTarget(client, f"{root.rstrip('/')}/{name}", host.label, stop)
    except Exception as e:  # SSHError names the host and says what to do
        result.error = str(e).removeprefix(f"{host.label}: ")
        return result
    result.dest = target.dir
    try:
        if host.is_local and Path(target.dir).resolve() == source:
            result.files = [FileResult(n, (source / n).stat().st_size) for n in names]
            advance(sum(f.size for f in result.files))
            return result
        target.makedirs()
        for file in names:
            result.files.append(copy_file(source, target, file, source_hash, advance, stop))
    except Stopped:
        raise
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}" if not isinstance(e, OSError) else str(e)
    finally:
        target.close()
    return result


def run_sync(
    hostfile: Hostfile,
    model: str,
    mode: str,
    split: list[int] | None,
    dest: str | None,
    accept_new: bool,
    progress,
) -> tuple[Path, list[HostResult]]:
    """Sync every host in parallel; ``progress(host, total_bytes)`` gives each host's advance
    callback. Ctrl-C stops every copy (KeyboardInterrupt) and leaves the .part files."""
    source = source_dir(model)
    files = host_files(source, hostfile, mode, split, split_weights(hostfile))
    stop = threading.Event()
    hashes = SourceHashes(source, stop)
    leaders: dict[tuple, Host] = {}  # one copy per host and directory, whatever the entries
    same: dict[int, Host] = {}
    for h in hostfile.hosts:
        key = destination(hostfile, h, dest)
        if key is not None and key in leaders:
            same[h.index] = leaders[key]
            files[leaders[key].index] = sorted(set(files[leaders[key].index]) | set(files[h.index]))
        elif key is not None:
            leaders[key] = h
    hosts = [h for h in hostfile.hosts if h.index not in same]
    advances = {
        h.index: progress(h, sum((source / n).stat().st_size for n in files[h.index]))
        for h in hosts
    }
    pool = ThreadPoolExecutor(max_workers=min(8, len(hosts)))
    futures = [
        pool.submit(
            sync_host,
            hostfile,
            h,
            source,
            model_name(str(source) if Path(model).expanduser().is_dir() else model),
            files[h.index],
            dest,
            hashes,
            advances[h.index],
            stop,
            accept_new,
        )
        for h in hosts
    ]
    try:
        results = [f.result() for f in futures]
    except (KeyboardInterrupt, Stopped):
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        raise KeyboardInterrupt from None
    pool.shutdown()
    done = {r.host.index: r for r in results}
    for h in hostfile.hosts:
        if h.index in same:
            leader = done[same[h.index].index]
            done[h.index] = HostResult(
                h, leader.dest, error=leader.error, same_as=leader.host.index
            )
    return source, [done[h.index] for h in hostfile.hosts]


def destination(hostfile: Hostfile, host: Host, dest: str | None) -> tuple | None:
    """Which machine and directory a host entry's copy goes to (None: it has none)."""
    root = dest or hostfile.model_dir_of(host)
    if root is None:
        return None
    where = ("this machine",) if host.is_local else (host.hostname, host.port, host.user)
    return (*where, root.rstrip("/"))
