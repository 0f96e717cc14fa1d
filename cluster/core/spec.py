"""The job spec: what the launcher asks of every rank, as typed dataclasses.

``cluster`` builds a ``JobSpec`` from the command line, ``node`` reads it back from the JSON file
the launcher writes on each host. Both sides import this module (it needs no mlx), every default
is defined here once, and ``to_dict``/``from_dict`` are the one place dataclasses become JSON and
back. Adding an option: a field here, its click option, and the code that uses it.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from cluster.core.params import ALL, OPENAI, RESPONSES, Range, param

T = TypeVar("T")
COMMANDS = ("generate", "logits", "chat", "serve", "bench", "links")


@dataclass
class Sampling:
    """How tokens are chosen; identical on every rank (rank 0 draws a missing seed). Each
    field is declared once (cluster.core.params): its default, the values it takes on the
    command line and in a request, its help, and its name in each API dialect."""

    max_tokens: int = param(256, Range(1, integer=True), "Most tokens to generate.")
    temp: float = param(
        0.0,
        Range(0, 100, meaning="0 is greedy"),
        "Sampling temperature.",
        api="temperature",
        dialects=ALL,
    )
    top_p: float = param(
        1.0,
        Range(0, 1, meaning="0 or 1: off"),
        "Nucleus sampling: keep the most likely tokens up to this probability mass.",
        api="top_p",
        dialects=ALL,
    )
    top_k: int = param(
        0,
        Range(
            -1, 2**31 - 1, integer=True, meaning="-1 or 0: off; the vocabulary size or more: off"
        ),
        "Keep only the K most likely tokens.",
        api="top_k",
        dialects=ALL,
    )
    min_p: float = param(
        0.0,
        Range(0, 1, meaning="0: off"),
        "Drop tokens less likely than this fraction of the most likely one.",
        api="min_p",
        dialects=(OPENAI,),
    )
    min_tokens_to_keep: int = param(
        1, Range(1, integer=True), "The fewest tokens --min-p may leave to sample from."
    )
    repetition_penalty: float | None = param(
        None,
        Range(0, 10, low_open=True, meaning="1: off"),
        "Divide the logits of tokens generated lately (--repetition-context-size) "
        "by this (>1 repeats less); the prompt is not penalised.",
        api="repetition_penalty",
        dialects=(OPENAI,),
        show_default=False,
    )
    presence_penalty: float | None = param(
        None,
        Range(-2, 2),
        "Subtract this from the logits of tokens generated lately "
        "(OpenAI's presence_penalty); the prompt is not penalised.",
        api="presence_penalty",
        dialects=(OPENAI, RESPONSES),
        show_default=False,
    )
    frequency_penalty: float | None = param(
        None,
        Range(-2, 2),
        "Subtract this times a token's count among those generated lately "
        "(OpenAI's frequency_penalty); the prompt is not penalised.",
        api="frequency_penalty",
        dialects=(OPENAI, RESPONSES),
        show_default=False,
    )
    repetition_context_size: int = param(
        20,
        Range(1, 2**20, integer=True),
        "Generated tokens the three penalties look back over (mlx-lm's default, 20).",
        api="repetition_context_size",
        dialects=(OPENAI,),
    )
    stop: list[str] = param(
        help="End the answer where this text appears (not printed); repeatable.",
        default_factory=list,
        multiple=True,
        metavar="STRING",
    )  # rank 0 decides, every rank agrees
    seed: int | None = param(
        None,
        Range(-1, 2**63 - 1, integer=True, meaning="-1: a random seed"),
        "Random seed, shared by every rank (default: a random "
        "one): the same seed gives the same text.",
        api="seed",
        dialects=(OPENAI, RESPONSES),
        show_default=False,
    )
    logit_bias: dict[str, float] | None = None  # token id (as text) -> added to its logit


def normalized(s: Sampling) -> Sampling:
    """The conventions every range admits, as the ranks take them: top_k -1 is 0 (off),
    seed -1 is None (a random one, drawn by rank 0)."""
    changes: dict[str, Any] = {}
    if s.top_k == -1:
        changes["top_k"] = 0
    if s.seed == -1:
        changes["seed"] = None
    return dataclasses.replace(s, **changes) if changes else s


@dataclass
class Template:
    """Switches for the model's chat template."""

    system: str | None = param(None, help="System prompt.", show_default=False)
    tools: list | None = param(
        None,
        help="JSON file with a list of tool schemas (OpenAI style) for the chat template.",
        flag="--tools",
        metavar="FILE",
        show_default=False,
    )
    enable_thinking: bool | None = param(
        None,
        help="Pass enable_thinking to the chat template (default: the template's own).",
        toggle="--thinking/--no-thinking",
        show_default=False,
    )
    reasoning_effort: str | None = param(
        None,
        help="Pass reasoning_effort to the chat template (gpt-oss and the like).",
        choices=("low", "medium", "high"),
        show_default=False,
    )


