"""Rank processes behind one small interface: start, stream output, signal, wait.

A local rank is a subprocess in its own session (so Ctrl-C at the terminal reaches only the
launcher, which then stops the ranks itself). A remote rank over SSH implements the same
methods. Output arrives as items on a queue shared by all ranks:
``("out", rank, bytes)``, ``("err", rank, str)`` and finally ``("exit", rank, code)``, the exit
coming only after all of that rank's output.
"""

from __future__ import annotations

import os
import queue
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cluster.core.hostfile import Host

STOP_GRACE_S = 5.0  # how long a stopped rank gets between SIGTERM and SIGKILL


@dataclass
class RankLaunch:
    """Everything needed to start one rank on its host."""

    rank: int
    host: Host
    python: str
    env: dict[str, str]
    files: dict[str, str]  # env var -> file text; written on the host, var set to its path
    spec: str  # job spec JSON text
    cwd: str | None = None
    extra_env: dict[str, str] = field(default_factory=dict)


def write_files(files: dict[str, str], directory: Path) -> dict[str, str]:
    """Write a rank's files (env var -> text) into ``directory``; the vars, set to their
    paths."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for var, text in files.items():
        path = directory / f"{var.lower()}.json"
        path.write_text(text)
        paths[var] = str(path)
    return paths


def node_command(python: str, spec_path: str) -> list[str]:
    return [python, "-m", "node", "run", "--spec", spec_path]


class LocalRank:
    """A rank on this machine: ``python -m node run`` as a subprocess."""

    def __init__(self, launch: RankLaunch, job_dir: Path):
        self.launch = launch
        self.rank = launch.rank
        self.host = launch.host
        self.dir = job_dir / f"rank{launch.rank}"
        self.proc: subprocess.Popen | None = None

    def start(self, events: queue.Queue) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        env = dict(os.environ)
        env.update(self.launch.extra_env)
        env.update(self.launch.env)
        env.update(write_files(self.launch.files, self.dir))
        spec_path = self.dir / "job.json"
        spec_path.write_text(self.launch.spec)
        os.chmod(spec_path, 0o600)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            node_command(self.launch.python, str(spec_path)),
            stdin=subprocess.PIPE,  # the launcher's channel (node.watchdog)
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=self.launch.cwd,
            start_new_session=True,
        )
        readers = [
            threading.Thread(
                target=_pump_bytes, args=(self.proc.stdout, self.rank, events), daemon=True
            ),
            threading.Thread(
                target=_pump_lines, args=(self.proc.stderr, self.rank, events), daemon=True
            ),
        ]
        for t in readers:
            t.start()

        def wait():
            for t in readers:
                t.join()
            events.put(("exit", self.rank, self.proc.wait()))

        threading.Thread(target=wait, daemon=True).start()

    def write_stdin(self, data: bytes) -> None:
        if self.proc is None or self.proc.stdin is None:
            raise OSError(f"rank {self.rank} has not started")
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    lost = False  # a process on this machine can always be signalled and waited for

    def host_answers(self) -> bool:
        return True

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def send_signal(self, sig: int) -> None:
        """Signal the rank's whole process group (the rank and anything it started)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _pump_bytes(stream, rank: int, events: queue.Queue) -> None:
    fd = stream.fileno()
    while chunk := os.read(fd, 65536):
        events.put(("out", rank, chunk))
    stream.close()


MAX_LINE = 8 << 20  # bytes of one stderr line: an event holds a tool call's arguments at most


class Lines:
    """A rank's stderr cut into lines, in time linear in its bytes however they arrive (no
    buffer joined again per read); a line past MAX_LINE is cut there, marked, and the rest of
    it dropped up to its newline, so a rank cannot grow the launcher's memory without end."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.cut = False

    def feed(self, data: bytes) -> list[str]:
        *whole, rest = data.split(b"\n")
        lines = []
        for piece in whole:
            self.add(piece)
            lines.append(self.line())
        self.add(rest)
        return lines

    def end(self) -> list[str]:
        """What is left after the stream ended, as a last line."""
        return [self.line()] if self.parts or self.cut else []

    def add(self, piece: bytes) -> None:
        if self.cut:
            return
        if len(piece) > MAX_LINE - self.size:
            piece, self.cut = piece[: MAX_LINE - self.size], True
        if piece:
            self.parts.append(piece)
            self.size += len(piece)

    def line(self) -> str:
        text = b"".join(self.parts).decode("utf-8", "replace")
        if self.cut:
            text += f" [cut: longer than {MAX_LINE} bytes]"
        self.parts, self.size, self.cut = [], 0, False
        return text + "\n"


def pump_lines(read, rank: int, events: queue.Queue) -> None:
    """Every line ``read()`` (bytes; b"" at the end) gives, as ("err", rank, line)."""
    lines = Lines()
    while data := read():
        for line in lines.feed(data):
            events.put(("err", rank, line))
    for line in lines.end():
        events.put(("err", rank, line))


def _pump_lines(stream, rank: int, events: queue.Queue) -> None:
    fd = stream.fileno()
    pump_lines(lambda: os.read(fd, 65536), rank, events)
    stream.close()


def make_job_dir() -> Path:
    """A private directory for this job's files on this machine."""
    return Path(tempfile.mkdtemp(prefix="mlx-cluster-job-"))


def rank_python(host: Host, default: str | None) -> str:
    """Per-host python, then the hostfile's, then our own here or ``python3`` on other hosts.
    A ``~/`` path is expanded here for this machine; other hosts expand it in their shell."""
    python = host.python or default or (sys.executable if host.is_local else "python3")
    return os.path.expanduser(python) if host.is_local else python


def shell_command(argv: list[str]) -> str:
    """``argv`` for a remote shell; a leading ``~/`` stays outside the quotes, so that the
    host's shell expands it to that host's home."""
    first, rest = argv[0], argv[1:]
    if first.startswith("~/"):
        first = '"$HOME"/' + shlex.quote(first[2:])
    else:
        first = shlex.quote(first)
    return " ".join([first, *map(shlex.quote, rest)])
