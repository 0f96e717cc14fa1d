"""Run one job: start every rank, relay rank 0's text, stop everything at the end or on failure.

Whatever happens (a rank fails, the user presses Ctrl-C, the launcher gets SIGTERM), every rank
is stopped and waited for before we return, and the report names the rank, its host, what it
was doing and the last lines it printed. The bookkeeping (who said what, who failed first) is
``cluster.job.state``; this module is the I/O around it.
"""

from __future__ import annotations

import functools
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import IO, Protocol

from cluster.core.backends import BACKENDS
from cluster.core.blas import blas_env_here
from cluster.core.hostfile import Host, Hostfile, rank_model_path, split_weights
from cluster.core.modelcheck import (
    ModelError,
    check_kv_quant,
    check_request,
    choose_split,
    looks_like_repo,
    read_config,
)
from cluster.core.protocol import (
    END_OF_INPUT,
    KEEPALIVE,
    KEEPALIVE_S,
    START,
    WAKE,
    AwaitingInput,
    BadEvent,
    Error,
    Event,
    Phase,
    Ready,
    Wake,
    decode_event,
)
from cluster.core.spec import JobSpec, LaunchSettings
from cluster.core.tensorplan import check_mode
from cluster.job.backends import port_in_use, rank_envs, ring_ports
from cluster.job.process import STOP_GRACE_S, LocalRank, RankLaunch, make_job_dir, rank_python
from cluster.job.signals import (
    Interrupted,
    Running,
    policy_of,
    restore_signals,
    trap_for,
)
from cluster.job.state import (
    EXIT_PEER_FAILED,
    JobResult,
    JobState,
    RankState,
    blame_unreachable,
    culprit,
    failure_report,
    on_error,
    on_event,
    on_text,
    overdue,
    ready_line,
    silent_ranks,
)

PEER_REPORT_S = 5.0  # how long a rank that stopped for a peer's failure waits for that peer's
# error before the job stops every rank (a SIGTERM then would leave the peer unheard)