@dataclass
class Constraint:
    """What an answer must match, decoded under a grammar on every rank (node.grammar):
    ``grammar``, llguidance's grammar made from a JSON schema, a regex or a Lark grammar
    (cluster.core.grammar, checked before it travels); or ``tools``, a tool call rank 0 writes
    the grammar of from the request's tools in the model's own markup: "required" (any tool),
    "strict" (free text, calls under their tool's schema) or a tool's name."""

    grammar: str | None = None
    tools: str | None = None
    source: str = ""  # the field it came from, for a refusal: "response_format", "tool_choice"
    single: bool = False  # at most one call (parallel_tool_calls false, disable_parallel_...)


@dataclass
class JobRequest:
    """The work of a one-shot job (launch) or the settings of every turn (chat); rank 0 only."""

    prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    template: Template = field(default_factory=Template)
    image: bytes | None = None  # for a vision-language model
    constraint: Constraint | None = None  # --json-schema, --regex


@dataclass
class ServeSettings:
    """``serve``: where the launcher's API listens, how rank 0 batches, how failures restart."""

    host: str = param(
        "127.0.0.1",
        help="Address the API listens on, on this machine (0.0.0.0 opens it to the network).",
    )
    port: int = param(8080, Range(0, 65535, integer=True), "Port the API listens on.")
    api_key: str | None = param(
        None,
        help="Require 'Authorization: Bearer KEY' (better: set "
        "MLX_CLUSTER_API_KEY, which keeps it out of the process list).",
        envvar="MLX_CLUSTER_API_KEY",
        show_default=False,
    )
    replicas: int = param(
        1,
        Range(1, 64, integer=True),
        "Groups of ranks, each a whole copy of the model, behind this one endpoint: the "
        "ranks (-n N, or the hostfile's hosts in order) split into R groups of N/R. Requests "
        "go to the group holding their longest cached prefix, else the least loaded "
        "(--routing); a failed group restarts alone while the others answer. A hostfile's "
        "'groups:' names the groups instead.",
    )
    routing: str = param(
        "prefix",
        help="How a fleet's requests find a group: prefix (the longest cached prefix, then "
        "the least work; a session stays on its group), least-loaded (the least work), "
        "round-robin.",
        choices=("prefix", "least-loaded", "round-robin"),
    )
    prefill_groups: int = param(
        0,
        Range(0, 63, integer=True),
        "Of the groups (--replicas, or the hostfile's 'groups:'), the first K only prefill: a "
        "request whose prompt has at least --disaggregate-min-tokens tokens to prefill is "
        "prefilled there and its KV cache handed to the group that decodes it, so long prompts "
        "never stall the streams decoding elsewhere (docs/serve.md).",
        metavar="K",
    )
    disaggregate_min_tokens: int = param(
        512,  # measured: docs/benchmarks.md, "Prefill on one group, decode on another"
        Range(1, integer=True),
        "With --prefill-groups: the fewest prompt tokens to prefill (beyond what the decoding "
        "group holds cached) that go to a prefill group; shorter prompts prefill where they "
        "decode.",
        metavar="TOKENS",
    )
    drain_timeout: float = param(
        30.0,
        Range(0),
        "On Ctrl-C or SIGTERM, the longest wait (s) for answers under way before they are cut.",
    )
    max_restarts: int = param(
        3,
        Range(0, integer=True),
        "Restarts of the ranks allowed within "
        "--restart-window; one more failure ends serve (exit 1). 0: the "
        "first failure ends it.",
    )
    restart_window_s: float = param(
        600.0,
        Range(1),
        "Seconds over which --max-restarts counts failures.",
        flag="--restart-window",
    )
    restart_wait: float = param(
        120.0,
        Range(0),
        "Longest a request waits (s) for the ranks to start or restart; then 503 with Retry-After.",
    )
    request_timeout: float = param(
        3600.0,
        Range(1),
        "Longest a request may be under way (s), from the ranks taking it to its last "
        "token; past it the client gets 504 and the ranks drop it, so no client waits "
        "forever on an answer that cannot come.",
    )
    responses_store_mb: float = param(
        256.0,
        Range(0),
        "Memory (MB) for the Responses API's stored responses (store: true, the API's "
        "default): previous_response_id continues their conversations, GET /v1/responses/ID "
        "reads them. Least recently used go first; kept in this process only. 0: none kept.",
    )
    responses_store_hours: float = param(
        24.0,
        Range(0, low_open=True),
        "Hours a stored response is kept after its conversation was last continued or read.",
    )
    decode_concurrency: int = param(
        32,
        Range(1, integer=True),
        "Most requests decoded together in one batch (more wait their turn).",
    )
    prompt_concurrency: int = param(8, Range(1, integer=True), "Most prompts prefilled together.")
    max_stall: float = param(
        0.25,
        Range(0),
        "Seconds a prefill step may pause answers already "
        "decoding: while any are, a long prompt's steps shrink to what "
        "the ranks prefill in this time (measured as they go; at least "
        "32 tokens). 0: steps of --prefill-step always.",
    )
    prompt_cache_size: int = param(
        10,
        Range(0, integer=True),
        "Finished answers whose KV "
        "caches every rank keeps; a request that starts with one (a "
        "chat sent again with a new turn) prefills only the rest. 0: "
        "no cache.",
    )
    max_tokens_cap: int = param(
        32768,
        Range(1, integer=True),
        "The most tokens one answer may have: a request's max_tokens above it is lowered to "
        "it (finish_reason 'length' if the answer reaches it). Rank 0 also lowers max_tokens "
        "to what the model's context leaves after the prompt, and reserves KV memory for "
        "prompt + max_tokens while the answer runs.",
    )
    default_max_tokens: int | None = param(
        None,
        Range(1, integer=True),
        "max_tokens of a request that sends none. Default: what the model's context leaves "
        "after its prompt, up to --max-tokens-cap (as OpenAI and vLLM do); less lets more "
        "such requests share the KV memory at once.",
        show_default=False,
    )
    max_prompt_tokens: int | None = param(
        None,
        Range(1, integer=True),
        "The longest prompt in "
        "tokens (longer: 400). Default: the model's context "
        "(max_position_embeddings).",
        show_default=False,
    )
    max_body_mb: float = param(
        16.0,
        Range(0, low_open=True),
        "The largest request body in MB "
        "(larger: 413); 16 MB holds a 128k-token prompt several times "
        "over.",
    )
    max_connections: int = param(
        256,
        Range(1, integer=True),
        "Open HTTP connections at once; past it a new one gets 503 with Retry-After.",
    )
    read_timeout: float = param(
        30.0,
        Range(0, low_open=True),
        "Seconds a request's line, "
        "headers and body may take to arrive (then the connection is "
        "closed): a slow client cannot hold the server.",
    )
    allowed_hosts: list[str] = param(
        help="Host names the API answers to besides loopback, IP "
        "addresses and this machine's own names (repeat it, or "
        "comma-separate; '*' for any): a request whose Host header "
        "names another gets 403, so a web page cannot reach the "
        "API through DNS rebinding. Add the name a reverse proxy "
        "or your LAN uses for this machine.",
        default_factory=list,
        multiple=True,
        commas=True,
        metavar="NAMES",
    )
    served_model_name: list[str] = param(
        help="Other model names the served model answers to (repeat it, or comma-separate; "
        "globs: 'claude-*', 'gpt-*'): agents that send their own model names (Claude Code's "
        "side requests, tools that default to gpt-*) then need no override. Any other name "
        "gets 404 naming what is served.",
        default_factory=list,
        multiple=True,
        commas=True,
        metavar="NAMES",
    )
    cors_origins: list[str] = param(
        help="Browser origins (e.g. http://localhost:3000; repeat "
        "it or comma-separate; '*' for any) that may call the API "
        "from a web page; any other page's request gets 403.",
        default_factory=list,
        multiple=True,
        commas=True,
        metavar="ORIGINS",
    )


