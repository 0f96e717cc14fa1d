import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT, become_subreaper, rank_pids
from tests.support.tiny import make_model

# No test may reach the real Hub (there is no internet here, and a test must not depend on it):
# a download goes to this closed port, unless the test points HF_ENDPOINT at its own stand-in.
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"

become_subreaper()


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
    """A tiny model trained to call a weather tool (tests/support/toolmodel.py), trained in a
    subprocess so that it gets OpenBLAS as ranks do (about 10 s instead of 100)."""
    from cluster.core.blas import blas_env

    out = tmp_path_factory.mktemp("toolmodel") / "m"
    env = {**os.environ}
    env.update(blas_env("auto", 1, env, sys.platform, os.cpu_count()) or {})
    subprocess.run([sys.executable, "-m", "tests.support.toolmodel", str(out)], env=env,
                   check=True, timeout=600, cwd=ROOT)  # fmt: skip
    return out


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    """A real OpenSSH server on 127.0.0.1 (see tests/support/sshd.py)."""
    from tests.support.sshd import SSHD, start_sshd

    if not Path(SSHD).exists():
        pytest.skip("needs openssh-server")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield server
    server.proc.terminate()
    server.proc.wait(10)
