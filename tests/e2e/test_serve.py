"""`mlx-cluster serve`, driven with the official openai client."""

import http.client
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.processes import CLI, cpu_seconds, rank_pids
from tests.support.reference import reference
from tests.support.serving import PROMPT, Served, ask, chat_reference, free_port

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.support.tiny import make_model

    model = make_model(tmp_path_factory.mktemp("serve") / "m", "qwen2", seed=2, chat_template=True)
    served = Served(model, "--max-prompt-tokens", "2000", "--read-timeout", "3", links=True)
    served.model = model
    yield served
    served.stop()


@pytest.fixture(autouse=True)
def no_stray_ranks():  # the server's ranks live for the whole module; checked at its end
    yield


def test_chat_completion(server):
    r = ask(server.client)
    assert r.choices[0].message.content == chat_reference(server.model, 16)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16
    assert r.model == "m"


def test_streaming_with_usage(server):
    chunks = list(ask(server.client, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_reference(server.model, 16)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16


def test_completions_endpoint_and_models(server):
    r = server.client.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(server.model))
    expected = generate(
        model, tokenizer, tokenizer.encode(PROMPT), max_tokens=8, sampler=make_sampler(0.0)
    )
    assert r.choices[0].text == expected
    assert [m.id for m in server.client.models.list().data] == ["m"]


def test_eight_concurrent_streams_each_get_the_lone_answer(server):
    expected = chat_reference(server.model, 24)

    def one(_):
        stream = ask(server.client, max_tokens=24, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(one, range(8)))
    assert texts == [expected] * 8


def test_idle_ranks_rest_and_wake_for_the_next_request(server):
    """Between requests no rank waits in a collective (whose receive polls a core): over a
    few idle seconds the two ranks together use a fraction of one core's time, and the next
    request wakes them and gets the lone answer."""
    assert ask(server.client).choices[0].message.content == chat_reference(server.model, 16)
    before = cpu_seconds(server.pids)
    # the idle window measured: shorter than the fixture's --read-timeout of 3 s, which ends an
    # idle keep-alive connection; this client does not retry, so a request sent as the server
    # cut its connection would fail for a reason this test is not about
    time.sleep(2)
    used = cpu_seconds(server.pids) - before
    assert used < 1.0, f"idle ranks used {used:.2f} s of CPU in 2 s"
    assert ask(server.client).choices[0].message.content == chat_reference(server.model, 16)


def test_client_that_leaves_frees_the_server(server):
    stream = ask(server.client, max_tokens=30_000, stream=True)
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()  # the connection goes away mid-answer
    r = ask(server.client, max_tokens=8, timeout=60)  # served at once, not after 30k tokens
    assert r.choices[0].message.content == chat_reference(server.model, 8)
    assert any("(cancelled)" in line for line in server.log)


def test_bad_requests_get_openai_errors_and_the_ranks_go_on(server):
    status, body = server.post("/v1/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = server.post("/v1/chat/completions", b'{"messages": "hi"}')
    assert status == 400 and "'messages'" in body["error"]["message"]
    status, body = server.post(
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "7"}).encode(),
    )
    assert status == 400 and "'max_tokens'" in body["error"]["message"]
    status, body = server.post("/v1/chat/completions", b"x" * (17 * 1024 * 1024))  # > 16 MB
    assert status == 413
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "x"}]
        )
    assert ask(server.client).choices[0].message.content == chat_reference(server.model, 16)


def test_two_hundred_mixed_requests_and_no_rank_restarts(server):
    """Malformed, non-streaming, streaming, completions and clients that leave mid-stream, 4 at
    a time: each gets its answer or its 4xx, and the same rank processes serve them all."""
    reference = chat_reference(server.model, 4)

    def one(i):
        kind = i % 5
        if kind == 0:
            return server.post("/v1/chat/completions", b"[]")[0] == 400
        if kind == 1:
            return ask(server.client, max_tokens=4).choices[0].message.content == reference
        if kind == 2:
            chunks = ask(server.client, max_tokens=4, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
                reference
            )
        if kind == 3:
            r = server.client.completions.create(model="m", prompt="x", max_tokens=4)
            return r.choices[0].finish_reason in ("stop", "length")
        stream = ask(server.client, max_tokens=1000, stream=True)
        next(iter(stream))
        stream.close()  # gone mid-answer
        return True

    with ThreadPoolExecutor(4) as pool:
        answered = list(pool.map(one, range(200)))
    assert all(answered), [i for i, ok in enumerate(answered) if not ok]
    assert server.proc.poll() is None
    assert len(server.pids) == 2 and server.pids <= set(
        rank_pids()
    )  # the ranks that started are the ones still serving
    assert ask(server.client, max_tokens=4).choices[0].message.content == reference


