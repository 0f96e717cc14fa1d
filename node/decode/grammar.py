"""Constrained decoding: an answer that must match a grammar (a JSON schema, a regex, a Lark
grammar, a forced tool call), decoded under a token mask wherever a token is sampled.

llguidance (maintained, Rust, the engine behind vLLM's and SGLang's guidance backends) turns
the grammar into a matcher over this model's tokens. Every rank samples (the same logits on
every rank: pipeline stages share the last hidden state, tensor shards all_sum), so every rank
builds its own matcher from the same grammar text and the same tokenizer.json, consumes the
same sampled tokens, and so computes the same mask: no mask crosses a link. The launcher
already checked the grammar without a tokenizer (cluster.serve.api.constrain); rank 0 checks
it against the model's tokens on its prepare thread (``check``: a verdict kept by digest).
Each request has a matcher of its own, never a copy of a cached one (copies share their
lexer's states, and so their limit: one long answer used it up for every later request, and a
rank whose cache had seen other requests decided other masks). In serve every rank builds it
on a thread (``Compiling``) before the request joins the batch, so nothing compiles on the
decode loop.

What one request's grammar may cost is bounded twice: by counts (cluster.core.grammar's
LIMITS, the same at the same token on every rank: the answer ends there with an error), and
by time on rank 0 (``Budget``: a share of the model's step; rank 0 ends the request and every
rank drops it with the next order).

A mask is computed while the forward pass runs: the processor starts the step's evaluation
(``mx.async_eval``) before it reads the last token and asks the matcher. When the prompt leaves
the model inside a think block, the mask waits until the block closes (``after``): reasoning
is free, the answer is constrained.

A forced tool call (``tool_choice`` required or a named tool, Anthropic's ``any``/``tool``) or a
strict tool is a grammar in the model's own tool-call markup, built from the request's tools
and mlx-lm's parser of the family (node.decode.toolcalls: every family mlx-lm parses; a model
without one answers a forced call as JSON, which rank 0 returns as the call).
"""

from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from cluster.core.grammar import (  # one set for the launcher and ranks
    LIMITS,
    first_line,
    is_panic,
    verdict,
)
from cluster.core.spec import Grammar
from node.rank.numbers import host_ints


class GrammarError(ValueError):
    """A grammar this model's tokens cannot follow, or a tool call it cannot force."""


@dataclass
class Tokens:
    """The job's tokenizer as llguidance sees it, and the width of the model's logits."""

    tokenizer: Any  # llguidance.LLTokenizer
    vocab: int  # logits' last dimension (the config's vocab_size, often past the tokenizer)


_SOURCE: tuple[Path, tuple[int, ...], int] | None = None  # tokenizer.json, eos ids, vocab


def limits():
    import llguidance

    return llguidance.LLParserLimits(**LIMITS)


def use_tokenizer(model_dir: Path, eos_ids, vocab: int) -> None:
    """The job's tokenizer for every grammar (each rank, once the model is loaded): the
    tokenizer.json beside the weights, read by llguidance's own Rust tokenizers when the
    first grammar comes (a job that constrains nothing never builds it)."""
    global _SOURCE
    _SOURCE = (Path(model_dir) / "tokenizer.json", tuple(sorted(eos_ids)), int(vocab))
    tokens.cache_clear()
    VERDICTS.clear()


@functools.cache
def tokens() -> Tokens:
    import llguidance

    if _SOURCE is None or not _SOURCE[0].exists():
        raise GrammarError("this model has no tokenizer.json: its answers cannot be constrained")
    path, eos, vocab = _SOURCE
    ends = [e for e in eos if 0 <= e < vocab] or None  # else tokenizer.json's own
    try:
        tokenizer = llguidance.LLTokenizer(str(path), n_vocab=vocab, eos_token=ends)
    except (ValueError, RuntimeError) as e:
        try:  # a decoder llguidance's reader does not know (Metaspace, ...): its token table
            table = llguidance.TokenizerWrapper(TokenTable(path, ends, vocab))
            tokenizer = llguidance.LLTokenizer(table, n_vocab=vocab, eos_token=ends)
        except (ValueError, RuntimeError, KeyError, OSError) as again:
            raise GrammarError(f"llguidance cannot read this model's tokenizer ({e}; as a "
                               f"token table: {again})") from None  # fmt: skip
    return Tokens(tokenizer, vocab)


