"""Run one job: start every rank, relay rank 0's text, stop everything at the end or on failure.

Whatever happens (a rank fails, the user presses Ctrl-C, the launcher gets SIGTERM), every rank
is stopped and waited for before we return, and the report names the rank, its host, what it
was doing and the last lines it printed.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .backends import port_in_use, rank_envs
from .hostfile import Hostfile
from .modelcheck import ModelError, check_shardable, looks_like_repo, read_config
from .process import LocalRank, RankLaunch, local_python, make_job_dir
from .protocol import decode_event

EXIT_PEER_FAILED = 3  # a rank that stopped because rank 0 failed (see node.__main__)
TAIL_LINES = 15
STOP_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """The job could not start or did not finish; the message is for the user."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(Exception):
    def __init__(self, signum: int):
        self.signum = signum


@dataclass
class JobOptions:
    model: str
    prompt: str
    mode: str = "pipeline"
    max_tokens: int = 256
    temp: float = 0.0
    seed: int | None = None
    verbose: bool = False
    starting_port: int | None = None
    connections_per_ip: int = 1


@dataclass
class RankState:
    rank: int
    host: str
    phase: str = "starting"
    exit_code: int | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    error: str | None = None


@dataclass
class JobResult:
    exit_code: int
    stats: dict[str, Any] | None = None
    first_token_s: float | None = None
    ready_s: float | None = None


def preflight(hostfile: Hostfile, options: JobOptions) -> None:
    """Checks that need no rank: the model's config (when it is here) and local ports."""
    path = Path(options.model).expanduser()
    elsewhere = not path.exists() and not all(h.is_local for h in hostfile.hosts)
    if looks_like_repo(options.model) or elsewhere:  # the hosts fetch or hold it; each checks
        check_shardable({}, options.mode, hostfile.world_size)
    else:
        config = read_config(path)
        check_shardable(config, options.mode, hostfile.world_size)


def check_ports(hostfile: Hostfile, launches: list[RankLaunch]) -> None:
    """A ring port that is taken on this machine fails fast with the rank and port named."""
    for launch in launches:
        if not launch.host.is_local or "MLX_HOSTFILE" not in launch.files:
            continue
        addresses = json.loads(launch.files["MLX_HOSTFILE"])[launch.rank]
        for address in addresses:
            ip, _, port = address.rpartition(":")
            ip = ip.strip("[]")
            if port_in_use(ip, int(port)):
                raise LaunchError(
                    f"port {port} on {ip} (rank {launch.rank}, {launch.host.label}) is already "
                    "in use; pass another --starting-port, or omit it to pick free ports",
                    exit_code=2,
                )


def job_spec(options: JobOptions, world_size: int, rank: int) -> str:
    spec: dict[str, Any] = {
        "command": "generate",
        "model": options.model,
        "mode": options.mode,
        "world_size": world_size,
    }
    if rank == 0:  # the prompt goes only where it is needed
        spec["request"] = {
            "prompt": options.prompt,
            "max_tokens": options.max_tokens,
            "temp": options.temp,
            "seed": options.seed,
        }
    return json.dumps(spec)


def plan(hostfile: Hostfile, options: JobOptions) -> list[RankLaunch]:
    local = Path(options.model).expanduser()
    if local.exists():  # ranks may run in another directory
        options.model = str(local.resolve())
    envs = rank_envs(hostfile, options.starting_port, options.connections_per_ip, options.verbose)
    return [
        RankLaunch(
            rank=e.rank,
            host=e.host,
            python=local_python(e.host, hostfile.python),
            env=e.env,
            files=e.files,
            spec=job_spec(options, len(envs), e.rank),
            cwd=e.host.cwd,
            extra_env=hostfile.env,
        )
        for e in envs
    ]


def log(stderr: IO[str], message: str) -> None:
    stderr.write(f"mlx-cluster: {message}\n")
    stderr.flush()


