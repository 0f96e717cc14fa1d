"""Run one job: start every rank, relay rank 0's text, stop everything at the end or on failure.

Whatever happens (a rank fails, the user presses Ctrl-C, the launcher gets SIGTERM), every rank
is stopped and waited for before we return, and the report names the rank, its host, what it
was doing and the last lines it printed.
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from .backends import port_in_use, rank_envs, ring_ports
from .hostfile import Hostfile, rank_model_path
from .modelcheck import (
    ModelError,
    check_request,
    check_shardable,
    choose_split,
    looks_like_repo,
    read_config,
)
from .process import LocalRank, RankLaunch, make_job_dir, rank_python
from .protocol import CANCEL, END_OF_INPUT, decode_event

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
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    stop: list[str] = field(default_factory=list)  # stop strings (rank 0 decides, all agree)
    system: str | None = None  # the system prompt (through the chat template)
    tools: list | None = None  # tool schemas for the chat template
    enable_thinking: bool | None = None  # passed to the chat template when set
    reasoning_effort: str | None = None  # passed to the chat template when set
    prompt_cache_gb: float = 4.0  # chat: the most KV cache each rank keeps between turns
    serve_host: str = "127.0.0.1"  # serve: where rank 0 listens
    serve_port: int = 8080
    api_key: str | None = None  # serve: clients must send it; travels in rank 0's spec file
    drain_timeout: float = 30.0  # serve: on SIGINT/SIGTERM, longest wait for answers under way
    decode_concurrency: int = 32  # serve: most requests decoded together
    prompt_concurrency: int = 8  # serve: most prompts prefilled together
    prompt_cache_size: int = 10  # serve: finished answers whose caches are kept (0: none)
    verbose: bool = False
    starting_port: int | None = None
    connections_per_ip: int = 1
    heartbeat_timeout: float = 30.0
    start_timeout: float = 1800.0
    accept_new_host_keys: bool = False
    forward_stdin: bool = False  # our stdin goes on to rank 0 (interactive chat)
    split: list[int] | None = None  # pipeline layers per rank (rank 0 holds the last layers)
    image: bytes | None = None  # for a vision-language model; only rank 0's spec carries it
    command: str = "generate"  # or "logits": print the prompt's next-token logits as JSON
    bench: dict | None = None  # bench: prompt_tokens, gen_tokens, warmup, repeat (every rank)


@dataclass
class RankState:
    rank: int
    host: str
    phase: str = "starting"
    host_is_local: bool = True
    unresponsive: bool = False  # given up on by the launcher (heartbeat or start timeout)
    error_t: float | None = None  # when the rank reported its own error (its own clock)
    stopped_by_us: bool = False  # still running when the launcher began the teardown
    last_seen: float = 0.0
    exit_code: int | None = None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    error: str | None = None
    bad_model: bool = False  # its error says the model cannot be served as asked
    peak_memory_gb: float | None = None  # reported by the rank when its work is done
    load_s: float | None = None  # how long the rank took to load its shard


@dataclass
class JobResult:
    exit_code: int
    stats: dict[str, Any] | None = None
    first_token_s: float | None = None
    ready_s: float | None = None
    peak_memory_gb: list[float | None] = field(default_factory=list)  # per rank, rank 0 first
    load_s: list[float | None] = field(default_factory=list)  # per rank
    bench: list[dict] = field(default_factory=list)  # bench_* events, each with its "rank"


def split_weights(hostfile: Hostfile) -> list[float] | None:
    """Per-rank memory (a host's memory_gb shared by its slots) when every host gives it."""
    hosts = hostfile.rank_hosts()
    if not all(h.memory_gb for h in hosts):
        return None
    return [h.memory_gb / h.slots for h in hosts]


def preflight(hostfile: Hostfile, options: JobOptions) -> list[int] | None:
    """Checks that need no rank: the model's config (when it is here). Returns the pipeline
    split when one is chosen (explicit or by memory), None for the even split."""
    n = hostfile.world_size
    if options.split and (options.mode != "pipeline" or n < 2):
        raise ModelError("--split is for pipeline mode with 2 or more ranks")
    path = Path(options.model).expanduser()
    elsewhere = not path.exists() and not all(h.is_local for h in hostfile.hosts)
    if looks_like_repo(options.model) or elsewhere:  # the hosts fetch or hold it; each checks
        check_shardable({}, options.mode, n)
        return options.split
    config = read_config(path)
    check_shardable(config, options.mode, n)
    check_request(config, options.command, options.image is not None, options.model)
    if options.mode != "pipeline":
        return None
    return choose_split(config, n, options.split, split_weights(hostfile))


def check_ports(hostfile: Hostfile, launches: list[RankLaunch]) -> None:
    """A ring port that is taken on this machine fails fast with the rank and port named."""
    for launch in launches:
        if not launch.host.is_local:
            continue
        for ip, port in ring_ports(launch.files, launch.rank):
            if port_in_use(ip, port):
                raise LaunchError(
                    f"port {port} on {ip} (rank {launch.rank}, {launch.host.label}) is already "
                    "in use; pass another --starting-port, or omit it to pick free ports",
                    exit_code=2,
                )


def job_spec(
    options: JobOptions,
    world_size: int,
    rank: int,
    weights: list[float] | None = None,
    model: str | None = None,
) -> str:
    """One rank's job; ``model`` is where that rank loads the model from (default: as given)."""
    spec: dict[str, Any] = {
        "command": options.command,
        "model": model or options.model,
        "mode": options.mode,
        "world_size": world_size,
        "split": options.split,
        "split_weights": weights,
        "prompt_cache_gb": options.prompt_cache_gb,
    }
    if options.bench is not None:
        spec["bench"] = options.bench
    if rank == 0 and options.command == "serve":
        spec["serve"] = {
            "host": options.serve_host,
            "port": options.serve_port,
            "api_key": options.api_key,
            "drain_timeout": options.drain_timeout,
            "decode_concurrency": options.decode_concurrency,
            "prompt_concurrency": options.prompt_concurrency,
            "prompt_cache_size": options.prompt_cache_size,
        }
    if rank == 0:  # the prompt goes only where it is needed
        spec["request"] = {
            "prompt": options.prompt,
            "max_tokens": options.max_tokens,
            "temp": options.temp,
            "seed": options.seed,
            "top_p": options.top_p,
            "top_k": options.top_k,
            "min_p": options.min_p,
            "repetition_penalty": options.repetition_penalty,
            "presence_penalty": options.presence_penalty,
            "stop": list(options.stop),
            "system": options.system,
            "tools": options.tools,
            "enable_thinking": options.enable_thinking,
            "reasoning_effort": options.reasoning_effort,
        }
        if options.image is not None:  # the spec is a JSON file: the bytes travel as base64
            spec["request"]["image_b64"] = base64.b64encode(options.image).decode()
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
            python=rank_python(e.host, hostfile.python),
            env=e.env,
            files=e.files,
            spec=job_spec(
                options,
                len(envs),
                e.rank,
                split_weights(hostfile),
                rank_model_path(hostfile, e.host, options.model),
            ),
            cwd=e.host.cwd,
            extra_env=hostfile.env,
            # chat: our stdin goes on; serve: the drain request travels on it
            stdin=(options.forward_stdin or options.command == "serve") and e.rank == 0,
        )
        for e in envs
    ]


