"""Options shared by the commands, each defined once and selected by name (``with_options``).

Defaults come from the dataclasses of ``cluster.core.spec``, so a default lives in one place.
"""

from __future__ import annotations

import io
import json
import sys
import time

import click

from cluster.core import grammar
from cluster.core.hostfile import BACKENDS, Hostfile, HostfileError, load_hostfile, local_hostfile
from cluster.core.modelcheck import MODES, default_draft_path, default_model_path
from cluster.core.spec import (
    Constraint,
    Draft,
    JobSpec,
    KVQuant,
    LaunchSettings,
    Sampling,
    ServeSettings,
    Template,
    default,
    pick,
)
from cluster.core.text import valid_text
from cluster.job.launcher import LaunchError, run_job

STARTED = time.perf_counter()
MAX_IMAGE_BYTES = 64 * 1024 * 1024


class HostfileParam(click.ParamType):
    """A hostfile path, loaded and validated: its error (file, host, field) is a usage error."""

    name = "hostfile"

    def convert(self, value, param, ctx) -> Hostfile:
        if isinstance(value, Hostfile):
            return value
        try:
            return load_hostfile(value)
        except HostfileError as e:
            self.fail(str(e), param, ctx)


HOSTFILE = HostfileParam()


def resolve_hostfile(
    hostfile: Hostfile | None, num_ranks: int | None, backend: str | None
) -> Hostfile:
    """--hostfile, or -n N ranks on this machine (2 by default, as hostfiles/local.yaml)."""
    if hostfile is not None and num_ranks is not None:
        raise click.UsageError("give either --hostfile or -n/--num-ranks, not both")
    hf = hostfile if hostfile is not None else local_hostfile(num_ranks or 2)
    if backend:
        hf.backend = backend
    return hf


def model_or_default(model: str | None) -> str:
    return model or str(default_model_path())


def run_or_exit(hf: Hostfile, spec: JobSpec, launch: LaunchSettings, stdout=None):
    """Run the job; on failure print its report and exit with its code."""
    try:
        return run_job(hf, spec, launch, stdout=stdout, started=STARTED)
    except LaunchError as e:
        if str(e):
            click.echo(str(e), err=True)
        sys.exit(e.exit_code)


def parse_split(ctx, param, value):
    if value is None:
        return None
    try:
        return [int(x) for x in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"{value!r}: give layer counts like 20,12") from None