class LaunchError(RuntimeError):
    """The job could not start or did not finish; the message is for the user.
    ``lost_hosts``: hostfile indices of hosts that stopped answering (serve leaves them out)."""

    def __init__(self, message: str, exit_code: int = 1, lost_hosts: list[int] | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.lost_hosts = lost_hosts or []


class JobLink(Protocol):
    """What a caller that talks to a running job gets (serve's cluster.serve.service.Service)."""

    def attach(self, send: Callable[[bytes], None], state: JobState) -> None:
        """The ranks started; ``send`` writes to rank 0's channel."""

    def on_event(self, rank: int, event: Event) -> None: ...

    running: Running | None  # the job under way (run_job sets it)

    def draining(self, tell: bool = False) -> None:
        """The user asked for a drain (SIGINT/SIGTERM): refuse new requests; with ``tell``,
        write END_OF_INPUT to rank 0 after every request already sent (one channel, one
        order)."""


def preflight(hostfile: Hostfile, spec: JobSpec) -> list[str]:
    """Checks that need no rank: the model's config (when it is here). Returns what to tell
    the user about the split (pipeline layers, tensor heads, replicated KV heads)."""
    n = hostfile.world_size
    if spec.command == "links":  # no model
        return []
    if spec.mode not in BACKENDS[hostfile.backend].modes and n > 1:
        raise ModelError(BACKENDS[hostfile.backend].refused)
    if spec.split and n < 2:
        raise ModelError("--split is for 2 or more ranks")
    if spec.micro_batches > 1 and spec.mode != "pipeline":
        raise ModelError(
            "--micro-batches splits a pipeline's batch so its stages work at once; tensor "
            "mode has no stages to keep busy (use --mode pipeline, or leave it at 1)"
        )
    path = Path(spec.model).expanduser()
    elsewhere = not path.exists() and not all(h.is_local for h in hostfile.hosts)
    if looks_like_repo(spec.model) or elsewhere:  # the hosts fetch or hold it; each checks
        check_mode({}, spec.mode, n)
        return []
    config = read_config(path)
    weights = spec.split or split_weights(hostfile)
    plan = check_mode(config, spec.mode, n, weights)
    check_request(config, spec.command, spec.request.image is not None, spec.model)
    check_kv_quant(config, spec.kv_quant.kv_bits, spec.kv_quant.kv_group_size)
    if plan is not None:
        kv_note = plan.kv_note()
        notes = [kv_note] if kv_note else []
        if weights:
            heads = ",".join(str(b - a) for a, b in plan.heads)
            notes.insert(0, f"tensor split in proportion {weights}: query heads per rank {heads}")
        return notes
    if spec.mode != "pipeline" or n < 2:
        return []
    split = choose_split(config, n, spec.split, split_weights(hostfile))
    return [f"pipeline split, layers per rank: {','.join(map(str, split))}"] if split else []


def check_ports(launches: list[RankLaunch]) -> None:
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


def rank_launches(hostfile: Hostfile, spec: JobSpec, launch: LaunchSettings) -> list[RankLaunch]:
    """Each rank's start: its host, python, environment, files and its view of the job."""
    local = Path(spec.model).expanduser()
    if spec.model and local.exists():  # ranks may run in another directory
        spec = replace(spec, model=str(local.resolve()))
    envs = rank_envs(hostfile, launch.starting_port, launch.connections_per_ip, launch.verbose)
    per_host = [sum(1 for o in envs if o.host.index == e.host.index) for e in envs]
    return [
        RankLaunch(
            rank=e.rank,
            host=e.host,
            python=rank_python(e.host, hostfile.python),
            env=e.env,
            files=e.files,
            spec=spec.for_rank(
                e.rank,
                world_size=len(envs),
                split_weights=split_weights(hostfile),
                model=rank_model_path(hostfile, e.host, spec.model) if spec.model else "",
                ranks_on_host=per_host[e.rank],
                device=e.host.device or "",
                launcher_timeout=launch.heartbeat_timeout,
                backend=hostfile.backend,
                handoff=replace(spec.handoff, host=e.host.address),
            ).to_json(),
            cwd=e.host.cwd,
            extra_env={
                **hostfile.env,
                **local_blas(e.host, spec.blas, per_host[e.rank], hostfile.env),
            },  # fmt: skip
        )
        for e in envs
    ]


def local_blas(host: Host, mode: str, ranks_on_host: int, extra_env: dict[str, str]) -> dict:
    """A rank on this machine gets its BLAS from the launcher (cluster.core.blas), so it starts
    once instead of starting again with OpenBLAS preloaded; a remote rank decides on its host."""
    if not host.is_local:
        return {}
    return blas_env_here(mode, ranks_on_host, {**os.environ, **extra_env}) or {}


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

        from cluster.job.ssh import RemoteRank, SSHError, connect

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
            reconnect=functools.partial(connect, r.host, hostfile, accept_new_host_keys),
        )
        for r in launches
    ]
    return ranks, list(clients.values())


