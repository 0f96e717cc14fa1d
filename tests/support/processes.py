"""The processes a test starts: mlx-cluster run as a user runs it (run_cli, start_streaming)
or in this process (invoke), and the rank processes this test session started (rank_pids),
never a user's own job beside the tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

CLI = shutil.which("mlx-cluster", path=str(Path(sys.executable).parent)) or "mlx-cluster"


def become_subreaper() -> None:
    """Orphans of our descendants (a rank whose launcher died) are re-parented to this process
    instead of init, so they stay countable as ours (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc (Linux) or ps."""
    tree: dict[int, list[int]] = {}
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    for line in out.splitlines():
        pid, ppid = map(int, line.split())
        tree.setdefault(ppid, []).append(pid)
    return tree


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        out = subprocess.run(["ps", "-o", "args=", "-p", str(pid)], capture_output=True)
        return out.stdout.decode()


def descendant_ranks(
    root: int, tree: dict[int, list[int]], cmdline, what: str = " -m node run "
) -> list[int]:
    """The `python -m node run` processes (``what``) below ``root`` in ``tree`` (parent ->
    children)."""
    found, todo = [], [root]
    while todo:
        for child in tree.get(todo.pop(), []):
            todo.append(child)
            if what in f" {cmdline(child)} ":
                found.append(child)
    return found


def rank_pids(what: str = " -m node run ") -> list[int]:
    """The `python -m node run` processes that this test session started (its descendants,
    orphans included); never a user's own job running beside the tests. ``what=" -m node "``
    counts the ranks' launcher watchers (`python -m node watch`) too."""
    return descendant_ranks(os.getpid(), _children(), _cmdline, what)


def rank_pid(rank: int) -> int:
    """The pid of this session's one running rank ``rank`` (its job.json path says which)."""
    pids = [p for p in rank_pids() if f"/rank{rank}/job.json" in _cmdline(p)]
    assert len(pids) == 1, f"rank {rank}: {pids}"
    return pids[0]


def cpu_seconds(pids) -> float:
    """User and system CPU time the processes ``pids`` used so far, together (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / tick


def ranks_below(root: int, n: int, timeout: float = 120) -> list[int]:
    """The ``n`` rank processes below process ``root``, rank 0 first (their job.json paths
    say which), once all of them are there."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        pids = descendant_ranks(root, _children(), _cmdline)
        if len(pids) == n:
            return sorted(pids, key=lambda p: _cmdline(p).split("/rank")[-1])
        assert time.monotonic() < deadline, f"found {len(pids)} of {n} ranks below {root}"
        time.sleep(0.2)


def invoke(*args, input=None) -> subprocess.CompletedProcess:
    """mlx-cluster in this process (click's CliRunner): for everything that fails or answers
    before any rank starts. Same fields as ``run_cli``'s result."""
    from click.testing import CliRunner

    from cluster.commands import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(
        ["mlx-cluster", *args], result.exit_code, result.stdout, result.stderr
    )


def run_cli(*args, input=None, timeout=180, env=None):
    """mlx-cluster as a user runs it. stdout and stderr decoded as UTF-8 with no newline
    translation (text mode would turn a generated "\\r" into "\\n")."""
    p = subprocess.run(
        [CLI, *map(str, args)],
        input=None if input is None else input.encode(),
        capture_output=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    return subprocess.CompletedProcess(
        p.args, p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8", "replace")
    )


def start_streaming(*args):
    """`mlx-cluster launch ARGS` in the background; returns once rank 0's text is streaming."""
    proc = subprocess.Popen(
        [CLI, "launch", *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    first = proc.stdout.read(1)  # blocks until rank 0 streams its first byte
    assert first, proc.stderr.read().decode()
    return proc


def marked_job_dirs(name: str, value: str) -> set[Path]:
    """The job directories under this machine's ~ (where local and ssh ranks keep theirs) of
    ranks whose environment sets ``name`` to ``value`` (their env.sh says so; a hostfile's
    ``env:`` marks a test's jobs, as another pytest worker's jobs run meanwhile). A directory
    whose env.sh is not written yet is not judged: ours write it before their rank starts."""
    import re

    jobs = Path("~/.cache/mlx-cluster/jobs").expanduser()
    found = set(jobs.iterdir()) if jobs.exists() else set()
    mine = re.compile(rf"^export {name}=.?{re.escape(value)}\b", re.M)
    return {d for d in found if any(mine.search(_text(e)) for e in d.glob("rank*/env.sh"))}


def _text(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # being removed
        return ""