def log(stderr: IO[str], message: str) -> None:
    stderr.write(f"mlx-cluster: {message}\n")
    stderr.flush()


def open_ranks(
    hostfile: Hostfile, launches: list[RankLaunch], job_dir: Path, accept_new_host_keys: bool
):
    """A LocalRank or RemoteRank per launch; SSH connections (one per host) opened in parallel."""
    remote_hosts = {r.host.index: r.host for r in launches if not r.host.is_local}
    clients = {}
    if remote_hosts:
        from concurrent.futures import ThreadPoolExecutor

        from .ssh import RemoteRank, SSHError, connect

        with ThreadPoolExecutor(max_workers=min(16, len(remote_hosts))) as pool:
            futures = {
                i: pool.submit(connect, h, hostfile, accept_new_host_keys)
                for i, h in remote_hosts.items()
            }
        errors = []
        for i, f in futures.items():
            try:
                clients[i] = f.result()
            except SSHError as e:
                errors.append(str(e))
        if errors:
            for c in clients.values():
                c.close()
            raise LaunchError("error: " + "\nerror: ".join(errors))
    ranks = [
        LocalRank(r, job_dir)
        if r.host.is_local
        else RemoteRank(
            r,
            clients[r.host.index],
            job_dir.name,
            reconnect=lambda h=r.host: connect(h, hostfile, accept_new_host_keys),
        )
        for r in launches
    ]
    return ranks, list(clients.values())