@dataclass
class ServeRequest:
    """One API request as rank 0 gets it (a JSON line on its channel): the launcher parsed
    the OpenAI body; rank 0 tokenizes and schedules it."""

    id: str
    kind: str  # "chat" (messages through the chat template), "completion" (prompt) or
    # "count" (messages through the template, only counted: no answer)
    sampling: Sampling
    template: Template = field(default_factory=Template)
    messages: list[dict[str, Any]] = field(default_factory=list)  # OpenAI chat messages
    prompt: str = ""
    seeded: bool = False  # decoded alone: its tokens depend on the random state
    logprobs: int | None = None  # None: none; 0: each token's own; k: and the k likeliest
    constraint: Constraint | None = None  # a grammar the answer must match
    cache_key: str | None = None  # prompt_cache_key: the prompt cache's entries of this key only
    handoff: HandoffTicket | None = None  # its prompt prefilled by a prefill group


@dataclass
class HandoffTicket:
    """A request whose prompt a prefill group prefills and hands to a decode group (issue
    53). The decode group's rank 0 gets the ticket alone: it holds the request until every
    rank has the KV. The prefill group's gets where the KV goes: each decode rank's door and
    the decode group's plan (its ranks' layouts: cluster.core.handoff.group_layouts)."""

    ticket: str
    doors: list[list[Any]] = field(default_factory=list)  # [host, port] per decode rank
    mode: str = "pipeline"
    world: int = 1
    split: list[int] | None = None
    weights: list[float] | None = None


