"""The ``mlx-cluster`` command."""

from __future__ import annotations

import io
import json
import sys
import time
from pathlib import Path

import click

from . import __version__
from .hostfile import BACKENDS, HostfileError, load_hostfile, local_hostfile
from .launcher import JobOptions, LaunchError, run_job
from .modelcheck import MODES, ModelError, default_model_path

STARTED = time.perf_counter()


def resolve_hostfile(path: str | None, num_ranks: int | None, backend: str | None):
    """--hostfile, or -n N ranks on this machine (2 by default, as hostfiles/local.yaml)."""
    if path is not None and num_ranks is not None:
        raise click.UsageError("give either --hostfile or -n/--num-ranks, not both")
    hostfile = load_hostfile(path) if path else local_hostfile(num_ranks or 2)
    if backend:
        hostfile.backend = backend
    return hostfile


def job_options(hostfile, num_ranks, backend, model, **fields) -> tuple:
    """The hostfile and JobOptions of a command that runs a job (launch, chat)."""
    try:
        hf = resolve_hostfile(hostfile, num_ranks, backend)
    except HostfileError as e:
        raise click.UsageError(str(e)) from None
    return hf, JobOptions(model=model or str(default_model_path()), **fields)


def run_or_exit(hf, options, stdout=None):
    """Run the job; on failure print its report and exit with its code."""
    try:
        return run_job(hf, options, stdout=stdout, started=STARTED)
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


MAX_IMAGE_BYTES = 64 * 1024 * 1024


def read_tools(path: str | None) -> list | None:
    if path is None:
        return None
    try:
        tools = json.loads(open(path).read())
    except (OSError, json.JSONDecodeError) as e:
        raise click.BadParameter(f"{path}: {e}", param_hint="--tools") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise click.BadParameter(
            f"{path}: want a JSON list of tool objects, like OpenAI's `tools`",
            param_hint="--tools",
        )
    return tools


def read_image(path: str) -> bytes:
    data = open(path, "rb").read()
    if not data:
        raise click.BadParameter(f"{path} is empty", param_hint="--image")
    if len(data) > MAX_IMAGE_BYTES:
        raise click.BadParameter(
            f"{path} is {len(data) / 2**20:.0f} MiB; images up to "
            f"{MAX_IMAGE_BYTES // 2**20} MiB are shared with the ranks (scale it down)",
            param_hint="--image",
        )
    try:  # fail before any rank starts (PIL comes with mlx-vlm)
        from PIL import Image

        Image.open(io.BytesIO(data)).verify()
    except ImportError:
        pass
    except Exception as e:
        raise click.BadParameter(
            f"{path} is not an image file PIL can read ({type(e).__name__}); "
            "give a PNG, JPEG or another common format",
            param_hint="--image",
        ) from None
    return data


