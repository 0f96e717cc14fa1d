"""``mlx-cluster bench``: a sweep over modes and rank counts, with its baselines in the same run.

Each configuration is one job (``python -m node run`` with the bench command): warm-up runs,
then timed runs of a synthetic prompt. The baselines are the same code on 1 rank and mlx-lm's
own distributed path, ``python -m mlx_lm.benchmark`` on every rank (started directly with the
environment mlx.launch gives its ranks, or by mlx.launch itself), on the same model, mode,
prompt (mlx_lm.benchmark draws the same ids) and lengths. The method is in docs/benchmarks.md.
"""

from __future__ import annotations

import csv
import io
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import IO

from cluster.core.blas import blas_env
from cluster.core.hostfile import Hostfile, HostfileError
from cluster.core.protocol import BenchRun
from cluster.core.spec import BenchSettings, Draft, JobSpec, KVQuant, LaunchSettings
from cluster.job.backends import free_port_run, rank_envs
from cluster.job.launcher import LaunchError, log, run_job
from cluster.job.process import STOP_GRACE_S, rank_python, write_files
from cluster.job.signals import Interrupted, restore_signals, trap_signals

OURS, MLX_LM, MLX_LAUNCH = "mlx-cluster", "mlx-lm", "mlx.launch"
BASELINES = ("single", MLX_LM, MLX_LAUNCH)
DEFAULT_BASELINES = ("single", MLX_LM)
TRIAL = re.compile(
    r"Trial \d+:\s+prompt_tps=([\d.]+), generation_tps=([\d.]+), peak_memory=([\d.]+)"
)
SPREAD_KEYS = ("ttft_s", "prefill_tps", "generation_tps")  # figures of each timed run
UNSUPPORTED = ("does not support", "model.safetensors.index.json")


@dataclass(kw_only=True)
class BenchPlan(BenchSettings):
    """The sweep: every configuration's runs (BenchSettings), what to run and against what."""

    model: str
    modes: list[str]
    ranks: list[int]
    blas: str = "auto"  # as JobSpec.blas, for our ranks and the mlx-lm baselines alike
    baselines: tuple[str, ...] = DEFAULT_BASELINES
    baseline_timeout: float = 1800.0
    draft: Draft = field(default_factory=Draft)  # when on: each of ours also with it
    kv_quant: KVQuant = field(default_factory=KVQuant)  # ours only: mlx_lm.benchmark has none
    prefill_step: int | None = None  # None: each side's default
    micro_batches: int = 1  # ours, pipeline mode: the batch's micro-batches (JobSpec's)
    prompt_lengths: list[int] = field(default_factory=list)  # each sweep's; [] -> prompt_tokens
    concurrency: list[int] = field(default_factory=lambda: [1])  # streams decoded together

    @property
    def lengths(self) -> list[int]:
        return self.prompt_lengths or [self.prompt_tokens]


@dataclass
class Config:
    impl: str  # OURS, MLX_LM or MLX_LAUNCH
    mode: str | None  # None: one rank, nothing sharded
    ranks: int
    draft: bool = False  # with the plan's speculative decoding
    prompt_tokens: int = 512
    streams: int = 1  # answers decoded together

    @property
    def label(self) -> str:
        return (
            f"{self.impl} {self.mode or 'single'} {self.ranks} rank(s)"
            + (" with the draft" if self.draft else "")
            + f", {self.prompt_tokens}-token prompt"
            + (f", {self.streams} streams" if self.streams > 1 else "")
        )


def configs(plan: BenchPlan) -> list[Config]:
    """What to run, in order, for each prompt length: one rank first (the baseline), then
    each mode by rank count; each of ours followed by the mlx-lm baselines of the same
    configuration."""
    theirs = [b for b in (MLX_LM, MLX_LAUNCH) if b in plan.baselines]
    out = []
    drafts = [False, True] if plan.draft.on else [False]
    for p in plan.lengths:
        for c in plan.concurrency:
            ours = drafts if c == 1 else [False]  # speculative decoding: one stream
            if 1 in plan.ranks or "single" in plan.baselines:
                out += [Config(OURS, None, 1, draft, p, c) for draft in ours]
                if theirs:  # one process: no launcher to tell apart
                    out.append(Config(MLX_LM, None, 1, prompt_tokens=p, streams=c))
            for mode in plan.modes:
                for n in plan.ranks:
                    if n > 1:
                        out += [Config(OURS, mode, n, draft, p, c) for draft in ours]
                        out.extend(Config(impl, mode, n, prompt_tokens=p, streams=c)
                                   for impl in theirs)  # fmt: skip
    return out