@dataclass
class Grammar:
    """A grammar every rank decodes a request under (node.grammar): llguidance's text, and
    the tokens it waits for (the end of a think block the prompt opened)."""

    text: str
    after: list[int] | None = None
    ticket: int | None = None  # serve: its matcher was built ahead (Order.compile)


@dataclass
class SharedRequest:
    """What every rank decodes for one request, made by rank 0 and carried to every rank by
    share_object: the prompt's tokens (a vision model's: its templated prompt and image, which
    every rank's processor turns into the same tokens), the sampling (the seed drawn), the
    grammar it follows, and the prompt cache scope it looks in."""

    sampling: Sampling
    tokens: list[int] = field(default_factory=list)
    grammar: Grammar | None = None
    cache_key: str | None = None
    vlm_prompt: str | None = None
    image: bytes | None = None


@dataclass
class Order:
    """Rank 0's order of one round of serve, applied alike by every rank (node.batch): the
    requests that join the batch, the uids that leave it, a request decoded alone, the end
    of the job, the prefill step from now on, a rest. An empty order is a ping (all still
    here: the rounds of ranks that cannot rest, having no launcher to wake them)."""

    insert: list[SharedRequest] = field(default_factory=list)
    remove: list[int] = field(default_factory=list)
    single: SharedRequest | None = None
    quit: bool = False
    prefill_step: int | None = None
    rest: bool = False  # nothing to do: every rank rests until rank 0 wakes it (node.rank)
    compile: list[Grammar] = field(default_factory=list)  # build these matchers, off the loop
    dropped: list[int] = field(default_factory=list)  # tickets whose requests will not come
    # handoffs (issue 53). A decode group: tickets whose KV comes to every rank's door
    # (``expect``), then is planted in the prompt cache (``adopt``) or forgotten (``forget``).
    expect: list[Expect] = field(default_factory=list)
    adopt: list[Adopt] = field(default_factory=list)
    forget: list[str] = field(default_factory=list)
    prefill: PrefillOrder | None = None  # a prefill group: prefill these tokens, hand them off


