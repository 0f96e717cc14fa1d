"""The package index through this machine, for hosts that have no internet of their own (a Mac
reached only over a Thunderbolt cable): ``install --index-via-here``.

The host's pip gets ``--proxy http://127.0.0.1:PORT``, where PORT is a remote forward of the
install's own SSH session. Each connection to it arrives here as a channel speaking HTTP
CONNECT; this end opens TCP to the index and pipes bytes both ways. TLS stays end to end
between the host's pip and the index (certificates are checked there, not here), and only
port 443 of the index's hosts can be reached, so the forward is no general way out.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import paramiko

INDEX_HOSTS = ("pypi.org", "files.pythonhosted.org")
HEAD_LIMIT = 8192  # bytes of a CONNECT request and its headers
CONNECT_TIMEOUT_S = 15.0


def parse_connect(head: bytes) -> tuple[str, int] | None:
    """(host, port) of an ``HTTP CONNECT host:port`` request head, or None for anything else."""
    try:
        line = head.split(b"\r\n", 1)[0].decode("ascii")
    except UnicodeDecodeError:
        return None
    parts = line.split()
    if len(parts) != 3 or parts[0] != "CONNECT" or not parts[2].startswith("HTTP/1."):
        return None
    host, sep, port = parts[1].rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.lower(), int(port)


def refusal(target: tuple[str, int] | None, allowed: Iterable[str], port: int = 443) -> str | None:
    """Why this end will not open ``target``, or None when it may."""
    if target is None:
        return "only HTTP CONNECT requests are served"
    if target[1] != port or target[0] not in allowed:
        hosts = ", ".join(allowed)
        return f"{target[0]}:{target[1]} is not a package index (allowed: {hosts}, port {port})"
    return None


@dataclass
class IndexTunnels:
    """What one host's pip did through this machine: tunnels opened and refused."""

    allowed: tuple[str, ...] = INDEX_HOSTS
    port: int = 443
    opened: int = 0
    refused: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def serve(self, channel: paramiko.Channel) -> None:
        """One forwarded connection: read its CONNECT, then pipe it to the index."""
        try:
            head = _read_head(channel)
            target = parse_connect(head)
            why = refusal(target, self.allowed, self.port)
            if why is None:
                try:
                    upstream = socket.create_connection(target, timeout=CONNECT_TIMEOUT_S)
                except OSError as e:
                    why = f"this machine cannot reach {target[0]}:{target[1]}: {e}"
            if why is not None:
                with self.lock:
                    self.refused.append(why)
                channel.sendall(f"HTTP/1.1 403 Forbidden\r\n\r\n{why}\n".encode())
                return
            with self.lock:
                self.opened += 1
            upstream.settimeout(None)
            channel.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            upstream.sendall(head.partition(b"\r\n\r\n")[2])  # bytes sent ahead, if any
            _pipe(channel, upstream)
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the host's pip went away mid-request: nothing to report
        finally:
            channel.close()


def forward_index(transport: paramiko.Transport, tunnels: IndexTunnels) -> int:
    """Listen on the far host's 127.0.0.1 through ``transport``; the port its pip should use
    as ``--proxy http://127.0.0.1:PORT``. The forward ends with the SSH session."""

    def handler(channel, _origin, _server):
        threading.Thread(target=tunnels.serve, args=(channel,), daemon=True).start()

    return transport.request_port_forward("127.0.0.1", 0, handler=handler)


def _read_head(channel: paramiko.Channel) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head and len(head) < HEAD_LIMIT:
        chunk = channel.recv(1024)
        if not chunk:
            break
        head += chunk
    return head


def _pipe(channel: paramiko.Channel, upstream: socket.socket) -> None:
    """Bytes both ways until either side closes; then both are closed."""

    def down() -> None:
        try:
            while data := upstream.recv(65536):
                channel.sendall(data)
        except OSError:
            pass
        finally:
            channel.shutdown_write()

    thread = threading.Thread(target=down, daemon=True)
    thread.start()
    try:
        while data := channel.recv(65536):
            upstream.sendall(data)
        upstream.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    thread.join()
    upstream.close()
