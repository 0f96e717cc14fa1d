"""What Ctrl-C (SIGINT), SIGTERM and SIGHUP do to a job, by command: they stop it (every rank
stopped, 128 + the signal), except in chat, where a Ctrl-C ends the answer being written (a
second within QUIT_WINDOW_S ends the session), and in serve, where the first SIGINT or SIGTERM
drains (answers under way finish, then every rank quits) and the next one stops at once.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from cluster.core.protocol import CANCEL, END_OF_INPUT
from cluster.core.spec import JobSpec

QUIT_WINDOW_S = 2.0  # a second Ctrl-C within this ends the chat session


class Interrupted(BaseException):
    """A signal that ends the job; a BaseException (like KeyboardInterrupt) so that no
    ``except Exception`` on the way (a rank that fails to start) takes it for an error."""

    def __init__(self, signum: int):
        self.signum = signum


@dataclass
class Running:
    """The job a signal acts on: its spec, serve's link, stderr, and (once the ranks started)
    the launcher's watch of them (cluster.job.launcher.RankWatch)."""

    spec: JobSpec
    link: Any  # cluster.job.launcher.JobLink (serve) or None
    stderr: IO[str]
    watch: Any = None
    stopped: int | None = None  # the signal ``interrupt`` was given

    def interrupt(self, signum: int) -> None:
        """Stop the job as a signal would, from another thread (a fleet's groups run on
        threads, and only the main thread takes signals)."""
        self.stopped = signum  # first: run_job reads it once the watch is set
        if self.watch is not None:
            self.watch.events.put(("interrupt", 0, signum))

    def tell_rank0(self, message: bytes, note: str) -> bool:
        """Write ``message`` to rank 0's stdin and say ``note``; False if it cannot be told
        (not started yet, or gone): the caller then ends the job."""
        if self.watch is None:
            return False
        try:
            self.watch.ranks[0].write_stdin(message)
        except (OSError, ValueError, EOFError, AttributeError):
            return False
        self.stderr.write(f"mlx-cluster: {note}\n")
        self.stderr.flush()
        return True


def cancel_answer(job: Running) -> bool:
    """Chat: rank 0 ends the answer it is writing."""
    note = f"answer cancelled; Ctrl-C again within {QUIT_WINDOW_S:g} s ends the chat"
    return job.tell_rank0(CANCEL, note)


def drain(job: Running) -> bool:
    """Serve: rank 0 finishes the answers under way, then every rank quits. While the ranks
    are still starting there is nothing to drain: the signal stops the job."""
    ready = job.watch is not None and job.watch.state.all_ready
    if job.link is not None:
        job.link.draining(tell=ready)
    if not ready:
        return False
    note = (
        f"draining: finishing the answers under way (at most {job.spec.serve.drain_timeout:g} "
        "s); Ctrl-C again stops now"
    )
    if job.link is not None:  # the link writes END_OF_INPUT after the requests it sent
        job.stderr.write(f"mlx-cluster: {note}\n")
        job.stderr.flush()
        drained = True
    else:
        drained = job.tell_rank0(END_OF_INPUT, note)
    if drained:
        job.watch.drained = True
    return drained


@dataclass(frozen=True)
class Policy:
    """What a command does with the user's stdin and with a signal."""

    forward_stdin: bool = False  # chat: stdin lines are turns for rank 0
    on_signal: Callable[[Running], bool] | None = None  # True: handled (else the job stops)
    once: bool = False  # serve: after the first, any signal stops the job
    signals: tuple = field(default=(signal.SIGINT,))  # the signals on_signal takes


POLICIES = {
    "chat": Policy(forward_stdin=True, on_signal=cancel_answer),
    "serve": Policy(on_signal=drain, once=True, signals=(signal.SIGINT, signal.SIGTERM)),
}


def policy_of(command: str) -> Policy:
    return POLICIES.get(command, Policy())


def trap_for(job: Running):
    """The job's command's signal policy, in force until ``restore_signals``."""
    policy = policy_of(job.spec.command)
    if policy.on_signal is None:
        return trap_signals()
    act = policy.on_signal
    return trap_signals(lambda: act(job), once=policy.once, signals=policy.signals)


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
