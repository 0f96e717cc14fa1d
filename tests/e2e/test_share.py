"""share_object on real ranks over the ring backend on loopback."""

import hashlib
import json
import os
import subprocess
import sys

import pytest

from cluster.core.hostfile import local_hostfile
from cluster.job.backends import rank_envs
from tests.support.processes import ROOT

WORKER = "tests.support.share_worker"


def run_ranks(n, tmp_path, timeout=120):
    envs = rank_envs(local_hostfile(n))
    ring = tmp_path / "ring.json"
    ring.write_text(envs[0].files["MLX_HOSTFILE"])
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", WORKER],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**os.environ, **e.env, "MLX_HOSTFILE": str(ring)},
        )
        for e in envs
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    return [json.loads(out) for out, _ in outs]


@pytest.mark.parametrize("n", [2, 3])
def test_share_object_on_real_ranks(n, tmp_path):
    results = run_ranks(n, tmp_path)
    blob = bytes(range(256)) * (5 * 1024 * 1024 // 256)
    for r in results:
        assert r["text"] == "hello"
        assert r["unicode"] == "héllo wörld 世界 🎉"
        assert r["blob"] == [
            "image.png",
            len(blob),
            hashlib.sha256(blob).hexdigest(),
            ["a", "", "bc"],
        ]
        assert r["none"] is None
        assert "over the limit of 1000000 bytes" in r["oversize"]
        assert "share_object: rank 0 could not encode the object" in r["unencodable"]
        if r["rank"] == 0:
            assert "not JSON serializable" in r["unencodable"]
        assert r["after"] == {"still": "in step"}
    assert sorted(r["rank"] for r in results) == list(range(n))