def read_tools(ctx, param, path: str | None) -> list | None:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            # a "\ud800" escape decodes to a lone surrogate: made U+FFFD, as the API refuses it
            tools = json.loads(f.read(), object_hook=valid_strings)
    except (OSError, ValueError) as e:
        raise click.BadParameter(f"{path}: {e}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise click.BadParameter(f"{path}: want a JSON list of tool objects, like OpenAI's `tools`")
    return tools


def valid_strings(obj: dict) -> dict:
    """A JSON object with its keys and string values made valid Unicode (a json hook)."""
    return {
        valid_text(k): [valid_text(x) if isinstance(x, str) else x for x in v]
        if isinstance(v, list)
        else (valid_text(v) if isinstance(v, str) else v)
        for k, v in obj.items()
    }


def names_list(value: str | None) -> list[str]:
    """A comma-separated option as its items (blanks dropped)."""
    return [x.strip() for x in (value or "").split(",") if x.strip()]


def read_image(ctx, param, path: str | None) -> bytes | None:
    if path is None:
        return None
    data = open(path, "rb").read()
    if not data:
        raise click.BadParameter(f"{path} is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise click.BadParameter(
            f"{path} is {len(data) / 2**20:.0f} MiB; images up to "
            f"{MAX_IMAGE_BYTES // 2**20} MiB are shared with the ranks (scale it down)"
        )
    try:  # fail before any rank starts (PIL comes with mlx-vlm)
        from PIL import Image

        Image.open(io.BytesIO(data)).verify()
    except ImportError:
        pass
    except Exception as e:
        raise click.BadParameter(
            f"{path} is not an image file PIL can read ({type(e).__name__}); "
            "give a PNG, JPEG or another common format"
        ) from None
    return data


HOST = {
    "hostfile": click.option(
        "--hostfile",
        type=HOSTFILE,
        help="YAML (or mlx.launch JSON) hostfile; default: 2 ranks on this machine.",
    ),
    "num_ranks": click.option(
        "-n",
        "--num-ranks",
        type=click.IntRange(min=1),
        help="Run N ranks on this machine (no hostfile). Default 2.",
    ),
    "backend": click.option(
        "--backend",
        type=click.Choice(BACKENDS),
        default=None,
        help="Collective backend; default: the hostfile's, else ring. nccl: NVIDIA GPUs, one "
        "rank per GPU, tensor mode only.",
    ),
    "accept_new_host_keys": click.option(
        "--accept-new-host-keys",
        is_flag=True,
        help="Trust and record the SSH host key of a host not yet in known_hosts (like "
        "OpenSSH's accept-new); a changed key is always refused.",
    ),
}
MODEL = {
    "model": click.option(
        "--model",
        default=None,
        metavar="PATH_OR_REPO",
        help="MLX checkpoint directory or Hugging Face repo; default: the tiny "
        "model embedded in mlx-cluster.",
    ),
    "mode": click.option(
        "--mode",
        type=click.Choice(MODES),
        default=default(JobSpec, "mode"),
        show_default=True,
        help="pipeline: each rank holds a range of layers; tensor: each rank holds "
        "a slice of every layer.",
    ),
    "split": click.option(
        "--split",
        default=default(JobSpec, "split"),
        callback=parse_split,
        metavar="N,N,...",
        help="Pipeline mode: layers per rank, rank 0 first (rank 0 holds the last layers). "
        "Tensor mode: each rank's share of the heads and MLP columns, as proportions (3,1 gives "
        "rank 0 three quarters). Default: in proportion to the hosts' memory_gb when every "
        "host gives it, else even.",
    ),
    "prefill_step": click.option(
        "--prefill-step",
        type=click.IntRange(min=16),
        default=None,
        metavar="TOKENS",
        help="Most prompt tokens prefilled in one step (mlx-lm's prefill_step_size). Default: "
        "2048, and in pipeline mode smaller for long prompts, so that the stages work on "
        "different steps at once (docs/benchmarks.md). serve: between two steps the running "
        "answers decode a token.",
    ),
    "blas": click.option(
        "--blas",
        type=click.Choice(["auto", "reference"]),
        default=default(JobSpec, "blas"),
        show_default=True,
        help="Linux ranks: auto preloads the host's OpenBLAS when it has one (one thread per "
        "core shared by the host's ranks); reference keeps the BLAS bundled with mlx[cpu].",
    ),
}
LAUNCH = {  # LaunchSettings: how the launcher runs and watches the ranks
    "starting_port": click.option(
        "--starting-port",
        type=click.IntRange(1, 65535),
        default=default(LaunchSettings, "starting_port"),
        help="First ring port (counts up per rank); default: free ports on this "
        "machine, 32323 on remote hosts.",
    ),
    "connections_per_ip": click.option(
        "--connections-per-ip",
        type=click.IntRange(min=1),
        default=default(LaunchSettings, "connections_per_ip"),
        show_default=True,
        help="Ring sockets per address.",
    ),
    "heartbeat_timeout": click.option(
        "--heartbeat-timeout",
        type=click.FloatRange(min=1),
        default=default(LaunchSettings, "heartbeat_timeout"),
        show_default=True,
        help="Give up on a rank that sends nothing (not even its once-a-second heartbeat) "
        "for this many seconds: stopped, hung, or its host unreachable. A rank that hears "
        "nothing from the launcher for as long ends itself.",
    ),
    "stall_timeout": click.option(
        "--stall-timeout",
        type=click.FloatRange(min=1),
        default=default(LaunchSettings, "stall_timeout"),
        show_default=True,
        help="Give up when every rank still beats but none has finished a step (a token, a "
        "prefill chunk) for this many seconds: a collective that cannot complete, as when a "
        "cable between two Macs is pulled.",
    ),
    "start_timeout": click.option(
        "--start-timeout",
        type=click.FloatRange(min=1),
        default=default(LaunchSettings, "start_timeout"),
        show_default=True,
        help="Give up if the ranks have not all loaded the model after this many seconds.",
    ),
    "verbose": click.option(
        "-v",
        "--verbose",
        is_flag=True,
        help="Show every rank's log lines on stderr, prefixed [rank k host].",
    ),
}
SAMPLING = {  # Sampling
    "max_tokens": click.option(
        "--max-tokens",
        type=click.IntRange(min=1),
        default=default(Sampling, "max_tokens"),
        show_default=True,
        help="Most tokens to generate.",
    ),
    "temp": click.option(
        "--temp",
        type=click.FloatRange(min=0),
        default=default(Sampling, "temp"),
        show_default=True,
        help="Sampling temperature; 0 is greedy.",
    ),
    "top_p": click.option(
        "--top-p",
        type=click.FloatRange(0, 1, min_open=True),
        default=default(Sampling, "top_p"),
        show_default=True,
        help="Nucleus sampling: keep the most likely tokens up to this probability mass.",
    ),
    "top_k": click.option(
        "--top-k",
        type=click.IntRange(min=0),
        default=default(Sampling, "top_k"),
        show_default=True,
        help="Keep only the K most likely tokens (0: all).",
    ),
    "min_p": click.option(
        "--min-p",
        type=click.FloatRange(0, 1),
        default=default(Sampling, "min_p"),
        show_default=True,
        help="Drop tokens less likely than this fraction of the most likely one.",
    ),
    "min_tokens_to_keep": click.option(
        "--min-tokens-to-keep",
        type=click.IntRange(min=1),
        default=default(Sampling, "min_tokens_to_keep"),
        show_default=True,
        help="The fewest tokens --min-p may leave to sample from.",
    ),
    "repetition_penalty": click.option(
        "--repetition-penalty",
        type=click.FloatRange(min=0, min_open=True),
        default=default(Sampling, "repetition_penalty"),
        help="Divide the logits of tokens generated in the last 20 by this (>1 repeats less); "
        "the prompt is not penalised.",
    ),
    "presence_penalty": click.option(
        "--presence-penalty",
        type=float,
        default=default(Sampling, "presence_penalty"),
        help="Subtract this from the logits of tokens generated in the last 20 (OpenAI's "
        "presence_penalty); the prompt is not penalised.",
    ),
    "frequency_penalty": click.option(
        "--frequency-penalty",
        type=float,
        default=default(Sampling, "frequency_penalty"),
        help="Subtract this times a token's count among the last 20 generated (OpenAI's "
        "frequency_penalty); the prompt is not penalised.",
    ),
    "stop": click.option(
        "--stop",
        multiple=True,
        default=default(Sampling, "stop"),
        metavar="STRING",
        callback=lambda ctx, param, value: list(value),
        help="End the answer where this text appears (not printed); repeatable.",
    ),
    "seed": click.option(
        "--seed",
        type=int,
        default=default(Sampling, "seed"),
        help="Random seed, shared by every rank (default: a random one): the same seed gives "
        "the same text.",
    ),
}
TEMPLATE = {  # Template
    "system": click.option("--system", default=default(Template, "system"), help="System prompt."),
    "tools": click.option(
        "--tools",
        type=click.Path(exists=True, dir_okay=False),
        default=default(Template, "tools"),
        callback=read_tools,
        help="JSON file with a list of tool schemas (OpenAI style) for the chat template.",
    ),
    "enable_thinking": click.option(
        "--thinking/--no-thinking",
        "enable_thinking",
        default=default(Template, "enable_thinking"),
        help="Pass enable_thinking to the chat template (default: the template's own).",
    ),
    "reasoning_effort": click.option(
        "--reasoning-effort",
        type=click.Choice(["low", "medium", "high"]),
        default=default(Template, "reasoning_effort"),
        help="Pass reasoning_effort to the chat template (gpt-oss and the like).",
    ),
}
SERVE = {  # ServeSettings
    "host": click.option(
        "--host",
        default=default(ServeSettings, "host"),
        show_default=True,
        help="Address the API listens on, on this machine (0.0.0.0 opens it to the network).",
    ),
    "port": click.option(
        "--port",
        type=click.IntRange(0, 65535),
        default=default(ServeSettings, "port"),
        show_default=True,
    ),
    "api_key": click.option(
        "--api-key",
        envvar="MLX_CLUSTER_API_KEY",
        default=default(ServeSettings, "api_key"),
        help="Require 'Authorization: Bearer KEY' (better: set MLX_CLUSTER_API_KEY, which keeps "
        "it out of the process list).",
    ),
    "decode_concurrency": click.option(
        "--decode-concurrency",
        type=click.IntRange(min=1),
        default=default(ServeSettings, "decode_concurrency"),
        show_default=True,
        help="Most requests decoded together in one batch (more wait their turn).",
    ),
    "prompt_concurrency": click.option(
        "--prompt-concurrency",
        type=click.IntRange(min=1),
        default=default(ServeSettings, "prompt_concurrency"),
        show_default=True,
        help="Most prompts prefilled together.",
    ),
    "measure_links": click.option(
        "--measure-links/--no-measure-links",
        default=default(JobSpec, "measure_links"),
        show_default=True,
        help="As the ranks start (and restart), measure each link they use as `doctor --links` "
        "does (round trip, bandwidth of 8 MB, all_sum; before the model loads, a fraction of a "
        "second per link) and show it on the page and in `status`, the slow link named.",
    ),
    "max_stall": click.option(
        "--max-stall",
        type=click.FloatRange(min=0),
        default=default(ServeSettings, "max_stall"),
        show_default=True,
        help="Seconds a prefill step may pause answers already decoding: while any are, a "
        "long prompt's steps shrink to what the ranks prefill in this time (measured as they "
        "go; at least 32 tokens). 0: steps of --prefill-step always.",
    ),
    "prompt_cache_size": click.option(
        "--prompt-cache-size",
        type=click.IntRange(min=0),
        default=default(ServeSettings, "prompt_cache_size"),
        show_default=True,
        help="Finished answers whose KV caches every rank keeps; a request that starts with one "
        "(a chat sent again with a new turn) prefills only the rest. 0: no cache.",
    ),
    "serve_cache_gb": click.option(
        "--prompt-cache-gb",
        "serve_cache_gb",
        type=click.FloatRange(min=0),
        default=default(ServeSettings, "serve_cache_gb"),
        help="Most KV cache of kept answers per rank, in GB; the least-recently used go first, "
        "decided alike on every rank. Default: half the memory left on the rank after the "
        "weights.",
    ),
    "max_tokens_cap": click.option(
        "--max-tokens-cap",
        type=click.IntRange(min=1),
        default=default(ServeSettings, "max_tokens_cap"),
        show_default=True,
        help="The most max_tokens a request may ask (more: 400). Rank 0 also lowers a "
        "request's max_tokens to what the model's context leaves after its prompt.",
    ),
    "max_prompt_tokens": click.option(
        "--max-prompt-tokens",
        type=click.IntRange(min=1),
        default=default(ServeSettings, "max_prompt_tokens"),
        help="The longest prompt in tokens (longer: 400). Default: the model's context "
        "(max_position_embeddings).",
    ),
    "max_body_mb": click.option(
        "--max-body-mb",
        type=click.FloatRange(min=0, min_open=True),
        default=default(ServeSettings, "max_body_mb"),
        show_default=True,
        help="The largest request body in MB (larger: 413); 16 MB holds a 128k-token prompt "
        "several times over.",
    ),
    "max_connections": click.option(
        "--max-connections",
        type=click.IntRange(min=1),
        default=default(ServeSettings, "max_connections"),
        show_default=True,
        help="Open HTTP connections at once; past it a new one gets 503 with Retry-After.",
    ),
    "read_timeout": click.option(
        "--read-timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=default(ServeSettings, "read_timeout"),
        show_default=True,
        help="Seconds a request's line, headers and body may take to arrive (then the "
        "connection is closed): a slow client cannot hold the server.",
    ),
    "allowed_hosts": click.option(
        "--allowed-hosts",
        multiple=True,
        default=(),
        callback=lambda _ctx, _param, v: [x for item in v for x in names_list(item)],
        metavar="NAMES",
        help="Host names the API answers to besides loopback, IP addresses and this machine's "
        "own names (repeat it, or comma-separate; '*' for any): a request whose Host header names "
        "another gets 403, so a web page cannot reach the API through DNS rebinding. Add the "
        "name a reverse proxy or your LAN uses for this machine.",
    ),
    "cors_origins": click.option(
        "--cors-origins",
        multiple=True,
        default=(),
        callback=lambda _ctx, _param, v: [x for item in v for x in names_list(item)],
        metavar="ORIGINS",
        help="Browser origins (e.g. http://localhost:3000; repeat it or comma-separate; '*' "
        "for any) that may call the API from a web page; any other page's request gets 403.",
    ),
    "drain_timeout": click.option(
        "--drain-timeout",
        type=click.FloatRange(min=0),
        default=default(ServeSettings, "drain_timeout"),
        show_default=True,
        help="On Ctrl-C or SIGTERM, the longest wait (s) for answers under way before they are "
        "cut.",
    ),
    "max_restarts": click.option(
        "--max-restarts",
        type=click.IntRange(min=0),
        default=default(ServeSettings, "max_restarts"),
        show_default=True,
        help="Restarts of the ranks allowed within --restart-window; one more failure ends "
        "serve (exit 1). 0: the first failure ends it.",
    ),
    "restart_window_s": click.option(
        "--restart-window",
        "restart_window_s",
        type=click.FloatRange(min=1),
        default=default(ServeSettings, "restart_window_s"),
        show_default=True,
        help="Seconds over which --max-restarts counts failures.",
    ),
    "restart_wait": click.option(
        "--restart-wait",
        type=click.FloatRange(min=0),
        default=default(ServeSettings, "restart_wait"),
        show_default=True,
        help="Longest a request waits (s) for the ranks to start or restart; then 503 with "
        "Retry-After.",
    ),
}
KV = {  # KVQuant: a quantized KV cache
    "kv_bits": click.option(
        "--kv-bits",
        type=click.Choice(["2", "3", "4", "5", "6", "8"]),
        callback=lambda _ctx, _param, v: None if v is None else int(v),
        default=None,
        help="Quantize the KV cache to this many bits (mlx-lm's QuantizedKVCache): 4 bits "
        "holds a context about 3.5x longer than 16-bit. Default: not quantized.",
    ),
    "kv_group_size": click.option(
        "--kv-group-size",
        type=click.Choice(["32", "64", "128"]),
        callback=lambda _ctx, _param, v: int(v),
        default=str(default(KVQuant, "kv_group_size")),
        show_default=True,
        help="Values sharing one scale and bias in the quantized KV cache.",
    ),
    "quantized_kv_start": click.option(
        "--quantized-kv-start",
        type=click.IntRange(min=0),
        default=default(KVQuant, "quantized_kv_start"),
        show_default=True,
        help="Tokens in the cache before it is quantized (mlx-lm's default).",
    ),
}
DRAFT = {  # Draft: speculative decoding
    "draft_model": click.option(
        "--draft-model",
        default=default(Draft, "draft_model"),
        metavar="PATH_OR_REPO",
        help="Speculative decoding: a small model with the same tokenizer proposes tokens, "
        "loaded whole on every rank; the model verifies --num-draft-tokens + 1 in one pass. "
        "The text is the same as without it. 'default': the embedded default model's draft.",
    ),
    "num_draft_tokens": click.option(
        "--num-draft-tokens",
        type=click.IntRange(1, 64),
        default=default(Draft, "num_draft_tokens"),
        show_default=True,
        help="Tokens proposed per verifying pass (with --draft-model or --prompt-lookup).",
    ),
    "draft_on": click.option(
        "--draft-on",
        type=click.Choice(["every", "rank0"]),
        default=default(Draft, "draft_on"),
        show_default=True,
        help="Where --draft-model runs: on every rank (each proposes the same tokens, no "
        "communication; each holds the draft's weights), or on rank 0 only (its logits are "
        "shared with one all_sum per drafted token; the other ranks need no draft).",
    ),
    "prompt_lookup": click.option(
        "--prompt-lookup",
        type=click.IntRange(0, 64),
        default=default(Draft, "prompt_lookup"),
        show_default=True,
        metavar="N",
        help="Speculative decoding without a draft model: propose what followed the last N "
        "tokens (or fewer) where they occurred before in the prompt or answer. 0: off.",
    ),
}
DISK = {  # the prompt cache's disk tier
    "prompt_cache_disk_gb": click.option(
        "--prompt-cache-disk-gb",
        type=click.FloatRange(min=0),
        default=default(JobSpec, "prompt_cache_disk_gb"),
        show_default=True,
        metavar="GB",
        help="Keep prompts' KV caches on each host's disk too, at most this many GB per host: "
        "a prompt that starts like an earlier one (an agent's system prompt and tools, a "
        "conversation sent again) reads that part instead of prefilling it, also after a "
        "restart. Each rank keeps its own layers' or heads' part. 0: off.",
    ),
    "prompt_cache_dir": click.option(
        "--prompt-cache-dir",
        default=None,
        metavar="DIR",
        help="Where each host keeps the disk tier: it makes a folder of its own in DIR, "
        "mlx-cluster-kv (0700), and reads, writes and removes only there (default DIR: "
        "~/.cache/mlx-cluster, or under $XDG_CACHE_HOME). One store holds many models and "
        "plans, and may be shared by several jobs of one user.",
    ),
}


def read_schema(ctx, param, path: str | None) -> str | None:
    """--json-schema FILE: the grammar of the JSON that schema allows (checked here)."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return grammar.json_schema(f.read())
    except OSError as e:
        raise click.BadParameter(f"{path}: {e.strerror or e}") from None
    except grammar.BadGrammar as e:
        raise click.BadParameter(f"{path}: {e}") from None


def read_regex(ctx, param, pattern: str | None) -> str | None:
    if pattern is None:
        return None
    try:
        return grammar.regex(pattern)
    except grammar.BadGrammar as e:
        raise click.BadParameter(str(e)) from None


CONSTRAIN = {  # Request.constraint
    "json_schema": click.option(
        "--json-schema",
        type=click.Path(exists=True, dir_okay=False),
        callback=read_schema,
        help="JSON schema file: every answer is JSON that follows it, decoded under its "
        "grammar on every rank (llguidance). Keys come in the schema's order.",
    ),
    "regex": click.option(
        "--regex",
        callback=read_regex,
        help="Every answer matches this regular expression (decoded under it on every rank).",
    ),
}


OPTIONS = {**HOST, **MODEL, **LAUNCH, **SAMPLING, **TEMPLATE, **SERVE, **DRAFT, **KV, **DISK,
           **CONSTRAIN}  # fmt: skip


def with_options(*names: str):
    """Decorate a command with the named shared options, in this order."""

    def apply(f):
        for name in reversed(names):
            f = OPTIONS[name](f)
        return f

    return apply


def job_options(f):
    """What every command that runs a job takes: hosts, model, how to launch."""
    return with_options(*HOST, *MODEL, *LAUNCH, *DRAFT, *KV, *DISK)(f)


def draft_of(values: dict) -> Draft:
    """--draft-model, --num-draft-tokens, --prompt-lookup (one proposer at most)."""
    draft = pick(Draft, values)
    if draft.draft_model and draft.prompt_lookup:
        raise click.UsageError("--draft-model and --prompt-lookup: choose one proposer")
    if draft.draft_model == "default":
        draft.draft_model = str(default_draft_path())
    return draft


def constraint_of(values: dict) -> Constraint | None:
    """--json-schema or --regex (one of them) as the request's constraint."""
    schema, pattern = values.pop("json_schema", None), values.pop("regex", None)
    if schema is not None and pattern is not None:
        raise click.UsageError("--json-schema and --regex: choose one")
    if schema is None and pattern is None:
        return None
    return Constraint(grammar=schema or pattern, source="--json-schema" if schema else "--regex")


def sampling_options(f):
    return with_options(*SAMPLING, *TEMPLATE, *CONSTRAIN)(f)