class TokenTable:
    """A tokenizer.json whose decoder llguidance's own reader does not know (SentencePiece's
    Metaspace, as Llama 2, Mistral and Gemma conversions carry it), as the table llguidance
    also takes: each token's bytes (a byte-fallback ``<0xHH>`` its byte, the Metaspace
    replacement a space; a special token marked with 0xFF, as llguidance marks them; ids
    past the tokenizer's up to the logits' width empty), and the tokenizer's own encoder."""

    def __init__(self, path: Path, eos: list[int] | None, vocab: int):
        import re

        from tokenizers import Tokenizer

        spec = json.loads(path.read_text())
        space = metaspace_of(spec.get("decoder") or {})
        self.encoder = Tokenizer.from_str(json.dumps(no_prefix_space(spec)))
        added = self.encoder.get_added_tokens_decoder()
        special = {i for i, t in added.items() if t.special}
        byte = re.compile(r"<0x([0-9A-Fa-f]{2})>")
        self.tokens: list[bytes] = []
        for i in range(self.encoder.get_vocab_size(with_added_tokens=True)):
            piece = self.encoder.id_to_token(i)
            if piece is None:
                self.tokens.append(b"")
            elif i in special:
                self.tokens.append(b"\xff" + piece.encode())
            elif m := byte.fullmatch(piece):
                self.tokens.append(bytes([int(m[1], 16)]))
            else:
                self.tokens.append(piece.replace(space, " ").encode())
        self.tokens += [b""] * (vocab - len(self.tokens))  # the logits' width: never sampled
        self.special_token_ids = sorted(special)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        return list(self.encoder.encode(text, add_special_tokens=False).ids)


def no_prefix_space(spec: Any) -> Any:
    """tokenizer.json's spec, encoding text without the space SentencePiece puts before it
    (llguidance encodes pieces of text in the middle of an answer: their bytes must be the
    text's own)."""
    if isinstance(spec, list):
        return [no_prefix_space(x) for x in spec if not is_prepend(x)]
    if not isinstance(spec, dict):
        return spec
    out = {k: no_prefix_space(v) for k, v in spec.items() if k != "decoder"}
    if out.get("type") == "Metaspace":
        out.update(prepend_scheme="never", add_prefix_space=False)
    for key in ("normalizer", "pre_tokenizer"):
        if is_prepend(out.get(key)):
            out[key] = None
    if "decoder" in spec:
        out["decoder"] = spec["decoder"]
    return out


def is_prepend(x: Any) -> bool:
    return isinstance(x, dict) and x.get("type") == "Prepend"


def metaspace_of(decoder: dict) -> str:
    """The character a Metaspace decoder turns into a space (in a Sequence too)."""
    if decoder.get("type") == "Metaspace":
        return str(decoder.get("replacement") or "\u2581")
    for part in decoder.get("decoders") or []:
        if isinstance(part, dict) and part.get("type") in ("Metaspace", "Replace"):
            if part.get("type") == "Metaspace":
                return str(part.get("replacement") or "\u2581")
            content = (part.get("pattern") or {}).get("String")
            if isinstance(content, str) and part.get("content") == " ":
                return content
    return "\u2581"