def hostile_requests(rng) -> list[tuple[str, bytes, dict]]:
    """(path, body, headers): the requests that once took serve down, malformed and
    hostile bodies, and odd but valid settings."""
    chat = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    out = []

    def add(body, path="/v1/chat/completions", **headers):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        out.append((path, data, headers))

    for extra in [
        {"seed": -1, "temperature": 0.5}, {"temperature": 0.7, "top_k": 100000},
        {"top_k": -1, "temperature": 1}, {"top_k": 0}, {"top_p": 0}, {"top_p": 1e-9},
        {"temperature": 100}, {"min_p": 1}, {"repetition_penalty": 10},
        {"presence_penalty": -2, "frequency_penalty": 2, "repetition_context_size": 1},
        {"logit_bias": {"3": 100}},
        {"logit_bias": {"511": -100}}, {"stop": ["x"] * 16}, {"stop": ""},
        {"seed": 2**63 - 1, "temperature": 1}, {"max_tokens": 1}, {"logprobs": True,
        "top_logprobs": 20},  # fmt: skip
        {"seed": -2}, {"temperature": -1}, {"top_k": 10**30}, {"max_tokens": 10**9},
        {"logit_bias": {"512": 1}}, {"logit_bias": {"x": 1}}, {"stop": ["x"] * 17},
        {"messages": [{"role": "user", "content": "lists " * 2500}]},  # over 2000 tokens
        {"messages": []}, {"messages": [{"role": "user", "content": {"a": 1}}]}, {"n": 2},
        {"model": []}, {"model": "other"}, {"tools": "x"}, {"response_format": {"type": "x"}},
    ]:  # fmt: skip
        add({**chat, **extra})
    for data in [b"{not json", b'{"temperature": NaN}', b"[" * 50_000, b'{"a": "\xff\xfe"}',
                 b"\xff" * 100, b"9" * 5000, b"", b"null", b'"x"', b"[]"]:  # fmt: skip
        add(data)
    add({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "/v1/messages")
    add({"max_tokens": 3, "messages": [{"role": "assistant", "content": [{"type": "image"}]}]},
        "/v1/messages")  # fmt: skip
    add({"input": [{"type": "computer_call"}]}, "/v1/responses")
    add({"prompt": ["a", "b"]}, "/v1/completions")
    add(chat, "/v1/nothing")
    # the third review's: a 1 MiB body a backtracking scan took hours over, holding the GIL;
    # bodies that raised past the door's checks (AttributeError, RecursionError)
    add(b'"' + b'\\"' * 524_288)
    add({**chat, "output_config": "x"}, "/v1/messages/count_tokens")
    add({**chat, "guided_json": "[" * 100_000})
    add({**chat, "structured_outputs": {"json": "[" * 100_000}})
    add(b"", "/v1/chat/completions", **{"Content-Length": "-1"})
    add(b"", "/v1/chat/completions", **{"Content-Length": str(100 << 20)})
    words = ["messages", "prompt", "input", "max_tokens", "temperature", "top_k", "stop",
             "seed", "tools", "stream", "role", "content", "logit_bias", "top_p"]  # fmt: skip
    leaves = [None, True, -1, 0, 1, 2**40, -0.5, 1e308, "", "x", [], {}]
    for _ in range(250):  # random bodies built of the fields serve reads

        def value(depth=0):
            if depth > 2 or rng.random() < 0.5:
                return rng.choice(leaves)
            if rng.random() < 0.5:
                return [value(depth + 1) for _ in range(rng.randint(0, 3))]
            return {rng.choice(words): value(depth + 1) for _ in range(rng.randint(0, 3))}

        body = {rng.choice(words): value() for _ in range(rng.randint(0, 5))}
        if rng.random() < 0.5:
            body = {**chat, **body, "max_tokens": 3}
        path = rng.choice(["/v1/chat/completions", "/v1/completions", "/v1/responses",
                           "/v1/messages", "/v1/messages/count_tokens"])  # fmt: skip
        add(body, path)
    return out


def test_hostile_requests_take_nothing_down(server):
    """A few hundred malformed, hostile and odd-but-valid requests, with a slowloris client
    beside them: each gets an answer or a 4xx; serve stays up with 0 restarts, /health is
    ok, and a greedy request still returns single-process mlx-lm's text."""
    import random
    from collections import Counter

    requests = hostile_requests(random.Random(0))

    def slowloris():
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 99\r\n\r\n{")
            try:
                for _ in range(100):  # a byte every 0.1 s: cut at the 3 s read deadline
                    s.sendall(b" ")
                    time.sleep(0.1)
            except OSError:
                return True
        return False

    def one(item):
        path, data, headers = item
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.putrequest("POST", path)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", headers.get("Content-Length", str(len(data))))
            conn.endheaders(data)
            response = conn.getresponse()
            response.read()
            return response.status
        except (ConnectionError, http.client.HTTPException):
            return "closed"  # a body refused without being read
        finally:
            conn.close()

    with ThreadPoolExecutor(4) as pool:
        cut = pool.submit(slowloris)
        statuses = list(pool.map(one, requests))
        assert cut.result(), "the slow client was not cut off"
    counts = Counter(statuses)
    print(
        f"\n{len(requests)} hostile requests, by outcome: {dict(sorted(counts.items(), key=str))}"
    )
    assert not [s for s in statuses if s not in (200, 400, 404, 413, "closed")], counts
    assert counts[200] > 20 and counts[400] > 100
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health").read())
    assert health["status"] == "ok" and health["restarts"] == 0, health
    assert server.proc.poll() is None and server.pids <= set(rank_pids())
    assert ask(server.client).choices[0].message.content == chat_reference(server.model, 16)


def review_requests() -> list[tuple[str, bytes, dict]]:
    """(path, body, headers): the second review's requests, each of which once ended serve,
    leaked or hung: lone surrogates (valid JSON) in stop strings, stop_sequences and content,
    tool-call arguments nested 500 deep inside their JSON text, a Unicode digit as a length
    and as a logit_bias key, stream_options of another type, a text/plain body, a GET and a
    POST to no route with a body behind them, a model named by another path."""
    lone = '"\\ud800"'
    chat = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3'
    deep = json.dumps("[" * 500 + "]" * 500)
    call = ('{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", '
            '"function": {"name": "f", "arguments": ' + deep + '}}]}')  # fmt: skip
    json_type = {"Content-Type": "application/json"}
    return [
        ("/v1/chat/completions", f'{chat}, "stop": [{lone}]}}'.encode(), json_type),
        ("/v1/messages", f'{chat}, "stop_sequences": [{lone}]}}'.encode(), json_type),
        ("/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": {lone}}}], "max_tokens": 3}}'.encode(),
         json_type),
        ("/v1/chat/completions",
         f'{{"messages": [{{"role": "user", "content": "x"}}, {call}], "max_tokens": 3}}'
         .encode(), json_type),
        ("/v1/chat/completions", f'{chat}, "logit_bias": {{"\u00b2": 1}}}}'.encode(), json_type),
        ("/v1/chat/completions", f'{chat}, "stream": true, "stream_options": 3}}'.encode(),
         json_type),
        ("/v1/chat/completions", f"{chat}}}".encode(), {"Content-Type": "text/plain"}),
        ("/v1/chat/completions", f"{chat}}}".encode(),
         {**json_type, "Content-Length": "\u00b2"}),
        ("/v1/chat/completions", f'{chat}, "model": "/Users/me/models/x"}}'.encode(),
         json_type),
    ]  # fmt: skip


