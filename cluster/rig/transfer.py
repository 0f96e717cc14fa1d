"""The byte stream of `sync`, and the receiver that runs on each host.

Standard library only: `sync` ships this file's text to each host over SSH (``python3 -c``
reads it from stdin), so a host needs nothing installed but Python. One receiver per host and
stream; the laptop talks to it in JSON lines over the SSH channel (stdin in, stdout out), and the
file bytes come either on the same stdin, or on a TCP connection that first presents a one-time
token the laptop handed over SSH (`--transport tcp`, and the hosts relaying to each other).

A stream is, per file: a JSON header line ``{"name", "offset", "size", "mtime_ns", "to"}``, the
``size - offset`` bytes, a JSON trailer line ``{"sha256"}``; and ``{"end": true}`` to finish. A
receiver keeps the files whose ``to`` holds its host index (writing ``NAME.part``, hashing as the
bytes pass, renaming once the hash matches) and forwards the stream to the next host when a host
after it wants anything: the laptop sends each file once, whatever the number of hosts.

Each destination directory has a manifest (name, size, mtime_ns, sha256 per file), so the next
sync knows what a host holds without reading it again.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import queue
import selectors
import socket
import sys
import threading
import time

BLOCK = 4 << 20
PART = ".part"
MANIFEST = ".mlx-cluster-manifest.json"
ACCEPT_TIMEOUT = 60.0
CONNECT_TIMEOUT = 5.0
IO_TIMEOUT = 120.0  # a host that takes no bytes for this long is lost (a pulled cable)
PROGRESS_EVERY = 0.2  # seconds between progress reports


def hash_prefix(path: str, length: int, stop=None):
    """sha256 object over the first ``length`` bytes of ``path``, ready to be continued."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        left = length
        while left:
            chunk = f.read(min(BLOCK, left))
            if not chunk:
                raise OSError(f"{path}: shorter than {length} bytes")
            if stop is not None and stop.is_set():
                raise KeyboardInterrupt
            digest.update(chunk)
            left -= len(chunk)
    return digest


def header(name: str, offset: int, size: int, mtime_ns: int, to: list[int]) -> bytes:
    entry = {"name": name, "offset": offset, "size": size, "mtime_ns": mtime_ns, "to": to}
    return (json.dumps(entry) + "\n").encode()


def send_file(out, path: str, entry: dict, digest, known: str | None, advance, stop) -> str:
    """One file onto a stream: header, bytes from ``entry['offset']``, trailer. ``digest`` is
    the hash of the bytes before the offset; it is continued as the bytes are read (one read
    of the source, hashed in a thread while the previous chunk is written), unless the file's
    sha256 is already ``known``. Returns the sha256."""
    write = out.write if hasattr(out, "write") else out.sendall
    write(header(entry["name"], entry["offset"], entry["size"], entry["mtime_ns"], entry["to"]))
    left = entry["size"] - entry["offset"]
    hashing = None
    with open(path, "rb", buffering=0) as f:
        f.seek(entry["offset"])
        while left:
            chunk = f.read(min(BLOCK, left))
            if not chunk:
                raise OSError(f"{path}: changed while being sent (shorter than it was)")
            if stop.is_set():
                raise KeyboardInterrupt
            if known is None:  # hashlib lets go of the GIL: this overlaps with the write
                if hashing is not None:
                    hashing.join()
                hashing = threading.Thread(target=digest.update, args=(chunk,))
                hashing.start()
            write(chunk)
            left -= len(chunk)
            advance(len(chunk))
    if hashing is not None:
        hashing.join()
    sha = known or digest.hexdigest()
    write((json.dumps({"sha256": sha}) + "\n").encode())
    return sha


def end_stream(out) -> None:
    write = out.write if hasattr(out, "write") else out.sendall
    write(b'{"end": true}\n')
    if hasattr(out, "flush"):
        out.flush()


# --- the receiver: runs on the host -------------------------------------------------------


def read_manifest(directory: str) -> dict:
    try:
        with open(os.path.join(directory, MANIFEST)) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return {}


