"""serve's HTTP server against hostile clients, with a stand-in service and no rank: bad
lengths, big bodies, slow clients, too many connections, odd keys, clients that leave."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time

import pytest

from cluster.core.protocol import Piece
from cluster.serve.api.shared import END
from cluster.serve.http import Api
from tests.support.serving import StandIn

BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()


@pytest.fixture
def api(request):
    options = getattr(request, "param", {})
    service = StandIn(hold=options.pop("hold", False))
    server = Api("127.0.0.1", 0, options.pop("key", None), service, **options)
    server.start()
    server.service = service
    yield server
    server.stop()


def post(api, body: bytes, headers: dict | None = None, path="/v1/chat/completions"):
    conn = http.client.HTTPConnection(*api.address, timeout=10)
    conn.putrequest("POST", path, skip_host="Host" in (headers or {}))
    for name, value in {"Content-Type": "application/json", **(headers or {})}.items():
        conn.putheader(name, value)
    if "Content-Length" not in (headers or {}):
        conn.putheader("Content-Length", str(len(body)))
    conn.endheaders(body)
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"null")


def test_a_plain_request_is_answered(api):
    status, body = post(api, BODY)
    assert status == 200 and body["choices"][0]["message"]["content"] == "ok"


def test_bad_lengths_and_big_bodies_are_refused_without_a_thread_held(api):
    for length, status, says in [
        ("-5", 400, "bad Content-Length '-5'"),
        ("12abc", 400, "bad Content-Length"),
        (str(1 << 40), 413, "over this server's 16777216 bytes (serve --max-body-mb)"),
    ]:
        got, body = post(api, b"", {"Content-Length": length})
        assert got == status and says in body["error"]["message"], (length, body)
    got, body = post(api, b" " * (17 << 20))  # sent whole: read, then refused
    assert got == 413 and "is 17825792 bytes" in body["error"]["message"]
    got, body = post(api, b"", {"Transfer-Encoding": "chunked"})
    assert got == 411
    got, body = post(api, b'{"messages": [', {})
    assert got == 400 and "not valid JSON" in body["error"]["message"]


@pytest.mark.parametrize("api", [{"read_timeout": 1.0}], indirect=True)
def test_a_slow_client_is_cut_off_at_the_read_deadline(api):
    """Slowloris: headers a byte at a time, and a body that never comes."""
    route = b"POST /v1/chat/completions HTTP/1.1\r\n"
    for start in (route + b"Host: x\r\n", route + b"Content-Length: 100\r\n\r\n{"):
        with socket.create_connection(api.address, timeout=10) as s:
            s.sendall(start)
            began = time.monotonic()
            try:
                while True:  # trickle a byte every 0.2 s: each recv would keep a plain timeout
                    s.sendall(b"X")
                    time.sleep(0.2)
                    if time.monotonic() - began > 8:
                        raise AssertionError("the server kept a slow client past its deadline")
            except OSError:
                pass  # the server closed the connection
    status, _ = post(api, BODY)
    assert status == 200  # and the server still answers


@pytest.mark.parametrize("api", [{"max_connections": 2, "read_timeout": 5.0}], indirect=True)
def test_connections_past_the_bound_get_503_at_once(api):
    idle = [socket.create_connection(api.address) for _ in range(2)]
    try:
        time.sleep(0.2)  # both accepted: each holds a thread
        with socket.create_connection(api.address, timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer
    finally:
        for s in idle:
            s.close()


@pytest.mark.parametrize("api", [{"key": "sekret"}], indirect=True)
def test_the_key_is_checked_as_bytes_before_the_body(api):
    status, body = post(api, BODY, {"Authorization": "Bearer s\u00e9kret"})
    assert status == 401 and body["error"]["type"] == "authentication_error"
    with socket.create_connection(api.address, timeout=5) as s:  # a non-Latin-1 byte string
        s.sendall(b"GET /health HTTP/1.1\r\nx-api-key: \xff\xfe\x80\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 401")
    with socket.create_connection(api.address, timeout=5) as s:  # announces 10 MB, sends none
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 10000000\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 401")  # refused without waiting for it
    assert post(api, BODY, {"x-api-key": "sekret"})[0] == 200
    assert post(api, BODY, {"Authorization": "Bearer sekret"})[0] == 200
    assert not [j for j in api.service.submitted if j.request.sampling.max_tokens != 2]


@pytest.mark.parametrize("api", [{"hold": True}], indirect=True)
def test_a_client_that_leaves_while_its_request_waits_cancels_it(api):
    with socket.create_connection(api.address, timeout=5) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(BODY)}\r\n\r\n".encode()
            + BODY
        )
        deadline = time.monotonic() + 5
        while not api.service.submitted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert api.service.submitted
    assert api.service.cancelled.wait(5), "the server did not notice the client left"


@pytest.mark.parametrize(
    ("api", "path", "alive"),
    [
        ({"hold": True, "keepalive_s": 0.2}, "/v1/chat/completions", b": keepalive\n\n"),
        ({"hold": True, "keepalive_s": 0.2}, "/v1/messages", b"event: ping\n"),
    ],
    indirect=["api"],
)
def test_a_stream_whose_answer_has_not_begun_is_kept_alive(api, path, alive):
    """A long prefill: the stream opens after keepalive_s and says it is alive until the
    first token comes, then the answer follows in the same stream."""
    body = json.loads(BODY)
    body["stream"] = True
    data = json.dumps(body).encode()
    with socket.create_connection(api.address, timeout=5) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nContent-Type: application/json\r\n".encode()
            + f"Content-Length: {len(data)}\r\nx-api-key: k\r\n\r\n".encode()
            + data
        )
        got = b""
        while got.count(alive) < 2:
            got += s.recv(65536)
        assert got.startswith(b"HTTP/1.1 200"), got
        assert not api.service.cancelled.is_set()
        (req,) = api.service.submitted
        req.result = {"finish_reason": "stop", "usage": {"prompt_tokens": 1,
                      "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip
        req.chunks.put(Piece(req.id, "late"))
        req.chunks.put(END)
        while chunk := s.recv(65536):
            got += chunk
    assert b'"late"' in got.split(alive)[-1], got


def raw_exchange(api, data: bytes, answers: int = 1) -> list[bytes]:
    """``data`` on one connection; the heads of the first ``answers`` answers on it."""
    with socket.create_connection(api.address, timeout=10) as s:
        s.sendall(data)
        f = s.makefile("rb")
        heads = []
        for _ in range(answers):
            head = b""
            while (line := f.readline()) not in (b"\r\n", b""):
                head += line
            length = [int(x.split(b":")[1]) for x in head.split(b"\r\n")
                      if x.lower().startswith(b"content-length")]  # fmt: skip
            f.read(length[0] if length else 0)
            heads.append(head)
        return heads


def test_the_host_header_must_name_this_server(api):
    """DNS rebinding: a page of evil.example whose name resolves to 127.0.0.1 sends its own
    name as Host; that name is refused, loopback names and addresses are not."""
    status, body = post(api, BODY, {"Host": "evil.example:8080"})
    assert status == 403 and "--allowed-hosts" in body["error"]["message"]
    for host in ("localhost:8080", "127.0.0.1", "[::1]:8080", "app.localhost", "10.1.2.3"):
        assert post(api, BODY, {"Host": host})[0] == 200, host
    conn = http.client.HTTPConnection(*api.address, timeout=10)
    conn.request("GET", "/v1/cluster", headers={"Host": "evil.example"})
    assert conn.getresponse().status == 403
    assert not api.service.submitted[1:] or all(
        r.request.sampling.max_tokens == 2 for r in api.service.submitted
    )  # fmt: skip


@pytest.mark.parametrize("api", [{"allowed_hosts": ["studio.lan"]}], indirect=True)
def test_allowed_hosts_are_answered(api):
    assert post(api, BODY, {"Host": "studio.lan:8080"})[0] == 200
    assert post(api, BODY, {"Host": "other.lan"})[0] == 403


def test_a_web_page_of_another_origin_is_refused(api):
    host = f"127.0.0.1:{api.address[1]}"
    status, body = post(api, BODY, {"Host": host, "Origin": "http://evil.example"})
    assert status == 403 and "--cors-origins" in body["error"]["message"]
    assert post(api, BODY, {"Host": host, "Origin": "null"})[0] == 403
    assert post(api, BODY, {"Host": host, "Origin": f"http://{host}"})[0] == 200  # the page
    conn = http.client.HTTPConnection(*api.address, timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://evil.example"})
    assert conn.getresponse().status == 403


@pytest.mark.parametrize("api", [{"cors_origins": ["http://localhost:3000"]}], indirect=True)
def test_cors_origins_may_call_the_api_from_a_page(api):
    conn = http.client.HTTPConnection(*api.address, timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})  # fmt: skip
    r = conn.getresponse()
    r.read()
    assert r.status == 204
    assert r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert r.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    conn.request("POST", "/v1/chat/completions", BODY, {
        "Origin": "http://localhost:3000", "Content-Type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    r.read()
    assert post(api, BODY, {"Origin": "http://localhost:3001"})[0] == 403


def test_json_routes_take_only_json(api):
    """A page may post text/plain across origins without a preflight: such a body is not
    taken as a request."""
    status, body = post(api, BODY, {"Content-Type": "text/plain"})
    assert status == 415 and "application/json" in body["error"]["message"]
    assert post(api, BODY, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    assert len(api.service.submitted) == 1


def test_a_body_no_route_reads_never_becomes_the_next_request(api):
    """A GET with a body, a POST to no route: the body is read (or the connection closed),
    so behind a proxy that reuses connections the next request is itself."""
    evil = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"  # what the body would smuggle
    second = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
              b"Content-Type: application/json\r\n"
              + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)  # fmt: skip
    for first in (
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
        + f"Content-Length: {len(evil)}\r\n\r\n".encode()
        + evil,
        b"POST /v1/nothing HTTP/1.1\r\nHost: localhost\r\n"
        + f"Content-Length: {len(evil)}\r\n\r\n".encode()
        + evil,
    ):
        heads = raw_exchange(api, first + second, answers=2)
        assert heads[0].split(b"\r\n")[0] in (b"HTTP/1.1 200 OK", b"HTTP/1.1 404 Not Found")
        assert heads[1].startswith(b"HTTP/1.1 200") and b"application/json" in heads[1]
    with socket.create_connection(api.address, timeout=10) as s:  # too big to read: closed
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
                  b"Content-Length: 99999999\r\n\r\n")  # fmt: skip
        answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 200") and b"Connection: close" in answer


def test_unicode_digits_are_not_a_length(api):
    status, body = post(api, BODY, {"Content-Length": "\u00b2"})
    assert status == 400 and "bad Content-Length" in body["error"]["message"]


def test_sixty_four_clients_connecting_at_once_are_all_answered(api):
    """socketserver's listen backlog of 5 reset connections of a burst (the kernel refuses
    past it); the backlog is now sized for --max-connections."""
    barrier = threading.Barrier(64)
    results = []

    def one():
        barrier.wait()
        try:
            results.append(post(api, BODY)[0])
        except OSError as e:
            results.append(repr(e))

    threads = [threading.Thread(target=one) for _ in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [200] * 64, results


def test_a_descriptor_past_1023_is_watched(api):
    """select() cannot watch a descriptor past 1023 (a server with many connections has
    them): a waiting request would have been taken for a client that left."""
    import resource

    from cluster.serve.http import readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("this process may not open 1200 files")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    with socket.create_connection(api.address, timeout=5) as s:
        fd = os.dup2(s.fileno(), 1100)
        high = socket.socket(fileno=fd)
        try:
            assert not readable(high)  # nothing to read yet, and no error
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            deadline = time.monotonic() + 5
            while not readable(high) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert readable(high)
        finally:
            high.detach()
            os.close(fd)


def test_serve_raises_its_open_files_limit_for_its_connections(tmp_path):
    import subprocess
    import sys

    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"  # macOS's default
        "from cluster.serve.http import raise_open_files\n"
        "print(raise_open_files(256), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    warning, soft = out.stdout.split()
    assert warning == "None" and int(soft) >= 512, out


def test_lengths_that_disagree_and_any_transfer_encoding_get_one_answer_and_a_close(api):
    """Two different Content-Lengths, or a Transfer-Encoding (identity then chunked: a proxy
    may read the chunks where this server read a length): one 4xx/501 with Connection:
    close, never a second answer to what the body smuggled."""
    smuggled = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    chunked = b"0\r\n\r\n" + smuggled
    cases = {
        b"Content-Length: 2\r\nContent-Length: %d\r\n" % len(smuggled): (b"{}" + smuggled, 400),
        b"Transfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n": (
            b"{}" + chunked,
            411,
        ),
        b"Transfer-Encoding: gzip\r\nContent-Length: 2\r\n": (b"{}" + smuggled, 501),
    }
    for headers, (body, status) in cases.items():
        data = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
                b"Content-Type: application/json\r\n" + headers + b"\r\n" + body)  # fmt: skip
        with socket.create_connection(api.address, timeout=10) as s:
            s.sendall(data)
            got = b""
            while chunk := s.recv(65536):  # the server closes: everything it sent
                got += chunk
        assert got.startswith(b"HTTP/1.1 %d" % status), got[:80]
        assert got.count(b"HTTP/1.1 ") == 1 and b"Connection: close" in got, got
    assert api.service.submitted == []


@pytest.mark.parametrize("api", [{"cors_origins": ["http://localhost:3000"]}], indirect=True)
def test_a_refused_origin_is_granted_nothing(api):
    for method, path in (("POST", "/v1/chat/completions"), ("OPTIONS", "/v1/chat/completions"),
                         ("GET", "/v1/models")):  # fmt: skip
        conn = http.client.HTTPConnection(*api.address, timeout=10)
        conn.request(method, path, BODY if method == "POST" else None, {
            "Origin": "http://evil.example", "Content-Type": "application/json"})  # fmt: skip
        r = conn.getresponse()
        r.read()
        assert r.status == 403 and r.headers["Access-Control-Allow-Origin"] is None, method


def test_an_unforeseen_exception_is_a_500_with_a_json_body_and_one_logged_traceback(api):
    lines = []
    api.log = lines.append

    def broken(body, door):
        raise AttributeError("'str' object has no attribute 'get'")

    api.routes["/v1/chat/completions"].parse = broken
    status, body = post(api, BODY)
    assert status == 500 and "AttributeError" in body["error"]["message"]
    assert len(lines) == 1 and "Traceback" in lines[0] and "broken" in lines[0]
    del api.routes["/v1/chat/completions"].parse
    assert post(api, BODY)[0] == 200  # the server goes on


@pytest.mark.timeout(60)
def test_a_body_that_once_took_hours_to_count_is_refused_at_once_while_health_answers(api):
    """A 1 MiB body of '"' and '\\"' x 524,288 (no closing quote) was scanned by a
    backtracking pattern in quadratic time holding the GIL (80 KB: 31 s). Now it is refused
    as the JSON it is not; /health answers meanwhile (the timeout guards a hang only)."""
    evil = b'"' + b'\\"' * 524_288
    health = []

    def poll():
        conn = http.client.HTTPConnection(*api.address, timeout=30)
        conn.request("GET", "/health")
        health.append(conn.getresponse().status)

    watcher = threading.Thread(target=poll)
    watcher.start()
    status, body = post(api, evil)
    watcher.join()
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    assert health == [200]
