"""serve's service and supervisor without ranks (cluster.serve): what happens to each request
when a job ends, the restart budget, when a lost host can be left out, and the failures before
any rank starts."""

from __future__ import annotations

import dataclasses
import json
import socket
import time

from cluster.core.hostfile import parse_hostfile
from cluster.core.protocol import END_OF_INPUT, Piece, Stats
from cluster.core.spec import JobSpec, ServeSettings
from cluster.job.launcher import LaunchError
from cluster.job.memory import fits
from cluster.serve.api.shared import END, RESTART, ApiRequest, RequestError
from cluster.serve.supervisor import Restarts, without_hosts
from tests.support.processes import invoke
from tests.support.serving import HOSTS, request, service, start_job, wait_sent


def drain(req: ApiRequest) -> list:
    items = []
    while not req.chunks.empty():
        items.append(req.chunks.get())
    return items


def test_requests_wait_for_the_ranks_then_go_to_rank0_in_order():
    svc, sent = service()
    reqs = [request(False), request(True)]
    for req in reqs:
        svc.submit(req)
    assert svc.health()["status"] == "starting" and svc.health()["waiting"] == 2
    start_job(svc, sent)
    lines = wait_sent(sent, 2)
    assert [x["request"]["id"] for x in lines] == [j.id for j in reqs]
    assert lines[0]["op"] == "request" and lines[0]["request"]["messages"][0]["content"] == "hi"
    assert svc.health()["status"] == "ok" and svc.health()["in_flight"] == 2


def test_a_failed_job_cuts_streams_under_way_and_decodes_the_rest_again():
    svc, sent = service()
    start_job(svc, sent)
    plain, shown_stream, quiet_stream = request(False), request(True), request(True)
    for req in (plain, shown_stream, quiet_stream):
        svc.submit(req)
    wait_sent(sent, 3)
    svc.on_event(0, Piece(plain.id, "Hel"))
    svc.on_event(0, Piece(shown_stream.id, "Hel"))
    svc.job_ended(LaunchError("error: rank 1 of 2 on b.local exited with code -9\nmore"))
    assert drain(plain) == [Piece(plain.id, "Hel"), RESTART]
    items = drain(shown_stream)
    assert items[0] == Piece(shown_stream.id, "Hel") and isinstance(items[1], RequestError)
    assert items[1].status == 502 and "the answer was cut: rank 1 of 2 on b.local" in str(items[1])
    assert drain(quiet_stream) == []
    assert [j.id for j in svc.pending] == [plain.id, quiet_stream.id]
    assert "1 stream(s) cut" in svc.stderr.getvalue()

    sent.clear()
    start_job(svc, sent)  # the restarted job gets them again, first in line
    assert [x["request"]["id"] for x in wait_sent(sent, 2)] == [plain.id, quiet_stream.id]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    svc.on_event(0, Piece(plain.id, "Hello"))
    svc.on_event(0, Stats("length", usage, {}, request=plain.id))
    assert drain(plain) == [Piece(plain.id, "Hello"), END] and plain.result["usage"] == usage
    metrics = svc.metrics.exposition().decode()
    assert 'mlx_cluster_requests_total{status="200"} 1.0' in metrics
    assert 'mlx_cluster_requests_total{status="stream_error"} 1.0' in metrics
    assert "mlx_cluster_completion_tokens_total 2.0" in metrics


def test_a_request_past_the_restart_wait_gets_503_with_retry_after():
    svc, _ = service(restart_wait=0.0)
    req = request(False)
    svc.submit(req)
    assert req.chunks.empty()  # it waits for the ranks...
    svc.reap(time.monotonic() + 0.001)  # ...until the loop's next look past the wait
    error = req.chunks.get_nowait()
    assert isinstance(error, RequestError) and error.status == 503 and error.retry_after
    assert "not ready after 0 s (starting)" in str(error)
    assert not svc.pending


def test_restarts_counts_failures_in_its_window():
    r = Restarts(2, 600)
    assert r.allow(0) and r.allow(100)
    assert not r.allow(200)  # 3 within 600 s
    r = Restarts(2, 600)
    assert r.allow(0) and r.allow(100) and r.allow(700) and r.allow(750)  # the first two expired
    assert not Restarts(0, 600).allow(0)


def test_a_lost_host_is_left_out_only_when_the_model_fits(tmp_path):
    from tests.support.tiny import make_model

    model = make_model(tmp_path / "m", "llama", seed=1)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    spec = JobSpec(model=str(model), command="serve")
    big = {"hosts": [{"ssh": f"h{i}.local", "memory_gb": 64} for i in range(3)]}
    rest = without_hosts(parse_hostfile(big), [2])
    assert [h.index for h in rest.hosts] == [0, 1]  # the hosts keep their numbers
    assert fits(rest, spec) is None
    small = {"hosts": [{"ssh": f"h{i}.local", "memory_gb": size / 4e9} for i in range(3)]}
    why = fits(without_hosts(parse_hostfile(small), [2]), spec)
    assert why.startswith("rank 0 on host 0 (h0.local) would hold") and "GB of weights" in why
    unknown = fits(without_hosts(parse_hostfile(HOSTS), [1]), spec)
    assert unknown == "the hostfile gives no memory_gb for host 0 (a.local), host 2 (c.local)"
    assert fits(without_hosts(parse_hostfile(big), [0, 1, 2]), spec) == "no host is left"


def test_a_busy_port_fails_before_any_rank_starts(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        p = invoke("serve", "--model", tmp_path, "--port", port)
    assert p.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port} (Address already in use); pass another" in p.stderr