def update_manifest(directory: str, name: str, entry: dict | None) -> None:
    """Several receivers (one per stream) share a directory: change one entry under a lock."""
    path = os.path.join(directory, MANIFEST)
    lock = os.open(directory, os.O_RDONLY)  # a lock on the directory: no lock file left over
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        manifest = read_manifest(directory)
        if entry is None:
            manifest.pop(name, None)
        else:
            manifest[name] = entry
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    finally:
        os.close(lock)


def bad_file_name(name: object) -> str | None:
    """The rule of cluster.core.shards.bad_file_name, again here: this file runs alone on a host
    (sent as text), so it can import nothing of the package."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        return f"is not a file name ({name!r})"
    if name.startswith("/") or any(p in ("", ".", "..") for p in name.split("/")):
        return f"leaves the model folder ({name!r}: absolute, or with . or ..)"
    return None


def inside(directory: str, name: str) -> str:
    """The path of ``name`` in ``directory``, refused (ValueError) when the name is bad or
    the path, links resolved, is outside the directory."""
    if why := bad_file_name(name):
        raise ValueError(f"a file name that {why}")
    path = os.path.join(directory, name)
    root = os.path.realpath(directory)
    if os.path.commonpath([root, os.path.realpath(path)]) != root:
        raise ValueError(f"{name!r} leads outside {directory} (through a link)")
    return path


class Receiver:
    def __init__(self, directory: str, index: int):
        self.dir = os.path.expanduser(directory)
        self.index = index
        self.out_lock = threading.Lock()
        self.prefixes: dict[str, object] = {}  # name -> sha256 of its .part, from `state`
        self.listeners: list[socket.socket] = []
        self.token = ""
        self.forward: socket.socket | None = None
        self.downstream: set[int] = set()

    def reply(self, **message) -> None:
        with self.out_lock:
            try:
                sys.stdout.write(json.dumps(message) + "\n")
                sys.stdout.flush()
            except OSError:  # the laptop went away: nobody to tell
                pass

    def state(self, sizes: dict[str, int], verify: bool) -> None:
        """What this directory holds: size and sha256 per file (from the manifest when its size
        and mtime still match, else read again), and how much of each .part there is. A file
        shorter than the source's (an interrupted or truncated copy) becomes the .part."""
        paths = {name: inside(self.dir, name) for name in sizes}  # all, before any change
        parts = {name: inside(self.dir, name + PART) for name in sizes}  # a linked .part too
        os.makedirs(self.dir, exist_ok=True)
        manifest = read_manifest(self.dir)
        files = {}
        for name, size in sizes.items():
            path = paths[name]
            try:
                there = os.path.getsize(path)
            except FileNotFoundError:
                there = None
            if there is not None and there < size:
                if there > _size_or_zero(parts[name]):
                    os.replace(path, parts[name])
                else:
                    os.unlink(path)
                update_manifest(self.dir, name, None)
            info: dict = {"size": None, "sha256": None, "part": 0, "part_sha256": None}
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None
            if st is not None:
                info["size"] = st.st_size
                known = manifest.get(name)
                if (
                    not verify
                    and known
                    and known["size"] == st.st_size
                    and known["mtime_ns"] == st.st_mtime_ns
                ):
                    info["sha256"] = known["sha256"]
                else:
                    info["sha256"] = hash_prefix(path, st.st_size).hexdigest()
                    entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
                    update_manifest(self.dir, name, {**entry, "sha256": info["sha256"]})
            part = _size_or_zero(parts[name])
            if part:
                digest = hash_prefix(parts[name], part)
                self.prefixes[name] = (part, digest)
                info["part"], info["part_sha256"] = part, digest.hexdigest()
            files[name] = info
        self.reply(op="state", dir=os.path.abspath(self.dir), files=files)

    def listen(self, addresses: list[str], token: str) -> None:
        """Listen for the upstream's connection on each of these addresses that is ours."""
        self.token = token
        ssh_conn = os.environ.get("SSH_CONNECTION", "").split()
        if len(ssh_conn) == 4:
            addresses = [*addresses, ssh_conn[2]]  # the address the laptop reached us on
        ports = {}
        for address in dict.fromkeys(addresses):
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.bind((address, 0))
            except OSError:
                s.close()
                continue
            s.listen(4)
            self.listeners.append(s)
            ports[address] = s.getsockname()[1]
        self.reply(op="listening", ports=ports)

    def connect_forward(self, candidates: list[list], token: str, downstream: list[int]) -> None:
        errors = []
        for address, port in candidates:
            try:
                s = socket.create_connection((address, port), timeout=CONNECT_TIMEOUT)
            except OSError as e:
                errors.append(f"{address}:{port}: {e.strerror or e}")
                continue
            s.settimeout(IO_TIMEOUT)
            s.sendall((token + "\n").encode())
            self.forward, self.downstream = s, set(downstream)
            self.reply(op="forwarding", address=address)
            return
        self.reply(op="error", error="cannot reach the next host: " + "; ".join(errors))
        sys.exit(1)

    def accept(self):
        """The upstream's connection: the first one that presents the token. Each connection
        shows its token on a thread of its own, so a peer that connects and says nothing
        (or says something else) delays no other."""
        selector = selectors.DefaultSelector()
        for s in self.listeners:
            selector.register(s, selectors.EVENT_READ)
        admitted: queue.SimpleQueue = queue.SimpleQueue()
        token = self.token.encode()

        def check(conn) -> None:
            conn.settimeout(10)
            stream = conn.makefile("rb", buffering=BLOCK)  # one reader: token, then stream
            try:
                line = stream.readline(256).strip()
            except OSError:
                line = b""
            if hmac.compare_digest(line, token):
                admitted.put((conn, stream))
            else:
                conn.close()

        deadline = time.monotonic() + ACCEPT_TIMEOUT
        while (left := deadline - time.monotonic()) > 0:
            try:
                conn, stream = admitted.get_nowait()
            except queue.Empty:
                for key, _ in selector.select(min(left, 0.1)):
                    conn, _ = key.fileobj.accept()
                    threading.Thread(target=check, args=(conn,), daemon=True).start()
                continue
            conn.settimeout(IO_TIMEOUT)
            for s in self.listeners:
                s.close()
            return stream
        self.reply(op="error", error="the upstream host never connected")
        sys.exit(1)

    def receive(self, stream) -> None:
        """Files off the stream until its end: kept, forwarded, or both."""
        writer = Writer(self)
        while True:
            line = stream.readline()
            if not line:
                writer.stop("the stream ended before its end mark")
            entry = json.loads(line)
            if entry.get("end"):
                break
            keep = self.index in entry["to"]
            forward = self.forward is not None and bool(self.downstream & set(entry["to"]))
            writer.put(("begin", entry, keep, forward))
            if forward:
                writer.put(("forward", line))
            left = entry["size"] - entry["offset"]
            while left:
                chunk = stream.read(min(BLOCK, left))
                if not chunk:
                    writer.stop(f"{entry['name']}: the stream ended mid-file")
                writer.put(("bytes", chunk))
                left -= len(chunk)
            writer.put(("end", stream.readline()))
        if self.forward is not None:
            writer.put(("forward", line))
        writer.put(None)
        writer.thread.join()  # a failed write ends the process there, after saying why
        if self.forward is not None:
            self.forward.shutdown(socket.SHUT_WR)
            self.forward.recv(1)  # the next host closes once it has read everything
            self.forward.close()
        self.reply(op="done")