class RankWatch:
    """The I/O loop of one running job: starts the ranks, takes their output off the queue,
    feeds it to ``cluster.job.state`` and prints what that says."""

    def __init__(
        self,
        ranks,
        command: str,
        launch: LaunchSettings,
        stdout: IO[bytes],
        stderr: IO[str],
        started: float,
        stdin: IO[bytes] | None = None,
        link: JobLink | None = None,
    ):
        self.stdin = stdin
        self.link = link
        self.ranks = ranks
        self.launch = launch
        self.stdout = stdout
        self.stderr = stderr
        self.started = started
        self.state = JobState(
            [RankState(r.rank, r.host.target, host_is_local=r.host.is_local) for r in ranks],
            command=command,
        )
        self.forward_stdin = policy_of(command).forward_stdin
        self.events: queue.Queue = queue.Queue()
        self.wrote_newline = True
        self.drained = False  # serve: rank 0 was asked to drain (it then ends the job)
        self.started_all = False  # START was sent: every rank reached Phase("init")
        self.stopping = False  # no keepalives once we stop: a rank we cannot reach ends itself
        # a rank that stopped because another failed, and when: that one says why in a moment
        self.peer_stopped: tuple[RankState, float] | None = None

    @property
    def result(self) -> JobResult:
        return self.state.result

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def run(self) -> None:
        """Start every rank and follow them to the end; raise LaunchError on any failure."""
        for r, state in zip(self.ranks, self.state.ranks, strict=True):
            try:
                r.start(self.events)
                # its heartbeat timeout counts from its own start: starting a rank over SSH
                # takes a while, and the ranks start one after another
                state.last_seen = time.monotonic()
            except Exception as e:  # a rank that cannot start: stop those that did
                state.error = f"could not start: {e}"
                state.exit_code = 255
                self.fail(state)
        if self.forward_stdin:
            threading.Thread(
                target=_forward_stdin, args=(self.stdin, self.ranks[0]), daemon=True
            ).start()
        threading.Thread(target=self.keep_alive, daemon=True, name="keepalive").start()
        if self.link is not None:
            self.link.attach(self.ranks[0].write_stdin, self.state)
        running = len(self.ranks)
        while running:
            try:
                kind, rank, payload = self.events.get(timeout=1.0)
            except queue.Empty:
                self.check_liveness()
                continue
            if kind == "interrupt":  # Running.interrupt: a signal another thread took
                raise Interrupted(payload)
            state = self.state.ranks[rank]
            state.last_seen = time.monotonic()
            if kind == "out":
                if on_text(self.state, rank, payload, self.elapsed()):
                    self.write_text(payload)
            elif kind == "err":
                self.on_stderr(state, payload)
            else:
                running -= 1
                state.exit_code = payload
                if payload == EXIT_PEER_FAILED and running and self.peer_stopped is None:
                    self.peer_stopped = (state, time.monotonic())  # stop the rest after it
                elif payload != 0:
                    self.fail(state)
            self.check_liveness()
        if self.peer_stopped is not None:  # every rank ended, the failed one without a word
            self.fail(self.peer_stopped[0])

    def keep_alive(self) -> None:
        """KEEPALIVE to every live rank once a second: a rank that hears nothing for the
        heartbeat timeout ends itself (node.watchdog)."""
        while not self.stopping:
            for r, state in zip(self.ranks, self.state.ranks, strict=True):
                if state.exit_code is None and not state.unresponsive and not self.stopping:
                    try:
                        r.write_stdin(KEEPALIVE)
                    except (OSError, ValueError, EOFError, AttributeError):
                        pass  # not started, or gone: the main loop reports it
            time.sleep(KEEPALIVE_S)

    def write_text(self, payload: bytes) -> None:
        try:
            self.stdout.write(payload)
            self.stdout.flush()
        except BrokenPipeError:  # `| head`: the reader has what it wanted
            raise Interrupted(signal.SIGPIPE) from None
        self.wrote_newline = payload.endswith(b"\n")

    def on_stderr(self, state: RankState, line: str) -> None:
        """One line of a rank's stderr: an event, or a log line for its tail. A line that
        starts as an event and is not a valid one from this rank is the rank's fault: the
        job fails naming it (serve restarts the ranks), never the launcher."""
        try:
            event = decode_event(line, state.rank)
        except BadEvent as e:
            state.tail.append(line.rstrip("\n")[:500])
            return self.misbehaved(state, f"sent an event the launcher cannot take ({e})")
        if event is None:
            state.tail.append(line.rstrip("\n"))
            if self.launch.verbose:
                self.stderr.write(f"[rank {state.rank} {state.host}] {line}")
            return
        try:
            said = on_event(self.state, state.rank, event, self.elapsed())
        except Exception as e:  # a field no check foresaw: still this rank's, not ours
            return self.misbehaved(state, f"sent a {event.kind} event the launcher cannot "
                                          f"take ({type(e).__name__}: {e})")  # fmt: skip
        for say in said:
            self.say(say.text)
        if isinstance(event, Phase) and not self.started_all:
            self.start_together()
        if isinstance(event, Wake):
            self.wake_others(state.rank)
        if self.link is not None:
            self.link.on_event(state.rank, event)
        if isinstance(event, AwaitingInput) and _isatty(self.stdin):
            self.stderr.write(">>> ")
            self.stderr.flush()
        elif isinstance(event, Ready) and self.launch.verbose:
            self.stderr.write(f"[rank {state.rank} {state.host}] {ready_line(event)}\n")

    def say(self, text: str) -> None:
        """A line for the user on stderr. When stdout and stderr are one terminal and the
        answer's text so far has no final newline, the line starts on a line of its own (the
        stats line after an answer that ends mid-line)."""
        if not self.wrote_newline and _isatty(self.stdout) and _isatty(self.stderr):
            try:
                self.stdout.write(b"\n")
                self.stdout.flush()
                self.wrote_newline = True
            except (OSError, ValueError):
                pass
        log(self.stderr, text)

    def misbehaved(self, state: RankState, why: str) -> None:
        state.error, state.misbehaved = why, True
        self.fail(state)

    def wake_others(self, waker: int) -> None:
        """Rank 0 has work after a rest: every other rank leaves its own (protocol.WAKE)."""
        for r in self.ranks:
            if r.rank == waker:
                continue
            try:
                r.write_stdin(WAKE)
            except (OSError, ValueError, EOFError, AttributeError):
                pass  # gone: the main loop reports it

    def start_together(self) -> None:
        """Once every rank waits at Phase("init"), START to each: they join the group
        together (cluster.core.protocol.START)."""
        if any(s.phase == "starting" for s in self.state.ranks):
            return
        self.started_all = True
        for r in self.ranks:
            try:
                r.write_stdin(START)
            except (OSError, ValueError, EOFError, AttributeError):
                pass  # gone: the main loop reports it

    def check_liveness(self) -> None:
        if self.peer_stopped is not None:
            # its peer's error, or PEER_REPORT_S without one: then the job stops
            stopped, since = self.peer_stopped
            said = any(s.error_t is not None for s in self.state.ranks)
            if said or time.monotonic() - since > PEER_REPORT_S:
                self.fail(stopped)
        late = overdue(
            self.state,
            time.monotonic(),
            self.elapsed(),
            self.launch.heartbeat_timeout,
            self.launch.start_timeout,
            self.launch.stall_timeout,
        )
        if late is None:
            return
        if late.unresponsive:  # a silent rank's host is probed once (bounded); one that does
            # not answer is marked lost: no signal is tried on it, its rank's watcher ends it
            silent = silent_ranks(self.state, time.monotonic(), self.launch.heartbeat_timeout)
            if silent:
                late = blame_unreachable(late, silent, self.probe_hosts(silent))
        self.fail(late)

    def probe_hosts(self, states: list[RankState]) -> dict[int, bool]:
        """rank -> whether its host answers a trivial command now, all asked at once."""
        answers: dict[int, bool] = {}

        def ask(rank: int) -> None:
            answers[rank] = self.ranks[rank].host_answers()

        askers = [threading.Thread(target=ask, args=(s.rank,), daemon=True) for s in states]
        for t in askers:
            t.start()
        for t in askers:
            t.join()
        return answers

    def fail(self, state: RankState) -> None:
        self.stop_all()
        first = culprit(state, self.state.ranks)
        lost = sorted({r.host.index for r in self.ranks if r.lost})
        raise LaunchError(
            failure_report(first, self.state.ranks),
            exit_code=2 if first.bad_model else 1,
            lost_hosts=lost,
        )

    def stop_all(self) -> None:
        self.stopping = True
        _stop_all(self.ranks, self.state.ranks, self.events)