class Job:
    """The launcher's view of one running job: ranks, what each last said, and when."""

    def __init__(
        self,
        ranks,
        options: JobOptions,
        stdout: IO[bytes],
        stderr: IO[str],
        started: float,
        stdin: IO[bytes] | None = None,
    ):
        self.stdin = stdin
        self.ranks = ranks
        self.options = options
        self.stdout = stdout
        self.stderr = stderr
        self.started = started
        self.states = [
            RankState(r.rank, r.host.target, host_is_local=r.host.is_local) for r in ranks
        ]
        self.events: queue.Queue = queue.Queue()
        self.result = JobResult(exit_code=0)
        self.wrote_newline = True
        self.ready = 0
        self.drained = False  # serve: rank 0 was asked to drain (it then ends the job)

    def run(self) -> None:
        """Start every rank and follow them to the end; raise LaunchError on any failure."""
        now = time.monotonic()
        for r, state in zip(self.ranks, self.states, strict=True):
            state.last_seen = now
            try:
                r.start(self.events)
            except Exception as e:  # a rank that cannot start: stop those that did
                state.error = f"could not start: {e}"
                state.exit_code = 255
                self.fail(state)
        if self.options.forward_stdin:
            threading.Thread(
                target=_forward_stdin, args=(self.stdin, self.ranks[0]), daemon=True
            ).start()
        running = len(self.ranks)
        while running:
            try:
                kind, rank, payload = self.events.get(timeout=1.0)
            except queue.Empty:
                self.check_liveness()
                continue
            state = self.states[rank]
            state.last_seen = time.monotonic()
            if kind == "out":
                self.on_stdout(state, payload)
            elif kind == "err":
                self.on_stderr(state, payload)
            else:
                running -= 1
                state.exit_code = payload
                if payload != 0:
                    self.fail(state)
            self.check_liveness()

    def on_stdout(self, state: RankState, payload: bytes) -> None:
        if state.rank != 0:
            state.tail.extend(payload.decode("utf-8", "replace").splitlines())
            return
        if self.result.first_token_s is None:
            self.result.first_token_s = time.perf_counter() - self.started
        try:
            self.stdout.write(payload)
            self.stdout.flush()
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            raise Interrupted(signal.SIGPIPE) from None
        self.wrote_newline = payload.endswith(b"\n")

    def on_stderr(self, state: RankState, line: str) -> None:
        event = decode_event(line)
        if event is None:
            state.tail.append(line.rstrip("\n"))
            if self.options.verbose:
                self.stderr.write(f"[rank {state.rank} {state.host}] {line}")
            return
        _on_event(event, state, self.result)
        kind = event["event"]
        if kind == "first_token" and self.result.first_token_s is None:
            self.result.first_token_s = time.perf_counter() - self.started
        elif kind == "stats":
            ttft = self.result.first_token_s if self.options.command == "generate" else None
            log(self.stderr, _stats_line(event, ttft))
        elif kind == "bench_run":
            log(self.stderr, _bench_run_line(event))
        elif kind == "notice":
            log(self.stderr, event.get("message", ""))
        elif kind == "awaiting_input" and _isatty(self.stdin):
            self.stderr.write(">>> ")
            self.stderr.flush()
        if kind == "ready":
            self.ready += 1
            if self.options.verbose:
                self.stderr.write(f"[rank {state.rank} {state.host}] {_ready_line(event)}\n")
            if self.ready == len(self.ranks):
                self.result.ready_s = time.perf_counter() - self.started
                log(self.stderr, f"all ranks ready after {self.result.ready_s:.1f} s")

    def check_liveness(self) -> None:
        """A rank silent past the heartbeat timeout, or not ready by the start deadline, fails."""
        now = time.monotonic()
        silent = sorted(
            (
                s
                for s in self.states
                if s.exit_code is None and now - s.last_seen > self.options.heartbeat_timeout
            ),
            key=lambda s: s.last_seen,
        )
        if silent:
            # The rank silent longest most likely stopped first; the others may only be
            # waiting on it, and are named too so nothing is hidden.
            state = silent[0]
            state.unresponsive = True
            state.error = (
                f"sent nothing for {now - state.last_seen:.1f} s (heartbeat timeout "
                f"{self.options.heartbeat_timeout:g} s): the process is stopped or hung, or "
                "its host is unreachable"
            )
            if silent[1:]:
                others = ", ".join(
                    f"rank {s.rank} on {s.host} ({now - s.last_seen:.1f} s)" for s in silent[1:]
                )
                state.error += f"; also silent: {others}"
            self.fail(state)
        if (
            self.ready < len(self.ranks)
            and time.perf_counter() - self.started > self.options.start_timeout
        ):
            late = next(s for s in self.states if s.phase not in ("ready", "generating"))
            late.unresponsive = True
            late.error = (
                f"not ready after the start timeout of {self.options.start_timeout:g} "
                "s (--start-timeout)"
            )
            self.fail(late)

    def fail(self, state: RankState) -> None:
        self.stop_all()
        culprit = _culprit(state, self.states)
        raise LaunchError(
            _failure_report(culprit, self.states, len(self.ranks)),
            exit_code=2 if culprit.bad_model else 1,
        )

    def stop_all(self) -> None:
        _stop_all(self.ranks, self.states, self.events)