class Writer:
    """Disk writes, hashing and forwarding in a thread of their own, so that reading the next
    bytes off the stream overlaps with them."""

    def __init__(self, receiver: Receiver):
        self.r = receiver
        self.queue: queue.Queue = queue.Queue(maxsize=8)
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def put(self, item) -> None:
        self.queue.put(item)

    def stop(self, why: str) -> None:
        self.r.reply(op="error", error=why)
        os._exit(1)  # the .part files keep what arrived; the next sync resumes from there

    def run(self) -> None:
        try:
            self._run()
        except (OSError, ValueError) as e:  # a disk error, or a name that leaves the folder
            self.r.reply(op="error", error=f"{getattr(self, 'name', '')}: {e}")
            os._exit(1)

    def _run(self) -> None:
        r = self.r
        f = digest = None
        while (item := self.queue.get()) is not None:
            kind = item[0]
            if kind == "begin":
                entry, keep, self.forwarding = item[1], item[2], item[3]
                self.name, self.entry, self.received, self.reported = entry["name"], entry, 0, 0
                self.last = time.monotonic()
                f = digest = None
                if keep:
                    part = inside(r.dir, entry["name"] + PART)
                    offset = entry["offset"]
                    known = r.prefixes.pop(entry["name"], None)
                    f = open(part, "r+b" if offset else "wb", buffering=0)
                    f.truncate(offset)
                    f.seek(offset)
                    if known is not None and known[0] == offset:
                        digest = known[1]
                    else:
                        digest = hash_prefix(part, offset)
            elif kind == "forward":
                r.forward.sendall(item[1])
            elif kind == "bytes":
                chunk = item[1]
                if self.forwarding:
                    r.forward.sendall(chunk)
                if f is not None:
                    f.write(chunk)
                    digest.update(chunk)
                    self.received += len(chunk)
                    now = time.monotonic()
                    if now - self.last >= PROGRESS_EVERY:
                        r.reply(op="progress", n=self.received - self.reported)
                        self.reported, self.last = self.received, now
            elif kind == "end":
                if self.forwarding:
                    r.forward.sendall(item[1])
                if f is not None:
                    self.finish(f, digest, json.loads(item[1])["sha256"])
                    f = None

    def finish(self, f, digest, sha: str) -> None:
        r, entry = self.r, self.entry
        f.close()
        name = entry["name"]
        final = inside(r.dir, name)
        part = inside(r.dir, name + PART)
        if self.received - self.reported:
            r.reply(op="progress", n=self.received - self.reported)
        if digest.hexdigest() != sha:
            os.unlink(part)
            r.reply(op="bad", name=name, error="the copy's sha256 differs from the source's")
            return
        os.utime(part, ns=(entry["mtime_ns"], entry["mtime_ns"]))
        os.replace(part, final)
        st = os.stat(final)
        record = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
        update_manifest(r.dir, name, record)
        # the sha256 this host computed goes back over SSH: the trailer it was checked against
        # came in the stream it protects (a TCP link between hosts carries both)
        r.reply(op="stored", name=name, sent=self.received, sha256=sha)