def run_job(
    hostfile: Hostfile,
    spec: JobSpec,
    launch: LaunchSettings | None = None,
    stdout: IO[bytes] | None = None,
    stderr: IO[str] | None = None,
    started: float | None = None,
    stdin: IO[bytes] | None = None,
    link: JobLink | None = None,
    trap: bool = True,
) -> JobResult:
    """Run the job to the end; raises LaunchError (with an exit code) on any failure.
    ``link`` (serve) is told when the ranks start and end, and gets every event. Without
    ``trap`` (a fleet's group, on a thread of its own) the job takes no signal: the caller
    acts through ``link.running`` (its drain, ``interrupt``)."""
    launch = launch or LaunchSettings()
    stdout = stdout or sys.stdout.buffer
    stdin = stdin or sys.stdin.buffer
    stderr = stderr or sys.stderr
    started = time.perf_counter() if started is None else started
    try:
        notes = preflight(hostfile, spec)
        launches = rank_launches(hostfile, spec, launch)
    except (ModelError, ValueError) as e:
        raise LaunchError(f"error: {e}", exit_code=2) from e
    check_ports(launches)

    job_dir = make_job_dir()
    clients = []
    watch: RankWatch | None = None

    running = Running(spec, link, stderr)
    previous = trap_for(running) if trap else {}
    if link is not None:
        link.running = running
    try:
        ranks, clients = open_ranks(hostfile, launches, job_dir, launch.accept_new_host_keys)
        watch = RankWatch(ranks, spec.command, launch, stdout, stderr, started, stdin, link)
        running.watch = watch
        if running.stopped is not None:  # interrupted before there was a watch to tell
            watch.events.put(("interrupt", 0, running.stopped))
        what = f"{spec.mode} mode, model {spec.model}" if spec.model else "to measure the links"
        log(stderr, f"starting {len(ranks)} rank(s), {hostfile.backend} backend, {what}")
        for note in notes:
            log(stderr, note)
        watch.run()
        if watch.drained:
            log(stderr, "drained; all ranks stopped")
    except Interrupted as e:
        if watch is not None:
            watch.stop_all()
        if e.signum == signal.SIGPIPE:
            _silence_stdout(stdout)
            raise LaunchError("", exit_code=128 + e.signum) from None
        name = signal.Signals(e.signum).name
        raise LaunchError(
            f"mlx-cluster: stopped by {name}; all ranks stopped", exit_code=128 + e.signum
        ) from None
    finally:
        restore_signals(previous)
        if watch is not None:
            for r in watch.ranks:  # even on an unexpected error nothing may survive
                if r.poll() is None:
                    r.send_signal(signal.SIGKILL)
                    r.wait(STOP_GRACE_S)
                r.cleanup()
            if not watch.wrote_newline and not stdout.closed and stdout.isatty():
                stdout.write(b"\n")
                stdout.flush()
        for c in clients:
            c.close()
        shutil.rmtree(job_dir, ignore_errors=True)

    result = watch.result
    result.peak_memory_gb = [s.peak_memory_gb for s in watch.state.ranks]
    result.load_s = [s.load_s for s in watch.state.ranks]
    if any(m is not None for m in result.peak_memory_gb):
        shown = ", ".join(
            f"rank {r} {m:.3f} GB" for r, m in enumerate(result.peak_memory_gb) if m is not None
        )
        log(stderr, f"peak memory: {shown}")
    return result


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