def test_the_review_s_requests_three_times_over_and_a_burst_of_64(server):
    """Each of the review's requests three times: a 4xx (or an answer), never a restart; then
    64 clients connecting at once all get their answers (the listen backlog was 5)."""
    before = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health").read())
    for _ in range(3):
        for path, data, headers in review_requests():
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
            conn.putrequest("POST", path)
            for name, value in {"Content-Length": str(len(data)), **headers}.items():
                conn.putheader(name, value.encode("utf-8").decode("latin-1"))
            conn.endheaders(data)
            r = conn.getresponse()
            body = json.loads(r.read())
            conn.close()
            assert r.status in (400, 404, 415), (path, data[:80], r.status, body)
            message = json.dumps(body)
            assert str(server.model) not in message  # the server's own folder, never
    for headers in ({"Host": "evil.example"}, {"Origin": "http://evil.example"}):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", b"{}",
                     {"Content-Type": "application/json", **headers})  # fmt: skip
        assert conn.getresponse().status == 403
    barrier = threading.Barrier(64)
    expected = chat_reference(server.model, 4)

    def one(_):
        barrier.wait()
        return ask(server.client, max_tokens=4).choices[0].message.content

    with ThreadPoolExecutor(64) as pool:
        texts = list(pool.map(one, range(64)))
    assert texts == [expected] * 64
    health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health").read())
    assert health["status"] == "ok" and health["restarts"] == before["restarts"] == 0, health
    assert server.proc.poll() is None and server.pids <= set(rank_pids())