OPTIONS = {
    "split": click.option(
        "--split",
        callback=parse_split,
        metavar="N,N,...",
        help="Pipeline layers per rank, rank 0 first (rank 0 holds the last layers). Default: "
        "in proportion to the hosts' memory_gb when every host gives it, else even.",
    ),
    "hostfile": click.option(
        "--hostfile",
        type=click.Path(dir_okay=False),
        help="YAML (or mlx.launch JSON) hostfile; default: 2 ranks on this machine.",
    ),
    "num_ranks": click.option(
        "-n",
        "--num-ranks",
        type=click.IntRange(min=1),
        help="Run N ranks on this machine (no hostfile). Default 2.",
    ),
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
        default="pipeline",
        show_default=True,
        help="pipeline: each rank holds a range of layers; tensor: each rank holds "
        "a slice of every layer.",
    ),
    "backend": click.option(
        "--backend",
        type=click.Choice(BACKENDS),
        default=None,
        help="Collective backend; default: the hostfile's, else ring.",
    ),
    "starting_port": click.option(
        "--starting-port",
        type=click.IntRange(1, 65535),
        default=None,
        help="First ring port (counts up per rank); default: free ports on this "
        "machine, 32323 on remote hosts.",
    ),
    "connections_per_ip": click.option(
        "--connections-per-ip",
        type=click.IntRange(min=1),
        default=1,
        show_default=True,
        help="Ring sockets per address.",
    ),
    "heartbeat_timeout": click.option(
        "--heartbeat-timeout",
        type=click.FloatRange(min=1),
        default=30.0,
        show_default=True,
        help="Give up on a rank that sends nothing (not even its once-a-second heartbeat) "
        "for this many seconds: stopped, hung, or its host unreachable.",
    ),
    "start_timeout": click.option(
        "--start-timeout",
        type=click.FloatRange(min=1),
        default=1800.0,
        show_default=True,
        help="Give up if the ranks have not all loaded the model after this many seconds.",
    ),
    "accept_new_host_keys": click.option(
        "--accept-new-host-keys",
        is_flag=True,
        help="Trust and record the SSH host key of a host not yet in known_hosts (like "
        "OpenSSH's accept-new); a changed key is always refused.",
    ),
    "verbose": click.option(
        "-v",
        "--verbose",
        is_flag=True,
        help="Show every rank's log lines on stderr, prefixed [rank k host].",
    ),
}
SAMPLING = {
    "max_tokens": click.option(
        "--max-tokens",
        type=click.IntRange(min=1),
        default=256,
        show_default=True,
        help="Most tokens to generate.",
    ),
    "temp": click.option(
        "--temp",
        type=click.FloatRange(min=0),
        default=0.0,
        show_default=True,
        help="Sampling temperature; 0 is greedy.",
    ),
    "top_p": click.option(
        "--top-p",
        type=click.FloatRange(0, 1, min_open=True),
        default=1.0,
        show_default=True,
        help="Nucleus sampling: keep the most likely tokens up to this probability mass.",
    ),
    "top_k": click.option(
        "--top-k",
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Keep only the K most likely tokens (0: all).",
    ),
    "min_p": click.option(
        "--min-p",
        type=click.FloatRange(0, 1),
        default=0.0,
        show_default=True,
        help="Drop tokens less likely than this fraction of the most likely one.",
    ),
    "repetition_penalty": click.option(
        "--repetition-penalty",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        help="Divide the logits of tokens generated in the last 20 by this (>1 repeats less); "
        "the prompt is not penalised.",
    ),
    "presence_penalty": click.option(
        "--presence-penalty",
        type=float,
        default=None,
        help="Subtract this from the logits of tokens generated in the last 20 (OpenAI's "
        "presence_penalty); the prompt is not penalised.",
    ),
    "stop": click.option(
        "--stop",
        multiple=True,
        metavar="STRING",
        help="End the answer where this text appears (not printed); repeatable.",
    ),
    "seed": click.option(
        "--seed",
        type=int,
        default=None,
        help="Random seed, shared by every rank (default: a random one): the same seed gives "
        "the same text.",
    ),
}
TEMPLATE = {
    "system": click.option("--system", default=None, help="System prompt."),
    "tools": click.option(
        "--tools",
        "tools",
        type=click.Path(exists=True, dir_okay=False),
        callback=lambda ctx, param, value: read_tools(value),
        help="JSON file with a list of tool schemas (OpenAI style) for the chat template.",
    ),
    "enable_thinking": click.option(
        "--thinking/--no-thinking",
        "enable_thinking",
        default=None,
        help="Pass enable_thinking to the chat template (default: the template's own).",
    ),
    "reasoning_effort": click.option(
        "--reasoning-effort",
        type=click.Choice(["low", "medium", "high"]),
        default=None,
        help="Pass reasoning_effort to the chat template (gpt-oss and the like).",
    ),
}
OPTIONS.update(SAMPLING)
OPTIONS.update(TEMPLATE)
HOST_OPTIONS = (
    "hostfile",
    "num_ranks",
    "backend",
    "starting_port",
    "connections_per_ip",
    "accept_new_host_keys",
)


def with_options(*names: str):
    """Decorate a command with the named shared options, in this order."""

    def apply(f):
        for name in reversed(names):
            f = OPTIONS[name](f)
        return f

    return apply


sampling_options = with_options(*SAMPLING, *TEMPLATE)
launch_options = with_options(
    *HOST_OPTIONS, "model", "mode", "split", "heartbeat_timeout", "start_timeout", "verbose"
)


@click.group()
@click.version_option(__version__, prog_name="mlx-cluster")
def cli():
    """Run one language model across several Apple Silicon Macs (or ranks of this machine)."""


@cli.command()
@click.argument("prompt", required=False)
@launch_options
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
    default=None,
    help="Image file for a vision-language model (mlx-vlm); its bytes reach every rank.",
)
@click.option(
    "--logits",
    is_flag=True,
    help="Instead of generating, print the next-token logits after the prompt as one JSON "
    "line (text models): to compare a sharded run with a single-process one.",
)
def launch(prompt, hostfile, num_ranks, backend, model, image, logits, as_json, stop, **job):
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
    if prompt is None or prompt == "-":
        if sys.stdin.isatty():
            click.echo("mlx-cluster: reading the prompt from stdin (end with Ctrl-D)", err=True)
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise click.UsageError("the prompt is empty")
    hf, options = job_options(
        hostfile,
        num_ranks,
        backend,
        model,
        prompt=prompt,
        image=read_image(image) if image else None,
        command="logits" if logits else "generate",
        stop=list(stop),
        **job,
    )
    if as_json and logits:
        raise click.UsageError("--logits already prints JSON; drop --json")
    text = io.BytesIO() if as_json else None
    result = run_or_exit(hf, options, stdout=text)
    if as_json:
        click.echo(json.dumps(answer_json(text.getvalue().decode("utf-8", "replace"), result)))