def _stop_one(rank) -> None:
    """SIGTERM, then SIGKILL after the grace period if the rank is still there."""
    rank.send_signal(signal.SIGTERM)
    rank.send_signal(signal.SIGCONT)  # a stopped (SIGSTOP) rank acts on the TERM only then
    if rank.wait(STOP_GRACE_S) is None:
        rank.send_signal(signal.SIGKILL)
        rank.wait(STOP_GRACE_S)


def _stop_all(ranks: list, states: list[RankState], events: queue.Queue) -> None:
    """Stop every live rank, all at once (a host that cannot be reached costs its own
    bounded attempt, not the others' time), and wait for them."""
    for st in states:
        st.stopped_by_us = st.exit_code is None
    stoppers = [threading.Thread(target=_stop_one, args=(r,), daemon=True) for r in ranks]
    for t in stoppers:
        t.start()
    deadline = time.monotonic() + 2 * STOP_GRACE_S + 1
    for t in stoppers:
        t.join(max(0.0, deadline - time.monotonic()))
    # Collect what the ranks printed on the way out, up to each one's exit (which comes after
    # all of its output): it belongs in the report, and says which rank failed first. A rank
    # on a host that stopped answering has nothing more to say.
    deadline = time.monotonic() + STOP_GRACE_S
    while any(st.exit_code is None and not r.lost for r, st in zip(ranks, states, strict=True)):
        try:
            kind, rank, payload = events.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if kind == "err":
            try:
                event = decode_event(payload, rank)
            except BadEvent:
                event = None
            if event is None:
                states[rank].tail.append(payload.rstrip("\n"))
            elif isinstance(event, Error):
                on_error(states[rank], event)
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