def conversation_reference(model_dir, messages, max_tokens: int) -> str:
    """Single-process mlx-lm, greedy, on the chat template of ``messages``."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(0.0))


def test_a_conversation_sent_again_prefills_only_its_new_turn(server):
    first = ask(server.client, max_tokens=16)
    again = ask(server.client, max_tokens=16)  # the same prompt: all but its last token cached
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    messages = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And tuples?"},
    ]
    r = server.client.chat.completions.create(
        model="m", messages=messages, max_tokens=16, temperature=0
    )
    assert r.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens
    assert r.choices[0].message.content == conversation_reference(server.model, messages, 16)


def test_a_chained_response_is_answered_from_the_stored_conversation(server):
    """Responses' previous_response_id: the stored turn and the new input make the prompt
    (found in the prompt cache), the answer is single-process mlx-lm's on that conversation,
    and each object the server sends validates against the specification's fields."""
    from tests.support.openresponses import ResponseResource, check

    client = server.client
    first = client.responses.create(model="m", input=PROMPT, max_output_tokens=16, temperature=0)
    second = client.responses.create(model="m", previous_response_id=first.id,
                                     input="And tuples?", max_output_tokens=16,
                                     temperature=0)  # fmt: skip
    for r in (first, second):
        check(r.model_dump(mode="json", exclude_unset=True), ResponseResource)
    messages = [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tuples?"},
    ]
    assert second.output_text == conversation_reference(server.model, messages, 16)
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens - 1 <= cached < second.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", previous_response_id=second.id, input="More")


def test_a_model_without_a_tool_format_answers_forced_calls_as_json(server):
    """This server's model has no tool-call format (its template renders no tools): a
    forced call is decoded as the arguments' JSON under the schema and returned as the call,
    in every dialect (tests/e2e/test_tool_formats.py: the model's own format)."""
    from tests.e2e.test_tool_formats import clients, forced_calls_follow_their_schemas

    clients(server, "m")
    forced_calls_follow_their_schemas(server)


def test_api_key(tmp_path):
    from tests.support.tiny import make_model

    model = make_model(tmp_path / "m", "llama", seed=1)
    served = Served(model, "-n", "1", env={"MLX_CLUSTER_API_KEY": "s3cret"})
    try:
        with pytest.raises(openai.AuthenticationError):
            served.client.models.list()
        keyed = openai.OpenAI(base_url=served.client.base_url, api_key="s3cret", max_retries=0)
        assert keyed.models.list().data[0].id == "m"
        assert not any("s3cret" in line for line in served.log)
    finally:
        assert served.stop() == 0


def test_health_names_every_rank(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("GET", "/health")
    health = json.loads(conn.getresponse().read())
    assert health["status"] == "ok" and health["ranks"] == health["ranks_up"] == 2
    assert health["mode"] == "pipeline" and health["hosts"] == health["hosts_in_hostfile"] == 1
    assert [r["rank"] for r in health["rank_states"]] == [0, 1]
    assert all(r["heartbeat_age_s"] < 5 for r in health["rank_states"]), health
    assert health["restarts"] == 0 and health["last_failure"] is None


def test_seeded_requests_repeat(server):
    def sampled(seed):
        return ask(server.client, max_tokens=16, seed=seed, temperature=0.9)

    first, again, other = sampled(5), sampled(5), sampled(6)
    assert first.choices[0].message.content == again.choices[0].message.content
    assert first.choices[0].message.content != other.choices[0].message.content


@pytest.mark.parametrize("mode,ranks", [("pipeline", 3), ("tensor", 2)])
def test_batch_on_three_ranks_equals_lone_answers(tmp_path, mode, ranks):
    """llama goes through our pipeline stages (3 ranks: a middle stage too; skipped cache
    slots in a batch; the batch in 3 micro-batches, one per stage, their collectives on one
    stream), tensor mode through node/model/tensor.py's shards (uneven head splits are the
    matrix's, at 3 ranks); requests of different lengths join one batch."""
    from tests.support.tiny import make_model

    model = make_model(tmp_path / "m", "llama", seed=1)
    micro = ["--micro-batches", "3"] if mode == "pipeline" else []
    served = Served(model, "-n", str(ranks), "--mode", mode, *micro)
    try:
        assert "batched" in "".join(served.log)
        if micro:  # it applies (our stages), not silently one batch
            assert "the batch decodes in 3 micro-batches" in "".join(served.log)
        prompts = [PROMPT, "hi", "a much longer prompt than the others, to pad the batch"]
        expected = [reference(model, p, 20) for p in prompts]

        def one(i):
            r = served.client.completions.create(
                model="m", prompt=prompts[i % 3], max_tokens=20, temperature=0, stream=True
            )
            return "".join(c.choices[0].text for c in r)

        with ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(one, range(6)))
        assert texts == expected + expected
    finally:
        assert served.stop() == 0


