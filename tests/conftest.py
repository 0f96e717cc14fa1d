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
CLI = shutil.which("mlx-cluster", path=str(Path(sys.executable).parent)) or "mlx-cluster"


def rank_pids() -> list[int]:
    """Every `python -m node run` process on this machine."""
    out = subprocess.run(["pgrep", "-f", "--", "-m node run"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


@pytest.fixture(autouse=True)
def no_stray_ranks():
    """Every test must leave no rank process behind; one that does fails (and is cleaned up)."""
    before = set(rank_pids())
    yield
    left = [p for p in rank_pids() if p not in before]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"rank processes left running: {left}"


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
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (see tests/sshd.py)."""
    from sshd import SSHD, start_sshd

    if not Path(SSHD).exists():
        pytest.skip("needs openssh-server")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.proc.terminate()
    server.proc.wait(10)
