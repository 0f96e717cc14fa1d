import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from matrix import reference  # noqa: F401  (the single-process baseline of every test)
from tiny import make_model

ROOT = Path(__file__).resolve().parent.parent
# No test may reach the real Hub (there is no internet here, and a test must not depend on it):
# a download goes to this closed port, unless the test points HF_ENDPOINT at its own stand-in.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"

CLI = shutil.which("mlx-cluster", path=str(Path(sys.executable).parent)) or "mlx-cluster"


def _become_subreaper() -> None:
    """Orphans of our descendants (a rank whose launcher died) are re-parented to this process
    instead of init, so they stay countable as ours (Linux prctl PR_SET_CHILD_SUBREAPER)."""
    if sys.platform != "linux":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)


_become_subreaper()


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


@pytest.fixture(autouse=True)
def no_stray_ranks():
    """Every test must leave no rank process (nor a rank's watcher) behind; one that does
    fails (and those it left are killed: only processes this session started)."""
    before = set(rank_pids(" -m node "))
    yield
    left = [p for p in rank_pids(" -m node ") if p not in before]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"rank processes left running: {left}"


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


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tiny float32 checkpoints: llama without and qwen2 with a chat template."""
    base = tmp_path_factory.mktemp("models")
    return {
        "llama": make_model(base / "llama", "llama", seed=1),
        "qwen2": make_model(base / "qwen2", "qwen2", seed=2, chat_template=True),
        # an EOS id no token can have: generation runs until stopped (teardown tests)
        "endless": make_model(base / "endless", "llama", seed=1, eos_token_id=100_000),
    }


@pytest.fixture(scope="session")
def kv_model(tmp_path_factory):
    """llama with a head dimension of 64, which a KV group of 64 divides."""
    base = tmp_path_factory.mktemp("kv")
    return make_model(base / "kv", "llama", seed=1, hidden_size=256, intermediate_size=256,
                      num_attention_heads=4, num_key_value_heads=2)  # fmt: skip


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory):
    """A tiny model trained to call a weather tool (tests/toolmodel.py), trained in a
    subprocess so that it gets OpenBLAS as ranks do (about 10 s instead of 100)."""
    from cluster.core.blas import blas_env

    out = tmp_path_factory.mktemp("toolmodel") / "m"
    env = {**os.environ}
    env.update(blas_env("auto", 1, env, sys.platform, os.cpu_count()) or {})
    here = Path(__file__).parent
    subprocess.run(
        [sys.executable, str(here / "toolmodel.py"), str(out)], env=env, check=True, timeout=600
    )
    return out


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (see tests/sshd.py)."""
    from sshd import SSHD, start_sshd

    if not Path(SSHD).exists():
        pytest.skip("needs openssh-server")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.proc.terminate()
    server.proc.wait(10)