@dataclass
class Expect:
    """A ticket whose KV every decode rank's door is to hold whole, for the prompt whose
    tokens' digest is ``tokens`` (node.cache.handoff.tokens_digest): the KV of another
    prompt is never adopted."""

    ticket: str
    tokens: str


@dataclass
class Adopt:
    """A handoff every decode rank holds whole: plant it in the prompt cache's ``scope``."""

    ticket: str
    cache_key: str | None = None


@dataclass
class PrefillOrder:
    """A prefill group's every rank: prefill ``tokens`` (all of the prompt but its last token)
    and send each rank's KV to the decode ranks, as ``handoff`` says."""

    handoff: HandoffTicket
    tokens: list[int]
    request: str = ""  # its id (rank 0 answers with Handed)


@dataclass
class ServeSetup:
    """What every serving rank must agree on before the first order (rank 0's): the random
    state, the batch's limits and the prompt cache (generators with other limits would
    schedule differently), and the tokens of KV the answers under way may hold."""

    seed: int
    decode_concurrency: int
    prompt_concurrency: int
    prefill_step: int
    prompt_cache_size: int
    cache_gb: float | None


@dataclass
class KVQuant:
    """A quantized KV cache (mlx-lm's QuantizedKVCache, as ``mlx_lm.generate --kv-bits``):
    each rank quantizes its own layers' or heads' cache once it holds ``quantized_kv_start``
    tokens."""

    kv_bits: int | None = param(
        None,
        help="Quantize the KV cache to this many bits (mlx-lm's "
        "QuantizedKVCache): 4 bits holds a context about 3.5x longer "
        "than 16-bit. Default: not quantized.",
        choices=(2, 3, 4, 5, 6, 8),
        show_default=False,
    )
    kv_group_size: int = param(
        64,
        help="Values sharing one scale and bias in the quantized KV cache.",
        choices=(32, 64, 128),
    )
    quantized_kv_start: int = param(
        5000,
        Range(0, integer=True),
        "Tokens in the cache before it is quantized (mlx-lm's default).",
    )

    def generate_kwargs(self) -> dict:
        """mlx-lm's generate_step arguments."""
        if self.kv_bits is None:
            return {}
        return {"kv_bits": self.kv_bits, "kv_group_size": self.kv_group_size,
                "quantized_kv_start": self.quantized_kv_start}  # fmt: skip


@dataclass
class Draft:
    """Speculative decoding (every rank alike): who proposes the tokens that the sharded model
    verifies K+1 at a time. At most one of ``draft_model`` and ``prompt_lookup``."""

    draft_model: str | None = param(
        None,
        help="Speculative decoding: a small model with the "
        "same tokenizer proposes tokens, loaded whole on every "
        "rank; the model verifies --num-draft-tokens + 1 in one "
        "pass. The text is the same as without it. 'default': the "
        "embedded default model's draft.",
        metavar="PATH_OR_REPO",
        show_default=False,
    )
    num_draft_tokens: int = param(
        3,
        Range(1, 64, integer=True),
        "Tokens proposed per verifying pass (with --draft-model or --prompt-lookup).",
    )
    prompt_lookup: int = param(
        0,
        Range(0, 64, integer=True),
        "Speculative decoding without a "
        "draft model: propose what followed the last N tokens (or fewer) "
        "where they occurred before in the prompt or answer. 0: off.",
        metavar="N",
    )
    draft_on: str = param(
        "every",
        help="Where --draft-model runs: on every rank (each proposes "
        "the same tokens, no communication; each holds the draft's weights), "
        "or on rank 0 only (its logits are shared with one all_sum per "
        "drafted token; the other ranks need no draft).",
        choices=("every", "rank0"),
    )

    @property
    def on(self) -> bool:
        return bool(self.draft_model or self.prompt_lookup)


