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
from typing import Any, TypeVar

T = TypeVar("T")
COMMANDS = ("generate", "logits", "chat", "serve", "bench", "links")


@dataclass
class Sampling:
    """How tokens are chosen; identical on every rank (rank 0 draws a missing seed)."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1  # the fewest tokens min-p may leave
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] = field(default_factory=list)  # rank 0 decides, every rank agrees
    seed: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (as text) -> added to its logit


@dataclass
class Template:
    """Switches for the model's chat template."""

    system: str | None = None
    tools: list | None = None  # OpenAI-style tool schemas
    enable_thinking: bool | None = None
    reasoning_effort: str | None = None


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


@dataclass
class Request:
    """The work of a one-shot job (launch) or the settings of every turn (chat); rank 0 only."""

    prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    template: Template = field(default_factory=Template)
    image: bytes | None = None  # for a vision-language model
    constraint: Constraint | None = None  # --json-schema, --regex


@dataclass
class ServeSettings:
    """``serve``: where the launcher's API listens, how rank 0 batches, how failures restart."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None  # stays in the launcher's process: never in argv or a rank's spec
    drain_timeout: float = 30.0  # on SIGINT/SIGTERM, the longest wait for answers under way
    max_restarts: int = 3  # restarts of the ranks within restart_window_s; past it, serve exits
    restart_window_s: float = 600.0
    restart_wait: float = 120.0  # longest a request waits for ranks that (re)start: then 503
    decode_concurrency: int = 32  # most requests decoded together
    prompt_concurrency: int = 8  # most prompts prefilled together
    max_stall: float = 0.25  # longest a prefill step may pause running streams (0: off)
    prompt_cache_size: int = 10  # finished answers whose caches every rank keeps (0: none)
    serve_cache_gb: float | None = None  # their most KV per rank (None: from memory left)
    max_tokens_cap: int = 32768  # the most max_tokens a request may ask
    max_prompt_tokens: int | None = None  # the longest prompt (None: the model's context)
    max_body_mb: float = 16.0  # the largest request body
    max_connections: int = 256  # open HTTP connections at once (503 past it)
    read_timeout: float = 30.0  # a request's line, headers and body must arrive within this
    allowed_hosts: list[str] = field(default_factory=list)  # Host names besides loopback's
    cors_origins: list[str] = field(default_factory=list)  # browser origins the API answers


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


@dataclass
class KVQuant:
    """A quantized KV cache (mlx-lm's QuantizedKVCache, as ``mlx_lm.generate --kv-bits``):
    each rank quantizes its own layers' or heads' cache once it holds ``quantized_kv_start``
    tokens."""

    kv_bits: int | None = None  # None: the full-precision cache
    kv_group_size: int = 64
    quantized_kv_start: int = 5000  # mlx-lm's default

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

    draft_model: str | None = None  # a small model with the same tokenizer, whole on each rank
    num_draft_tokens: int = 3  # K: tokens proposed per verifying pass
    prompt_lookup: int = 0  # proposals from n-grams (up to this long) of the prompt and answer
    draft_on: str = "every"  # the draft model on every rank, or on "rank0" (proposals shared)

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


@dataclass
class JobSpec:
    """One rank's job. ``request`` and ``serve`` are filled on rank 0 only (``for_rank``)."""

    model: str
    command: str = "generate"  # one of COMMANDS
    mode: str = "pipeline"
    world_size: int = 1
    split: list[int] | None = None  # pipeline layers per rank (rank 0 holds the last layers)
    split_weights: list[float] | None = None  # per-rank memory, for a weighted split
    prefill_step: int | None = None  # prompt tokens per prefill step (None: for mode and N)
    prompt_cache_gb: float = 4.0  # chat: the most KV cache each rank keeps between turns
    prompt_cache_disk_gb: float = 0.0  # each host's disk tier of the prompt cache (0: off)
    prompt_cache_dir: str | None = None  # its folder on each host (None: the user's cache)
    request: Request = field(default_factory=Request)
    serve: ServeSettings = field(default_factory=ServeSettings)
    bench: BenchSettings = field(default_factory=BenchSettings)
    draft: Draft = field(default_factory=Draft)
    kv_quant: KVQuant = field(default_factory=KVQuant)
    blas: str = "auto"  # Linux ranks: "auto" preloads an optimized BLAS when found, "reference"
    ranks_on_host: int = 1  # ranks sharing this rank's host (BLAS threads = cores / this)
    launcher_timeout: float = 30.0  # the rank ends itself when the launcher is silent this long
    hostfile_backend: str = "ring"  # ring, jaccl, jaccl-ring, nccl (links: which pairs it joins)
    measure_links: bool = True  # serve: every rank measures its links (doctor --links) at start

    def to_json(self) -> str:
        return json.dumps(to_dict(self))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return from_dict(cls, json.loads(text))

    def for_rank(self, rank: int, **changes: Any) -> JobSpec:
        """This job as one rank sees it: the request and serve settings go only to rank 0,
        and the API key to none (the launcher serves the API)."""
        if rank != 0:
            changes.setdefault("request", Request())
            changes.setdefault("serve", ServeSettings())
        changes.setdefault("serve", dataclasses.replace(self.serve, api_key=None))
        return dataclasses.replace(self, **changes)


@dataclass
class LaunchSettings:
    """How the launcher runs and watches the ranks (never sent to them)."""

    starting_port: int | None = None
    connections_per_ip: int = 1
    heartbeat_timeout: float = 30.0  # both ways: ranks to the launcher and back
    start_timeout: float = 1800.0
    stall_timeout: float = 120.0  # every rank beats but none makes progress: a stuck collective
    accept_new_host_keys: bool = False
    verbose: bool = False


def default(cls: type, name: str) -> Any:
    """A field's default, for a click option that must show the same one."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def pick(cls: type[T], values: dict[str, Any]) -> T:
    """``cls`` from the entries of ``values`` named like its fields, popped from ``values``
    (a command's keyword arguments: what is left belongs elsewhere)."""
    names = [f.name for f in dataclasses.fields(cls) if f.name in values]
    return cls(**{n: values.pop(n) for n in names})


def to_dict(obj: Any) -> Any:
    """Dataclasses to plain JSON values; bytes become base64 text (the spec is a JSON file)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (bytes, bytearray)):
        return base64.b64encode(obj).decode()
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """The inverse of ``to_dict``; fields missing from ``data`` take their defaults, unknown
    keys are an error (a launcher and a rank of different versions)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: expected an object, got {type(data).__name__}")
    decoders = _decoders(cls)
    unknown = sorted(set(data) - decoders.keys())
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
    return cls(**{name: _value(decoders[name], value) for name, value in data.items()})


@functools.cache
def _decoders(cls: type) -> dict[str, Any]:
    """Per field of ``cls``: the dataclass, ``bytes`` or None (a plain JSON value) its value
    is decoded as. Resolved once per class: the launcher decodes an event per token."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        options = typing.get_args(hint) if _is_union(hint) else (hint,)
        out[f.name] = next((o for o in options if dataclasses.is_dataclass(o) or o is bytes), None)
    return out


def _value(decoder: Any, value: Any) -> Any:
    if value is None or decoder is None:
        return value
    if decoder is bytes:
        return base64.b64decode(value)
    return from_dict(decoder, value)


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)
