"""`serve` outlives its ranks: a killed rank restarts the job under the same API, waiting
requests are answered, non-streaming ones under way are decoded again, streams under way end
with an error event; /health and /metrics say what happened; too many failures end serve."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.processes import _children, _cmdline, descendant_ranks
from tests.support.reference import reference
from tests.support.serving import (
    PROMPT,
    Load,
    Served,
    ask,
    chat_reference,
    free_port,
    get,
    wait_for,
)

openai = pytest.importorskip("openai")


def ranks_of(served: Served) -> dict[int, int]:
    """rank -> pid of this server's current ranks."""
    found = {}
    for pid in descendant_ranks(served.proc.pid, _children(), _cmdline):
        m = re.search(r"/rank(\d+)/", _cmdline(pid))
        if m:
            found[int(m[1])] = pid
    return found


def serving_again(served: Served, restarts: int) -> dict:
    """/health once it is ok after ``restarts`` restarts."""

    def ok():
        status, health, _ = get(served, "/health")
        done = status == 200 and health["status"] == "ok" and health["restarts"] == restarts
        return health if done else None

    return wait_for(ok)


def kill_rank(served: Served, rank: int) -> None:
    ranks = wait_for(lambda: ranks_of(served) if len(ranks_of(served)) >= 2 else None)
    os.kill(ranks[rank], signal.SIGKILL)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from tests.support.tiny import make_model

    return make_model(tmp_path_factory.mktemp("restart") / "m", "qwen2", seed=2, chat_template=True)


def test_three_killed_ranks_under_load_lose_no_request(model):
    """6 clients in a loop while a rank is SIGKILLed three times (rank 1, rank 0, rank 1)."""
    served = Served(model, "-n", "2", "--heartbeat-timeout", "5")
    expected = chat_reference(model, 16)
    load = Load(served, 6, expected, 16)
    try:
        for i, rank in enumerate((1, 0, 1), 1):
            before = load.ok()
            wait_for(lambda before=before: load.ok() >= before + 6)  # answers flow
            kill_rank(served, rank)
            health = serving_again(served, i)
            assert f"rank {rank}" in health["last_failure"]["message"], health
        before = load.ok()
        wait_for(lambda: load.ok() >= before + 6)
        outcomes = load.finish()
        status, metrics, _ = get(served, "/metrics")
    finally:
        load.stop.set()
        code = served.stop()
    log = "".join(served.log)
    print(f"outcomes: {dict(outcomes)}")
    backs = [float(x) for x in re.findall(r"back ([\d.]+) s after the failure", log)]
    print(f"ready again after (s): {backs}")
    under_way = re.findall(r"(\d+) request\(s\) to decode again, (\d+) stream\(s\) cut", log)
    print(f"under way at each failure (decoded again, cut): {under_way}")
    assert code == 0, log
    assert set(outcomes) <= {"ok", "ok stream", "cut"}, outcomes  # none refused, hung, wrong
    assert outcomes["ok"] > 0 and outcomes["ok stream"] > 0
    assert len(backs) == 3, log
    assert log.count("restarting the ranks") == 3
    # the server's own count agrees with the clients'
    assert "mlx_cluster_restarts_total 3.0" in metrics
    served_ok = re.search(r'mlx_cluster_requests_total\{status="200"\} ([\d.]+)', metrics)
    assert float(served_ok[1]) == outcomes["ok"] + outcomes["ok stream"], metrics
    cut = re.search(r'mlx_cluster_requests_total\{status="stream_error"\} ([\d.]+)', metrics)
    assert float(cut[1] if cut else 0) == outcomes["cut"], metrics
    assert re.search(r'mlx_cluster_rank_peak_memory_bytes\{host="localhost",rank="1"\}', metrics)
    assert "mlx_cluster_time_to_first_token_seconds_bucket" in metrics


def test_under_way_a_stream_is_cut_and_a_plain_request_is_decoded_again(models):
    served = Served(models["endless"], "-n", "2")
    client = openai.OpenAI(base_url=served.client.base_url, api_key="none", max_retries=0)
    try:
        stream = client.completions.create(
            model="endless", prompt="hi", max_tokens=30_000, temperature=0, stream=True
        )
        chunks = iter(stream)
        next(chunks)  # under way
        with ThreadPoolExecutor(1) as pool:
            plain = pool.submit(
                client.completions.create,
                model="endless", prompt="hi", max_tokens=400, temperature=0,
            )  # fmt: skip
            wait_for(lambda: get(served, "/health")[1]["in_flight"] == 2)
            kill_rank(served, 1)
            with pytest.raises(openai.APIError, match="the answer was cut: rank 1"):
                for _ in chunks:
                    pass
            answer = plain.result(timeout=300)
        assert answer.choices[0].text == reference(models["endless"], "hi", 400)
        assert answer.choices[0].finish_reason == "length"
    finally:
        assert served.stop() == 0
    assert "1 request(s) to decode again, 1 stream(s) cut" in "".join(served.log)