@dataclass
class BenchSettings:
    """``bench``: one configuration's runs (every rank)."""

    prompt_tokens: int = 512
    gen_tokens: int = 128
    warmup: int = 1
    repeat: int = 3
    streams: int = 1  # answers decoded together, each with its own prompt (bench --concurrency)


@dataclass
class JobSpec:
    """One rank's job. ``request`` and ``serve`` are filled on rank 0 only (``for_rank``)."""

    model: str
    command: str = "generate"  # one of COMMANDS
    mode: str = param(
        "pipeline",
        help="pipeline: each rank holds a range of layers; tensor: "
        "each rank holds a slice of every layer.",
        choices=("pipeline", "tensor"),
    )
    world_size: int = 1
    split: list[int] | None = param(
        None,
        help="Pipeline mode: layers per rank, rank 0 first "
        "(rank 0 holds the last layers). Tensor mode: each rank's "
        "share of the heads and MLP columns, as proportions (3,1 "
        "gives rank 0 three quarters). Default: in proportion to "
        "the hosts' memory_gb when every host gives it, else even.",
        metavar="N,N,...",
        show_default=False,
    )
    split_weights: list[float] | None = None  # per-rank memory, for a weighted split
    prefill_step: int | None = param(
        None,
        Range(16, integer=True),
        "Most prompt tokens "
        "prefilled in one step (mlx-lm's prefill_step_size). "
        "Default: 2048, and in pipeline mode smaller for long "
        "prompts, so that the stages work on different steps at "
        "once (docs/benchmarks.md). serve: between two steps the "
        "running answers decode a token.",
        metavar="TOKENS",
        show_default=False,
    )
    prompt_cache_gb: float | None = param(
        None,
        Range(0),
        "Most KV cache each rank keeps for "
        "reuse, in GB (chat: the conversation's between "
        "turns, over it the next turn starts afresh; serve: "
        "finished answers', the least recently used dropped "
        "alike on every rank). Default: half the memory left "
        "on the rank after the weights.",
        show_default=False,
    )
    prompt_cache_disk_gb: float = param(
        0.0,
        Range(0),
        "Keep prompts' KV caches on each host's "
        "disk too, at most this many GB per host: a prompt that "
        "starts like an earlier one (an agent's system prompt "
        "and tools, a conversation sent again) reads that part "
        "instead of prefilling it, also after a restart. Each "
        "rank keeps its own layers' or heads' part. 0: off.",
        metavar="GB",
    )
    prompt_cache_dir: str | None = param(
        None,
        help="Where each host keeps the disk tier: it "
        "makes a folder of its own in DIR, mlx-cluster-kv "
        "(0700), and reads, writes and removes only there "
        "(default DIR: ~/.cache/mlx-cluster, or under "
        "$XDG_CACHE_HOME). One store holds many models and "
        "plans, and may be shared by several jobs of one user.",
        metavar="DIR",
        show_default=False,
    )
    request: JobRequest = field(default_factory=JobRequest)
    serve: ServeSettings = field(default_factory=ServeSettings)
    bench: BenchSettings = field(default_factory=BenchSettings)
    draft: Draft = field(default_factory=Draft)
    kv_quant: KVQuant = field(default_factory=KVQuant)
    blas: str = param(
        "auto",
        help="Linux ranks: auto preloads the host's OpenBLAS when it has "
        "one (one thread per core shared by the host's ranks); reference keeps "
        "the BLAS bundled with mlx[cpu].",
        choices=("auto", "reference"),
    )
    ranks_on_host: int = 1  # ranks sharing this rank's host (BLAS threads = cores / this)
    device: str = ""  # "cpu": compute on the CPU where MLX would take the GPU (hostfile's device)
    launcher_timeout: float = 30.0  # the rank ends itself when the launcher is silent this long
    backend: str = "ring"  # the hostfile's (cluster.core.backends): how the ranks join
    micro_batches: int = param(
        1,
        Range(1, 64, integer=True),
        "Pipeline mode, serve and bench: split the streams "
        "decoding together into N micro-batches, each on its own "
        "stream, so that stage k works on one while stage k+1 "
        "works on another (N = the rank count keeps every stage "
        "busy). Each stage reads its weights once per micro-batch, "
        "so it gains where a step's cost divides by streams (many "
        "streams, long contexts), not where reading the weights "
        "bounds it; and on CPU ranks with no core to spare, MLX's "
        "ring spins a core while it waits and it costs more than it "
        "gives (docs/serve.md). Measure it with bench --concurrency.",
        metavar="N",
    )
    handoff: Handoff = field(default_factory=lambda: Handoff())
    measure_links: bool = param(
        True,
        help="As the ranks start (and restart), measure each link "
        "they use as `doctor --links` does (round trip, bandwidth of 8 "
        "MB, all_sum; before the model loads, a fraction of a second "
        "per link) and show it on the page and in `status`, the slow "
        "link named.",
        toggle="--measure-links/--no-measure-links",
    )

    @property
    def stages(self) -> int:
        """Pipeline stages: a rank each in pipeline mode, one in tensor mode."""
        return self.world_size if self.mode == "pipeline" else 1

    def to_json(self) -> str:
        return json.dumps(to_dict(self))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return from_dict(cls, json.loads(text))

    def for_rank(self, rank: int, **changes: Any) -> JobSpec:
        """This job as one rank sees it: the request and serve settings go only to rank 0,
        and the API key to none (the launcher serves the API)."""
        if rank != 0:
            changes.setdefault("request", JobRequest())
            changes.setdefault("serve", ServeSettings())
        changes.setdefault("serve", dataclasses.replace(self.serve, api_key=None))
        return dataclasses.replace(self, **changes)


