"""Continuous batching in lockstep: every rank runs the same mlx-lm BatchGenerator.

mlx-lm's BatchGenerator is deterministic: the same inserts, removals and ``next()`` calls give
the same tokens on every rank (pipeline stages and tensor shards compute the same logits, and the
random state is seeded alike). So rank 0 decides, once a round, which requests join (prompt
tokens and sampling settings) and which leave (a stop string rank 0 saw, a client gone), shares
that order (plain JSON, share_object), and every rank applies it and steps the generator for the
round. Only rank 0 turns tokens into text.

Each rank also keeps the same prompt cache (mlx-lm's LRUPromptCache, holding that rank's own
layers or slices): a finished answer's cache is kept under its tokens, and a new request starts
from the longest cached prefix, so a client that sends the conversation again prefills only its
new turn. A model whose cache cannot be cut back to a shorter prefix (linear attention, sliding
windows) also keeps snapshots while its prompts prefill (node.cache.snapshots): the end of each
prompt, and doubling block boundaries. Every rank makes the same inserts and lookups in the same
order. The cache is bounded
by count and by bytes; bytes differ from rank to rank, so after a round that kept an answer,
one all_sum tells every rank whether any rank is over its bytes, and every rank then drops its
least recently used entry alike, until none is.

A request whose settings fail (node.sampling.tried, the same on every rank) does not join: it
fails alone and the batch goes on.

A long prompt does not stop the answers already decoding: mlx-lm's generator prefills at most
``prefill_step_size`` tokens of each prompt per step, between two decode steps. While answers
decode, rank 0 shrinks that step to what the ranks prefill in ``max_stall`` seconds (measured
over the last steps; ``PrefillPace``) and shares it in its order, so every rank steps alike.
While a prompt is being prefilled beside decoding answers a round is one step, so a new order
(a cancel, a new request) is taken between any two chunks.

In pipeline mode, ``--micro-batches N`` splits the batch into N BatchGenerators, each on its
own stream, stepped in turn: each enqueues its next step before it waits for its last, so
while one micro-batch waits for the last stage the other's layers run, and every stage works.
Their stages' collectives go on one stream (node.model.stage.collectives_on), in the order
every rank builds them. A request joins the micro-batch holding the fewest; uids are this
batch's, mapped to each generator's own.

In pipeline mode with nothing decoding, the prompt goes in smaller steps (node.decode.prefill's
``prefill_step``: the stages work on different steps at once) and a round takes as many as make
2048 (or --prefill-step, if more) x stages tokens: about the time one rank takes for one full
step, after which the next order is taken. (Each round ends in a collective, which drains the
pipeline.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, KeysView, Sequence

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, generation_stream
from mlx_lm.models.cache import (
    BatchKVCache,
    LRUPromptCache,
    can_trim_prompt_cache,
    make_prompt_cache,
    trim_prompt_cache,
)

from cluster.core.spec import Order
from node.cache.disk import BLOCK_TOKENS, worth_reading
from node.cache.snapshots import SNAPSHOTS_PER_PROMPT, in_memory, segments, trimmable
from node.decode.grammar import Constrained, compiling, mask_batch
from node.decode.loop import STOP_CHECK_EVERY, Ticking
from node.decode.prefill import PREFILL_STEP, prefill_step
from node.decode.sampling import RequestFailed, tried
from node.model.stage import collectives_on, staged
from node.rank.dist import control_stream
from node.rank.memory import reapply_wired_limit
from node.rank.numbers import host_float

ROUND_STEPS = STOP_CHECK_EVERY  # generator steps between two orders of rank 0
MODEL_KEY = "served"  # one model per server: every cache entry is under this key
PREFILL_MIN = 32  # the smallest prefill step while answers decode: below it a step is overhead


def micro_batches_for(model, stages: int, asked: int) -> int:
    """The micro-batches a batch runs in: as asked (--micro-batches) in a pipeline whose stages
    are ours (StageLayer, whose collectives can go on one stream), else 1."""
    return asked if stages > 1 and staged(model) else 1


def micro_batches_note(model, stages: int, asked: int) -> str | None:
    """What rank 0 tells the user of --micro-batches: that it applies, or why not."""
    if asked == 1:
        return None
    if micro_batches_for(model, stages, asked) > 1:
        return f"the batch decodes in {asked} micro-batches (--micro-batches), a stage on each"
    why = "one rank has no stages" if stages == 1 else "this family's pipeline is mlx-lm's own"
    return f"--micro-batches {asked} does not apply ({why}): the batch decodes as one"


_streams: list = []  # the micro-batches' streams, made once per process (each has a thread)


def micro_streams(micro: int) -> list:
    """The streams of ``micro`` micro-batches: mlx-lm's generation stream and ``micro - 1``
    more on its device, then (with more than one) the stream of their collectives. Made once
    and reused by every batch (bench makes one per run)."""
    if micro == 1:
        return [generation_stream]
    while len(_streams) < micro:  # [collectives, micro-batch 1, micro-batch 2, ...]
        device = control_stream() if not _streams else generation_stream.device
        _streams.append(mx.new_stream(device))
    return [generation_stream, *_streams[1:micro], _streams[0]]


class PrefillPace:
    """Rank 0's prefill step: the most tokens while nothing decodes, else what the ranks
    prefill in ``max_stall`` seconds at the rate of the last steps (attention grows with the
    prompt's length, so the rate is followed as it falls)."""

    def __init__(self, most: int, max_stall: float):
        self.most = most
        self.max_stall = max_stall
        self.rate: float | None = None  # prompt tokens per second, recent steps weigh most

    def measured(self, tokens: int, seconds: float) -> None:
        if tokens and seconds > 0:
            rate = tokens / seconds
            self.rate = rate if self.rate is None else 0.5 * self.rate + 0.5 * rate

    def step(self, decoding: bool) -> int:
        if not decoding or self.max_stall <= 0:
            return self.most
        if self.rate is None:
            return min(self.most, PREFILL_MIN)
        return max(min(self.most, PREFILL_MIN), min(self.most, int(self.rate * self.max_stall)))


def cache_scope(key: str | None) -> str:
    """Where a request looks in the prompt cache and leaves its answer's cache: one scope
    per ``prompt_cache_key`` (the disk tier keeps the unscoped ones only), else the shared
    one."""
    return MODEL_KEY if key is None else f"{MODEL_KEY}/{key}"


def batchable(model) -> bool:
    """Whether every cache slot of this model can be batched (mlx-lm's own test)."""
    return all(hasattr(c, "merge") for c in make_prompt_cache(model))


def grouped_step(self) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's ``GenerationBatch._step`` (0.30-0.32), with the streams' grammars masked
    together (node.decode.grammar.mask_batch): one read of the tokens the step before
    sampled, one array of masks and one ``where`` for the batch, instead of mlx-lm's call of
    each stream's processors on its own row. Other processors (penalties, logit biases) run
    per stream first, as mlx-lm runs them, with their token context; a stream whose only
    processor is its grammar needs none. The tokens sampled are those of mlx-lm's step."""
    self._current_tokens = self._next_tokens
    self._current_logprobs = self._next_logprobs
    inputs = self._current_tokens
    logits = self.model(inputs[:, None], cache=self.prompt_cache)
    logits = logits[:, -1, :]
    token_context = []
    if any(self.logits_processors):
        rows, grammars, changed = [], [], False
        for e in range(len(self.uids)):
            row = logits[e : e + 1]
            processors = self.logits_processors[e] or ()
            own = [p for p in processors if not isinstance(p, Constrained)]
            if own:
                context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in own:
                    row = processor(context, row)
                changed = True
            rows.append(row)
            grammars += [(e, p) for p in processors if isinstance(p, Constrained)]
        if changed:
            logits = mx.concatenate(rows, axis=0)
        if grammars:
            logits = mask_batch(logits, inputs, grammars)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    samplers = [self.fallback_sampler if s is None else s
                for s in (self.samplers or [None] * len(self.uids))]  # fmt: skip
    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else self.fallback_sampler)(logprobs)
    else:
        sampled = mx.concatenate([s(logprobs[e : e + 1]) for e, s in enumerate(samplers)],
                                 axis=0)  # fmt: skip
    self._next_tokens = sampled
    self._next_logprobs = list(logprobs)
    mx.async_eval(self._next_tokens, self._next_logprobs, token_context)
    mx.eval(inputs, self._current_logprobs)
    tokens = inputs.tolist()
    for sti, ti in zip(self.tokens, tokens, strict=True):
        sti.append(ti)
    return tokens, self._current_logprobs


