"""Liveness both ways, without processes: the launcher's stall rule (cluster.job.state) and the
rank's watch on its launcher (node.rank.watchdog)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from cluster.core import protocol
from cluster.job.state import (
    JobState,
    RankState,
    blame_unreachable,
    culprit,
    failure_report,
    on_event,
    overdue,
    silent_ranks,
)
from node.rank.watchdog import watch_launcher


def ready_job(n: int = 3) -> JobState:
    job = JobState([RankState(r, f"mac{r}") for r in range(n)])
    for r in range(n):
        on_event(job, r, protocol.Ready(1.0), 10.0)
    return job


def beat_all(job: JobState, progress: int, t: float, idle_rank: int | None = None) -> None:
    for r in range(len(job.ranks)):
        on_event(job, r, protocol.Beat(progress=progress, idle=r == idle_rank), t)


def test_no_progress_on_any_rank_past_the_stall_timeout_is_a_stall():
    job = ready_job()
    beat_all(job, 5, 11.0)
    beat_all(job, 5, 20.0)  # beats go on, progress does not
    assert overdue(job, 0.0, 20.0, 30, 1800, stall_timeout=10) is None
    beat_all(job, 5, 21.5)
    late = overdue(job, 0.0, 21.5, 30, 1800, stall_timeout=10)
    assert late is job.ranks[0] and late.stalled
    assert "no rank made progress for 10.5 s" in late.error
    assert "mac0, mac1, mac2" in late.error
    report = failure_report(late, job.ranks)
    assert "in a collective that does not complete" in report.splitlines()[0]


def test_one_rank_moving_is_progress():
    job = ready_job()
    beat_all(job, 5, 11.0)
    on_event(job, 2, protocol.Beat(progress=6), 19.0)
    assert overdue(job, 0.0, 25.0, 30, 1800, stall_timeout=10) is None


def test_a_rank_waiting_for_the_user_is_not_a_stall():
    job = ready_job()
    beat_all(job, 5, 11.0, idle_rank=0)
    assert overdue(job, 0.0, 500.0, 30, 1800, stall_timeout=10) is None


def test_no_stall_before_every_rank_is_ready_or_without_a_timeout():
    job = JobState([RankState(r, f"mac{r}") for r in range(2)])
    on_event(job, 0, protocol.Ready(1.0), 10.0)
    assert overdue(job, 0.0, 500.0, 1e9, 1800, stall_timeout=10) is None
    job = ready_job()
    assert overdue(job, 0.0, 500.0, 1e9, 1800, stall_timeout=0) is None


class Watch:
    """watch_launcher on pipes, in a thread, with the kill recorded instead of sent."""

    def __init__(self, timeout: float, job_dir: str | None = None):
        stdin_r, self.stdin = os.pipe()
        self.out, out_w = os.pipe()
        life_r, self.lifeline = os.pipe()
        self.killed: list[tuple[int, int]] = []
        self.why = "not returned"
        self.done = threading.Event()

        def run():
            self.why = watch_launcher(4242, timeout, life_r, stdin_r, out_w, self.record,
                                      job_dir)  # fmt: skip
            self.done.set()

        threading.Thread(target=run, daemon=True).start()

    def record(self, pid: int, sig: int) -> None:
        self.killed.append((pid, sig))


def test_keepalives_are_taken_out_the_rest_passes_and_eof_kills_the_rank(capfd):
    w = Watch(timeout=0)
    os.write(w.stdin, b"first" + protocol.KEEPALIVE + b" line\n" + protocol.KEEPALIVE)
    assert os.read(w.out, 64) == b"first line\n"
    os.close(w.stdin)
    assert w.done.wait(5) and "closed its connection" in w.why
    assert w.killed == [(4242, signal.SIGKILL)]
    err = capfd.readouterr().err
    assert "error: the launcher closed its connection" in err
    events = [protocol.decode_event(line) for line in err.split("\n")]  # \x1e is a "line" too
    assert any(
        isinstance(e, protocol.Error) and "closed its connection" in e.message for e in events
    )


def test_a_silent_launcher_gets_the_rank_killed():
    w = Watch(timeout=0.5)
    for _ in range(3):  # keepalives hold it off
        os.write(w.stdin, protocol.KEEPALIVE)
        time.sleep(0.2)
    assert not w.done.is_set()
    assert w.done.wait(5) and "no word from the launcher" in w.why
    assert w.killed == [(4242, signal.SIGKILL)]


@pytest.mark.parametrize("name", ["rank1", "notes"])
def test_a_lost_launchers_rank_folder_goes_once_the_rank_is_gone(tmp_path, name):
    """Nobody else will remove it (its env.sh may hold a forwarded token): the watcher does,
    after the rank it killed is gone, and the job's folder with it when it is empty; a
    folder that is not a rank's of the launcher's making is left alone."""
    rank = tmp_path / "jobs" / "abc123" / name
    rank.mkdir(parents=True)
    (rank / "job.json").write_text("{}")
    (rank / "env.sh").write_text("export HF_TOKEN=secret\n")
    w = Watch(timeout=0, job_dir=str(rank))
    os.close(w.stdin)  # the launcher is gone
    for _ in range(500):
        if w.killed:
            break
        time.sleep(0.01)
    assert w.killed == [(4242, signal.SIGKILL)] and rank.exists()  # not before it is gone
    os.close(w.lifeline)  # the rank is gone
    assert w.done.wait(5)
    assert rank.exists() == (name == "notes")
    assert (tmp_path / "jobs" / "abc123").exists() == (name == "notes")


def test_the_watcher_ends_with_its_rank_and_kills_nothing():
    w = Watch(timeout=0.5)
    os.close(w.lifeline)  # the rank exited
    assert w.done.wait(5) and w.why is None and w.killed == []


def heard(job: JobState, last_seen: list[float]) -> None:
    """When the launcher last heard each rank (its I/O loop sets this)."""
    for state, t in zip(job.ranks, last_seen, strict=True):
        state.last_seen = t


def test_the_silent_rank_whose_host_does_not_answer_is_named():
    """Rank 1 holds the GIL waiting on rank 2 (silent, host fine); rank 2's host is cut off."""
    job = ready_job()
    heard(job, [16.0, 10.0, 10.2])  # rank 1 silent longest
    late = overdue(job, 16.0, 16.0, 5, 1800)
    assert late is job.ranks[1]
    silent = silent_ranks(job, 16.0, 5)
    assert silent == [job.ranks[1], job.ranks[2]]
    named = blame_unreachable(late, silent, {1: True, 2: False})
    assert named is job.ranks[2] and named.unresponsive
    assert "its host does not answer over SSH" in named.error
    assert "also silent, on hosts that answer (waiting on it): rank 1 on mac1" in named.error
    report = failure_report(culprit(named, job.ranks), job.ranks)
    assert report.splitlines()[0].startswith("error: rank 2 of 3 on mac2 stopped responding")