def test_requests_wait_at_most_the_restart_wait_then_503(model):
    """While the ranks start: /health says starting (503), a request gets 503 with Retry-After
    once it has waited --restart-wait; once serving, requests are answered."""
    import subprocess

    from tests.support.processes import CLI

    port = free_port()
    proc = subprocess.Popen(
        [CLI, "serve", "--model", str(model), "--port", str(port), "--restart-wait", "0"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    served = Served.__new__(Served)
    served.proc, served.address, served.port, served.log = proc, "127.0.0.1", port, []
    for line in proc.stderr:
        served.log.append(line)
        if "API on" in line:
            break
    status, health, _ = get(served, "/health")
    assert status == 503 and health["status"] == "starting", health
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"model": "m", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    r = conn.getresponse()
    error = json.loads(r.read())["error"]
    assert r.status == 503 and r.getheader("Retry-After") == "10", error
    assert "not ready after 0 s (starting)" in error["message"]
    for line in proc.stderr:
        served.log.append(line)
        if "serving" in line:
            break
    threading.Thread(target=lambda: served.log.extend(proc.stderr), daemon=True).start()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    assert ask(client, 8).choices[0].message.content == chat_reference(model, 8)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(60) == 0, "".join(served.log)


def test_failures_past_max_restarts_end_serve_naming_each(model):
    served = Served(model, "-n", "2", "--max-restarts", "1")
    kill_rank(served, 1)
    serving_again(served, 1)
    kill_rank(served, 1)
    assert served.proc.wait(60) == 1
    log = "".join(served.log)
    assert "2 failures within 10 min (--max-restarts 1); giving up" in log, log
    failures = re.findall(r"mlx-cluster:   (\d)\. \S+ (.*)", log)
    assert [n for n, _ in failures] == ["1", "2"], log
    assert all("rank 1" in text for _, text in failures), failures
    assert not ranks_of(served)


SAYS = '''
import os, sys, threading, time

def _say():
    """A rank of the test's serve writes each line the test drops in its folder for it
    (rN-*.line) to its stderr, as a rank sends an event (the test's own fault)."""
    folder, mine = os.environ["MLXC_TEST_SAYS"], "r" + os.environ["MLX_RANK"] + "-"
    while True:
        for name in sorted(os.listdir(folder)):
            if name.startswith(mine) and name.endswith(".line"):
                path = os.path.join(folder, name)
                data = open(path, "rb").read()
                os.remove(path)
                os.write(2, data)
        time.sleep(0.05)

if "MLX_RANK" in os.environ and b"\\x00run\\x00" in open("/proc/self/cmdline", "rb").read():
    threading.Thread(target=_say, daemon=True).start()
'''


def test_a_rank_s_malformed_event_or_wake_restarts_the_ranks_naming_it(model, tmp_path):
    """What once hung a client (a Wake from rank 1 wrote WAKE into rank 0's request channel,
    whose next line was then dropped and kept in flight forever) or ended serve (rank 0's
    stats without their timings: KeyError in the launcher): each is now that rank's failure,
    named, the ranks restart, and the request under way is answered."""
    (tmp_path / "sitecustomize.py").write_text(SAYS)
    says = tmp_path / "says"
    says.mkdir()
    served = Served(model, "-n", "2", env={"PYTHONPATH": str(tmp_path),
                                            "MLXC_TEST_SAYS": str(says)})  # fmt: skip
    expected = chat_reference(model, 16)
    prefix = "\x1emlx-cluster "
    broken = '{"event": "stats", "finish_reason": "stop", "usage": {}, "timings": {}}'
    lines = [(1, prefix + '{"event": "wake"}\n'), (0, prefix + broken + "\n")]
    try:
        text = lambda: ask(served.client).choices[0].message.content  # noqa: E731
        assert text() == expected
        for i, (rank, line) in enumerate(lines, 1):
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(text)
                (says / f"r{rank}-{i}.line").write_text(line)
                health = serving_again(served, i)
                assert answer.result(timeout=120) == expected
            message = health["last_failure"]["message"]
            assert f"rank {rank}" in message and "misbehaved" in message, message
        assert text() == expected
    finally:
        code = served.stop()
    log = "".join(served.log)
    assert "only rank 0 may send" in log and "usage.prompt_tokens is not a number" in log, log
    assert code == 0, log