def use_grouped_step() -> bool:
    """Put ``grouped_step`` in mlx-lm's GenerationBatch when it is the class it was written
    for (its fields by name); otherwise keep mlx-lm's own (each stream's grammar alone)."""
    import importlib
    import inspect

    batch = getattr(importlib.import_module("mlx_lm.generate"), "GenerationBatch", None)
    if batch is None:
        return False
    names = set(inspect.signature(batch.__init__).parameters)
    wanted = {"uids", "inputs", "prompt_cache", "tokens", "samplers", "fallback_sampler",
              "logits_processors"}  # fmt: skip
    if not wanted <= names or "_token_context" not in inspect.getsource(batch.__init__):
        return False
    batch._step = grouped_step
    return True


MLX_LM_EXTEND = BatchKVCache.extend  # mlx-lm's own, before use_one_copy_joins


def extend_in_one_copy(self, other) -> None:
    """mlx-lm's ``BatchKVCache.extend`` (0.32), copying only what the two batches hold: a new
    zeroed array, each batch's tokens written right-justified at the longer one's index, and
    room for the next token. mlx-lm's pads each batch to the longer (a copy of the padding
    too), concatenates them (a second copy of all of it) and leaves no room, so the next
    token's write copies it a third time: 8 streams of 300 tokens joined by a prompt of 9,107
    copied 1 GB three times (issue 53's worst token gap; tests/bench/join_cost.py). The
    arrays it leaves read as mlx-lm's do up to the index."""
    if self.keys is None and other.keys is None:
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
        self.offset = mx.concatenate([self.offset, other.offset])
        return
    full = other if self.keys is None else self
    _, heads, _, dk = full.keys.shape
    dv = full.values.shape[3]
    index = max(self._idx, other._idx)
    size = -(-(index + 1) // self.step) * self.step
    rows = [c.offset.shape[0] for c in (self, other)]
    keys = mx.zeros((sum(rows), heads, size, dk), dtype=full.keys.dtype)
    values = mx.zeros((sum(rows), heads, size, dv), dtype=full.values.dtype)
    lefts, row = [], 0
    for c, n in zip((self, other), rows, strict=True):
        left = index - c._idx
        if c.keys is not None and c._idx:
            keys[row : row + n, :, left:index] = c.keys[..., : c._idx, :]
            values[row : row + n, :, left:index] = c.values[..., : c._idx, :]
        lefts.append(c.left_padding + left)
        row += n
    self.keys, self.values, self._idx = keys, values, index
    self.offset = mx.concatenate([self.offset, other.offset])
    self.left_padding = mx.concatenate(lefts)


def filter_in_one_copy(self, batch_indices) -> None:
    """mlx-lm's ``BatchKVCache.filter`` (0.32), reading only the kept streams' window: mlx-lm
    gathers the kept rows whole, then drops the padding they all share, so 8 streams of 300
    tokens left by a prompt of 9,107 copied 8 x 9,107 tokens to keep 8 x 300 (and held them
    until the next copy). The arrays it leaves read as mlx-lm's do."""
    self.offset = self.offset[batch_indices]
    self.left_padding = self.left_padding[batch_indices]
    lefts = self.left_padding.tolist()
    shared = min(lefts) if lefts else 0
    if self.keys is not None:
        rows = batch_indices if isinstance(batch_indices, mx.array) else mx.array(batch_indices)
        self.keys = self.keys[:, :, shared:, :][rows]
        self.values = self.values[:, :, shared:, :][rows]
    if shared > 0:
        self._idx -= shared
        self.left_padding -= shared


MLX_LM_FILTER = BatchKVCache.filter  # mlx-lm's own, before use_one_copy_joins


def use_one_copy_joins() -> bool:
    """Put ``extend_in_one_copy`` and ``filter_in_one_copy`` in mlx-lm's BatchKVCache when it
    is the class they were written for (its fields by name); otherwise keep mlx-lm's own."""
    import inspect

    source = inspect.getsource(MLX_LM_EXTEND) + inspect.getsource(MLX_LM_FILTER)
    fields = ("_idx", "left_padding", "offset", "keys", "values")
    step = getattr(BatchKVCache, "step", None)
    if not all(f in source for f in fields) or not isinstance(step, int):
        return False
    BatchKVCache.extend = extend_in_one_copy  # type: ignore[method-assign]
    BatchKVCache.filter = filter_in_one_copy  # type: ignore[method-assign]
    return True


class Lockstep:
    """One rank's batch. Every rank holds the same uids: they come from the same orders."""

    def __init__(
        self,
        model,
        tokenizer,
        decode_concurrency: int,
        prompt_concurrency: int,
        prompt_cache_size: int,
        cache_bytes: float = float("inf"),
        group=None,
        vocab: int | None = None,
        prefill_step: int = 2048,
        max_stall: float = 0.0,
        stages: int = 1,
        disk=None,
        micro_batches: int = 1,
    ):
        # a cache that cannot be cut back keeps snapshots while prompts prefill
        # (node.cache.snapshots); every rank alike: the same model, the same prompt cache.
        # --prompt-cache-size counts answers: their snapshots ride along, in bytes as any entry
        self.snapshots = bool(prompt_cache_size) and not trimmable(model)
        entries = prompt_cache_size * (SNAPSHOTS_PER_PROMPT + 1 if self.snapshots else 1)
        self.prompt_cache = LRUPromptCache(max_size=entries) if prompt_cache_size else None
        self.cache_bytes = cache_bytes  # this rank's most bytes of kept caches
        self.group = group
        self.vocab = vocab or tokenizer.vocab_size
        # pipeline stages through StageLayer: micro-batches each on its own stream, their
        # collectives on one stream in the order every rank builds them
        micro = micro_batches_for(model, stages, micro_batches)
        streams = micro_streams(micro)
        self.comm = streams[-1] if micro > 1 else None
        use_grouped_step()
        use_one_copy_joins()
        self.generators = [
            BatchGenerator(
                Ticking(model),  # a tick per forward pass: a long batched prefill is progress
                stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
                completion_batch_size=-(-decode_concurrency // micro),
                prefill_batch_size=-(-prompt_concurrency // micro),
                prefill_step_size=prefill_step,
                stream=streams[i],
            )
            for i in range(micro)
        ]
        self.held: list[dict[int, int]] = [{} for _ in self.generators]  # generator uid -> uid
        # uid -> (micro-batch, its generator's uid): every request inserted and not yet
        # finished or removed
        self.where: dict[int, tuple[int, int]] = {}
        self.uids = 0  # uids handed out
        reapply_wired_limit()
        self.prefilling: dict[int, tuple[int, int]] = {}  # uid -> (prompt tokens done, of)
        self.pace = PrefillPace(prefill_step, max_stall)  # rank 0's
        self.stages = stages  # pipeline stages (1 in tensor mode)
        self.model = model
        self.disk = disk  # node.cache.disk.DiskCache: the tier under the prompt cache
        self.from_disk: dict[int, int] = {}  # the last apply's: uid -> prompt tokens from disk
        self.scopes: dict[int, str] = {}  # uid -> its prompt cache scope (prompt_cache_key)
        self.totals: dict[int, int] = {}  # uid -> its prompt's tokens (for its snapshots)
        self.kept = 0  # answers' caches kept since the bytes were last checked
        # uid -> the token list its cache is kept under, since rank 0 last read them
        # (node.jobs.serve.CachedPrefixes: what the fleet's router is told)
        # uid -> the token lists its caches were kept under this round (an answer's, and its
        # prompt's snapshots: each serves the prefix until the prompt cache drops it)
        self.kept_now: dict[int, list[list[int]]] = {}
        self.report_kept = False  # rank 0 sets it
        self.grammars: dict[int, Constrained] = {}  # uid -> its grammar's processor
        self.last_round = (0.0, 0)  # (seconds, steps) of the last round

    @property
    def live(self) -> KeysView[int]:
        """The uids inserted and not yet finished or removed."""
        return self.where.keys()

    def decoding(self) -> bool:
        return len(self.live) > len(self.prefilling)

    def next_prefill_step(self, joining: Sequence[int] = ()) -> int | None:
        """Rank 0: the prefill step the next round should take (``joining``: the prompt
        lengths its order inserts), when it is not the current one (None)."""
        step = self.pace.most
        if self.prefilling or joining:
            step = self.pace.step(self.decoding())
            if step == self.pace.most and self.stages > 1:  # nothing decodes: overlap stages
                longest = max([*joining, *(total for _, total in self.prefilling.values())])
                step = min(step, prefill_step(longest, self.stages))
        return None if step == self.prefill_step_size else step

    def steps_this_round(self) -> int:
        """Generator steps in this round (the same on every rank: they hold the same state)."""
        if not self.prefilling:
            return ROUND_STEPS
        if self.decoding() or self.stages == 1:
            return 1
        budget = max(self.pace.most, PREFILL_STEP) * self.stages  # about one full step's time
        return max(1, budget // self.prefill_step_size)

    def apply(self, order: Order) -> list[tuple[int | None, int, str | None]]:
        """Insert ``order.insert`` and drop ``order.remove``; returns (uid, prompt tokens
        taken from the cache, None) for each new request, in order, or (None, 0, why) for one
        whose settings failed (on every rank alike)."""
        if order.prefill_step is not None:
            self.prefill_step_size = order.prefill_step
        self.from_disk = {}
        joined: list[tuple[int | None, int, str | None]] = []
        for r in order.insert:
            try:
                chosen, chain = tried(r, self.vocab)
            except RequestFailed as e:
                joined.append((None, 0, str(e)))
                continue
            finally:
                if r.grammar is not None and r.grammar.ticket is not None:
                    compiling.drop([r.grammar.ticket])  # its chain holds the matcher now
            scope = cache_scope(r.cache_key)
            cache, rest, from_disk = self.nearest(r.tokens, scope)
            m = min(range(len(self.generators)), key=lambda i: len(self.held[i]))
            cached = len(r.tokens) - len(rest)
            (inner,) = self.generators[m].insert_segments(
                [segments(r.tokens, cached, self.snapshots, self.disk_scope(scope))],
                max_tokens=[r.sampling.max_tokens],
                caches=[cache],
                all_tokens=[r.tokens[: len(r.tokens) - len(rest)]],
                samplers=[chosen],
                logits_processors=[chain],
            )
            uid = self.uids
            self.uids += 1
            self.held[m][inner] = uid
            self.where[uid] = (m, inner)
            joined.append((uid, len(r.tokens) - len(rest), None))
            for process in chain:
                if isinstance(process, Constrained):
                    self.grammars[uid] = process
            self.scopes[uid] = scope
            self.totals[uid] = len(r.tokens)
            if from_disk:
                self.from_disk[uid] = from_disk
            self.prefilling[uid] = (0, len(rest))
        gone = [u for u in order.remove if u in self.live]
        for m, generator in enumerate(self.generators):
            inner = [self.where[u][1] for u in gone if self.where[u][0] == m]
            if inner:
                generator.remove(inner)
        for uid in gone:
            self.forget(uid)
            self.prefilling.pop(uid, None)
            self.scopes.pop(uid, None)
            self.totals.pop(uid, None)
            self.grammars.pop(uid, None)
        return joined

    def forget(self, uid: int) -> None:
        """``uid`` is no longer in any micro-batch."""
        m, inner = self.where.pop(uid)
        del self.held[m][inner]

    @property
    def prefill_step_size(self) -> int:
        return self.generators[0].prefill_step_size

    @prefill_step_size.setter
    def prefill_step_size(self, step: int) -> None:
        for generator in self.generators:
            generator.prefill_step_size = step

    def adopt(self, ticket: str, cache_key: str | None) -> dict:
        """A handoff every rank holds whole, planted in the prompt cache (every rank alike),
        where the request that waits for it finds it as any cached prefix; its figures
        (node.cache.handoff.handoff_figures: one all_sum)."""
        from node.cache.handoff import adopted_cache, handoff_figures

        got, cache = adopted_cache(ticket, self.model)
        if self.prompt_cache is not None and got.tokens:
            self.prompt_cache.insert_cache(cache_scope(cache_key), got.tokens, cache)
        return handoff_figures(got, self.group)

    def nearest(self, tokens: list[int], scope: str = MODEL_KEY) -> tuple:
        """The cache of the longest cached prefix of ``tokens`` (in memory, else on disk),
        the tokens after it and how many of those before it were read from disk; at least the
        last token is left to run, as the generator needs one. Every rank alike: the memory
        caches are the same everywhere, and the disk's answer is agreed."""
        cache, rest = self.in_memory(tokens, scope)
        if self.disk is not None and len(rest) - 1 >= BLOCK_TOKENS and scope == MODEL_KEY:
            worth = worth_reading(self.disk.stats, self.pace.rate)
            from_disk, n = self.disk.restore(self.model, tokens, worth)
            if n > len(tokens) - len(rest):
                return from_disk, tokens[n:], n
        return cache, rest, 0

    def in_memory(self, tokens: list[int], scope: str = MODEL_KEY) -> tuple:
        if self.prompt_cache is None:
            return None, tokens
        if self.snapshots:  # the last token is fed anyway: a cache at most one token short
            # (an entry of the whole prompt could not be cut back to it; node.cache.snapshots)
            cache, rest = self.prompt_cache.fetch_nearest_cache(scope, tokens[:-1])
            return cache, [*rest, tokens[-1]]
        cache, rest = self.prompt_cache.fetch_nearest_cache(scope, tokens)
        if cache is not None and not rest:  # the whole prompt is cached: run its last token
            if not can_trim_prompt_cache(cache):
                return None, tokens
            trim_prompt_cache(cache, 1)
            rest = tokens[-1:]
        return cache, rest

    def keep(self, response) -> None:
        """A finished answer's cache, under the tokens it holds (every rank alike), and its
        blocks to the disk tier (written by its thread)."""
        scope = self.scopes.pop(response.uid, MODEL_KEY)
        self.totals.pop(response.uid, None)
        if self.disk is not None and response.prompt_cache is not None and scope == MODEL_KEY:
            self.disk.save(list(response.all_tokens), response.prompt_cache)
        if response.prompt_cache is not None:
            self.hold(response.uid, scope, list(response.all_tokens), response.prompt_cache)

    def hold(self, uid: int, scope: str, tokens: list[int], cache: list, kind="assistant") -> None:
        """A cache into the prompt cache under the tokens it holds (every rank alike)."""
        if self.prompt_cache is None:
            return
        self.prompt_cache.insert_cache(scope, tokens, cache, cache_type=kind)
        self.kept += 1
        if self.report_kept:
            self.kept_now.setdefault(uid, []).append(tokens)

    def keep_snapshots(self, m: int, inner: list[int]) -> None:
        """The caches of micro-batch ``m``'s sequences ``inner`` (generator uids) whose
        prompt reached a snapshot point this step (node.cache.snapshots), kept as prompt
        cache entries; "user" entries, which mlx-lm's prompt cache drops in turn with the
        answers' when it must drop one."""
        for g_uid, (cache, tokens) in self.generators[m].extract_cache(inner).items():
            uid = self.held[m][g_uid]
            scope, tokens = self.scopes.get(uid, MODEL_KEY), list(tokens)
            if self.disk_scope(scope) and len(tokens) % BLOCK_TOKENS == 0:
                self.disk.save(tokens, cache, whole=True)
            if in_memory(len(tokens), self.totals.get(uid, 0)):
                self.hold(uid, scope, tokens, cache, "user")

    def disk_scope(self, scope: str) -> bool:
        """Whether caches of this scope go to the disk tier (the unscoped ones, as keep)."""
        return self.disk is not None and scope == MODEL_KEY

    def cached_ids(self) -> set[int] | None:
        """The ids of the token lists the prompt cache holds now (None: not known; mlx-lm's
        LRUPromptCache keeps its order in ``_lru``, which it does not promise to keep)."""
        lrus = getattr(getattr(self.prompt_cache, "_lru", None), "_lrus", None)
        if not isinstance(lrus, dict):
            return None
        return {id(tokens) for queue in lrus.values() for _, tokens in queue}

    def fit_bytes(self) -> None:
        """Every rank drops its least recently used cache while any rank is over its bytes
        (one all_sum per entry dropped, and one to agree there is nothing to drop)."""
        import mlx.core as mx

        if self.prompt_cache is None:
            return
        while self.kept and len(self.prompt_cache):
            over = self.prompt_cache.nbytes > self.cache_bytes
            if self.group is not None and self.group.size() > 1:
                flag = mx.array(1.0 if over else 0.0)
                total = mx.distributed.all_sum(flag, group=self.group, stream=control_stream())
                over = host_float(total) > 0
            if not over:
                break
            self.prompt_cache.trim_to(n_sequences=len(self.prompt_cache) - 1)
        self.kept = 0

    def round(self, on_token: Callable | None) -> None:
        """Step the generator ``steps_this_round`` times (fewer once nothing is left);
        ``on_token`` (rank 0) gets every generated token's response. Ends with no step in
        flight, so the next collective on another stream cannot interleave with the
        generator's.

        With micro-batches, a step steps each in turn: each generator enqueues its next
        step before it waits for its last, so while one micro-batch waits for the last stage
        (its share of the final hidden state) the other's layers run on its own stream, and
        every stage is busy."""
        began, steps = time.perf_counter(), 0
        with collectives_on(self.comm):
            for _ in range(self.steps_this_round()):
                if not self.live:
                    break
                steps += 1
                for m, generator in enumerate(self.generators):
                    if self.held[m]:
                        self.step(m, generator, on_token)
        for generator in self.generators:
            mx.synchronize(generator.stream)
        if self.comm is not None:
            mx.synchronize(self.comm)
        self.last_round = (time.perf_counter() - began, steps)
        if self.kept:
            self.fit_bytes()

    def step(self, m: int, generator: BatchGenerator, on_token: Callable | None) -> None:
        """One step of micro-batch ``m``; its responses carry this batch's uids."""
        with generator.stats() as work:
            prompts, responses = generator.next()
        self.pace.measured(work.prompt_tokens, work.prompt_time)
        ends = []
        for p in prompts:
            uid = self.held[m][p.uid]
            if p.end_of_prompt:
                self.prefilling.pop(uid, None)
            elif uid in self.prefilling:
                self.prefilling[uid] = p.progress
            if p.end_of_segment and not p.end_of_prompt and self.snapshots:
                ends.append(p.uid)
        if ends:
            self.keep_snapshots(m, ends)
        for r in responses:
            r.uid = self.held[m][r.uid]
            if r.finish_reason is not None:
                self.forget(r.uid)
                self.keep(r)
            if on_token is not None:
                on_token(r)  # rank 0 reads a failed grammar's why in self.grammars
            if r.finish_reason is not None:
                self.grammars.pop(r.uid, None)

    def close(self) -> None:
        for generator in reversed(self.generators):  # each puts back the wired limit it found
            generator.close()