def widen_pipe(fd: int) -> None:
    """Linux pipes hold 64 KiB: a wider one means fewer wake-ups per gigabyte."""
    try:
        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), 1 << 20)
    except OSError:
        pass  # not a pipe, not Linux, or over the limit: the default will do


def main(argv: list[str]) -> None:
    """``receive DIR INDEX``: then commands on stdin, one JSON line each."""
    directory, index = argv[-2], int(argv[-1])
    if sys.platform == "linux":
        widen_pipe(0)
    r = Receiver(directory, index)
    stdin = sys.stdin.buffer
    try:
        while line := stdin.readline():
            command = json.loads(line)
            op = command["op"]
            if op == "state":
                r.state(command["sizes"], command.get("verify", False))
            elif op == "listen":
                r.listen(command["addresses"], command["token"])
            elif op == "forward":
                r.connect_forward(command["candidates"], command["token"], command["downstream"])
            elif op == "receive":
                if command["from"] == "stdin":
                    r.receive(stdin)
                else:
                    watch = threading.Thread(target=_exit_on_eof, args=(stdin,), daemon=True)
                    watch.start()  # the laptop went away: stop, whatever the socket does
                    r.receive(r.accept())
                    sys.stdout.flush()
                    os._exit(0)  # the watcher holds stdin: no interpreter shutdown to wait on
            elif op == "bye":
                return
    except Exception as e:  # said to the laptop, which names the host
        r.reply(op="error", error=f"{type(e).__name__}: {e}")
        os._exit(1)


def _size_or_zero(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def _exit_on_eof(stdin) -> None:
    while stdin.readline():
        pass
    os._exit(1)


if __name__ == "__main__":
    main(sys.argv)
