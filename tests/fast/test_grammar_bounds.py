"""What one request's grammar may cost and how it fails, in one process: a matcher per
request (a cached one's copies shared their lexer's states, and its limit, with every later
request), ranks whose caches saw other requests decide the same masks, a matcher that fails
ends the answer with an error (never a quiet stop), rank 0's time budget ends a request over
it, a request with a grammar joins only once every rank built its matcher, the think-block
scan is incremental, and GBNF grammars are taken. Across ranks: tests/e2e/test_structured.py."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from cluster.core import grammar
from cluster.core.protocol import Refused
from cluster.core.spec import Grammar, Sampling, ServeRequest, SharedRequest
from node.decode import grammar as node_grammar
from node.decode.loop import generate
from node.decode.sampling import processors

VOCAB = 512
LEXER_HEAVY = grammar.regex("(a|b)*a(a|b){20}")  # its lexer's states grow with every token


@pytest.fixture
def qwen(models):
    from mlx_lm import load

    model, tokenizer = load(str(models["qwen2"]))
    node_grammar.use_tokenizer(models["qwen2"], tokenizer.eos_token_ids, VOCAB)
    return model, tokenizer


def walk(c: node_grammar.Constrained, steps: int, seed: int) -> list[np.ndarray]:
    """``steps`` tokens drawn at random among those the mask allows (end of sequence never):
    the masks seen on the way."""
    rng = np.random.default_rng(seed)
    eos = set(node_grammar.tokens().tokenizer.eos_tokens)
    history, masks = [7], []
    for _ in range(steps):
        masked = c(mx.array(history), mx.zeros((1, VOCAB)))
        allowed = np.array(masked[0] > -1e30)
        masks.append(allowed)
        choices = [t for t in np.nonzero(allowed)[0] if t not in eos]
        if not choices:
            break
        history.append(int(rng.choice(choices)))
    return masks


@pytest.fixture
def small_limits(monkeypatch):
    """llguidance's limits at a tenth or less, so each shape shows in a few hundred tokens."""
    monkeypatch.setitem(grammar.LIMITS, "max_lexer_states", 5_000)
    monkeypatch.setitem(grammar.LIMITS, "step_max_items", 300)


def test_one_long_answer_no_longer_poisons_the_grammar_for_the_requests_after_it(
    qwen, small_limits
):
    """17 answers of 1,000 tokens under this regex used up the 50,000 lexer states of the
    one cached matcher all its copies shared; from then on every request with it got an
    end-of-sequence-only mask. Now each request's matcher is its own (here: 8 answers of
    400 tokens, ~1,200 states each, under a limit of 5,000)."""
    for seed in range(8):
        c = node_grammar.Constrained(LEXER_HEAVY)
        masks = walk(c, 400, seed)
        assert len(masks) == 400 and c.failure is None, (seed, c.failure)


def test_ranks_with_other_cache_histories_decide_the_same_masks(qwen, small_limits):
    """Rank 0 checks grammars of requests the others never see (cancelled, refused) and had
    its own cache history; a rank's masks now depend on the request's tokens alone."""
    for other in range(150):  # rank 0's own checks of other grammars
        node_grammar.check(grammar.regex(f"x{other}(a|b)*"))
    for seed in range(3):  # and earlier answers under the same grammar
        walk(node_grammar.Constrained(LEXER_HEAVY), 400, seed)
    rank0 = walk(node_grammar.Constrained(LEXER_HEAVY), 600, seed=99)
    node_grammar.VERDICTS.clear()
    rank1 = walk(node_grammar.Constrained(LEXER_HEAVY), 600, seed=99)
    assert len(rank0) == len(rank1) == 600
    assert all((a == b).all() for a, b in zip(rank0, rank1, strict=True))


AMBIGUOUS = grammar.lark('start: x\nx: x x | x x x | "a" | "b" | "ab"\n')


def test_a_matcher_that_fails_ends_the_answer_with_an_error_not_a_stop(qwen, small_limits):
    """The ambiguous grammar of the third review reaches step_max_items (10,000; here 300)
    within a few hundred tokens: every rank then allows only end-of-sequence at the same
    token, and the answer is an error (GrammarFailed in launch and a request decoded alone;
    serve's batch: a 400), not 'stop'."""
    model, tokenizer = qwen
    c = node_grammar.Constrained(AMBIGUOUS)
    masks = walk(c, 600, seed=0)
    assert c.failure is not None and "Too many items" in c.failure, c.failure
    eos = node_grammar.tokens().tokenizer.eos_tokens
    assert sorted(np.nonzero(masks[-1])[0]) == sorted(eos)  # the end, on every rank alike
    never_done = grammar.lark('start: x "!"\nx: x x | x x x | "a" | "b" | "ab"\n')
    request = SharedRequest(Sampling(max_tokens=600, temp=0.0), [1, 2, 3],
                            Grammar(never_done))  # fmt: skip
    with pytest.raises(node_grammar.GrammarFailed, match="grammar failed after"):
        generate(model, tokenizer, request, None)