def fresh(grammar: str):
    """A new matcher of ``grammar``, this request's alone: llguidance's copies of one
    matcher share its lexer's states (and their limit), so a matcher is never copied from a
    cache; GrammarError when this model's tokens cannot follow the grammar."""
    import llguidance
    from llguidance.numpy import fill_next_token_bitmask

    t = tokens()
    try:
        matcher = llguidance.LLMatcher(t.tokenizer, grammar, log_level=0, limits=limits())
        if not matcher.is_error():  # the first mask builds the lexer's start: not mid-batch
            fill_next_token_bitmask(matcher, np.zeros((1, (t.vocab + 31) // 32), dtype=np.int32))
    except BaseException as e:
        if not is_panic(e):
            raise
        raise GrammarError(f"llguidance failed on this grammar ({first_line(str(e))})") from None
    if matcher.is_error():
        raise GrammarError(first_line(matcher.get_error()))
    return matcher


VERDICTS: OrderedDict[bytes, str] = OrderedDict()  # digest -> "" or why (rank 0's checks)


def check(grammar: str) -> None:
    """Rank 0, off the decode loop: the grammar compiles for this model (GrammarError). The
    verdict is kept by the text's digest; no matcher is kept."""
    if why := verdict(grammar, tokens().tokenizer, VERDICTS):
        raise GrammarError(why)


# What one request's matcher may hold at most: llguidance's lexer states at ~2 KB each
# (its own estimate is 1-2 KB), counted against the KV memory of the answers under way.
MATCHER_BYTES = LIMITS["max_lexer_states"] * 2048


class Compiling:
    """Every rank's matchers being built for the requests rank 0 announced (Order.compile),
    on a thread of their own, so that no rank compiles on its decode loop: rank 0 inserts a
    request only once every rank said its matcher is ready (``ready``, one all_sum), and
    the request takes it then (``take``). Tickets come from rank 0's orders, so every rank
    holds the same ones."""

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.futures: dict[int, Any] = {}

    def submit(self, grammars: list[Grammar]) -> None:
        for g in grammars:
            if g.ticket is not None:
                self.futures[g.ticket] = self.pool.submit(fresh, g.text)

    @property
    def pending(self) -> list[int]:
        return sorted(self.futures)

    def ready(self, wait: float = 0.0) -> list[bool]:
        """For each pending ticket (in order), whether its matcher is built (or failed)
        here; waits up to ``wait`` seconds for them first (nothing else to do)."""
        from concurrent.futures import wait as wait_for

        if wait > 0:
            wait_for(list(self.futures.values()), timeout=wait)
        return [self.futures[t].done() for t in self.pending]

    def take(self, ticket: int):
        """The ticket's matcher (GrammarError as its build raised it); kept until ``drop``
        (a request alone tries its chain, then decodes with a new one: the same matcher,
        reset)."""
        return self.futures[ticket].result()

    def drop(self, tickets) -> None:
        for t in tickets:
            future = self.futures.pop(t, None)
            if future is not None:
                future.cancel()


compiling = Compiling()  # this rank's


def own_copy(part: mx.array) -> mx.array:
    """``part`` (a few tokens sliced from the history) as an array of its own to read on the
    host. Read as a slice, the host reads the history's whole buffer, and on CUDA MLX then
    moves that buffer into managed memory, a new managed allocation and a copy a step, the
    buffer then back in MLX's cache for the GPU's own arrays to reuse (and fault on); a copy
    of one or two tokens comes from MLX's pool of scalars, already where the host reads."""
    return (part + 0).astype(mx.int32)


SHIFTS = mx.arange(32, dtype=mx.uint32)  # a bitmask word's bits, token 32 * word + bit


@functools.cache
def on_gpu() -> bool:
    """Whether this rank computes on a GPU (Metal, CUDA): asked once per process."""
    return mx.default_device() == mx.gpu


def device_mask(words: np.ndarray, width: int) -> mx.array:
    """The allowed tokens of an llguidance bitmask (int32 words, token 32 * w + b at bit b
    of word w), expanded by the device: ``width`` booleans, False past the mask."""
    bits = (mx.array(words.view(np.uint32))[:, None] >> SHIFTS) & 1
    mask = bits.reshape(-1)[:width].astype(mx.bool_)
    if mask.shape[0] < width:
        mask = mx.concatenate([mask, mx.zeros(width - mask.shape[0], mx.bool_)])
    return mask


class Constrained:
    """A logits processor (mlx-lm's ``processor(tokens, logits)``) that masks every token the
    grammar does not allow next. ``after``: token ids that must appear in the answer before
    the grammar applies (the end of a think block the prompt opened). Its matcher is its own:
    built by ``compiling`` (serve: the ticket rank 0 gave it), else here.

    A matcher that fails (a limit of LIMITS reached: the same token on every rank) allows
    only end-of-sequence, so every rank ends the answer at the same step, and keeps why in
    ``failure``: the answer is then an error, never a quiet stop. ``spent`` and ``steps``
    count this rank's CPU time in the matcher (rank 0's Budget reads them)."""

    def __init__(self, grammar: str | Grammar, after: list[int] | None = None):
        if isinstance(grammar, Grammar):
            self.grammar, self.after = grammar.text, list(grammar.after or [])
            ticket = grammar.ticket
        else:
            self.grammar, self.after, ticket = grammar, list(after or []), None
        if ticket is not None and ticket in compiling.futures:
            self.matcher = compiling.take(ticket)
        else:
            self.matcher = fresh(self.grammar)
        self.failure: str | None = None
        self.spent = 0.0  # seconds in the matcher
        self.steps = 0
        t = tokens()
        self.words = np.zeros((1, (t.vocab + 31) // 32), dtype=np.int32)
        self.reset()

    def reset(self) -> None:
        """Back to the start (``node.sampling.tried`` runs the chain once on dummy tokens)."""
        self.matcher.reset()
        self.start: int | None = None  # tokens before the first call: the prompt (or feed)
        self.fed = 0  # answer tokens given to the matcher (or to the wait for ``after``)
        self.waiting = bool(self.after)
        self.tail: list[int] = []  # the answer so far while waiting, to find ``after`` in
        self.failure = None
        self.complete = False  # the answer matched and ended: only end-of-sequence follows
        self.spent, self.steps = 0.0, 0

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        n = history.shape[-1]
        if self.start is None:
            self.start = n
        # The tokens the matcher has not seen (the last one, sampled by the step before)
        # are scheduled before this step's forward, which then runs while the matcher
        # works; read after, they wait only for the step before. (Sliced after the forward
        # was scheduled, the slice waited for the forward too: a bubble on a GPU, 0.68x.)
        unseen = own_copy(history[self.start + self.fed :]) if n > self.start + self.fed else None
        if unseen is not None:
            mx.async_eval(unseen)
        mx.async_eval(logits)
        if not self.advance(host_ints(unseen) if unseen is not None else []):
            return logits
        return self.masked(logits)

    def advance(self, new: list[int]) -> bool:
        """The answer's ``new`` tokens to the matcher (or to the wait for ``after``), then the
        next token's mask into ``words``; False while the mask does not apply yet (a think
        block still open)."""
        self.fed += len(new)
        if self.waiting:
            seen = len(self.tail)
            self.tail += new
            # only where the marker could newly end: the scan is linear in the reasoning
            at = find(self.tail, self.after, max(0, seen - len(self.after) + 1))
            if at < 0:
                return False
            self.waiting = False
            new = self.tail[at + len(self.after) :]
            self.tail = []
        # The matcher's own CPU time is the grammar's cost (Budget): a pause of the thread
        # (the other rank's turn on a shared core, a page fault) is not, nor is MLX's work
        # with the mask after (on CUDA a copy to the device may wait for the stream, and
        # its wait spins: CPU time that a budget of the grammar must not charge)
        began = time.thread_time()
        if new and self.failure is None and not self.complete:
            accepting = self.matcher.is_accepting()
            if not self.matcher.consume_tokens(new) and accepting:
                # tokens past a complete answer (mlx-lm computes a step past its end of
                # sequence): the answer stands; only end-of-sequence follows
                self.complete = True
        self.fill()
        self.spent += time.thread_time() - began
        self.steps += 1
        return True

    @property
    def ends(self) -> bool:
        """Only end-of-sequence may follow (the grammar failed, or the answer is complete)."""
        return self.failure is not None or self.complete

    def fill(self) -> None:
        """The matcher's mask of the next token into ``words`` (or its failure)."""
        from llguidance.numpy import fill_next_token_bitmask

        if self.failure is None and not self.complete and not self.matcher.is_error():
            fill_next_token_bitmask(self.matcher, self.words)
        if self.failure is None and not self.complete and self.matcher.is_error():
            self.failure = first_line(self.matcher.get_error())

    def masked(self, logits: mx.array) -> mx.array:
        """``logits`` with every token the grammar does not allow at -inf (``fill`` made the
        mask). On a GPU the matcher's bitmask (a bit per token: 19 KB for a 150k vocabulary)
        goes to the device as it is and is expanded there, in the step's graph
        (``device_mask``), rather than unpacked on the host into a 150 KB array and copied,
        per stream per token."""
        width = logits.shape[-1]
        if self.failure is not None or self.complete:  # every rank alike: the answer ends
            allowed = np.zeros(width, dtype=bool)
            allowed[tokens().tokenizer.eos_tokens] = True
            mask = mx.array(allowed)
        elif on_gpu():
            mask = device_mask(self.words[0], width)
        else:  # numpy's unpacking is faster on a CPU than the same ops in MLX's graph
            allowed = np.zeros(width, dtype=bool)
            bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")
            allowed[: min(len(bits), width)] = bits[:width].astype(bool)
            mask = mx.array(allowed)
        return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))


def mask_batch(logits: mx.array, inputs: mx.array, grammars: list[tuple[int, Constrained]]
               ) -> mx.array:  # fmt: skip
    """A batch's logits (one row per stream) with every grammar's mask applied at once:
    ``inputs`` holds each stream's token of the step before (what its matcher has not seen),
    read once for the whole batch while this step's forward runs; ``grammars`` are (row,
    processor). The masks go to the device as one array of bitmask words (a row of all-ones
    words for a stream without a grammar, or whose grammar waits), expanded there, and one
    ``where`` covers the batch: the per-stream reads, copies and row slices this replaces
    cost 28% of 8 streams' decoding on an H100 (docs/benchmarks.md)."""
    mx.async_eval(logits)
    last = host_ints(inputs)
    width = logits.shape[-1]
    words = np.full((logits.shape[0], (width + 31) // 32), -1, dtype=np.int32)
    for row, grammar in grammars:
        first = grammar.start is None  # its first step: the token is the prompt's last
        if first:
            grammar.start = 0
        if not grammar.advance([] if first else [last[row]]):
            continue
        if grammar.ends:
            words[row] = 0
            bits = words[row].view(np.uint32)
            for eos in tokens().tokenizer.eos_tokens:
                if 0 <= eos < width:
                    bits[eos // 32] |= np.uint32(1 << (eos % 32))
        else:
            words[row] = grammar.words[0]
    if on_gpu():
        bits = (mx.array(words.view(np.uint32))[:, :, None] >> SHIFTS) & 1
        mask = bits.reshape(words.shape[0], -1)[:, :width].astype(mx.bool_)
    else:
        unpacked = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")
        mask = mx.array(unpacked[:, :width].astype(bool))
    return mx.where(mask, logits, mx.array(-float("inf"), logits.dtype))


class GrammarFailed(RuntimeError):
    """An answer's grammar failed mid-answer (a limit of LIMITS): on every rank alike."""


def failure_of(chain) -> str | None:
    """Why the grammar among a request's processors failed, if it did."""
    for process in chain or []:
        if isinstance(process, Constrained) and process.failure is not None:
            return process.failure
    return None


@dataclass
class Budget:
    """Rank 0's bound on a request's grammar work per step, decided on rank 0 alone and
    carried to every rank as a removal, so no rank decides otherwise: over the last
    ``window`` steps its matcher may take at most ``share`` of the model's own step (the
    step less every grammar's work), or ``floor`` seconds when that is more. A request over it
    ends with an error; the others in the batch then step at least 1 / (1 + share) as fast
    as alone (0.87x at 0.15)."""

    share: float = 0.15
    floor: float = 0.0005
    window: int = 8

    def over(self, spent: float, steps: int, model_step: float) -> str | None:
        """Why ``spent`` seconds over ``steps`` steps is over budget (None: it is not); a
        window's worth spent in fewer steps is over at once."""
        allowed = max(self.floor, self.share * model_step)
        if spent <= max(steps, self.window) * allowed:
            return None
        per_step = spent / max(steps, 1)
        return (f"the grammar took {per_step * 1000:.1f} ms per token, over its budget of "
                f"{allowed * 1000:.1f} ms ({self.share:.0%} of the model's step, at least "
                f"{self.floor * 1000:g} ms); simplify it: fewer alternatives, less "
                "ambiguity")  # fmt: skip


def find(seq: list[int], part: list[int], start: int = 0) -> int:
    """Where ``part`` first occurs in ``seq`` from ``start`` (-1: nowhere)."""
    k = len(part)
    for i in range(start, len(seq) - k + 1):
        if seq[i : i + k] == part:
            return i
    return -1


def think_rule(tokenizer) -> str:
    """A think block of the model's own special markers, for a grammar whose free text may
    begin with one ("" when the markers are not special tokens: text covers them)."""
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    if not start or not end:
        return ""
    open_, close = marker(tokenizer, start), marker(tokenizer, end)
    if not (open_.startswith("<[") and close.startswith("<[")):
        return ""
    return f"think: {open_} THOUGHT {close}\nTHOUGHT: /(.|\\n)*/\n"


def marker(tokenizer, text: str) -> str:
    """A markup string in Lark: the special token itself when it is one (its bytes are not
    text), else the text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and is_special(tokenizer, ids[0]):
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def is_special(tokenizer, token: int) -> bool:
    """Whether llguidance takes ``token`` as special: matched as the token, never as text.
    Its own view when the job's tokenizer is loaded (it takes an added token written like
    ``<tool_call>`` as special, whatever tokenizer.json's flag says: Qwen's ``<tool_call>``
    and ``<think>`` are not flagged), else the tokenizer's flags."""
    try:
        return bool(tokens().tokenizer.is_special_token(token))
    except GrammarError:
        from node.decode.toolcalls import flagged_special

        return flagged_special(tokenizer, token)


def shared_grammar(tokenizer, constraint, tools: list | None,
                   prompt: list[int]) -> Grammar | None:  # fmt: skip
    """Rank 0: what every rank needs to constrain the answer (the grammar's text, and the
    tokens it waits for), checked against this model; GrammarError otherwise. None: nothing
    to constrain (strict tools of a model without tool-call markup)."""
    text = constraint.grammar
    if not text:
        from node.decode.toolcalls import tool_grammar

        try:
            text = tool_grammar(tokenizer, tools or [], constraint.tools or "",
                                think_rule(tokenizer), constraint.single,
                                lambda token: is_special(tokenizer, token))  # fmt: skip
        except ValueError as e:
            raise GrammarError(str(e)) from None
        if text is None:
            return None
    check(text)
    return Grammar(text, think_end(tokenizer, prompt))


def think_end(tokenizer, prompt: list[int]) -> list[int] | None:
    """The token ids that end the think block the prompt leaves the model in (None: the
    prompt does not open one, and the grammar applies from the first token)."""
    from node.decode.reasoning import opens_in_thought

    if not opens_in_thought(tokenizer, prompt):
        return None
    return tokenizer.encode(tokenizer.think_end, add_special_tokens=False)
