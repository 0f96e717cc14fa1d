"""serve's supervisor without ranks: what happens to each request when a job ends, the
restart budget, when a lost host can be left out, and the failures before any rank starts."""

from __future__ import annotations

import json
import socket
import time

from cluster.core.hostfile import parse_hostfile
from cluster.core.protocol import END_OF_INPUT, Piece, Stats
from cluster.core.spec import JobSpec, Order, Sampling, ServeSettings, SharedRequest, to_dict
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


def test_rank0_serves_the_requests_before_end_of_input_in_the_same_read():
    """The drain mark and the last requests often arrive in one read of the channel."""
    import os

    from node.jobs.serve import Inbox

    read_fd, write_fd = os.pipe()
    req = request(False)
    line = json.dumps({"op": "request", "request": to_dict(req.to_rank0())}).encode()
    os.write(write_fd, line + b"\n" + END_OF_INPUT)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as channel:
        inbox = Inbox(channel, print)
        first = inbox.tickets.get(timeout=5)
        assert first is not None and first.request.id == req.id
        assert inbox.tickets.get(timeout=5) is None and inbox.draining.is_set()
        assert inbox.prepared_all.is_set()  # only now may rank 0 quit


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


def test_kept_caches_stay_within_their_bytes(tmp_path):
    """node.batch.Lockstep on one rank: a finished answer's cache is kept, and the least
    recently used go once the kept bytes pass the budget (ranks agree through an all_sum,
    here a group of one)."""
    from mlx_lm import load

    from node.decode.sampling import seeded
    from node.jobs.batch import Lockstep
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / "m", "llama", seed=1)))

    def answer_three(cache_bytes: float) -> Lockstep:
        batch = Lockstep(model, tokenizer, 4, 4, 10, cache_bytes)
        for prompt in ([5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]):
            request = SharedRequest(seeded(Sampling(max_tokens=3, seed=1)), prompt)
            batch.apply(Order(insert=[request]))
            while batch.live:
                batch.round(None)
        batch.close()
        return batch

    roomy = answer_three(float("inf"))
    assert len(roomy.prompt_cache) == 3
    one = roomy.prompt_cache.nbytes / 3  # each answer's cache (the KV steps make them alike)
    tight = answer_three(one * 1.5)
    assert len(tight.prompt_cache) == 1 and tight.prompt_cache.nbytes <= one * 1.5


def test_prefill_pace_follows_the_measured_rate():
    from node.jobs.batch import PREFILL_MIN, PrefillPace

    pace = PrefillPace(2048, 0.5)
    assert pace.step(decoding=False) == 2048  # nobody waits: the biggest steps
    assert pace.step(decoding=True) == PREFILL_MIN  # not measured yet: a small first step
    pace.measured(1000, 1.0)
    assert pace.step(decoding=True) == 500
    pace.measured(200, 1.0)  # a longer prompt prefills slower: the step follows
    assert pace.step(decoding=True) == 300
    for _ in range(5):
        pace.measured(1, 1.0)
    assert pace.step(decoding=True) == PREFILL_MIN  # never below
    pace.measured(10**6, 1.0)
    assert pace.step(decoding=True) == 2048  # never above --prefill-step
    assert PrefillPace(2048, 0.0).step(decoding=True) == 2048  # --max-stall 0: off


def test_a_long_prompt_is_prefilled_in_steps_between_the_running_answers_tokens(tmp_path):
    """node.batch.Lockstep on one rank: while a long prompt joins, every round is one step:
    the running answer gets a token, the prompt at most one prefill step of tokens (rank 0's
    pace, shared in the order), so a cancel or a new request can come between any two."""
    from mlx_lm import load

    from node.decode.sampling import seeded
    from node.jobs.batch import PREFILL_MIN, Lockstep
    from tests.support.tiny import make_model

    model, tokenizer = load(str(make_model(tmp_path / "m", "llama", seed=1, eos_token_id=9999)))
    batch = Lockstep(model, tokenizer, 4, 4, 0, prefill_step=2048, max_stall=0.5)
    got: list = []
    batch.apply(Order(insert=[SharedRequest(seeded(Sampling(max_tokens=400)), [5, 6, 7])]))
    while len(got) < 2:
        batch.round(got.append)
    step = batch.next_prefill_step(joining=[1000])  # streams decode: the pace's step
    assert step == batch.pace.step(decoding=True) and PREFILL_MIN <= step <= 2048
    long = SharedRequest(seeded(Sampling(max_tokens=2)), [5 + i % 200 for i in range(1000)])
    ((uid, _, _),) = batch.apply(Order(insert=[long], prefill_step=PREFILL_MIN))
    done = 0
    while batch.prefilling:
        got.clear()
        batch.round(got.append)
        assert [r.uid for r in got] == [0], got  # one step: the running answer's token
        if uid in batch.prefilling:
            now = batch.prefilling[uid][0]
            assert 0 < now - done <= batch.generator.prefill_step_size, (done, now)
            done = now
        if (step := batch.next_prefill_step()) is not None:  # the pace, once measured
            batch.apply(Order(prefill_step=step))
    assert batch.pace.rate is not None
    while uid in batch.live:
        got.clear()
        batch.round(got.append)
    batch.apply(Order(remove=[0]))
    assert not batch.live
    batch.close()