def test_an_answer_that_ends_where_its_grammar_ends_is_no_failure(qwen):
    model, tokenizer = qwen
    req = SharedRequest(Sampling(max_tokens=20, temp=0.0), [1, 2, 3],
                        Grammar(grammar.regex("yes|no")))  # fmt: skip
    got = generate(model, tokenizer, req, None)
    assert got.stats["finish_reason"] == "stop"
    (c,) = processors(req, 3)
    assert c.failure is None


def test_the_budget_ends_a_grammar_over_its_share_of_the_step():
    budget = node_grammar.Budget(share=0.15, floor=0.0005, window=8)
    assert budget.over(spent=8 * 0.0009, steps=8, model_step=0.01) is None  # 1.5 ms allowed
    why = budget.over(spent=8 * 0.002, steps=8, model_step=0.01)
    assert why is not None and "2.0 ms per token" in why and "1.5 ms" in why
    assert budget.over(spent=0.002, steps=2, model_step=0.01) is None  # a window not spent
    assert budget.over(spent=0.05, steps=1, model_step=0.01) is not None  # a window at once
    assert budget.over(spent=8 * 0.0004, steps=8, model_step=0.001) is None  # the floor


class Inbox:
    def __init__(self):
        import queue
        import threading

        self.flights = queue.Queue()
        self.prepared_all, self.draining = threading.Event(), threading.Event()
        self.logged = []

    def ended(self, flight):
        pass

    def log(self, line):
        self.logged.append(line)


def grammar_flight(text: str):
    import node.jobs.serve as ns

    flight = ns.Flight(ServeRequest(id="g", kind="completion", sampling=Sampling()))
    flight.shared = SharedRequest(Sampling(max_tokens=8), [1, 2], Grammar(text))
    flight.size = ns.shared_size(flight.shared)
    return flight


def test_a_request_with_a_grammar_joins_once_every_rank_built_its_matcher(qwen):
    """Rank 0 announces the grammar (Order.compile), every rank builds it on its thread,
    and the request joins only after they all said so (serve's agree_built); a cancelled
    one's ticket is dropped everywhere."""
    import node.jobs.serve as ns

    events = []
    s = ns.Scheduler(None, events.append, True, 30.0, ns.Admission(VOCAB, None, None))
    s.inbox = Inbox()
    s.take(grammar_flight(LEXER_HEAVY))
    order = s.order(live=0)
    assert not order.insert and [g.ticket for g in order.compile] == [0]
    assert order.compile[0].text == LEXER_HEAVY
    node_grammar.compiling.submit(order.compile)
    assert s.order(live=0) is None  # not built everywhere yet: nothing joins
    built = ns.agree_built(None, wait=30)
    assert built == [0]
    s.compiled(built)
    order = s.order(live=0)
    assert [r.grammar.ticket for r in order.insert] == [0]
    request = order.insert[0]
    (c,) = processors(request, 2)  # the matcher built off the loop, taken by the request
    assert c.matcher is node_grammar.compiling.take(0)
    node_grammar.compiling.drop([0])
    assert node_grammar.compiling.pending == []
    s.inserting = []
    cancelled = grammar_flight(AMBIGUOUS)
    s.take(cancelled)
    s.order(live=0)
    cancelled.cancel.set()
    assert s.order(live=0).dropped == [1]


def test_rank_0_ends_a_request_over_its_budget_and_refuses_that_grammar_for_a_while(qwen):
    import node.jobs.serve as ns

    events = []
    s = ns.Scheduler(None, events.append, True, 30.0, ns.Admission(VOCAB, None, None))
    s.inbox = Inbox()
    flight = grammar_flight(AMBIGUOUS)
    one = ns.InBatch(flight, None, None, 2, 0.0)
    s.in_batch[5] = one
    c = node_grammar.Constrained(AMBIGUOUS)
    c.spent, c.steps = 0.4, 8  # 50 ms a token
    s.grammars[5] = c
    s.police((0.08, 8))  # a model step of 5 ms
    (refused,) = events
    assert isinstance(refused, Refused) and refused.status == 400
    assert "over its budget" in refused.message and s.removals == [5]
    assert refused.grammar == grammar.digest(AMBIGUOUS).hex()  # the launcher's door learns it
    assert "refused for 600 s after a failure" in s.failures.why(refused.grammar)


def test_the_think_block_scan_reads_each_token_once(qwen, monkeypatch):
    """The wait for the end of a think block looked for its marker in the whole reasoning
    every step (13 ms a step at 32k tokens, on every rank)."""
    scanned = []
    real = node_grammar.find

    def counting(seq, part, start=0):
        scanned.append(len(seq) - start)
        return real(seq, part, start)

    monkeypatch.setattr(node_grammar, "find", counting)
    c = node_grammar.Constrained(grammar.regex("ok"), after=[500, 501])
    history = [1, 2, 3]
    for i in range(2000):
        c(mx.array(history), mx.zeros((1, VOCAB)))
        history.append(10 + i % 400)
    assert c.waiting and sum(scanned) < 3 * 2000  # linear, not 2000^2 / 2