def answer_json(text: str, result) -> dict:
    """--json: the answer and its stats (llama-server's usage and timings fields)."""
    stats = result.stats or {}
    return {
        "text": text,
        "finish_reason": stats.get("finish_reason"),
        "usage": stats.get("usage"),
        "timings": stats.get("timings"),
        "time_to_first_token_s": result.first_token_s,
        "peak_memory_gb": result.peak_memory_gb,
    }


@cli.command()
@launch_options
@sampling_options
@click.option(
    "--prompt-cache-gb",
    type=click.FloatRange(min=0),
    default=4.0,
    show_default=True,
    help="Most KV cache each rank keeps between turns (over it, the next turn starts afresh).",
)
def chat(hostfile, num_ranks, backend, model, stop, **job):
    """Talk to the model turn by turn: a line on stdin is a turn, rank 0's answer goes to stdout.

    Every rank keeps the KV cache of its layers between turns, so a turn prefills only its own
    new tokens (the stats line on stderr says how many were reused). /reset forgets the
    conversation; /exit or Ctrl-D ends the session; Ctrl-C ends the current answer and keeps
    the session (twice within 2 s quits). Works with piped stdin too.

    \b
    Examples:
      mlx-cluster chat --model ./my-model
      printf 'Hi\nTell me more\n' | mlx-cluster chat --hostfile hostfiles/thunderbolt-ring.yaml
    """
    hf, options = job_options(
        hostfile,
        num_ranks,
        backend,
        model,
        prompt="",
        command="chat",
        forward_stdin=True,
        stop=list(stop),
        **job,
    )
    if sys.stdin.isatty():
        click.echo(
            "mlx-cluster: chat; /reset forgets, /exit or Ctrl-D ends, Ctrl-C stops an answer",
            err=True,
        )
    run_or_exit(hf, options)


@cli.command()
@launch_options
@click.option(
    "--host",
    "serve_host",
    default="127.0.0.1",
    show_default=True,
    help="Address rank 0 listens on (0.0.0.0 opens it to the network).",
)
@click.option(
    "--port", "serve_port", type=click.IntRange(0, 65535), default=8080, show_default=True
)
@click.option(
    "--api-key",
    envvar="MLX_CLUSTER_API_KEY",
    default=None,
    help="Require 'Authorization: Bearer KEY' (better: set MLX_CLUSTER_API_KEY, which keeps "
    "it out of the process list).",
)
@click.option(
    "--decode-concurrency",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Most requests decoded together in one batch (more wait their turn).",
)
@click.option(
    "--prompt-concurrency",
    type=click.IntRange(min=1),
    default=8,
    show_default=True,
    help="Most prompts prefilled together.",
)
@click.option(
    "--prompt-cache-size",
    type=click.IntRange(min=0),
    default=10,
    show_default=True,
    help="Finished answers whose KV caches every rank keeps; a request that starts with one "
    "(a chat sent again with a new turn) prefills only the rest. 0: no cache.",
)
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On Ctrl-C or SIGTERM, the longest wait (s) for answers under way before they are cut.",
)
def serve(hostfile, num_ranks, backend, model, **job):
    """Serve the model with an OpenAI-compatible API on rank 0 until Ctrl-C.

    Endpoints: GET /v1/models, GET /health, POST /v1/chat/completions and /v1/completions
    (streaming with SSE, or not). Concurrent requests are decoded together as one batch, in
    lockstep on every rank (continuous batching: a request joins or leaves between steps); a
    request with a seed, or a model whose caches cannot be batched, is decoded alone. A client
    that disconnects mid-stream cancels its answer on every rank.

    Ctrl-C or SIGTERM drains: new requests get 503, answers under way finish (cut after
    --drain-timeout), then every rank exits (exit 0). A second Ctrl-C stops at once (exit 130).

    \b
    Examples:
      mlx-cluster serve --model ./my-model --port 8080
      OPENAI_BASE_URL=http://127.0.0.1:8080/v1 OPENAI_API_KEY=none python my_client.py
    """
    hf, options = job_options(
        hostfile, num_ranks, backend, model, prompt="", command="serve", **job
    )
    run_or_exit(hf, options)