def run_job(
    hostfile: Hostfile,
    options: JobOptions,
    stdout: IO[bytes] | None = None,
    stderr: IO[str] | None = None,
    started: float | None = None,
    stdin: IO[bytes] | None = None,
) -> JobResult:
    """Run the job to the end; raises LaunchError (with an exit code) on any failure."""
    stdout = stdout or sys.stdout.buffer
    stdin = stdin or sys.stdin.buffer
    stderr = stderr or sys.stderr
    started = time.perf_counter() if started is None else started
    try:
        split = preflight(hostfile, options)
        launches = plan(hostfile, options)
    except (ModelError, ValueError) as e:
        raise LaunchError(f"error: {e}", exit_code=2) from e
    check_ports(hostfile, launches)

    job_dir = make_job_dir()
    clients = []
    job = None

    def tell_rank0(message: bytes, note: str) -> bool:
        """Write ``message`` to rank 0's stdin and log ``note``; False if it cannot be told."""
        if job is None:
            return False
        try:
            job.ranks[0].write_stdin(message)
        except (OSError, ValueError, EOFError):
            return False
        log(stderr, note)
        return True

    def cancel_answer() -> bool:
        """Chat: rank 0 ends the answer it is writing."""
        note = f"answer cancelled; Ctrl-C again within {QUIT_WINDOW_S:g} s ends the chat"
        return tell_rank0(CANCEL, note)

    def drain() -> bool:
        """Serve: rank 0 finishes the answers under way, then every rank quits."""
        note = (
            f"draining: finishing the answers under way (at most {options.drain_timeout:g} s); "
            "Ctrl-C again stops now"
        )
        job.drained = tell_rank0(END_OF_INPUT, note)
        return job.drained

    if options.command == "chat":
        previous = trap_signals(cancel_answer)
    elif options.command == "serve":
        previous = trap_signals(drain, once=True, signals=(signal.SIGINT, signal.SIGTERM))
    else:
        previous = trap_signals()
    try:
        ranks, clients = open_ranks(hostfile, launches, job_dir, options.accept_new_host_keys)
        job = Job(ranks, options, stdout, stderr, started, stdin)
        log(
            stderr,
            f"starting {len(ranks)} rank(s), {options.mode} mode, "
            f"{hostfile.backend} backend, model {options.model}",
        )
        if split:
            log(stderr, f"pipeline split, layers per rank: {','.join(map(str, split))}")
        job.run()
        if job.drained:
            log(stderr, "drained; all ranks stopped")
    except Interrupted as e:
        if job is not None:
            job.stop_all()
        if e.signum == signal.SIGPIPE:
            _silence_stdout(stdout)
            raise LaunchError("", exit_code=128 + e.signum) from None
        name = signal.Signals(e.signum).name
        raise LaunchError(
            f"mlx-cluster: stopped by {name}; all ranks stopped", exit_code=128 + e.signum
        ) from None
    finally:
        restore_signals(previous)
        if job is not None:
            for r in job.ranks:  # even on an unexpected error nothing may survive
                if r.poll() is None:
                    r.send_signal(signal.SIGKILL)
                    r.wait(STOP_GRACE_S)
                r.cleanup()
            if not job.wrote_newline and not stdout.closed and stdout.isatty():
                stdout.write(b"\n")
                stdout.flush()
        for c in clients:
            c.close()
        shutil.rmtree(job_dir, ignore_errors=True)

    result = job.result
    result.peak_memory_gb = [s.peak_memory_gb for s in job.states]
    result.load_s = [s.load_s for s in job.states]
    if any(m is not None for m in result.peak_memory_gb):
        shown = ", ".join(
            f"rank {r} {m:.3f} GB" for r, m in enumerate(result.peak_memory_gb) if m is not None
        )
        log(stderr, f"peak memory: {shown}")
    return result


