"""``launch``, ``chat`` and ``serve``: one job on the ranks, rank 0's text or API to the user."""

from __future__ import annotations

import io
import json
import sys

import click

from cluster.commands.options import (
    STARTED,
    constraint_of,
    draft_of,
    job_options,
    model_or_default,
    read_image,
    resolve_hostfile,
    run_or_exit,
    sampling_options,
    with_options,
)
from cluster.core.spec import (
    JobRequest,
    JobSpec,
    KVQuant,
    LaunchSettings,
    Sampling,
    ServeSettings,
    Template,
    normalized,
    pick,
)
from cluster.core.text import valid_text
from cluster.job.state import JobResult


def job_spec(command: str, values: dict, **fields) -> JobSpec:
    """The JobSpec of a command, from its keyword arguments (each dataclass takes the ones
    named like its fields)."""
    request = JobRequest(
        prompt=valid_text(values.pop("prompt", "")),
        sampling=normalized(pick(Sampling, values)),
        template=pick(Template, values),
        image=values.pop("image", None),
        constraint=constraint_of(values),
    )
    # argv and stdin may hold bytes that are not UTF-8: Python keeps them as lone surrogates,
    # which no encoder on the way to the ranks takes
    request.sampling.stop = [valid_text(s) for s in request.sampling.stop]
    if request.template.system is not None:
        request.template.system = valid_text(request.template.system)
    spec = JobSpec(
        model=model_or_default(values.pop("model")),
        command=command,
        request=request,
        serve=pick(ServeSettings, values),
        draft=draft_of(values),
        kv_quant=pick(KVQuant, values),
        mode=values.pop("mode"),
        split=values.pop("split"),
        prefill_step=values.pop("prefill_step"),
        prompt_cache_disk_gb=values.pop("prompt_cache_disk_gb"),
        prompt_cache_dir=values.pop("prompt_cache_dir"),
        blas=values.pop("blas"),
        **{
            name: values.pop(name)
            for name in ("prompt_cache_gb", "measure_links", "micro_batches")
            if name in values
        },
        **fields,
    )
    if values:  # an option that no dataclass field takes: a bug, not the user's error
        raise TypeError(f"options without a JobSpec field: {', '.join(values)}")
    return spec


def hosts_and_launch(values: dict):
    """The hostfile and LaunchSettings from a command's keyword arguments."""
    hf = resolve_hostfile(values.pop("hostfile"), values.pop("num_ranks"), values.pop("backend"))
    return hf, pick(LaunchSettings, values)


@click.command()
@click.argument("prompt", required=False)
@job_options
@sampling_options
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object at the end instead of streaming: text, finish_reason, usage, "
    "timings (llama-server's fields) and each rank's peak memory.",
)
@click.option(
    "--image",
    type=click.Path(exists=True, dir_okay=False, readable=True),
    callback=read_image,
    help="Image file for a vision-language model (mlx-vlm); its bytes reach every rank.",
)
@click.option(
    "--logits",
    is_flag=True,
    help="Print one JSON line instead of the text: the next-token logits after the prompt and "
    "the text generated (text models), to compare a sharded run with a single-process one.",
)
def launch(prompt, logits, as_json, **values):
    """Generate a reply to PROMPT on every rank in lockstep; rank 0's text goes to stdout.

    PROMPT '-' or absent reads the prompt from stdin. The prompt goes through the model's chat
    template when it has one (as mlx_lm.generate does). stdout carries exactly the generated
    text; progress and stats go to stderr.

    \b
    Examples:
      mlx-cluster launch "Tell me about lists"
      mlx-cluster launch -n 3 --mode tensor --model ./my-model "Hi"
      mlx-cluster launch --model ./my-vlm --image cat.png "What is in the picture?"
      mlx-cluster launch --hostfile hostfiles/thunderbolt-ring.yaml --model mlx-community/... -
    """
    if as_json and logits:
        raise click.UsageError("--logits already prints JSON; drop --json")
    hf, settings = hosts_and_launch(values)
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            click.echo("mlx-cluster: reading the prompt from stdin (end with Ctrl-D)", err=True)
        prompt = sys.stdin.buffer.read().decode("utf-8", "replace")
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    spec = job_spec("logits" if logits else "generate", {**values, "prompt": prompt})
    text = io.BytesIO() if as_json else None
    result = run_or_exit(hf, spec, settings, stdout=text)
    if as_json:
        click.echo(json.dumps(answer_json(text.getvalue().decode("utf-8", "replace"), result)))


def answer_json(text: str, result: JobResult) -> dict:
    """--json: the answer and its stats (llama-server's usage and timings fields)."""
    stats = result.stats
    return {
        "text": text,
        "finish_reason": stats and stats.finish_reason,
        "usage": stats and stats.usage,
        "timings": stats and stats.timings,
        "time_to_first_token_s": result.first_token_s,
        "peak_memory_gb": result.peak_memory_gb,
    }


