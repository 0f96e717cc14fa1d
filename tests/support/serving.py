"""Servers the tests and benchmarks start: ``Served`` (mlx-cluster serve with the official
openai client), a serve of its own for a measurement (``fresh_serve``), and the plumbing of
both (a free port, waiting for a server, stopping a process group, a JSON POST)."""

from __future__ import annotations

import contextlib
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    import openai
except ImportError:  # a GPU host measuring with fresh_serve alone has no client
    openai = None  # type: ignore[assignment]

from cluster.core.hostfile import parse_hostfile
from cluster.core.protocol import Piece, Serving
from cluster.core.spec import JobSpec, ServeSettings
from cluster.job.state import JobState, RankState
from cluster.serve.api.openai import ChatCompletions
from cluster.serve.api.shared import END, ApiRequest, Door
from cluster.serve.metrics import Metrics
from cluster.serve.service import Service
from tests.support.processes import CLI, rank_pids
from tests.support.reference import reference

HOSTS = {"hosts": [{"ssh": "a.local"}, {"ssh": "b.local"}, {"ssh": "c.local"}]}

PROMPT = "Tell me about lists"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    def __init__(self, model_dir, *args, env=None, address="127.0.0.1", links=False):
        """``address``: where rank 0 listens, as seen from here (with ``--host`` in args
        when it is not 127.0.0.1). ``links``: the ranks measure their links as they start
        (serve's default; the tests that check the figures ask for it, the others save the
        second or two per start)."""
        self.address = address
        self.port = free_port()
        before = set(rank_pids())
        self.proc = subprocess.Popen(
            [
                CLI,
                "serve",
                "--model",
                str(model_dir),
                "--port",
                str(self.port),
                *args,
                *([] if links else ["--no-measure-links"]),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        for line in self.proc.stderr:  # until rank 0 listens
            self.log.append(line)
            if "serving" in line:
                break
        else:
            raise AssertionError("".join(self.log))
        self.pids = set(rank_pids()) - before
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.client = openai.OpenAI(
            base_url=f"http://{address}:{self.port}/v1", api_key="none", max_retries=0
        )

    def post(self, path: str, body: bytes, headers=None):
        conn = http.client.HTTPConnection(self.address, self.port, timeout=60)
        conn.request("POST", path, body, {"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"null")

    def stop(self, sig=signal.SIGINT) -> int:
        """Ctrl-C (a drain); the exit code, once none of this server's ranks is left."""
        self.proc.send_signal(sig)
        code = self.proc.wait(60)
        assert not self.pids & set(rank_pids()), "rank processes left running"
        return code

    def stop_clean(self, refusals: bool = False) -> None:
        """A module's server at its end: never restarted, drained with exit 0, and (unless
        ``refusals``) no 400 and no traceback in its log."""
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health").read())
        assert health["restarts"] == 0, health
        assert self.stop() == 0
        if not refusals:
            assert not any(" 400 " in line or "Traceback" in line for line in self.log)


def chat_reference(model_dir, max_tokens: int) -> str:
    return reference(model_dir, PROMPT, max_tokens)  # the chat template, greedy


def ask(client, max_tokens=16, model="m", **kw):
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        **{"temperature": 0, **kw},
    )


BIN = Path(sys.executable).parent


def wait_up(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("server not up in time")


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGINT to each process group, SIGKILL what is left after 30 s."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass
    for proc in procs:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def start(argv: list[str], env: dict | None = None) -> subprocess.Popen:
    # stdin: a pipe never written. mlx.launch forwards its stdin to the ranks, and at EOF
    # (/dev/null, as in a background job) its select loop spins a core all the time.
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )


def post(port: int, path: str, body: dict, timeout: float = 1800):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


@contextlib.contextmanager
def fresh_serve(model: Path, mode: str, ranks: int, *flags: str):
    """A serve of its own (one BLAS thread per rank), warmed up with a short request; its
    port. Stopped (a drain) on leaving."""
    port = free_port()
    argv = [str(BIN / "mlx-cluster"), "serve", "-n", str(ranks), "--mode", mode, "--model",
            str(model), "--port", str(port), *flags]  # fmt: skip
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=env)  # fmt: skip
    try:
        wait_up(port, proc)
        post(port, "/v1/completions", {"model": model.name, "prompt": "Warm up.", "max_tokens": 2})
        yield port
    finally:
        stop([proc])


def llama_576(base: Path) -> Path:
    """The llama-shaped model of the long-prompt measurements (hidden 576, 8 layers, 9 heads),
    its EOS out of reach, with a 64k context."""
    from tests.support.tiny import make_model

    return make_model(base / "llama-576", "llama", seed=3, eos_token_id=100_000,
                      hidden_size=576, intermediate_size=1536, num_hidden_layers=8,
                      num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=65536)  # fmt: skip


class StandIn:
    """The part of cluster.serve.service.Service the server calls; answers "ok" at once unless
    told to hold requests."""

    def __init__(self, hold: bool = False):
        self.model_id = "m"
        self.door = Door(frozenset({"m"}))
        self.metrics = Metrics(lambda: [])
        self.hold = hold
        self.submitted, self.cancelled = [], threading.Event()

    def submit(self, req) -> None:
        self.submitted.append(req)
        if not self.hold:
            req.result = {"finish_reason": "stop", "usage": {"prompt_tokens": 1,
                          "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip
            req.chunks.put(Piece(req.id, "ok"))
            req.chunks.put(END)

    def cancel(self, req) -> None:
        self.cancelled.set()

    def refused_grammar(self, request):
        return None

    def health(self) -> dict:
        return {"status": "ok"}


@contextlib.contextmanager
def running_api(service: StandIn, **options):
    """serve's HTTP server on a free port of 127.0.0.1 with ``service`` behind it."""
    from cluster.serve.http import Api

    server = Api("127.0.0.1", 0, options.pop("key", None), service, **options)
    server.start()
    server.service = service
    try:
        yield server
    finally:
        server.stop()


def service(restart_wait: float = 60.0) -> tuple[Service, list[bytes]]:
    spec = JobSpec(model="m", command="serve", serve=ServeSettings(restart_wait=restart_wait))
    svc = Service(parse_hostfile(HOSTS), spec, io.StringIO(), thread=False)
    sent: list[bytes] = []
    return svc, sent


def start_job(svc: Service, sent: list[bytes]) -> None:
    svc.attach(sent.append, JobState([RankState(0, "a.local"), RankState(1, "b.local")]))
    svc.on_event(0, Serving("m", True))


def request(stream: bool, **fields) -> ApiRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream,
            **fields}  # fmt: skip
    chat = ChatCompletions()
    return ApiRequest(chat, chat.parse(body, Door(frozenset({"m"}))), stream, "m", chat.echo(body))


def wait_sent(sent: list[bytes], n: int) -> list[dict]:
    import time

    deadline = time.monotonic() + 5
    while len(sent) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return [json.loads(line) for line in sent]


def get(served: Served, path: str) -> tuple[int, dict | str, dict]:
    conn = http.client.HTTPConnection(served.address, served.port, timeout=30)
    conn.request("GET", path)
    r = conn.getresponse()
    data = r.read().decode()
    headers = dict(r.getheaders())
    return r.status, (json.loads(data) if path == "/health" else data), headers


def wait_for(what, timeout: float = 120, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {what}")


class Load:
    """Clients in a loop, each request's outcome counted: ok, wrong, refused (no connection),
    hung (no answer within the client's timeout), cut (a stream ended by an error event),
    or the HTTP status of an error."""

    def __init__(
        self, served: Served, clients: int, expected: str, max_tokens: int, model: str = "m"
    ):
        self.client = openai.OpenAI(
            base_url=served.client.base_url, api_key="none", max_retries=0, timeout=120
        )
        self.expected, self.max_tokens, self.model = expected, max_tokens, model
        self.outcomes: Counter = Counter()
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.pool = ThreadPoolExecutor(clients)
        self.futures = [self.pool.submit(self.loop, i) for i in range(clients)]

    def count(self, outcome: str) -> None:
        with self.lock:
            self.outcomes[outcome] += 1

    def ok(self) -> int:
        with self.lock:
            return self.outcomes["ok stream"] + self.outcomes["ok"]

    def loop(self, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            stream = (i + n) % 2 == 0
            n += 1
            try:
                if stream:
                    chunks = self.client.chat.completions.create(
                        model=self.model, messages=[{"role": "user", "content": PROMPT}],
                        max_tokens=self.max_tokens, temperature=0, stream=True,
                    )  # fmt: skip
                    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                else:
                    answer = ask(self.client, self.max_tokens, self.model)
                    text = answer.choices[0].message.content
                kind = "ok" if text == self.expected else "wrong"
                self.count(f"{kind} stream" if stream and kind == "ok" else kind)
            except openai.APIConnectionError as e:
                self.count("hung" if isinstance(e, openai.APITimeoutError) else "refused")
            except openai.APIStatusError as e:
                self.count(f"status {e.status_code}")
            except openai.APIError as e:  # an error event in a stream
                self.count("cut" if "the answer was cut" in str(e) else f"error {e}")

    def finish(self) -> Counter:
        self.stop.set()
        for f in self.futures:
            f.result(timeout=300)
        self.pool.shutdown()
        return self.outcomes