def first_ranks(hostfile: Hostfile, n: int) -> Hostfile:
    """The hostfile cut to its first ``n`` ranks (hosts in order, slots counted)."""
    if n > hostfile.world_size:
        raise HostfileError(
            f"--ranks {n}: {hostfile.path or 'the hostfile'} has only {hostfile.world_size} rank(s)"
        )
    hosts, left = [], n
    for h in hostfile.hosts:
        if left == 0:
            break
        take = min(h.slots, left)
        hosts.append(replace(h, slots=take))
        left -= take
    if any(h.rdma for h in hosts):
        hosts = [replace(h, rdma=h.rdma[: len(hosts)]) for h in hosts]
    return replace(hostfile, hosts=hosts)


def spread(values: list[float | None]) -> dict | None:
    """Median with min and max; None when there is nothing to summarise."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def blank(config: Config, plan: BenchPlan) -> dict:
    """A result row with every field, filled as the run goes."""
    return {
        "impl": config.impl,
        "mode": config.mode,
        "ranks": config.ranks,
        "draft": config.draft,
        "draft_accepted": None,  # accepted / drafted tokens over the timed runs
        "vs_no_draft": None,  # ratios against the same configuration without the draft
        "status": "ok",
        "reason": None,
        "command": None,
        "prompt_tokens": config.prompt_tokens,
        "streams": config.streams,
        "gen_tokens": plan.gen_tokens,
        "warmup": plan.warmup if config.impl == OURS else 1,  # mlx_lm.benchmark's own
        "repeat": plan.repeat,
        "runs": [],
        "ttft_s": None,
        "prefill_tps": None,
        "generation_tps": None,
        "load_s": None,
        "ready_s": None,
        "start_to_first_token_s": None,
        "peak_memory_gb": [],
        "tokens_sha": None,
        "same_tokens_as_single": None,
        "collectives": None,
        "collectives_per_token": None,
        "allsum_bytes": None,
        "allsum_latency_s": None,
        "comm_s_per_token": None,
        "comm_share": None,
        "predicted_generation_tps": None,
        "vs_single": None,
        "vs_mlx_lm": None,
    }


def summarise_runs(row: dict) -> None:
    for key in SPREAD_KEYS:
        row[key] = spread([r[key] for r in row["runs"]])


def critical_collectives(per_rank: list[dict[str, int]]) -> int:
    """Collectives on one token's path: point-to-point sends follow one another (pipeline
    stages), group collectives run on every rank at once (count them once)."""
    sends = sum(c.get("send", 0) for c in per_rank)
    group = max(sum(v for k, v in c.items() if k.startswith("all_")) for c in per_rank)
    return sends + group


def run_ours(
    config: Config, plan: BenchPlan, hostfile: Hostfile, launch: LaunchSettings, stderr
) -> dict:
    row = blank(config, plan)
    hf = first_ranks(hostfile, config.ranks)
    row["command"] = our_command(config, plan, hostfile)
    spec = JobSpec(
        model=plan.model,
        mode=config.mode or "pipeline",
        command="bench",
        blas=plan.blas,
        bench=replace(
            BenchSettings(**{f.name: getattr(plan, f.name) for f in fields(BenchSettings)}),
            prompt_tokens=config.prompt_tokens,
            streams=config.streams,
        ),
        draft=plan.draft if config.draft else Draft(),
        kv_quant=plan.kv_quant,
        prefill_step=plan.prefill_step,
        micro_batches=plan.micro_batches if config.mode == "pipeline" else 1,
    )
    try:
        result = run_job(hf, spec, launch, stdout=io.BytesIO(), stderr=stderr)
    except LaunchError as e:
        if e.exit_code >= 128:  # Ctrl-C or a signal: the sweep stops here
            raise
        row["status"], row["reason"] = "failed", str(e).removeprefix("error: ")
        return row
    runs = result.bench_runs
    row["runs"] = [_run_fields(e) for e in runs if not e.warmup]
    shas = {e.tokens_sha for e in runs}
    row["tokens_sha"] = shas.pop() if len(shas) == 1 else None  # None: runs disagreed
    summarise_runs(row)
    drafted = sum(e.draft_n or 0 for e in runs if not e.warmup)
    if config.draft and drafted:
        row["draft_accepted"] = sum(e.draft_n_accepted or 0 for e in runs if not e.warmup) / drafted
    loads = [x for x in result.load_s if x is not None]
    row["load_s"] = max(loads) if loads else None
    row["ready_s"] = result.ready_s
    row["start_to_first_token_s"] = result.first_token_s
    row["peak_memory_gb"] = result.peak_memory_gb
    comm = [e for _, e in sorted(result.bench_comm, key=lambda x: x[0])]
    if config.ranks > 1 and comm:
        per_rank = [e.counts for e in comm]
        row["collectives"] = per_rank
        row["collectives_per_token"] = critical_collectives(per_rank)
        row["allsum_bytes"] = comm[0].allsum_bytes
        row["allsum_latency_s"] = comm[0].allsum_latency_s
        row["comm_s_per_token"] = row["collectives_per_token"] * row["allsum_latency_s"]
        gen = row["generation_tps"]
        if gen:  # one step decodes a token of every stream, with one step's collectives
            row["comm_share"] = row["comm_s_per_token"] * gen["median"] / config.streams
    return row


def _run_fields(event: BenchRun) -> dict:
    return {k: getattr(event, k) for k in ("ttft_s", "prefill_tps", "generation_tps", "generated")}


def our_command(config: Config, plan: BenchPlan, hostfile: Hostfile) -> str:
    where = f"--hostfile {hostfile.path}" if hostfile.path else ""
    mode = f" --modes {config.mode}" if config.mode else ""
    if config.draft:
        d = plan.draft
        proposer = (
            f"--draft-model {d.draft_model}"
            if d.draft_model
            else f"--prompt-lookup {d.prompt_lookup}"
        )
        mode += f" {proposer} --num-draft-tokens {d.num_draft_tokens}"
        if d.draft_model and d.draft_on != "every":
            mode += f" --draft-on {d.draft_on}"
    mode += step_flags(plan)
    return (
        f"mlx-cluster bench {where} --model {plan.model}{mode} --ranks {config.ranks} "
        f"--prompt-tokens {config.prompt_tokens} --concurrency {config.streams} "
        f"--gen-tokens {plan.gen_tokens} "
        f"--repeat {plan.repeat} --warmup {plan.warmup} --baselines none"
    ).replace("  ", " ")


def step_flags(plan: BenchPlan) -> str:
    """--prefill-step and --kv-bits as the plan has them."""
    flags = f" --prefill-step {plan.prefill_step}" if plan.prefill_step else ""
    q = plan.kv_quant
    if q.kv_bits is not None:
        flags += f" --kv-bits {q.kv_bits} --kv-group-size {q.kv_group_size}"
        flags += f" --quantized-kv-start {q.quantized_kv_start}"
    return flags


def mlx_lm_command(config: Config, plan: BenchPlan, python: str) -> list[str]:
    """One rank of ``mlx_lm.benchmark`` for this configuration (tensor parallel by default,
    ``--pipeline`` for pipeline mode)."""
    bench = [
        python,
        "-m",
        "mlx_lm.benchmark",
        "--model",
        plan.model,
        "--prompt-tokens",
        str(config.prompt_tokens),
        "--generation-tokens",
        str(plan.gen_tokens),
        "--num-trials",
        str(plan.repeat),
    ]
    if plan.prefill_step:
        bench += ["--prefill-step-size", str(plan.prefill_step)]
    if config.streams > 1:  # batch_generate: the streams decoded together, aggregate figures
        bench += ["--batch-size", str(config.streams)]
    return bench + (["--pipeline"] if config.mode == "pipeline" else [])


def mlx_launch(python: str) -> str | None:
    """The mlx.launch next to ``python`` (its venv), else on PATH."""
    here = Path(python).parent / "mlx.launch"
    return str(here) if here.exists() else shutil.which("mlx.launch")


def run_mlx_lm(config: Config, plan: BenchPlan, hostfile: Hostfile, stderr) -> dict:
    """mlx-lm's own path; its figures converted to ours (see docs/benchmarks.md).

    impl "mlx-lm": the ranks of mlx_lm.benchmark started directly with the environment
    mlx.launch gives them (MLX_RANK, MLX_HOSTFILE). impl "mlx.launch": started by mlx.launch
    itself, whose output relay loop busy-waits on a core while the ranks run."""
    row = blank(config, plan)
    hf = first_ranks(hostfile, config.ranks)
    if plan.kv_quant.kv_bits is not None:
        row["status"] = "skipped"
        row["reason"] = "mlx_lm.benchmark has no --kv-bits: its cache would not be the same"
        return row
    if not all(h.is_local for h in hf.hosts):
        row["status"] = "skipped"
        row["reason"] = (
            "the mlx-lm baselines run on this machine's ranks only; on the rig run "
            "mlx.launch --hostfile HOSTS.json -- python -m mlx_lm.benchmark yourself"
        )
        return row
    python = rank_python(hf.hosts[0], hf.python)
    bench = mlx_lm_command(config, plan, python)
    env = {**os.environ, **hf.env, "PYTHONUNBUFFERED": "1"}
    env |= blas_env(plan.blas, config.ranks, env, sys.platform, os.cpu_count()) or {}
    with tempfile.TemporaryDirectory(prefix="mlx-cluster-bench-") as tmp:
        if config.ranks == 1:
            ranks = [(bench, env)]
        elif config.impl == MLX_LAUNCH:
            launch = mlx_launch(python)
            if launch is None:
                row["status"], row["reason"] = "skipped", "mlx.launch not found"
                return row
            port = str(free_port_run("127.0.0.1", config.ranks))  # not its fixed 32323
            argv = [launch, "-n", str(config.ranks), "--backend", "ring"]
            ranks = [([*argv, "--starting-port", port, "--", *bench], env)]
        else:
            ranks = [
                (bench, {**env, **e.env, **write_files(e.files, Path(tmp) / f"rank{e.rank}")})
                for e in rank_envs(replace(hf, backend="ring"))
            ]
        row["command"] = " ".join(ranks[0][0])
        try:
            lines, ready_s, code = _follow(ranks, Path(tmp), plan.baseline_timeout, stderr)
        except TimeoutError:
            row["status"] = "failed"
            row["reason"] = f"not done after {plan.baseline_timeout:g} s (--baseline-timeout)"
            return row
    trials = [m for m in map(TRIAL.search, lines) if m]
    if code != 0 or not trials:
        unsupported = any(u in x for x in lines for u in UNSUPPORTED)
        row["status"] = "unsupported" if unsupported else "failed"
        errors = [x for x in lines if "Error" in x or "error" in x]
        row["reason"] = (errors or lines or [f"exit code {code}"])[-1].strip()
        return row
    g = plan.gen_tokens
    for m in trials:
        prompt_tps, generation_tps = float(m.group(1)), float(m.group(2))
        row["runs"].append(
            {
                "ttft_s": config.prompt_tokens * config.streams / prompt_tps,
                "prefill_tps": prompt_tps,
                # mlx-lm divides n tokens by the time after the first: ours counts n-1
                "generation_tps": generation_tps * (g - 1) / g,
                "generated": g * config.streams,
                "generation_tps_reported": generation_tps,
            }
        )
    summarise_runs(row)
    row["ready_s"] = ready_s
    if ready_s is not None:  # its warm-up starts when it says so; its first token comes after
        row["start_to_first_token_s"] = ready_s + row["ttft_s"]["median"]
    row["peak_memory_gb"] = [float(trials[-1].group(3))]  # rank 0's, the one it reports
    return row


def _follow(ranks: list[tuple[list, dict]], tmp: Path, timeout: float, stderr):
    """Start every (command, env), each in its own process group; follow the first one's
    output. Returns its lines (the other ranks' last lines after them), when it said it had
    loaded (mlx_lm.benchmark's "Running warmup"), and the first non-zero exit code. Ctrl-C
    or the timeout stops every group (mlx.launch and the ranks it started, too)."""
    started = time.perf_counter()
    procs, logs = [], []
    timed_out = threading.Event()

    def give_up():
        timed_out.set()
        for p in procs:
            _stop_group(p, signal.SIGKILL)

    previous = trap_signals()
    timer = threading.Timer(timeout, give_up)
    lines: deque = deque(maxlen=200)
    ready_s = None
    try:
        for i, (command, env) in enumerate(ranks):
            out = subprocess.PIPE
            if i > 0:
                logs.append(open(tmp / f"rank{i}.log", "wb"))
                out = logs[-1]
            procs.append(
                subprocess.Popen(
                    command,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    # a pipe we never write: mlx.launch forwards its stdin to the ranks, and
                    # at EOF (as from /dev/null) its relay loop would not even wait
                    stdin=subprocess.PIPE,
                    env=env,
                    start_new_session=True,
                )
            )
        timer.start()
        for raw in procs[0].stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            lines.append(line)
            if ready_s is None and "Running warmup" in line:
                ready_s = time.perf_counter() - started
            if TRIAL.search(line):
                log(stderr, f"  {line.strip()}")
        codes = [p.wait() for p in procs]
    finally:  # also on Ctrl-C (Interrupted): nothing we started survives
        restore_signals(previous)
        timer.cancel()
        for p in procs:
            if p.poll() is None:
                _stop_group(p, signal.SIGTERM)
            p.stdin.close()
        for f in logs:
            f.close()
    if timed_out.is_set():
        raise TimeoutError
    for f in logs:
        lines.extend(Path(f.name).read_text(errors="replace").splitlines()[-20:])
    return list(lines), ready_s, next((c for c in codes if c != 0), 0)


def _stop_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the process group, then SIGKILL what is left after a grace period."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # ranks that outlived mlx.launch
    except ProcessLookupError:
        pass
    proc.wait()


def add_ratios(rows: list[dict]) -> None:
    """Ratios from the same run: against the 1-rank row of the same implementation, and
    (ours) against mlx-lm's row of the same mode and rank count."""
    ok = {
        (r["impl"], r["mode"], r["ranks"], r["draft"], (r["prompt_tokens"], r["streams"])): r
        for r in rows
        if r["status"] == "ok"
    }
    for r in rows:
        if r["status"] != "ok":
            continue
        p = (r["prompt_tokens"], r["streams"])
        if r["draft"] and (plain := ok.get((r["impl"], r["mode"], r["ranks"], False, p))):
            r["vs_no_draft"] = _ratios(r, plain)
        single = ok.get((_single_impl(r["impl"]), None, 1, False, p))
        if single is not None and r is not single:
            r["vs_single"] = _ratios(r, single)
            if r["impl"] == OURS and r["tokens_sha"] and single["tokens_sha"]:
                r["same_tokens_as_single"] = r["tokens_sha"] == single["tokens_sha"]
            r["predicted_generation_tps"] = predicted_generation_tps(r, single)
        theirs = ok.get((MLX_LM, r["mode"], r["ranks"], False, p)) or ok.get(
            (MLX_LAUNCH, r["mode"], r["ranks"], False, p)
        )
        if r["impl"] == OURS and theirs is not None:
            r["vs_mlx_lm"] = _ratios(r, theirs)


def predicted_generation_tps(row: dict, single: dict) -> float | None:
    """Decode tokens/s the link allows: one rank's time per token (tensor: split over the
    ranks; pipeline: the stages run one after another, so all of it) plus, per token, the
    collectives on its path times the all_sum latency measured in the same job."""
    gen, comm = single["generation_tps"], row["comm_s_per_token"]
    if not gen or not gen["median"] or comm is None or row.get("streams", 1) > 1:
        return None  # the model is one stream's
    compute = 1 / gen["median"] / (row["ranks"] if row["mode"] == "tensor" else 1)
    return 1 / (compute + comm)


def _single_impl(impl: str) -> str:
    """Whose 1-rank row an implementation's rows compare with (mlx.launch has none: one
    process needs no launcher)."""
    return MLX_LM if impl == MLX_LAUNCH else impl


def _ratios(row: dict, base: dict) -> dict:
    return {
        key: row[key]["median"] / base[key]["median"]
        for key in ("prefill_tps", "generation_tps")
        if row[key] and base[key] and base[key]["median"]
    }


def run_sweep(
    plan: BenchPlan, hostfile: Hostfile, launch: LaunchSettings, stderr: IO[str]
) -> list[dict]:
    """Every configuration in turn. Ctrl-C or a signal stops the sweep: SweepStopped, with
    the rows done so far."""
    rows: list[dict] = []
    todo = configs(plan)
    previous = trap_signals()  # Ctrl-C between two jobs stops the sweep too
    try:
        _sweep(todo, rows, plan, hostfile, launch, stderr)
    finally:
        restore_signals(previous)
    add_ratios(rows)
    return rows


def _sweep(todo, rows, plan, hostfile, launch, stderr) -> None:
    try:
        for i, config in enumerate(todo, start=1):
            log(stderr, f"bench [{i}/{len(todo)}] {config.label}")
            if config.impl == OURS:
                row = run_ours(config, plan, hostfile, launch, stderr)
            else:
                row = run_mlx_lm(config, plan, hostfile, stderr)
            if row["status"] != "ok":
                log(stderr, f"  {row['status']}: {row['reason']}")
            rows.append(row)
    except (LaunchError, Interrupted) as e:
        add_ratios(rows)
        raise SweepStopped(rows, e) from None


class SweepStopped(Exception):
    """Ctrl-C (or a signal) during the sweep; ``rows`` holds what was measured."""

    def __init__(self, rows: list[dict], cause: Exception):
        self.rows = rows
        self.exit_code = getattr(cause, "exit_code", None) or 128 + getattr(cause, "signum", 2)


def _fmt(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _fmt_spread(s: dict | None, digits: int = 1) -> str:
    if s is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def _fmt_ratio(r: dict | None, key: str = "generation_tps") -> str:
    return "-" if not r or key not in r else f"{r[key]:.2f}"


DRAFT_HEAD = ["gen vs no draft", "draft accepted"]
TABLE_HEAD = (
    "impl",
    "mode",
    "ranks",
    "first token s",
    "prefill tok/s",
    "generation tok/s",
    "predicted gen tok/s",
    "gen vs 1 rank",
    "gen vs mlx-lm",
    "collectives/token",
    "all_sum us",
    "comm share",
    "load s",
    "start to 1st token s",
    "peak GB (max rank)",
)


def table(rows: list[dict]) -> str:
    """A markdown table of the sweep: medians with [min-max] over the timed runs; with a
    draft, each configuration's row with it follows the row without, and says the ratio."""
    drafts = any(r.get("draft") for r in rows)
    lengths = len({r["prompt_tokens"] for r in rows}) > 1
    streams = len({r.get("streams", 1) for r in rows}) > 1
    head = list(TABLE_HEAD)
    if drafts:
        head[9:9] = DRAFT_HEAD
    if streams:
        head[3:3] = ["streams"]
    if lengths:
        head[3:3] = ["prompt tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        mode = (r["mode"] or "-") + (" +draft" if r.get("draft") else "")
        if r["status"] != "ok":
            cells = [r["impl"], mode, str(r["ranks"]), f"{r['status']}: {r['reason']}"]
            cells += [""] * (len(head) - len(cells))
        else:
            peaks = [m for m in r["peak_memory_gb"] if m is not None]
            latency = r["allsum_latency_s"]
            cells = [
                r["impl"],
                mode,
                str(r["ranks"]),
                _fmt_spread(r["ttft_s"], 3),
                _fmt_spread(r["prefill_tps"]),
                _fmt_spread(r["generation_tps"]),
                _fmt(r["predicted_generation_tps"], 1),
                _fmt_ratio(r["vs_single"]),
                _fmt_ratio(r["vs_mlx_lm"]),
                "-" if r["collectives_per_token"] is None else str(r["collectives_per_token"]),
                "-" if latency is None else f"{latency * 1e6:.0f}",
                "-" if r["comm_share"] is None else f"{100 * r['comm_share']:.0f}%",
                _fmt(r["load_s"], 2),
                _fmt(r["start_to_first_token_s"], 2),
                _fmt(max(peaks) if peaks else None, 3),
            ]
            if drafts:
                accepted = r.get("draft_accepted")
                cells[9:9] = [
                    _fmt_ratio(r.get("vs_no_draft")),
                    "-" if accepted is None else f"{100 * accepted:.0f}%",
                ]
        if streams:
            cells[3:3] = [str(r.get("streams", 1))]
        if lengths:
            cells[3:3] = [str(r["prompt_tokens"])]
        cells = cells[: len(head)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


CSV_FIELDS = (
    "impl",
    "mode",
    "ranks",
    "draft",
    "draft_accepted",
    "status",
    "reason",
    "prompt_tokens",
    "streams",
    "gen_tokens",
    "warmup",
    "repeat",
    *(f"{k}_{s}" for k in SPREAD_KEYS for s in ("median", "min", "max")),
    "load_s",
    "ready_s",
    "start_to_first_token_s",
    "peak_memory_gb",
    "collectives_per_token",
    "allsum_bytes",
    "allsum_latency_s",
    "comm_s_per_token",
    "comm_share",
    "predicted_generation_tps",
    "vs_single_prefill_tps",
    "vs_single_generation_tps",
    "vs_mlx_lm_prefill_tps",
    "vs_mlx_lm_generation_tps",
    "vs_no_draft_prefill_tps",
    "vs_no_draft_generation_tps",
    "same_tokens_as_single",
    "tokens_sha",
    "command",
)


def csv_text(rows: list[dict]) -> str:
    """One line per configuration, every figure a column (lists joined with ';')."""
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        flat = {k: r.get(k) for k in CSV_FIELDS if k in r}
        for key in SPREAD_KEYS:
            for s in ("median", "min", "max"):
                flat[f"{key}_{s}"] = r[key][s] if r[key] else None
        for base in ("vs_single", "vs_mlx_lm", "vs_no_draft"):
            for key in ("prefill_tps", "generation_tps"):
                flat[f"{base}_{key}"] = (r[base] or {}).get(key)
        flat["peak_memory_gb"] = ";".join(_fmt(m, 4) for m in r["peak_memory_gb"])
        writer.writerow(flat)
    return out.getvalue()


def check_plot() -> None:
    """--plot needs matplotlib (an optional extra); say so before anything runs."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'mlx-cluster[plot]' (or pip install matplotlib)"
        ) from None


def plot(rows: list[dict], path: str, title: str) -> None:
    """Generation tokens/s against rank count, one line per mode and implementation; the
    1-rank row starts every line of its implementation; bars span min to max."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["status"] == "ok" and r["generation_tps"]]
    lengths = sorted({r["prompt_tokens"] for r in ok})
    if len(lengths) > 1:
        return plot_prefill(ok, path, title)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    modes = sorted({r["mode"] for r in ok if r["mode"]})
    for impl, style in ((OURS, "-o"), (MLX_LM, "--s"), (MLX_LAUNCH, ":^")):
        single = [r for r in ok if r["impl"] == _single_impl(impl) and r["mode"] is None]
        for mode in modes or [None]:
            points = sorted(
                single + [r for r in ok if r["impl"] == impl and r["mode"] == mode],
                key=lambda r: r["ranks"],
            )
            if not points or (mode is not None and len(points) == len(single)):
                continue
            g = [p["generation_tps"] for p in points]
            ax.errorbar(
                [p["ranks"] for p in points],
                [x["median"] for x in g],
                yerr=[[x["median"] - x["min"] for x in g], [x["max"] - x["median"] for x in g]],
                fmt=style,
                capsize=3,
                label=f"{impl} {mode or 'single'}",
            )
    ax.set_xlabel("ranks")
    ax.set_ylabel("generation tokens/s (median)")
    ax.set_title(title)
    ax.set_xticks(sorted({r["ranks"] for r in ok}) or [1])
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_prefill(ok: list[dict], path: str, title: str) -> None:
    """Several prompt lengths: time to first token and prefill tokens/s against the prompt's
    length, one line per implementation, mode and rank count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    lines: dict[tuple, list[dict]] = {}
    for r in ok:
        lines.setdefault((r["impl"], r["mode"], r["ranks"], r["draft"]), []).append(r)
    for (impl, mode, ranks, draft), points in lines.items():
        points.sort(key=lambda r: r["prompt_tokens"])
        x = [p["prompt_tokens"] for p in points]
        label = f"{impl} {mode or 'single'} {ranks}" + (" +draft" if draft else "")
        style = "-o" if impl == OURS else "--s"
        left.plot(x, [p["ttft_s"]["median"] for p in points], style, label=label)
        right.plot(x, [p["prefill_tps"]["median"] for p in points], style, label=label)
    for ax, what in ((left, "time to first token (s, median)"), (right, "prefill tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(what)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