def run_job(
    hostfile: Hostfile,
    options: JobOptions,
    stdout: IO[bytes] | None = None,
    stderr: IO[str] | None = None,
    started: float | None = None,
) -> JobResult:
    """Run the job to the end; raises LaunchError (with an exit code) on any failure."""
    stdout = stdout or sys.stdout.buffer
    stderr = stderr or sys.stderr
    started = time.perf_counter() if started is None else started
    try:
        preflight(hostfile, options)
        launches = plan(hostfile, options)
    except (ModelError, ValueError) as e:
        raise LaunchError(f"error: {e}", exit_code=2) from e
    check_ports(hostfile, launches)

    job_dir = make_job_dir()
    ranks = [LocalRank(launch, job_dir) for launch in launches]
    states = [RankState(r.rank, r.host.target) for r in ranks]
    events: queue.Queue = queue.Queue()
    result = JobResult(exit_code=0)
    wrote_newline = True
    log(
        stderr,
        f"starting {len(ranks)} rank(s), {options.mode} mode, "
        f"{hostfile.backend} backend, model {options.model}",
    )

    previous = _trap_signals()
    try:
        for r in ranks:
            r.start(events)
        running = len(ranks)
        ready = 0
        failed: RankState | None = None
        while running:
            kind, rank, payload = events.get()
            state = states[rank]
            if kind == "out":
                if rank == 0:
                    if result.first_token_s is None:
                        result.first_token_s = time.perf_counter() - started
                    try:
                        stdout.write(payload)
                        stdout.flush()
                    except BrokenPipeError:  # `| head`: the reader has what it wanted
                        raise Interrupted(signal.SIGPIPE) from None
                    wrote_newline = payload.endswith(b"\n")
                else:
                    state.tail.extend(payload.decode("utf-8", "replace").splitlines())
            elif kind == "err":
                event = decode_event(payload)
                if event is None:
                    state.tail.append(payload.rstrip("\n"))
                    if options.verbose:
                        stderr.write(f"[rank {rank} {state.host}] {payload}")
                    continue
                _on_event(event, state, result)
                if event["event"] == "ready":
                    ready += 1
                    if options.verbose:
                        stderr.write(f"[rank {rank} {state.host}] {_ready_line(event)}\n")
                    if ready == len(ranks):
                        result.ready_s = time.perf_counter() - started
                        log(stderr, f"all ranks ready after {result.ready_s:.1f} s")
            else:
                running -= 1
                state.exit_code = payload
                if payload != 0 and failed is None:
                    failed = state
                    break
        if failed is not None:
            _stop_all(ranks, states, events)
            raise LaunchError(_failure_report(failed, states, len(ranks)))
    except Interrupted as e:
        _stop_all(ranks, states, events)
        if e.signum == signal.SIGPIPE:
            _silence_stdout(stdout)
            raise LaunchError("", exit_code=128 + e.signum) from None
        name = signal.Signals(e.signum).name
        raise LaunchError(
            f"mlx-cluster: stopped by {name}; all ranks stopped", exit_code=128 + e.signum
        ) from None
    finally:
        _restore_signals(previous)
        for r in ranks:  # even on an unexpected error nothing may survive
            if r.poll() is None:
                r.send_signal(signal.SIGKILL)
                r.wait(STOP_GRACE_S)
        shutil.rmtree(job_dir, ignore_errors=True)
        if not wrote_newline and not stdout.closed and stdout.isatty():
            stdout.write(b"\n")
            stdout.flush()

    if result.stats:
        s = result.stats
        log(
            stderr,
            f"prompt {s['prompt_tokens']} tokens at {s['prompt_tps']:.1f} tok/s, "
            f"generated {s['generation_tokens']} tokens at {s['generation_tps']:.1f} "
            f"tok/s, first token {result.first_token_s or 0:.2f} s after start, "
            f"peak memory (rank 0) {s['peak_memory_gb']:.3f} GB",
        )
    return result


def _ready_line(event: dict) -> str:
    layers = event.get("layers")
    where = f"layers {layers[0]}-{layers[1] - 1}" if layers else "all layers"
    files = ", ".join(event.get("files") or [])
    return f"loaded in {event.get('load_s', 0):.2f} s: {where}; weight files: {files}"


def _on_event(event: dict, state: RankState, result: JobResult) -> None:
    kind = event["event"]
    if kind == "phase":
        state.phase = event["phase"]
    elif kind == "ready":
        state.phase = "ready"
    elif kind == "stats":
        result.stats = event
    elif kind == "error":
        state.error = event.get("message")


PHASE_WORDS = {
    "starting": "while starting",
    "init": "while joining the distributed group",
    "loading": "while loading the model",
    "ready": "after loading, before generating",
    "generating": "while generating",
}


HINTS = {
    "init": "check that the ranks can reach each other on the hostfile's ips and ports "
    "(firewall, cable, --starting-port); run with --verbose to see MLX's ring log",
    "loading": "check the model files on {host}: a truncated or missing file means an "
    "incomplete copy or download; copy the model again",
}


def _failure_report(failed: RankState, states: list[RankState], world: int) -> str:
    # A rank that stopped because rank 0 failed points at rank 0: report the cause.
    if failed.exit_code == EXIT_PEER_FAILED and states[0].exit_code not in (None, 0):
        failed = states[0]
    code = failed.exit_code
    how = (
        f"was killed by signal {-code}"
        if code is not None and code < 0
        else f"exited with code {code}"
    )
    lines = [
        f"error: rank {failed.rank} of {world} on {failed.host} {how} "
        f"{PHASE_WORDS.get(failed.phase, failed.phase)}"
    ]
    if failed.error:
        lines.append(f"  reason: {failed.error}")
    if failed.tail:
        lines.append(f"  last lines of rank {failed.rank} ({failed.host}):")
        lines.extend(f"    {line}" for line in failed.tail)
    hint = HINTS.get(failed.phase)
    if hint:
        lines.append(f"  what to do: {hint.format(host=failed.host)}")
    lines.append("  every other rank was stopped")
    return "\n".join(lines)


def _stop_all(ranks: list[LocalRank], states: list[RankState], events: queue.Queue) -> None:
    """SIGTERM every live rank, SIGKILL what is left after a grace period, wait for all."""
    for r in ranks:
        r.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for r in ranks:
        if r.wait(max(0.0, deadline - time.monotonic())) is None:
            r.send_signal(signal.SIGKILL)
            r.wait(STOP_GRACE_S)
    # Drain what the ranks printed on the way out: it belongs in the report.
    while True:
        try:
            kind, rank, payload = events.get_nowait()
        except queue.Empty:
            break
        if kind == "err":
            event = decode_event(payload)
            if event is None:
                states[rank].tail.append(payload.rstrip("\n"))
            elif event["event"] == "error":
                states[rank].error = event.get("message")
        elif kind == "exit" and states[rank].exit_code is None:
            states[rank].exit_code = payload


def _silence_stdout(stdout) -> None:
    """After a broken pipe, point fd 1 at /dev/null so the exit-time flush cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


def _trap_signals():
    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    return previous


def _restore_signals(previous) -> None:
    for sig, h in previous.items():
        signal.signal(sig, h)