def test_a_silent_rank_on_a_host_that_answers_is_hung():
    job = ready_job()
    heard(job, [16.0, 10.0, 16.0])
    late = overdue(job, 16.0, 16.0, 5, 1800)
    named = blame_unreachable(late, silent_ranks(job, 16.0, 5), {1: True})
    assert named is job.ranks[1] and "its host answers: the process is hung" in named.error


def test_start_waits_for_the_watchers_signal_whichever_thread_gets_it(monkeypatch):
    """The rank's wait for the launcher's START (passed on by its watcher as a signal): a
    signal that came before the wait is kept; one the kernel gives to another thread (as
    OpenBLAS's threads, started before Python, do not block it) neither ends the process nor
    is lost; no second START, and the wait times out."""
    from node.rank import watchdog

    monkeypatch.setattr(watchdog, "_watcher", object())  # as under a launcher
    previous = signal.getsignal(watchdog.START_SIGNAL)
    try:
        watchdog.hold_start()
        signal.pthread_kill(threading.get_ident(), watchdog.START_SIGNAL)  # before the wait
        assert watchdog.wait_for_start(5.0)
        assert not watchdog.wait_for_start(0.1)  # no second START: the wait times out
        other = threading.Thread(target=time.sleep, args=(1.0,))
        other.start()
        signal.pthread_kill(other.ident, watchdog.START_SIGNAL)  # to a thread that is not us
        assert watchdog.wait_for_start(5.0)
        other.join()
    finally:
        signal.set_wakeup_fd(-1)
        signal.signal(watchdog.START_SIGNAL, previous)


def test_a_resting_rank_takes_one_wake_per_rest_and_ends_with_the_channel(monkeypatch):
    """Rank 0's wakes may reach a rank before it rests, or two in one read: each rest takes
    exactly one; a channel that closes while it rests is an error, not a hang. Resting is
    idle by design (the heartbeat says so: no stall)."""
    from node.rank import watchdog

    r, w = os.pipe()
    monkeypatch.setattr(watchdog, "_input", os.fdopen(r, "rb", buffering=0))
    monkeypatch.setattr(watchdog, "_wakes", 0)
    os.write(w, protocol.WAKE * 2)  # two rests' wakes, before either rest
    monkeypatch.setattr(watchdog, "progress", watchdog.Progress())
    watchdog.wait_for_wake()
    watchdog.wait_for_wake()
    assert watchdog._wakes == 0 and watchdog.progress.steps == 2
    woke = threading.Event()

    def rest():
        watchdog.wait_for_wake()
        woke.set()

    threading.Thread(target=rest, daemon=True).start()
    assert not woke.wait(0.3)  # no wake yet: it rests, idle by design
    assert watchdog.progress.idle
    os.write(w, protocol.WAKE)
    assert woke.wait(5)
    os.close(w)
    with pytest.raises(EOFError, match="closed while this rank rested"):
        watchdog.wait_for_wake()


def test_a_rank_ends_without_teardown_but_with_its_output_and_exit_handlers():
    """node.__main__.exit_now: the exit code, buffered output (no newline, not flushed) and
    what atexit was given to run all survive ending without the interpreter's teardown."""
    code = (
        "import atexit, sys\n"
        "from node.__main__ import exit_now\n"
        "atexit.register(lambda: sys.stderr.write('handler ran'))\n"
        "sys.stdout.write('the answer')\n"
        "exit_now(3)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3
    assert p.stdout == "the answer"
    assert p.stderr.endswith("handler ran")