@dataclass
class Handoff:
    """A serve group's part in handoffs (--prefill-groups), on every rank: ``prefill`` only
    prefills and sends KV, ``decode`` takes KV at a door (on ``host``, this rank's address
    as the others reach it) from holders of ``key`` (the fleet's secret, hex), ``both`` (no
    prefill groups) neither."""

    role: str = "both"
    key: str = ""
    host: str = "127.0.0.1"


@dataclass
class LaunchSettings:
    """How the launcher runs and watches the ranks (never sent to them)."""

    starting_port: int | None = param(
        None,
        Range(1, 65535, integer=True),
        "First ring port "
        "(counts up per rank); default: free ports on this "
        "machine, 32323 on remote hosts.",
        show_default=False,
    )
    connections_per_ip: int = param(1, Range(1, integer=True), "Ring sockets per address.")
    heartbeat_timeout: float = param(
        30.0,
        Range(1),
        "Give up on a rank that sends nothing (not "
        "even its once-a-second heartbeat) for this many seconds: "
        "stopped, hung, or its host unreachable. A rank that hears "
        "nothing from the launcher for as long ends itself.",
    )
    start_timeout: float = param(
        1800.0,
        Range(1),
        "Give up if the ranks have not all loaded the model after this many seconds.",
    )
    stall_timeout: float = param(
        120.0,
        Range(1),
        "Give up when every rank still beats but none "
        "has finished a step (a token, a prefill chunk) for this many "
        "seconds: a collective that cannot complete, as when a cable "
        "between two Macs is pulled.",
    )
    accept_new_host_keys: bool = param(
        False,
        help="Trust and record the SSH host key of a host "
        "not yet in known_hosts (like OpenSSH's accept-new); a "
        "changed key is always refused.",
        toggle="--accept-new-host-keys",
        show_default=False,
    )
    verbose: bool = param(
        False,
        help="Show every rank's log lines on stderr, prefixed [rank k host].",
        toggle="-v/--verbose",
        show_default=False,
    )