def test_gbnf_is_taken_as_documented():
    text = grammar.lark('root ::= "a" [b-z]* "."')
    assert "start" in text
    with pytest.raises(grammar.BadGrammar, match="GBNF"):
        grammar.lark('root ::= "a')


def test_a_grammar_s_matcher_counts_against_the_memory_of_the_answers_under_way():
    import node.jobs.serve as ns

    plain = SharedRequest(Sampling(max_tokens=10), [1] * 10)
    constrained = SharedRequest(Sampling(max_tokens=10), [1] * 10, Grammar("x"))
    assert ns.needed(plain, 500) == 20 and ns.needed(constrained, 500) == 520
    assert node_grammar.MATCHER_BYTES == grammar.LIMITS["max_lexer_states"] * 2048


def test_a_bitmask_expanded_on_the_device_allows_what_numpy_unpacks():
    """A GPU rank expands llguidance's bitmask in the step's graph (node.decode.grammar:
    device_mask); a CPU rank unpacks it with numpy: the same tokens, for any logits width."""
    import numpy as np

    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(1, 4749), dtype=np.int64).astype(np.int32)
    for width in (151_936, 151_968, 152_064, 1000):  # the mask's, past it, short of it
        bits = np.unpackbits(words.view(np.uint8), bitorder="little")
        expected = np.zeros(width, dtype=bool)
        expected[: min(len(bits), width)] = bits[:width].astype(bool)
        got = np.array(node_grammar.device_mask(words[0], width))
        assert got.shape == (width,) and (got == expected).all(), width


def test_the_batchs_grammars_masked_together_pick_the_tokens_each_alone_picks(qwen):
    """node.jobs.batch.grouped_step (one read, one mask array for the batch) against
    mlx-lm's own step (each stream's processor on its row): three streams, two under
    grammars (one also with a logit bias), one free, sampled at temperature 1 with one
    seed: the same tokens, token for token, and each grammar's matcher in the same state."""
    from mlx_lm.generate import BatchGenerator, GenerationBatch
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    from node.jobs import batch

    model, tokenizer = qwen
    text = grammar.json_schema({"type": "array", "items": {"type": "integer"}})
    prompts = [tokenizer.encode(p) for p in ("A list:", "Numbers, please:", "Say hi.")]

    def run() -> tuple[list[list[int]], list[bool]]:
        mx.random.seed(5)
        gen = BatchGenerator(model, stop_tokens=[], sampler=make_sampler(temp=1.0))
        grammars = [node_grammar.Constrained(text), node_grammar.Constrained(text)]
        bias = make_logits_processors(logit_bias={tokenizer.encode("1")[0]: 2.0})
        gen.insert(prompts, max_tokens=[24] * 3,
                   logits_processors=[[grammars[0]], [*bias, grammars[1]], []])  # fmt: skip
        out: dict[int, list[int]] = {}
        while len([u for u in out if len(out[u]) == 24]) < 3:
            for r in gen.next_generated():
                out.setdefault(r.uid, []).append(r.token)
        gen.close()
        return [out[u] for u in sorted(out)], [g.matcher.is_accepting() for g in grammars]

    own = GenerationBatch._step
    try:
        alone = run()
        assert batch.use_grouped_step() and GenerationBatch._step is batch.grouped_step
        together = run()
    finally:
        GenerationBatch._step = own
    assert together == alone
    assert alone[0][0] != alone[0][2]  # the grammars did constrain (the free stream differs)


def test_a_request_with_a_grammar_does_not_hold_up_the_ones_behind_it_in_prepare():
    """Rank 0 prepares a request with a grammar (building and checking it: 0.1 s for a tool
    of 300 properties, seconds before issue 62) on a thread of its own: a plain request sent
    after it is ready first (beside three such tools a neighbour's answer took 4.8x its time
    alone, 1.3x now: tests/bench/tool_neighbour.py). The drain still waits for both."""
    import json
    import os
    import threading

    from cluster.core.spec import Constraint, Sampling, ServeRequest, to_dict
    from node.jobs.serve import Inbox

    release = threading.Event()

    def prepare(flight):
        if flight.request.constraint is not None:
            assert release.wait(10)
        return flight

    r, w = os.pipe()
    inbox = Inbox(os.fdopen(r, "rb"), lambda m: None, prepare)
    for rid, constraint in [("wide", Constraint(tools="strict")), ("plain", None)]:
        req = ServeRequest(id=rid, kind="completion", sampling=Sampling(), prompt="x",
                           constraint=constraint)  # fmt: skip
        os.write(w, json.dumps({"op": "request", "request": to_dict(req)}).encode() + b"\n")
    assert inbox.flights.get(timeout=10).request.id == "plain"
    os.close(w)  # the drain: prepared_all waits for the grammar's request
    assert not inbox.prepared_all.wait(0.2)
    release.set()
    assert inbox.flights.get(timeout=10).request.id == "wide"
    assert inbox.prepared_all.wait(10) and inbox.flights.get(timeout=10) is None
