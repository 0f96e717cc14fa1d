"""The launcher's bookkeeping of one job, as plain functions of (state, event).

No processes, no I/O: ``cluster.job.launcher`` feeds what the ranks say into ``on_event`` /
``on_exit`` / ``overdue`` and prints what they return; tests drive them directly. The failure
report (which rank failed first, on which host, doing what, and what to do) is built here too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cluster.core.gpus import shared_gpu_warning
from cluster.core.protocol import (
    AwaitingInput,
    Beat,
    BenchComm,
    BenchRun,
    Error,
    Event,
    FirstToken,
    Gpu,
    LinkReport,
    Memory,
    Notice,
    Phase,
    Prefill,
    Ready,
    Stats,
    Wake,
)

EXIT_PEER_FAILED = 3  # a rank that stopped because rank 0 failed (see node.__main__)
TAIL_LINES = 15


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
    disk_bytes: tuple[int, int] | None = None  # its disk prompt cache's bytes read, written
    handoff_bytes: int | None = None  # a decode rank's: handed-off KV its door holds
    load_s: float | None = None  # how long the rank took to load its shard
    layers: list[int] | None = None  # [first, end) of its pipeline stage; None: all layers
    progress: int = -1  # the last beat's step count
    progress_at: float = 0.0  # job time (elapsed) when it last changed
    idle: bool = False  # waits for the user on purpose: no progress is expected
    stalled: bool = False  # given up on because no rank made progress (a stuck collective)
    misbehaved: bool = False  # sent what the launcher cannot take (a malformed event)
    gpu: Gpu | None = None  # the NVIDIA GPU its MLX device is, when its host has one


@dataclass
class JobResult:
    exit_code: int
    stats: Stats | None = None
    first_token_s: float | None = None
    ready_s: float | None = None
    peak_memory_gb: list[float | None] = field(default_factory=list)  # per rank, rank 0 first
    load_s: list[float | None] = field(default_factory=list)  # per rank
    bench_runs: list[BenchRun] = field(default_factory=list)  # rank 0's
    bench_comm: list[tuple[int, BenchComm]] = field(default_factory=list)  # (rank, counts)
    links: LinkReport | None = None  # doctor --links (rank 0's)


@dataclass
class JobState:
    ranks: list[RankState]
    command: str = "generate"
    result: JobResult = field(default_factory=lambda: JobResult(exit_code=0))
    ready: int = 0  # ranks that reported Ready
    prefill_from: float | None = None  # when the prompt's prefill began (seconds into the job)
    prefill_said: float = 0.0  # when progress was last shown

    @property
    def all_ready(self) -> bool:
        return self.ready == len(self.ranks)


@dataclass
class Say:
    """A line for the user's stderr (``prefix``: mlx-cluster's own, else as it is)."""

    text: str
    prefix: bool = True


PREFILL_SHOWN_FROM = 4096  # prompt tokens: a shorter prefill needs no progress line
PREFILL_EVERY_S = 2.0


def prefill_progress(job: JobState, event: Prefill, elapsed: float) -> list[Say]:
    """A long prompt's prefill: tokens done, the rate so far and the time left, every
    PREFILL_EVERY_S."""
    if event.done == 0 or job.prefill_from is None:
        job.prefill_from, job.prefill_said = elapsed, elapsed
    if event.total < PREFILL_SHOWN_FROM or not 0 < event.done < event.total:
        return []
    if elapsed - job.prefill_said < PREFILL_EVERY_S:
        return []
    job.prefill_said = elapsed
    rate = event.done / max(elapsed - job.prefill_from, 1e-9)
    left = (event.total - event.done) / rate
    return [Say(f"prefill {event.done}/{event.total} tokens ({100 * event.done // event.total}%)"
                f", {rate:.0f} tok/s, about {left:.0f} s left")]  # fmt: skip


def on_event(job: JobState, rank: int, event: Event, elapsed: float) -> list[Say]:
    """Take one event of ``rank``; ``elapsed``: seconds since the job started. Returns what
    to tell the user."""
    state = job.ranks[rank]
    said: list[Say] = []
    if isinstance(event, Phase):
        state.phase = event.phase
    elif isinstance(event, Ready):
        state.phase = "ready"
        state.load_s = event.load_s
        state.layers = event.layers
        job.ready += 1
        if job.all_ready:
            job.result.ready_s = elapsed
            said.append(Say(f"all ranks ready after {elapsed:.1f} s"))
    elif isinstance(event, Prefill):
        said += prefill_progress(job, event, elapsed)
    elif isinstance(event, FirstToken):
        if job.result.first_token_s is None:
            job.result.first_token_s = elapsed
    elif isinstance(event, Stats):
        job.result.stats = event
        ttft = job.result.first_token_s if job.command == "generate" else None
        said.append(Say(stats_line(event, ttft)))
    elif isinstance(event, BenchRun):
        job.result.bench_runs.append(event)
        said.append(Say(bench_run_line(event)))
    elif isinstance(event, BenchComm):
        job.result.bench_comm.append((rank, event))
    elif isinstance(event, LinkReport):
        job.result.links = event
    elif isinstance(event, Memory):
        state.peak_memory_gb = event.peak_memory_gb
        if event.disk_read_bytes is not None:
            state.disk_bytes = (event.disk_read_bytes, event.disk_written_bytes or 0)
        if event.handoff_bytes is not None:
            state.handoff_bytes = event.handoff_bytes
    elif isinstance(event, Notice):
        said.append(Say(event.message))
    elif isinstance(event, Error):
        on_error(state, event)
    elif isinstance(event, AwaitingInput):
        pass  # the launcher shows a prompt when its stdin is a terminal
    elif isinstance(event, Wake):
        pass  # the launcher wakes the other ranks (RankWatch.wake_others)
    elif isinstance(event, Gpu):
        state.gpu = event
        said += shared_gpu(job, rank)
    elif isinstance(event, Beat):
        if event.progress != state.progress or event.idle:
            state.progress, state.progress_at = event.progress, elapsed
        state.idle = event.idle
    return said


def shared_gpu(job: JobState, rank: int) -> list[Say]:
    """Once every rank of ``rank``'s host said its GPU: a warning for each GPU that several
    of them would use (cluster.core.gpus)."""
    host = job.ranks[rank].host
    here = [(r.rank, r.gpu) for r in job.ranks if r.host == host]
    if any(gpu is None for _, gpu in here):
        return []
    by_gpu: dict[int, list[tuple[int, Gpu]]] = {}
    for r, gpu in here:
        if gpu is not None:
            by_gpu.setdefault(gpu.index, []).append((r, gpu))
    said = []
    for index, sharing in sorted(by_gpu.items()):
        if len(sharing) > 1:
            gpu = sharing[0][1]
            what = f"GPU {index} ({gpu.name}, {gpu.memory_gb:.0f} GB)"
            ranks = [r for r, _ in sharing]
            said.append(Say(shared_gpu_warning(ranks, what, host, gpu.mlx_cuda)))
    return said


def on_error(state: RankState, event: Error) -> None:
    state.error = event.message
    if not event.peer:  # "rank 0 failed" is an effect, never the cause
        state.error_t = event.t
    state.bad_model = event.cause in ("model", "setup")


def on_text(job: JobState, rank: int, text: bytes, elapsed: float) -> bool:
    """Stdout of ``rank``: True when it goes to the user (rank 0's), else kept in the tail."""
    if rank != 0:
        job.ranks[rank].tail.extend(text.decode("utf-8", "replace").splitlines())
        return False
    if job.result.first_token_s is None:
        job.result.first_token_s = elapsed
    return True


def overdue(
    job: JobState,
    now: float,
    elapsed: float,
    heartbeat_timeout: float,
    start_timeout: float,
    stall_timeout: float = 0.0,
) -> RankState | None:
    """The rank to give up on: silent past the heartbeat timeout, not ready by the start
    deadline, or (rank 0, for all) no rank making progress past the stall timeout while all
    still beat; None while all is well. Marks it unresponsive (or stalled) with the reason."""
    silent = silent_ranks(job, now, heartbeat_timeout)
    if silent:
        # The rank silent longest most likely stopped first; the others may only be
        # waiting on it, and are named too so nothing is hidden.
        state = silent[0]
        state.unresponsive = True
        state.error = (
            f"sent nothing for {now - state.last_seen:.1f} s (heartbeat timeout "
            f"{heartbeat_timeout:g} s): the process is stopped or hung, or its host is "
            "unreachable"
        )
        if silent[1:]:
            others = ", ".join(
                f"rank {s.rank} on {s.host} ({now - s.last_seen:.1f} s)" for s in silent[1:]
            )
            state.error += f"; also silent: {others}"
        return state
    if not job.all_ready and elapsed > start_timeout:
        late = next(s for s in job.ranks if s.phase not in ("ready", "generating"))
        late.unresponsive = True
        late.error = f"not ready after the start timeout of {start_timeout:g} s (--start-timeout)"
        return late
    return stalled(job, elapsed, stall_timeout)


def silent_ranks(job: JobState, now: float, heartbeat_timeout: float) -> list[RankState]:
    """Live ranks that sent nothing for the heartbeat timeout, silent longest first."""
    silent = [s for s in job.ranks if s.exit_code is None and now - s.last_seen > heartbeat_timeout]
    return sorted(silent, key=lambda s: s.last_seen)


def blame_unreachable(
    late: RankState, silent: list[RankState], answers: dict[int, bool]
) -> RankState:
    """Among silent ranks, the one whose host does not answer is the cause: a rank on a host
    that answers may only wait on it (MLX holds the GIL in some waits, so it cannot beat).
    ``answers``: rank -> its host answered a probe. Marks the unreachable ones unresponsive
    and says of each silent rank which it was."""
    cut = [s for s in silent if not answers.get(s.rank, True)]
    if not cut:
        late.error = f"{late.error}; its host answers: the process is hung, or waits on a peer"
        return late
    first = cut[0]
    first.unresponsive = True
    first.error = (
        "sent nothing past the heartbeat timeout and its host does not answer over SSH: it is "
        "down, asleep or cut off from this machine (check it is awake and its network is up, "
        "then run again)"
    )
    waiting = [f"rank {s.rank} on {s.host}" for s in silent if s not in cut]
    if waiting:
        first.error += f"; also silent, on hosts that answer (waiting on it): {', '.join(waiting)}"
    if cut[1:]:
        more = ", ".join(f"rank {s.rank} on {s.host}" for s in cut[1:])
        first.error += f"; hosts that do not answer either: {more}"
    for s in cut:
        s.unresponsive = True
    return first


def stalled(job: JobState, elapsed: float, stall_timeout: float) -> RankState | None:
    """Every rank beats (MLX releases the GIL in a collective) but none has finished a step
    for ``stall_timeout``: a collective that cannot complete, as when a link between two
    ranks is down while the launcher still reaches both. Reported on rank 0, naming all."""
    live = [s for s in job.ranks if s.exit_code is None]
    if not stall_timeout or not job.all_ready or not live or any(s.idle for s in live):
        return None
    since = max([job.result.ready_s or 0.0, *(s.progress_at for s in live)])
    if elapsed - since <= stall_timeout:
        return None
    state = job.ranks[0]
    state.stalled = True
    hosts = ", ".join(dict.fromkeys(s.host for s in job.ranks))
    state.error = (
        f"no rank made progress for {elapsed - since:.1f} s (--stall-timeout "
        f"{stall_timeout:g} s) while every rank still sends heartbeats: a collective cannot "
        f"complete. The launcher reaches every host, so a link between the ranks is most "
        f"likely down or dropping everything; check the cables and addresses of {hosts} "
        "(the hostfile's ips), and run with --verbose to see MLX's log"
    )
    return state


def stats_line(stats: Stats, since_start: float | None) -> str:
    """One answer's numbers: prompt tokens prefilled (and reused from the cache), generation."""
    t = stats.timings
    if since_start is not None:
        first = f"first token {since_start:.2f} s after start"
    else:
        first = f"first token after {stats.time_to_first_token_s or 0:.2f} s"
    drafted = ""
    if "draft_n" in t:
        share = t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else 0.0
        drafted = f", {t['draft_n_accepted']} of {t['draft_n']} drafted accepted ({share:.0%})"
    disk = f" ({t['cache_disk_n']} from disk)" if t.get("cache_disk_n") else ""
    return (
        f"prompt {t['prompt_n']} tokens at {t['prompt_per_second']:.1f} tok/s, cache "
        f"{t['cache_n']}{disk}, generated {t['predicted_n']} tokens at "
        f"{t['predicted_per_second']:.1f} tok/s ({stats.finish_reason}){drafted}, {first}"
    )


def bench_run_line(run: BenchRun) -> str:
    what = "warm-up run" if run.warmup else "run"
    return (
        f"  {what} {run.run + 1}: first token after {run.ttft_s:.3f} s, prefill "
        f"{run.prefill_tps:.1f} tok/s, generation {run.generation_tps or 0:.1f} tok/s"
    )


def ready_line(event: Ready) -> str:
    where = f"layers {event.layers[0]}-{event.layers[1] - 1}" if event.layers else "all layers"
    return f"loaded in {event.load_s:.2f} s: {where}; weight files: {', '.join(event.files)}"


PHASE_WORDS = {
    "starting": "while starting",
    "init": "while joining the distributed group",
    "links": "while measuring the links",
    "loading": "while loading the model",
    "ready": "after loading, before generating",
    "generating": "while generating",
}
HINTS = {
    "init": "check that the ranks can reach each other on the hostfile's ips and ports "
    "(firewall, cable, --starting-port); run with --verbose to see MLX's ring log",
    "links": "run `mlx-cluster doctor --links` with this hostfile: it names a bad link",
    "loading": "check the model files on {host}: a truncated or missing file means an "
    "incomplete copy or download; copy the model again",
}


def culprit(failed: RankState, states: list[RankState]) -> RankState:
    """The rank that failed first. Its peers fail a moment later in a collective ("connection
    to a peer was lost", reported as peer errors) and their exits can even arrive first. So:
    the earliest error a rank reported as its own; else a rank that died without a word (a
    signal, a lost connection), preferring one the launcher did not stop itself."""
    if failed.unresponsive or failed.stalled or failed.misbehaved:
        return failed
    reported = [s for s in states if s.error_t is not None]
    if reported:
        return min(reported, key=lambda s: s.error_t or 0.0)
    silent = [s for s in states if s.exit_code not in (None, 0) and s.error is None]
    silent.sort(key=lambda s: s.stopped_by_us)
    return silent[0] if silent else failed


def failure_report(failed: RankState, states: list[RankState]) -> str:
    # A rank that stopped because rank 0 failed points at rank 0: report the cause.
    if failed.exit_code == EXIT_PEER_FAILED and states[0].exit_code not in (None, 0):
        failed = states[0]
    code = failed.exit_code
    if failed.stalled:
        how = "waits with every other rank in a collective that does not complete"
    elif failed.misbehaved:
        how = "misbehaved"
    elif failed.unresponsive:
        how = "stopped responding"
    elif failed.error_t is not None:
        # It said why. How it then exited says nothing more: a peer's failure can start the
        # teardown while this rank is still shutting down, and our SIGTERM ends it.
        how = "failed"
    elif code is not None and code < 0:
        how = f"was killed by signal {-code}"
    elif code == 255 and not failed.host_is_local:
        how = "was killed by a signal or lost its SSH connection"
    else:
        how = f"exited with code {code}"
    lines = [
        f"error: rank {failed.rank} of {len(states)} on {failed.host} {how} "
        f"{PHASE_WORDS.get(failed.phase, failed.phase)}"
    ]
    if failed.error:
        lines.append(f"  reason: {failed.error}")
    if failed.tail:
        lines.append(f"  last lines of rank {failed.rank} ({failed.host}):")
        lines.extend(f"    {line}" for line in failed.tail)
    hint = None if failed.bad_model else HINTS.get(failed.phase)  # the reason says what to do
    if failed.misbehaved:
        hint = ("check that {host} runs the launcher's version of mlx-cluster (mlx-cluster "
                "install); if it does, this is a bug: report it with these lines")  # fmt: skip
    if hint:
        lines.append(f"  what to do: {hint.format(host=failed.host)}")
    lines.append("  every other rank was stopped")
    return "\n".join(lines)
