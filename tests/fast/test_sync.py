"""`mlx-cluster sync`: each host gets exactly its ranks' files over OpenSSH (a real sshd on
loopback), equal files are skipped, partial ones resumed, and ranks then load the copy."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT


def test_a_crafted_index_is_refused_before_any_byte_is_written(tmp_path):
    """A repo whose weight_map names ../x or /tmp/x: refused here (cluster.core.shards), and by a
    receiver fed such names directly (cluster.rig.transfer), with nothing written anywhere."""
    import json as json_

    from cluster.core.modelcheck import ModelError
    from cluster.core.shards import bad_file_name, weight_files_for_layers
    from cluster.rig.transfer import bad_file_name as receivers_rule
    from cluster.rig.transfer import header

    for evil in ("../x.safetensors", "/tmp/x.safetensors", "a/../../x", "a\\..\\x", ""):
        model = tmp_path / "crafted"
        model.mkdir(exist_ok=True)
        index = {"weight_map": {"model.layers.0.w": "model.safetensors", "lm_head.w": evil}}
        (model / "model.safetensors.index.json").write_text(json_.dumps(index))
        with pytest.raises(ModelError, match="names a file that"):
            weight_files_for_layers(model, 0, 1)
    names = ["ok.safetensors", "sub/ok", "../x", "/x", "a//b", "./a", "a\0b", "..", "a/..", 3]
    assert [bad_file_name(n) for n in names] == [receivers_rule(n) for n in names]
    assert [bad_file_name(n) is None for n in names] == [True, True] + [False] * 8

    dest = tmp_path / "dest" / "model"
    dest.mkdir(parents=True)
    (tmp_path / "dest" / "link").symlink_to(tmp_path)  # a link out of the folder
    (dest / "out").symlink_to(tmp_path)
    receiver = [
        sys.executable,
        str(ROOT / "cluster" / "rig" / "transfer.py"),
        "receive",
        str(dest),
        "0",
    ]
    for evil in ("../escaped", "/tmp/escaped-by-sync", "out/escaped"):
        state = json_.dumps({"op": "state", "sizes": {evil: 5}}).encode() + b"\n"
        p = subprocess.run(receiver, input=state, capture_output=True, timeout=30)
        assert p.returncode == 1 and (b"leaves" in p.stdout or b"leads outside" in p.stdout), p
        stream = (
            b'{"op": "receive", "from": "stdin"}\n'
            + header(evil, 0, 5, 0, [0])
            + b"hello"
            + json_.dumps({"sha256": "0" * 64}).encode()
            + b"\n"
            + b'{"end": true}\n'
        )
        p = subprocess.run(receiver, input=stream, capture_output=True, timeout=30)
        assert p.returncode == 1 and b'"op": "error"' in p.stdout, p
    assert not list(tmp_path.glob("escaped*")) and not list(tmp_path.rglob("escaped*"))
    assert not Path("/tmp/escaped-by-sync").exists()
    assert [x.name for x in dest.iterdir()] == ["out"]

    # a NAME.part that is a link out of the folder: neither read nor written through
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    (dest / "w.safetensors.part").symlink_to(victim)
    state = json_.dumps({"op": "state", "sizes": {"w.safetensors": 5}}).encode() + b"\n"
    p = subprocess.run(receiver, input=state, capture_output=True, timeout=30)
    assert p.returncode == 1 and b"leads outside" in p.stdout, p
    stream = (b'{"op": "receive", "from": "stdin"}\n' + header("w.safetensors", 0, 5, 0, [0])
              + b"hello" + json_.dumps({"sha256": "0" * 64}).encode() + b"\n"
              + b'{"end": true}\n')  # fmt: skip
    p = subprocess.run(receiver, input=stream, capture_output=True, timeout=30)
    assert p.returncode == 1 and b"leads outside" in p.stdout, p
    assert victim.read_bytes() == b"keep me"


def test_a_copy_changed_on_its_way_is_caught_by_the_sha256_the_host_sends_back(tmp_path):
    """The trailer a host checks its copy against travels in the stream it protects (between
    hosts, over TCP): a stream changed on its way, trailer included, is stored. The host's own
    sha256 comes back over SSH, and this machine compares it with the source's."""
    import json as json_
    import types

    from cluster.rig.sync import Copy, HostResult
    from cluster.rig.transfer import header

    dest = tmp_path / "dest"
    dest.mkdir()
    forged = b"other"
    stream = (b'{"op": "receive", "from": "stdin"}\n' + header("w.safetensors", 0, 5, 0, [0])
              + forged + json_.dumps({"sha256": hashlib.sha256(forged).hexdigest()}).encode()
              + b"\n" + b'{"end": true}\n')  # fmt: skip
    receiver = [sys.executable, str(ROOT / "cluster" / "rig" / "transfer.py"), "receive",
                str(dest), "0"]  # fmt: skip
    p = subprocess.run(receiver, input=stream, capture_output=True, timeout=30)
    replies = [json_.loads(x) for x in p.stdout.splitlines()]
    (stored,) = [r for r in replies if r["op"] == "stored"]
    assert stored["sha256"] == hashlib.sha256(forged).hexdigest()  # stored, and said
    result = HostResult(host=types.SimpleNamespace(label="h"))
    result.stored_sha256[stored["name"]] = stored["sha256"]
    copy = types.SimpleNamespace(
        results={0: result},
        hashes=types.SimpleNamespace(known=lambda name: hashlib.sha256(b"hello").hexdigest()),
    )
    copy.fail = lambda i, error: Copy.fail(copy, i, error)
    Copy.check_stored(copy, 0)
    assert "the stream was changed on its way" in result.error
