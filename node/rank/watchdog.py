"""A rank's side of liveness, both ways.

To the launcher: a ``Beat`` every second from its own thread, also while the main thread waits
in a collective (MLX releases the GIL there). Each beat carries the rank's progress (steps its
main loop finished) and whether it is idle by design (waiting for the user's next turn), so the
launcher can tell a stalled collective, where every rank beats but none moves, from a quiet one.
Some MLX calls hold the GIL while they wait (``mx.clear_cache`` synchronizes the streams, and
mlx-lm calls it every 256 tokens); a rank stuck there stops beating, and the launcher sees it
as silent.

From the launcher: rank stdin is the launcher's channel. It writes KEEPALIVE once a second. A
watcher process (``python -m node watch``, started by the rank, its own interpreter so no GIL
the rank holds can stop it) reads stdin, takes the keepalives out and hands everything else to
the rank (chat turns, CANCEL, END_OF_INPUT) through a pipe. EOF means the launcher is gone
(killed, or its SSH session closed); silence for the heartbeat timeout means it cannot reach
this host any more (a laptop that lost its network). Either way the watcher says why on stderr
and kills the rank: a rank left waiting in a collective keeps its memory wired on a Mac until
reboot. Once the rank is gone it removes the rank's job folder, which no launcher is left to
remove (its env.sh may hold a forwarded token, its job.json the fleet's key). The watcher ends
with the rank: it holds the read end of a pipe only the rank writes to, which the kernel
closes when the rank exits however it exits.
"""

from __future__ import annotations

import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO

from cluster.core.protocol import KEEPALIVE, START, WAKE, Beat, Error, Event, encode_event

HEARTBEAT_S = 1.0
START_SIGNAL = signal.SIGUSR1  # the watcher's word to its rank that the launcher said START


class Progress:
    """Steps the main loop finished (tokens, prefill chunks, serve rounds), and whether the
    rank waits for input on purpose."""

    def __init__(self):
        self.steps = 0
        self.idle = False

    def tick(self) -> None:
        self.steps += 1

    @contextmanager
    def waiting(self):
        """While the rank waits for the user (chat), no progress is not a stall."""
        self.idle = True
        try:
            yield
        finally:
            self.idle = False
            self.tick()


progress = Progress()


def start_heartbeat(emit: Callable[[Event], None]) -> None:
    def beat():
        while True:
            emit(Beat(progress=progress.steps, idle=progress.idle))
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()


def watch_launcher(
    rank_pid: int,
    timeout: float,
    lifeline: int,
    stdin: int = 0,
    out: int = 1,
    kill: Callable[[int, int], None] = os.kill,
    job_dir: str | None = None,
) -> str | None:
    """The watcher's loop: copy stdin to ``out`` without the keepalives until the rank ends
    (``lifeline`` at EOF: returns None) or the launcher is lost (kills the rank, returns why,
    and once the rank is gone removes its ``job_dir``: no launcher is left to, and its files
    hold the job's secrets)."""
    heard = time.monotonic()
    why = None
    while why is None:
        ready, _, _ = select.select([lifeline, stdin], [], [], min(1.0, timeout / 4 or 1.0))
        if lifeline in ready:
            return None  # the rank ended
        if stdin in ready:
            try:
                data = os.read(stdin, 65536)
            except OSError:
                data = b""
            if not data:
                why = "the launcher closed its connection to this rank (it ended or was killed)"
                break
            heard = time.monotonic()
            data = data.replace(KEEPALIVE, b"")
            if START in data:  # every rank is ready to join: tell ours (wait_for_start)
                data = data.replace(START, b"")
                kill(rank_pid, START_SIGNAL)
            try:
                if data:
                    os.write(out, data)
            except OSError:
                return None  # the rank closed its end: it is ending
        silent = time.monotonic() - heard
        if timeout > 0 and silent > timeout:
            why = (
                f"no word from the launcher for {silent:.0f} s (heartbeat timeout {timeout:g} s): "
                "it cannot reach this host any more"
            )
    if select.select([lifeline], [], [], 0)[0]:
        return None  # the rank ended meanwhile: its PID may already be another process's
    message = f"{why}; this rank ends itself so it holds no memory"
    try:
        event = encode_event(Error(message, t=time.time()))
        os.write(2, f"error: {message}\n{event}".encode())
    except OSError:
        pass  # nobody is reading any more
    kill(rank_pid, signal.SIGKILL)
    if job_dir is not None and select.select([lifeline], [], [], RANK_GONE_S)[0]:
        remove_job_dir(job_dir)
    return why