def default(cls: type, name: str) -> Any:
    """A field's default, for a click option that must show the same one."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def pick(cls: type[T], values: dict[str, Any]) -> T:
    """``cls`` from the entries of ``values`` named like its fields, popped from ``values``
    (a command's keyword arguments: what is left belongs elsewhere)."""
    names = [f.name for f in dataclasses.fields(cast(Any, cls)) if f.name in values]
    return cls(**{n: values.pop(n) for n in names})


def to_dict(obj: Any, raw_bytes: bool = False) -> Any:
    """Dataclasses to plain JSON values; bytes become base64 text (the spec is a JSON file),
    or stay bytes with ``raw_bytes`` (share_object sends them raw, after its JSON header)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name), raw_bytes) for f in dataclasses.fields(obj)}
    if isinstance(obj, (bytes, bytearray)):
        return bytes(obj) if raw_bytes else base64.b64encode(obj).decode()
    if isinstance(obj, (list, tuple)):
        return [to_dict(v, raw_bytes) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v, raw_bytes) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """The inverse of ``to_dict``; fields missing from ``data`` take their defaults, unknown
    keys are an error (a launcher and a rank of different versions), and so is a value that
    is not of its field's type (ValueError naming the field): what a rank or the launcher
    sends is checked where it is read, not trusted."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    decoders = _decoders(cast(Any, cls))
    unknown = sorted(set(data) - decoders.keys())
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
    out = {}
    for name, value in data.items():
        decoder, hint = decoders[name]
        if decoder is None and not conforms(hint, value):
            shown = json.dumps(value)[:60] if _jsonable(value) else type(value).__name__
            raise ValueError(f"{cls.__name__}.{name}: expected {_shown(hint)}, got {shown}")
        out[name] = _value(decoder, value, hint)
    return cls(**out)


def conforms(hint: Any, value: Any) -> bool:
    """Whether a plain JSON value is of ``hint`` (str, int, float, bool, lists and dicts of
    them, unions, Any); an int is a float, a bool is neither."""
    if hint is Any:
        return True
    if _is_union(hint):
        return any(conforms(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(hint) or hint, typing.get_args(hint)
    if origin is list:
        return isinstance(value, list) and (not args or all(conforms(args[0], v) for v in value))
    if origin is dict:
        return isinstance(value, dict) and (
            not args or all(isinstance(k, str) and conforms(args[1], v) for k, v in value.items())
        )
    return True  # a hint no JSON value is checked against (none so far)


def _shown(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


@functools.cache
def _decoders(cls: type) -> dict[str, tuple[Any, Any]]:
    """Per field of ``cls``: the dataclass, ``bytes``, ``[dataclass]`` (a list of them) or
    None (a plain JSON value) its value is decoded as, and its type hint. Resolved once per
    class: the launcher decodes an event per token."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        options = typing.get_args(hint) if _is_union(hint) else (hint,)
        found: Any = next((o for o in options if dataclasses.is_dataclass(o) or o is bytes), None)
        for o in options:
            args = typing.get_args(o)
            if typing.get_origin(o) is list and args and dataclasses.is_dataclass(args[0]):
                found = [args[0]]
        out[f.name] = (found, hint)
    return out


def _value(decoder: Any, value: Any, hint: Any = None) -> Any:
    if value is None:
        if hint is not None and not conforms(hint, None) and decoder is not None:
            raise ValueError(f"expected {_shown(hint)}, got null")
        return value
    if decoder is None:
        return value
    if decoder is bytes:
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if not isinstance(value, str):
            raise ValueError(f"expected bytes as base64 text, got {type(value).__name__}")
        return base64.b64decode(value)
    if isinstance(decoder, list):
        if not isinstance(value, list):
            raise ValueError(f"expected a list of {decoder[0].__name__}")
        return [from_dict(decoder[0], v) for v in value]
    return from_dict(decoder, value)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)