def comma_choices(value: str, allowed, example: str, none_ok: bool = False) -> list[str]:
    """A comma-separated list of ``allowed`` names, each once, in the order given."""
    names = list(dict.fromkeys(x.strip() for x in value.split(",") if x.strip()))
    if none_ok and names == ["none"]:
        return []
    if not names or any(x not in allowed for x in names):
        also = ", or none" if none_ok else ""
        raise click.BadParameter(
            f"{value!r}: give a comma-separated list of {', '.join(allowed)}{also} (e.g. {example})"
        )
    return names


def parse_modes(ctx, param, value: str) -> list[str]:
    return comma_choices(value, MODES, "pipeline,tensor")


def parse_baselines(ctx, param, value: str) -> tuple[str, ...]:
    from .bench import BASELINES

    return tuple(comma_choices(value, BASELINES, "single,mlx-lm", none_ok=True))


def parse_ranks(ctx, param, value: str) -> list[int]:
    try:
        ranks = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or any(n < 1 for n in ranks):
        raise click.BadParameter(
            f"{value!r}: give a comma-separated list of rank counts, each 1 or more (e.g. 1,2,3)"
        )
    return sorted(set(ranks))


@cli.command()
@with_options(
    "hostfile",
    "backend",
    "starting_port",
    "connections_per_ip",
    "accept_new_host_keys",
    "model",
    "heartbeat_timeout",
    "start_timeout",
    "verbose",
)
@click.option(
    "--modes",
    default="pipeline,tensor",
    show_default=True,
    callback=parse_modes,
    help="Sharding modes to measure, comma-separated.",
)
@click.option(
    "--ranks",
    default="1,2",
    show_default=True,
    callback=parse_ranks,
    help="Rank counts to measure, comma-separated: ranks of this machine, or the first N of "
    "the hostfile's.",
)
@click.option(
    "--prompt-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Length of the synthetic prompt, exactly.",
)
@click.option(
    "--gen-tokens",
    type=click.IntRange(min=2),
    default=128,
    show_default=True,
    help="Tokens generated per run, exactly (EOS does not end a run).",
)
@click.option(
    "--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="Timed runs."
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Untimed runs before them, in the same job.",
)
@click.option(
    "--baselines",
    default="single,mlx-lm",
    show_default=True,
    callback=parse_baselines,
    help="single: 1 rank through the same code (run also without 1 in --ranks); mlx-lm: "
    "mlx_lm.benchmark's ranks, same model, mode and ranks, with the environment mlx.launch "
    "gives them; mlx.launch: the same started by mlx.launch itself; none.",
)
@click.option(
    "--baseline-timeout",
    type=click.FloatRange(min=1),
    default=1800.0,
    show_default=True,
    help="Give up on one mlx-lm baseline run after this many seconds.",
)
@click.option(
    "--json",
    "json_file",
    type=click.Path(dir_okay=False, writable=True),
    help="Write every figure as JSON to FILE ('-': stdout, the table then goes to stderr).",
)
@click.option(
    "--csv",
    "csv_file",
    type=click.Path(dir_okay=False, writable=True),
    help="Write one CSV line per configuration to FILE.",
)
@click.option(
    "--plot",
    "plot_file",
    type=click.Path(dir_okay=False, writable=True),
    help="Write a PNG of generation tokens/s against ranks per mode (needs matplotlib: "
    "pip install 'mlx-cluster[plot]').",
)
def bench(hostfile, backend, model, modes, ranks, json_file, csv_file, plot_file, **options):
    """Measure the model across modes and rank counts, with baselines from the same run.

    Each configuration is one job: --warmup untimed runs, then --repeat timed runs of a
    synthetic prompt of exactly --prompt-tokens tokens, generating exactly --gen-tokens. Per
    configuration: time to first token, prefill and generation tokens/s (median [min-max]),
    load time, time from the job's start to its first token, peak memory per rank, the
    collectives each token needs and the all_sum latency at the activation size, and ratios
    against 1 rank and against mlx-lm's own sharded run. The table goes to stdout, progress
    to stderr. Exits 1 if one of mlx-cluster's configurations failed (a baseline that fails is
    reported in its row). Method: docs/benchmarks.md.

    \b
    Examples:
      mlx-cluster bench --ranks 1,2,3
      mlx-cluster bench --model ./my-model --modes tensor --json out.json --plot out.png
      mlx-cluster bench --hostfile hostfiles/thunderbolt-ring.yaml --model ./m --ranks 1,2,4
    """
    from .bench import (
        BenchPlan,
        SweepStopped,
        check_plot,
        csv_text,
        first_ranks,
        plot,
        run_sweep,
        table,
    )

    plan = BenchPlan(
        model=model or str(default_model_path()),
        modes=modes,
        ranks=ranks,
        prompt_tokens=options.pop("prompt_tokens"),
        gen_tokens=options.pop("gen_tokens"),
        repeat=options.pop("repeat"),
        warmup=options.pop("warmup"),
        baselines=options.pop("baselines"),
        baseline_timeout=options.pop("baseline_timeout"),
    )
    try:
        hf = resolve_hostfile(hostfile, max(ranks) if hostfile is None else None, backend)
        for n in ranks:
            first_ranks(hf, n)
    except HostfileError as e:
        raise click.UsageError(str(e)) from None
    try:
        if plot_file:
            check_plot()
        check_bench_model(plan, hf)
    except (ValueError, ModelError) as e:
        raise click.UsageError(str(e)) from None
    code = 0
    try:
        rows = run_sweep(plan, hf, options, sys.stderr)
    except SweepStopped as e:
        rows, code = e.rows, e.exit_code
        click.echo(f"mlx-cluster: bench stopped; {len(rows)} configuration(s) measured", err=True)
    if code == 0 and any(r["status"] == "failed" and r["impl"] == "mlx-cluster" for r in rows):
        code = 1
    report = {"settings": bench_settings(plan, hf), "results": rows}
    if json_file:
        text = json.dumps(report, indent=2)
        if json_file == "-":
            click.echo(text)
        else:
            Path(json_file).write_text(text + "\n")
    if csv_file:
        Path(csv_file).write_text(csv_text(rows))
    if plot_file and rows:
        plot(
            rows,
            plot_file,
            f"{Path(plan.model).name}: {plan.prompt_tokens} prompt, "
            f"{plan.gen_tokens} generated tokens",
        )
    click.echo(table(rows), nl=False, err=json_file == "-")
    sys.exit(code)