RANK_GONE_S = 10.0  # how long the watcher waits for its killed rank to be gone


def remove_job_dir(path: str) -> None:
    """A rank's folder of the launcher's making (``.../jobs/<job>/rank<N>``, its job.json
    in it), and its job's folder once no rank's is left; anything else is left alone."""
    folder = Path(path)
    if not re.fullmatch(r"rank\d+", folder.name) or not (folder / "job.json").is_file():
        return
    shutil.rmtree(folder, ignore_errors=True)
    with suppress(OSError):
        folder.parent.rmdir()  # only when empty: the other ranks' watchers may still be at it


_input: IO[bytes] | None = None
_lifeline: int | None = None  # the write end, held open for the rank's whole life
_watcher: subprocess.Popen | None = None


def start_launcher_link(timeout: float, job_dir: str | None = None) -> None:
    """Start this rank's watcher (see the module's docstring); stdin is its from now on.
    ``job_dir``: the rank's folder, which the watcher removes if the launcher is lost."""
    global _input, _lifeline, _watcher
    data_r, data_w = os.pipe()
    life_r, _lifeline = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    watch = [sys.executable, "-m", "node", "watch", "--rank-pid", str(os.getpid())]
    watch += ["--timeout", str(timeout), "--lifeline", str(life_r)]
    watch += ["--job-dir", job_dir] if job_dir else []
    _watcher = subprocess.Popen(watch, stdin=0, stdout=data_w, pass_fds=(life_r,), env=env)
    os.close(data_w)
    os.close(life_r)
    devnull = os.open(os.devnull, os.O_RDONLY)  # nothing in the rank reads the link itself
    os.dup2(devnull, 0)
    os.close(devnull)
    _input = os.fdopen(data_r, "rb", buffering=0)


_wakeup: tuple[int, int] | None = None  # the pipe the signal's C handler writes to


def hold_start() -> None:
    """Catch START_SIGNAL for ``wait_for_start``, in whichever thread the kernel gives it to.
    A process-directed signal goes to any thread that does not block it, and its default
    action ends the process; threads that exist before this runs cannot be made to block it
    (OpenBLAS, preloaded, starts its thread pool before Python does). So a handler takes it
    wherever it lands, and the handler's C part wakes ``wait_for_start`` through a wakeup pipe
    (signal.set_wakeup_fd) even when another thread ran it. First thing in the rank: the
    launcher sends START only after this rank said Phase("init")."""
    global _wakeup
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(START_SIGNAL, lambda signum, frame: None)  # the wakeup pipe says it came
    _wakeup = (r, w)


def wait_for_start(timeout: float) -> bool:
    """Until the launcher's START reaches this rank through its watcher (False after
    ``timeout``: the launcher sends it once every rank is ready to join the group)."""
    if _watcher is None or _wakeup is None:
        return True  # no launcher: nobody to wait for
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([_wakeup[0]], [], [], left)
        try:
            data = os.read(_wakeup[0], 256) if ready else b""
        except BlockingIOError:
            data = b""
        if bytes([START_SIGNAL]) in data:  # other signals' bytes: their handlers run anyway
            return True
    return False


def can_rest() -> bool:
    """Whether this rank may rest between orders: a launcher is there to pass rank 0's Wake
    on (every rank of a job starts the same way, so all of them answer alike)."""
    return _watcher is not None


_wakes = 0  # WAKE bytes read but not yet used: two rests' wakes may come in one read


def wait_for_wake() -> None:
    """A rank other than 0 at rest: blocked on the launcher's pipe, using no CPU, until the
    launcher passes on rank 0's Wake (cluster.core.protocol.WAKE). Rank 0 wakes the others
    exactly once per rest they all agreed on, so each rest takes exactly one WAKE."""
    global _wakes
    channel = launcher_input()
    with progress.waiting():  # resting is not a stall (the heartbeat says idle)
        while _wakes == 0:
            data = os.read(channel.fileno(), 4096)
            if not data:
                raise EOFError("the launcher's channel closed while this rank rested")
            _wakes += data.count(WAKE)
        _wakes -= 1


def launcher_input() -> IO[bytes]:
    """What the launcher sends this rank besides its keepalives (chat turns, CANCEL,
    END_OF_INPUT); plain stdin when the rank runs without a launcher."""
    return _input if _input is not None else sys.stdin.buffer