def _stats_line(stats: dict, since_start: float | None) -> str:
    """One answer's numbers: prompt tokens prefilled (and reused from the cache), generation."""
    t = stats["timings"]
    if since_start is not None:
        first = f"first token {since_start:.2f} s after start"
    else:
        first = f"first token after {stats.get('time_to_first_token_s') or 0:.2f} s"
    return (
        f"prompt {t['prompt_n']} tokens at {t['prompt_per_second']:.1f} tok/s, cache "
        f"{t['cache_n']}, generated {t['predicted_n']} tokens at "
        f"{t['predicted_per_second']:.1f} tok/s ({stats['finish_reason']}), {first}"
    )


def _bench_run_line(run: dict) -> str:
    what = "warm-up run" if run["warmup"] else "run"
    gen = run.get("generation_tps")
    return (
        f"  {what} {run['run'] + 1}: first token after {run['ttft_s']:.3f} s, prefill "
        f"{run['prefill_tps']:.1f} tok/s, generation {gen or 0:.1f} tok/s"
    )


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _forward_stdin(stdin: IO[bytes], rank) -> None:
    """Copy our stdin to rank 0 as it arrives; EOF on ours becomes END_OF_INPUT, not a closed
    pipe, so a Ctrl-C after it can still cancel the answer."""
    fd = stdin.fileno()
    try:
        while data := os.read(fd, 65536):
            rank.write_stdin(data)
        rank.write_stdin(END_OF_INPUT)
    except (OSError, EOFError, ValueError):
        pass  # rank 0 is gone; its exit is reported by the main loop


def _ready_line(event: dict) -> str:
    layers = event.get("layers")
    where = f"layers {layers[0]}-{layers[1] - 1}" if layers else "all layers"
    files = ", ".join(event.get("files") or [])
    return f"loaded in {event.get('load_s', 0):.2f} s: {where}; weight files: {files}"


