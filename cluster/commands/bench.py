"""``bench``: a sweep over modes and rank counts, with its baselines in the same run."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path

import click

from cluster import __version__
from cluster.commands.options import (
    DRAFT,
    KV,
    LAUNCH,
    draft_of,
    model_or_default,
    resolve_hostfile,
    with_options,
)
from cluster.core.hostfile import HostfileError
from cluster.core.modelcheck import MODES, ModelError
from cluster.core.spec import BenchSettings, JobSpec, KVQuant, LaunchSettings, default, pick
from cluster.job.launcher import preflight
from cluster.rig.bench import (
    BASELINES,
    BenchPlan,
    SweepStopped,
    check_plot,
    csv_text,
    first_ranks,
    plot,
    run_sweep,
    table,
)


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
    return tuple(comma_choices(value, BASELINES, "single,mlx-lm", none_ok=True))


def parse_counts(value: str, what: str, example: str) -> list[int]:
    try:
        counts = [int(x) for x in value.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise click.BadParameter(
            f"{value!r}: give a comma-separated list of {what}, each 1 or more (e.g. {example})"
        )
    return sorted(set(counts))


def parse_ranks(ctx, param, value: str) -> list[int]:
    return parse_counts(value, "rank counts", "1,2,3")


@click.command()
@with_options(
    "hostfile",
    "backend",
    "accept_new_host_keys",
    "model",
    "blas",
    "prefill_step",
    "micro_batches",
    *LAUNCH,
    *DRAFT,
    *KV,
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
    "prompt_lengths",
    default=str(default(BenchSettings, "prompt_tokens")),
    show_default=True,
    callback=lambda ctx, param, value: parse_counts(value, "prompt lengths", "1024,8192,32768"),
    help="Length of the synthetic prompt, exactly; a comma-separated list runs the sweep for "
    "each (the table and plot then show first-token time and prefill tok/s against it).",
)
@click.option(
    "--concurrency",
    default="1",
    show_default=True,
    callback=lambda ctx, param, value: parse_counts(value, "stream counts", "1,8,32"),
    help="Answers decoded together, comma-separated (e.g. 1,8,32): each its own synthetic "
    "prompt, greedy, in one batch as serve decodes concurrent requests; the figures are "
    "aggregate (prefill of every prompt, decode tokens/s of all streams). mlx-lm's baseline "
    "runs mlx_lm.benchmark --batch-size N beside it. Speculative decoding runs at 1 only.",
)
@click.option(
    "--gen-tokens",
    type=click.IntRange(min=2),
    default=default(BenchSettings, "gen_tokens"),
    show_default=True,
    help="Tokens generated per run, exactly (EOS does not end a run).",
)
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=default(BenchSettings, "repeat"),
    show_default=True,
    help="Timed runs.",
)
@click.option(
    "--warmup",
    type=click.IntRange(min=0),
    default=default(BenchSettings, "warmup"),
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
    default=default(BenchPlan, "baseline_timeout"),
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
def bench(hostfile, backend, json_file, csv_file, plot_file, **values):
    """Measure the model across modes and rank counts, with baselines from the same run.

    Each configuration is one job: --warmup untimed runs, then --repeat timed runs of a
    synthetic prompt of exactly --prompt-tokens tokens (--concurrency: that many prompts
    decoded together), generating exactly --gen-tokens. Per
    configuration: time to first token, prefill and generation tokens/s (median [min-max]),
    load time, time from the job's start to its first token, peak memory per rank, the
    collectives each token needs and the all_sum latency at the activation size, the decode
    rate those predict (with the 1-rank row), and ratios against 1 rank and against mlx-lm's
    own sharded run. With --draft-model or --prompt-lookup, each of mlx-cluster's
    configurations runs again with speculative decoding: its row follows, with the generation
    ratio against the row without and the share of drafted tokens accepted. The table goes to
    stdout, progress to stderr. Exits 1 if one of mlx-cluster's configurations failed (a
    baseline that fails is reported in its row).
    Method: docs/benchmarks.md.

    \b
    Examples:
      mlx-cluster bench --ranks 1,2,3
      mlx-cluster bench --model ./big --draft-model ./small --ranks 2 --baselines none
      mlx-cluster bench --model ./my-model --modes tensor --json out.json --plot out.png
      mlx-cluster bench --ranks 1,2 --concurrency 1,8,32 --gen-tokens 64
      mlx-cluster bench --hostfile hostfiles/thunderbolt-ring.yaml --model ./m --ranks 1,2,4
    """
    values["model"] = model_or_default(values["model"])
    draft = draft_of(values)
    kv_quant = pick(KVQuant, values)
    plan = pick(BenchPlan, values)
    plan.kv_quant = kv_quant
    plan.prompt_tokens = plan.prompt_lengths[0]
    plan.draft = draft
    launch = pick(LaunchSettings, values)
    hf = resolve_hostfile(hostfile, max(plan.ranks) if hostfile is None else None, backend)
    try:
        for n in plan.ranks:
            first_ranks(hf, n)
        if plot_file:
            check_plot()
        check_bench_model(plan, hf)
    except (HostfileError, ValueError, ModelError) as e:
        raise click.UsageError(str(e)) from None
    code = 0
    try:
        rows = run_sweep(plan, hf, launch, sys.stderr)
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
            f"{Path(plan.model).name}: {','.join(map(str, plan.lengths))} prompt, "
            f"{plan.gen_tokens} generated tokens",
        )
    click.echo(table(rows), nl=False, err=json_file == "-")
    sys.exit(code)


def check_bench_model(plan, hostfile) -> None:
    """Every configuration of the sweep passes the launcher's preflight (the model's config,
    when it is here, against the mode and rank count), before any rank starts."""
    for mode in plan.modes:
        for n in plan.ranks:
            spec = JobSpec(model=plan.model, mode=mode, command="bench", kv_quant=plan.kv_quant)
            try:
                preflight(first_ranks(hostfile, n), spec)
            except ModelError as e:
                raise ModelError(f"--modes {mode} --ranks {n}: {e}") from None


def bench_settings(plan, hostfile) -> dict:
    """What the sweep ran, and where: part of the JSON report."""
    return {
        "model": plan.model,
        "modes": plan.modes,
        "ranks": plan.ranks,
        "prompt_tokens": plan.prompt_tokens,
        "prompt_lengths": plan.lengths,
        "gen_tokens": plan.gen_tokens,
        "repeat": plan.repeat,
        "warmup": plan.warmup,
        "baselines": list(plan.baselines),
        "prefill_step": plan.prefill_step,
        "micro_batches": plan.micro_batches,
        "kv_bits": plan.kv_quant.kv_bits,
        "backend": hostfile.backend,
        "hosts": [h.target for h in hostfile.hosts],
        "launcher": {"platform": platform.platform(), "python": platform.python_version()},
        "version": __version__,
    }