def test_a_cancel_during_the_prefill_stops_it_within_one_chunk(tmp_path):
    """node.decode.loop on one rank, cancellable (chat): rank 0 cancelled after the first chunk;
    the prefill stops there, the answer is empty and "cancelled", and the cache holds exactly
    the chunk prefilled (chat keeps it for the next turn)."""
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from node.decode.loop import generate
    from node.decode.sampling import seeded
    from tests.support.tiny import make_model

    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    model, tokenizer = load(str(make_model(tmp_path / "m", "llama", seed=1, **small)))
    request = SharedRequest(seeded(Sampling(max_tokens=4)), [5 + i % 200 for i in range(5000)])
    seen: list[tuple[int, int]] = []
    cache = make_prompt_cache(model)
    answer = generate(model, tokenizer, request, lambda _: None, prompt_cache=cache,
                      cancelled=lambda: bool(seen) and seen[-1][0] > 0, cancellable=True,
                      on_prefill=lambda d, t: seen.append((d, t)))  # fmt: skip
    assert answer.stats["finish_reason"] == "cancelled" and answer.tokens == [], answer.stats
    assert seen == [(0, 5000), (2048, 5000)], seen  # mlx-lm's chunks of 2048
    assert cache[0].offset == 2048


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


def test_kv_bits_reach_mlx_lm_with_and_without_a_draft(monkeypatch):
    """--kv-bits goes to mlx-lm's stream_generate on every path, the speculative one too."""
    import node.decode.loop as g
    from node.decode.prefill import use_step_args
    from node.decode.sampling import seeded

    seen: list[dict] = []
    monkeypatch.setattr(g, "stream_generate", lambda *a, **kw: seen.append(kw) or iter(()))
    use_step_args({"kv_bits": 4, "kv_group_size": 64, "quantized_kv_start": 0})
    try:
        request = SharedRequest(seeded(Sampling(max_tokens=2)), [1, 2])
        g.token_stream(None, None, request)
        draft = type("Speculation", (), {"proposer": "p", "k": 3})()
        g.token_stream(None, None, request, speculation=draft)
    finally:
        use_step_args({})
    assert all(kw["kv_bits"] == 4 and kw["quantized_kv_start"] == 0 for kw in seen), seen
    assert seen[1]["draft_model"] == "p" and seen[1]["num_draft_tokens"] == 3


def test_pipeline_prefill_steps_make_enough_for_every_stage():
    """node.decode.prefill.prefill_step: in pipeline mode the step halves from 2048 until the prompt
    makes 8 steps per stage (down to 256): the stages then overlap (tests/prefill_overlap.py)."""
    from node.decode.prefill import prefill_step

    assert prefill_step(9123, 1) == 2048  # one rank or tensor mode: mlx-lm's step
    assert prefill_step(9123, 2) == 512  # 18 steps: 0.53 of one rank's time, ideally
    assert prefill_step(9123, 3) == 256
    assert prefill_step(32768, 2) == 2048  # already 16 steps
    assert prefill_step(40, 4) == 256  # a short prompt: one step anyway


def test_serve_overlaps_pipeline_stages_only_while_nothing_decodes(tmp_path):
    """node.batch.Lockstep with 2 stages: a long prompt alone goes in the pipeline's step,
    several per round (a round makes about 2048 x stages tokens); beside a running answer,
    one paced step per round."""
    from mlx_lm import load

    from node.decode.sampling import seeded
    from node.jobs.batch import ROUND_STEPS, Lockstep
    from tests.support.tiny import make_model

    small = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 64,
    }  # a 5000-token prompt, fast
    built = make_model(tmp_path / "m", "llama", seed=1, eos_token_id=9999, **small)
    model, tokenizer = load(str(built))
    batch = Lockstep(model, tokenizer, 4, 4, 0, prefill_step=2048, max_stall=0.5, stages=2)
    assert batch.steps_this_round() == ROUND_STEPS
    step = batch.next_prefill_step(joining=[5000])
    assert step == 256
    long = SharedRequest(seeded(Sampling(max_tokens=2)), [5 + i % 200 for i in range(5000)])
    ((uid, _, _),) = batch.apply(Order(insert=[long], prefill_step=step))
    assert batch.steps_this_round() == 2048 * 2 // 256
    batch.round(None)
    assert batch.prefilling[uid][0] == 16 * 256  # 16 steps in one round
    batch.apply(Order(remove=[uid]))
    short = SharedRequest(seeded(Sampling(max_tokens=400)), [5, 6, 7])
    batch.apply(Order(insert=[short]))
    while not batch.decoding():
        batch.round(None)
    step = batch.next_prefill_step(joining=[5000])  # beside a decoding answer: the pace's
    assert step == batch.pace.step(decoding=True)
    batch.apply(Order(insert=[long], prefill_step=step))
    assert batch.steps_this_round() == 1
    batch.close()