def check_bench_model(plan, hostfile) -> None:
    """Every configuration of the sweep passes the launcher's preflight (the model's config,
    when it is here, against the mode and rank count), before any rank starts."""
    from .bench import first_ranks
    from .launcher import preflight

    for mode in plan.modes:
        for n in plan.ranks:
            options = JobOptions(model=plan.model, prompt="", mode=mode, command="bench")
            try:
                preflight(first_ranks(hostfile, n), options)
            except ModelError as e:
                raise ModelError(f"--modes {mode} --ranks {n}: {e}") from None


def bench_settings(plan, hostfile) -> dict:
    """What the sweep ran, and where: part of the JSON report."""
    import platform

    return {
        "model": plan.model,
        "modes": plan.modes,
        "ranks": plan.ranks,
        "prompt_tokens": plan.prompt_tokens,
        "gen_tokens": plan.gen_tokens,
        "repeat": plan.repeat,
        "warmup": plan.warmup,
        "baselines": list(plan.baselines),
        "backend": hostfile.backend,
        "hosts": [h.target for h in hostfile.hosts],
        "launcher": {"platform": platform.platform(), "python": platform.python_version()},
        "version": __version__,
    }


@cli.command()
@with_options(*HOST_OPTIONS, "model", "mode")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor(
    hostfile,
    num_ranks,
    backend,
    starting_port,
    connections_per_ip,
    accept_new_host_keys,
    model,
    mode,
    as_json,
):
    """Check that every host is ready: SSH, python, versions, ports, RDMA, memory.

    One row per host on stdout; every problem named on a line below the table. Exits 1 when
    any host has a problem (versions that differ across hosts count), 0 when all are ready.
    With --model, also checks that each host's share of the model fits in its memory
    (memory_gb from the hostfile, else the host's physical memory).
    """
    import json

    from .doctor import diagnose, render
    from .modelcheck import ModelError

    try:
        hf = resolve_hostfile(hostfile, num_ranks, backend)
    except HostfileError as e:
        raise click.UsageError(str(e)) from None
    try:
        reports = diagnose(hf, model, mode, starting_port, accept_new_host_keys)
    except (ModelError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        ok = all(r.ok for r in reports)
        click.echo(json.dumps({"ok": ok, "hosts": [r.to_json() for r in reports]}, indent=2))
    else:
        click.echo(render(reports), nl=False)
    sys.exit(0 if all(r.ok for r in reports) else 1)


from . import cli_rig  # noqa: E402, F401 - registers sync, install and hostfile


def main():
    cli()


if __name__ == "__main__":
    main()