def test_sigint_drains_then_every_rank_exits(tmp_path, models):
    served = Served(models["endless"], "-n", "3")
    assert len(served.pids) == 3
    stream = served.client.completions.create(
        model="endless", prompt="hi", max_tokens=80, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks)  # the answer is under way
    served.proc.send_signal(signal.SIGINT)
    text = [c.choices[0] for c in chunks]  # ... and is finished, not cut
    assert text[-1].finish_reason == "length"
    with pytest.raises((openai.APIConnectionError, openai.InternalServerError)):
        served.client.completions.create(model="endless", prompt="hi", max_tokens=4)
    assert served.proc.wait(60) == 0  # the drain ends the job by itself
    assert not served.pids & set(rank_pids()), "rank processes left running"
    log = "".join(served.log)
    assert "draining" in log and "drained; all ranks stopped" in log


def test_second_sigint_stops_at_once(tmp_path, models):
    served = Served(models["endless"], "-n", "2")
    stream = served.client.completions.create(
        model="endless", prompt="hi", max_tokens=30_000, temperature=0, stream=True
    )
    next(iter(stream))
    served.proc.send_signal(signal.SIGINT)
    while not any("draining" in line for line in served.log):  # the first one was handled
        assert served.proc.poll() is None
        time.sleep(0.05)
    assert served.stop() == 130
    assert "stopped by SIGINT; all ranks stopped" in "".join(served.log)


@pytest.mark.parametrize("family, mode", [("llama", "pipeline"), ("qwen2", "tensor")])
def test_prompt_cache_in_each_mode(tmp_path, family, mode):
    """Our own pipeline stages (llama) and tensor shards keep caches the same way."""
    from tests.support.tiny import make_model

    model = make_model(tmp_path / "m", family, seed=4, chat_template=True)
    served = Served(model, "--mode", mode)
    try:
        answers = [ask(served.client, max_tokens=12) for _ in range(3)]
        assert {a.choices[0].message.content for a in answers} == {chat_reference(model, 12)}
        cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
        assert cached[0] == 0 and cached[1] == cached[2] == answers[0].usage.prompt_tokens - 1
    finally:
        assert served.stop() == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_serve_starts_stops_every_rank(models, sig):
    """Before the ranks are ready there is nothing to drain: the job stops (128 + signal)."""
    proc = subprocess.Popen(
        [CLI, "serve", "--model", str(models["llama"]), "--port", str(free_port())],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    for line in proc.stderr:  # the launcher has started the ranks; none is ready yet
        if "starting 2 rank(s)" in line:
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert "AttributeError" not in err and "all ranks stopped" in err
    assert "serving" not in err and out == ""


def test_status_and_the_page_show_the_running_server(server):
    """`mlx-cluster status` prints /v1/cluster's overview: both ranks ready, on this host,
    with the layers each holds; the page's file is served at /. (The page in a browser:
    tests/e2e/test_page.py.)"""
    from tests.support.processes import invoke

    ask(server.client)  # one answer, so the figures have something
    p = invoke("status", "--url", f"http://127.0.0.1:{server.port}")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "m: ok, pipeline mode, 2 of 2 ranks up, 0 restart(s)", p.stdout
    ranks = [x.split() for x in lines if x.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2]) for r in ranks] == [("0", "localhost", "ready"),
                                                   ("1", "localhost", "ready")]  # fmt: skip
    assert all("layers" in x for x in lines if x.strip()[:1].isdigit())
    (link,) = [x.split() for x in lines if x.startswith("link 0-1")]  # measured at start-up
    assert link[2:5] == ["localhost", "-", "localhost"] and float(link[7]) > 0, p.stdout
    assert link[9] == "yes" and any(x.startswith("all_sum: ") for x in lines), p.stdout
    p = invoke("status", "--url", f"http://127.0.0.1:{server.port}", "--json")
    assert json.loads(p.stdout)["answered"] >= 1
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/html")
        assert b"mlx-cluster" in r.read()
    gone = invoke("status", "--url", f"http://127.0.0.1:{free_port()}")
    assert gone.returncode == 1 and "no serve answers at" in gone.stderr
