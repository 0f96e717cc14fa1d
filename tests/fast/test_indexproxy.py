"""The index proxy of `install --index-via-here`, without SSH: its channel is one end of a
socket pair, the index a socket server on this machine."""

import socket
import socketserver
import threading

import pytest

from cluster.rig.indexproxy import IndexTunnels, parse_connect, refusal


def test_parse_connect():
    assert parse_connect(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org\r\n\r\n") == (
        "pypi.org",
        443,
    )
    assert parse_connect(b"CONNECT PyPI.org:443 HTTP/1.0\r\n\r\n") == ("pypi.org", 443)
    assert parse_connect(b"GET http://pypi.org/ HTTP/1.1\r\n\r\n") is None
    assert parse_connect(b"CONNECT pypi.org HTTP/1.1\r\n\r\n") is None
    assert parse_connect(b"CONNECT :443 HTTP/1.1\r\n\r\n") is None
    assert parse_connect(b"\xff\xfe") is None


def test_refusal_names_what_is_allowed():
    allowed = ("pypi.org", "files.pythonhosted.org")
    assert refusal(("pypi.org", 443), allowed) is None
    assert refusal(("files.pythonhosted.org", 443), allowed) is None
    assert "pypi.org:22 is not a package index" in refusal(("pypi.org", 22), allowed)
    why = refusal(("example.com", 443), allowed)
    assert "example.com:443" in why and "pypi.org, files.pythonhosted.org" in why
    assert refusal(None, allowed) == "only HTTP CONNECT requests are served"


class Channel:
    """The part of a paramiko channel that the proxy uses, over a socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def echo_port():
    class Echo(socketserver.BaseRequestHandler):
        def handle(self):
            while data := self.request.recv(65536):
                self.request.sendall(data.upper())

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) as server:
        threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
        yield server.server_address[1]
        server.shutdown()


def through_proxy(tunnels: IndexTunnels, request: bytes, body: bytes) -> bytes:
    ours, theirs = socket.socketpair()
    thread = threading.Thread(target=tunnels.serve, args=(Channel(theirs),))
    thread.start()
    ours.sendall(request + body)
    ours.shutdown(socket.SHUT_WR)
    answer = b""
    while data := ours.recv(65536):
        answer += data
    thread.join(timeout=10)
    assert not thread.is_alive()
    ours.close()
    return answer


def test_a_tunnel_pipes_both_ways(echo_port):
    tunnels = IndexTunnels(allowed=("127.0.0.1",), port=echo_port)
    body = b"hello index" * 10000
    answer = through_proxy(
        tunnels, f"CONNECT 127.0.0.1:{echo_port} HTTP/1.1\r\n\r\n".encode(), body
    )
    assert answer == b"HTTP/1.1 200 Connection established\r\n\r\n" + body.upper()
    assert tunnels.opened == 1 and tunnels.refused == []


def test_another_host_is_refused_and_counted(echo_port):
    tunnels = IndexTunnels(allowed=("pypi.org",))
    answer = through_proxy(
        tunnels, f"CONNECT 127.0.0.1:{echo_port} HTTP/1.1\r\n\r\n".encode(), b"x"
    )
    assert answer.startswith(b"HTTP/1.1 403 Forbidden\r\n\r\n127.0.0.1:")
    assert tunnels.opened == 0
    assert tunnels.refused == [
        f"127.0.0.1:{echo_port} is not a package index (allowed: pypi.org, port 443)"
    ]