@click.command()
@job_options
@sampling_options
@with_options("prompt_cache_gb")
def chat(**values):
    """Talk to the model turn by turn: a line on stdin is a turn, rank 0's answer goes to stdout.

    Every rank keeps the KV cache of its layers between turns, so a turn prefills only its own
    new tokens (the stats line on stderr says how many were reused). /reset forgets the
    conversation; /exit or Ctrl-D ends the session; Ctrl-C ends the current answer and keeps
    the session (twice within 2 s quits). Works with piped stdin too.

    \b
    Examples:
      mlx-cluster chat --model ./my-model
      printf 'Hi\\nTell me more\\n' | mlx-cluster chat --hostfile hostfiles/thunderbolt-ring.yaml
    """
    hf, settings = hosts_and_launch(values)
    spec = job_spec("chat", values)
    if sys.stdin.isatty():
        click.echo(
            "mlx-cluster: chat; /reset forgets, /exit or Ctrl-D ends, Ctrl-C stops an answer",
            err=True,
        )
    run_or_exit(hf, spec, settings)


@click.command()
@job_options
@with_options(
    "host",
    "port",
    "api_key",
    "decode_concurrency",
    "prompt_concurrency",
    "max_stall",
    "micro_batches",
    "measure_links",
    "prompt_cache_size",
    "prompt_cache_gb",
    "max_tokens_cap",
    "default_max_tokens",
    "max_prompt_tokens",
    "max_body_mb",
    "max_connections",
    "read_timeout",
    "allowed_hosts",
    "cors_origins",
    "served_model_name",
    "replicas",
    "routing",
    "prefill_groups",
    "disaggregate_min_tokens",
    "drain_timeout",
    "max_restarts",
    "restart_window_s",
    "restart_wait",
    "request_timeout",
    "responses_store_mb",
    "responses_store_hours",
)
def serve(**values):
    """Serve the model with OpenAI's, Anthropic's and Ollama's APIs until Ctrl-C; the API
    outlives the ranks.

    Endpoints: POST /v1/chat/completions, /v1/completions, /v1/responses (OpenAI; responses
    are kept for previous_response_id and GET/DELETE /v1/responses/ID), POST /v1/messages and
    /v1/messages/count_tokens (Anthropic), streaming with SSE or not; POST /api/chat,
    /api/generate, /api/show and GET /api/tags, /api/ps, /api/version (Ollama, streaming a
    JSON object per line); GET /v1/models, /health, /metrics (Prometheus). Tool calls come
    back parsed (mlx-lm's parser
    of the model's family), reasoning apart from the answer, logprobs when asked; the key
    (--api-key) is accepted as a bearer token or x-api-key. The API runs in this process, on
    this machine; rank 0 gets each request over the job's own channel. Concurrent requests are
    decoded together as one batch, in lockstep on every rank (continuous batching); a request
    with a seed, or a model whose caches cannot be batched, is decoded alone. A client that
    disconnects cancels its answer on every rank.

    When a rank fails (it exits, its host is lost, it stops beating, a collective stalls),
    every rank is stopped and the job starts again, without a lost host when the model fits in
    the memory_gb of the others (/health: degraded). Requests wait for the ranks (at most
    --restart-wait, then 503 with Retry-After) and the ones rank 0 was answering are decoded
    again, except a stream that already sent text: it ends with an error event and [DONE].
    More than --max-restarts failures within --restart-window: exit 1, each failure named.
    A request under way at two failures is answered with an error, never replayed again.

    Every field of a request is checked at the door (ranges, sizes, counts; docs/serve.md,
    "Limits and refusals"): a bad one gets a 400 naming the field and what it allows, and
    never reaches a rank. A request that fails on the ranks alike (its settings, its
    template) fails alone, with no restart.

    Ctrl-C or SIGTERM drains: new requests get 503, answers under way finish (cut after
    --drain-timeout), then every rank exits (exit 0). A second Ctrl-C stops at once (exit 130).

    \b
    Examples:
      mlx-cluster serve --model ./my-model --port 8080
      OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY=none python my_client.py
      ANTHROPIC_BASE_URL=http://127.0.0.1:8080 ANTHROPIC_API_KEY=none python my_agent.py
      curl -s 127.0.0.1:8080/health; curl -s 127.0.0.1:8080/metrics
    """
    from cluster.serve.supervisor import serve_until_done

    hf, settings = hosts_and_launch(values)
    spec = job_spec("serve", values)
    if spec.kv_quant.kv_bits is not None:
        raise click.UsageError(
            "--kv-bits: serve decodes its requests as one batch (mlx-lm's BatchGenerator), "
            "which batches only full-precision caches; launch, chat and bench take it"
        )
    sys.exit(serve_until_done(hf, spec, settings, started=STARTED))