def _on_event(event: dict, state: RankState, result: JobResult | None) -> None:
    kind = event["event"]
    if kind == "phase":
        state.phase = event["phase"]
    elif kind == "ready":
        state.phase = "ready"
        state.load_s = event.get("load_s")
    elif kind.startswith("bench_"):
        result.bench.append({**event, "rank": state.rank})
    elif kind == "stats":
        result.stats = event
    elif kind == "memory":
        state.peak_memory_gb = event.get("peak_memory_gb")
    elif kind == "error":
        state.error = event.get("message")
        if not event.get("peer"):  # "rank 0 failed" is an effect, never the cause
            state.error_t = event.get("t")
        state.bad_model = event.get("cause") == "model"


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
    if failed.unresponsive:
        how = "stopped responding"
    elif failed.error_t is not None:
        # It said why. How it then exited says nothing more: a peer's failure can start the
        # teardown while this rank is still shutting down, and our SIGTERM ends it.
        how = "failed"
    elif code < 0:
        how = f"was killed by signal {-code}"
    elif code == 255 and not failed.host_is_local:
        how = "was killed by a signal or lost its SSH connection"
    else:
        how = f"exited with code {code}"
    lines = [
        f"error: rank {failed.rank} of {world} on {failed.host} {how} "
        f"{PHASE_WORDS.get(failed.phase, failed.phase)}"
    ]
    if failed.error:
        lines.append(f"  reason: {failed.error}")
    if failed.tail:
        lines.append(f"  last lines of rank {failed.rank} ({failed.host}):")
        lines.extend(f"    {line}" for line in failed.tail)
    hint = None if failed.bad_model else HINTS.get(failed.phase)  # the reason says what to do
    if hint:
        lines.append(f"  what to do: {hint.format(host=failed.host)}")
    lines.append("  every other rank was stopped")
    return "\n".join(lines)


def _stop_all(ranks: list[LocalRank], states: list[RankState], events: queue.Queue) -> None:
    """SIGTERM every live rank, SIGKILL what is left after a grace period, wait for all."""
    for r, st in zip(ranks, states, strict=True):
        st.stopped_by_us = st.exit_code is None
        r.send_signal(signal.SIGTERM)
        r.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) rank acts on the TERM only then
    deadline = time.monotonic() + STOP_GRACE_S
    for r in ranks:
        if r.wait(max(0.0, deadline - time.monotonic())) is None:
            r.send_signal(signal.SIGKILL)
            r.wait(STOP_GRACE_S)
    # Collect what the ranks printed on the way out, up to each one's exit (which comes after
    # all of its output): it belongs in the report, and says which rank failed first.
    deadline = time.monotonic() + STOP_GRACE_S
    while any(st.exit_code is None for st in states):
        try:
            kind, rank, payload = events.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if kind == "err":
            event = decode_event(payload)
            if event is None:
                states[rank].tail.append(payload.rstrip("\n"))
            elif event["event"] == "error":
                _on_event(event, states[rank], None)
        elif kind == "exit" and states[rank].exit_code is None:
            states[rank].exit_code = payload


def _culprit(failed: RankState, states: list[RankState]) -> RankState:
    """The rank that failed first. Its peers fail a moment later in a collective ("connection
    to a peer was lost", reported as peer errors) and their exits can even arrive first. So:
    the earliest error a rank reported as its own; else a rank that died without a word (a
    signal, a lost connection), preferring one the launcher did not stop itself."""
    if failed.unresponsive:
        return failed
    reported = [s for s in states if s.error_t is not None]
    if reported:
        return min(reported, key=lambda s: s.error_t)
    silent = [s for s in states if s.exit_code not in (None, 0) and s.error is None]
    silent.sort(key=lambda s: s.stopped_by_us)
    return silent[0] if silent else failed


def _silence_stdout(stdout) -> None:
    """After a broken pipe, point fd 1 at /dev/null so the exit-time flush cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


QUIT_WINDOW_S = 2.0  # a second Ctrl-C within this ends the chat session


def trap_signals(cancel=None, once: bool = False, signals=(signal.SIGINT,)):
    """SIGINT/TERM/HUP end the job (Interrupted). With ``cancel``, one of ``signals`` calls it
    instead: in chat a Ctrl-C ends the answer and a second one within QUIT_WINDOW_S ends the
    job; with ``once`` (serve: the drain) any later signal ends the job."""
    last_cancel = [float("-inf")]

    def handler(signum, frame):
        now = time.monotonic()
        fresh = now - last_cancel[0] > QUIT_WINDOW_S and not (once and last_cancel[0] > 0)
        if cancel is not None and signum in signals and fresh:
            last_cancel[0] = now
            if cancel():
                return
        raise Interrupted(signum)

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    return previous


def restore_signals(previous) -> None:
    for sig, h in previous.items():
        signal.signal(sig, h)