def test_a_job_that_never_served_is_not_restarted(tmp_path):
    p = invoke("serve", "--model", tmp_path, "--port", 0)  # no config.json there
    assert p.returncode == 2, p.stderr
    assert "config.json" in p.stderr and "restarting" not in p.stderr


def test_a_drain_reaches_rank0_after_every_request_sent_before_it():
    """The race of a drain with a request: one channel, one order (the loop writes both)."""
    svc, sent = service()
    start_job(svc, sent)
    req = request(False)
    svc.submit(req)
    svc.draining(tell=True)
    late = request(False)
    svc.submit(late)
    deadline = time.monotonic() + 5
    while len(sent) < 2 and time.monotonic() < deadline:  # the pump writes on its thread
        time.sleep(0.01)
    assert json.loads(sent[0])["request"]["id"] == req.id and sent[1] == END_OF_INPUT
    assert len(sent) == 2 and drain(late)[0].status == 503


def test_a_request_under_way_at_two_failures_is_not_replayed_a_third_time():
    svc, sent = service()
    start_job(svc, sent)
    req = request(False)
    svc.submit(req)
    wait_sent(sent, 1)
    svc.job_ended(LaunchError("error: rank 1 of 2 on b.local exited with code -11"))
    assert list(svc.pending) == [req]  # replayed once
    sent.clear()
    start_job(svc, sent)
    wait_sent(sent, 1)
    svc.job_ended(LaunchError("error: rank 1 of 2 on b.local exited with code -11"))
    (error,) = drain(req)
    assert error.status == 500 and "failed 2 times while this request was under way" in str(error)
    assert not svc.pending
    health = svc.health()
    assert health["dropped_after_failures"] == [req.id]
    assert health["last_failure"]["in_flight"] == [req.id]
    assert f"request {req.id} was under way at 2 failures" in svc.stderr.getvalue()


def test_fits_counts_the_ranks_cap_and_the_kv_serve_needs(tmp_path):
    from tests.support.tiny import make_model

    model = make_model(tmp_path / "m", "llama", seed=1)
    size = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    hosts = {"hosts": [{"ssh": f"h{i}.local", "memory_gb": size * 1.1 / 1e9} for i in range(2)]}
    rest = without_hosts(parse_hostfile(hosts), [1])
    plain = JobSpec(model=str(model), command="serve", serve=ServeSettings(max_prompt_tokens=1))
    assert "(85% of its memory_gb)" in fits(rest, plain)  # 110% of the weights, 85% usable
    roomy = {"hosts": [{"ssh": f"h{i}.local", "memory_gb": size * 2 / 1e9} for i in range(2)]}
    rest = without_hosts(parse_hostfile(roomy), [1])
    assert fits(rest, plain) is None
    cached = JobSpec(
        model=str(model),
        command="serve",
        serve=ServeSettings(max_prompt_tokens=1),
        prompt_cache_gb=size / 1e9,
    )
    assert "GB of KV cache" in fits(rest, cached)


def test_health_shows_each_request_being_prefilled():
    """Rank 0's Prefill events per request: /health lists how far each has come, until its
    first text."""
    from cluster.core.protocol import Piece, Prefill

    svc, sent = service()
    start_job(svc, sent)
    req = request(True)
    svc.submit(req)
    svc.on_event(0, Prefill(4096, 30000, req.id))
    assert svc.health()["prefilling"] == [{"id": req.id, "done": 4096, "total": 30000}]
    svc.on_event(0, Piece(req.id, "hi"))
    assert svc.health()["prefilling"] == []


def test_a_request_under_way_past_its_deadline_gets_504_and_is_dropped_on_the_ranks():
    """A request line rank 0 never answers (lost, or a rank stuck on it) no longer keeps
    its client waiting forever: past --request-timeout it gets 504 and rank 0 a cancel."""
    svc, sent = service()
    svc.settings = dataclasses.replace(svc.settings, request_timeout=5.0)
    start_job(svc, sent)
    req = request(stream=False)
    svc.submit(req)
    (line,) = wait_sent(sent, 1)
    svc.reap(time.monotonic() + 1)
    assert req.chunks.empty()
    svc.reap(time.monotonic() + 6)
    error = req.chunks.get_nowait()
    assert error.status == 504 and "--request-timeout" in str(error)
    cancel = wait_sent(sent, 2)[-1]
    assert cancel == {"op": "cancel", "id": line["request"]["id"]}
    assert req.id not in svc.inflight


def test_a_grammar_whose_answer_failed_is_refused_at_the_door_for_a_while():
    """Rank 0 ends an answer whose grammar went over its budget with a Refused naming the
    grammar's digest; the launcher then refuses that grammar before it reaches a rank."""
    from cluster.core.grammar import digest, regex
    from cluster.core.protocol import Refused

    svc, sent = service()
    start_job(svc, sent)
    pattern = "(a|b)*a(a|b){20}"
    req = request(stream=False, guided_regex=pattern)
    assert svc.refused_grammar(req.request) is None
    svc.submit(req)
    (line,) = wait_sent(sent, 1)
    key = digest(regex(pattern)).hex()
    svc.on_event(0, Refused(line["request"]["id"], 400, "over its budget", grammar=key))
    assert req.chunks.get_nowait().status == 400
    again = svc.refused_grammar(request(stream=False, guided_regex=pattern).request)
    assert again.status == 400 and "refused for 600 s after a failure" in str(again)
    assert svc.refused_grammar(request(stream=False, guided_regex="(a|b)*").request) is None
