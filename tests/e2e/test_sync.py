"""`mlx-cluster sync`: each host gets exactly its ranks' files over OpenSSH (a real sshd on
loopback), equal files are skipped, partial ones resumed, and ranks then load the copy."""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

from cluster.rig.transfer import MANIFEST
from tests.support.processes import run_cli
from tests.support.reference import reference

PROMPT = "Tell me about lists"


def rig(sshd, tmp_path, model_dirs=True) -> Path:
    """Host 0 is this machine (copied to directly), host 1 is reached over SSH."""
    d0 = f"\n    model_dir: {tmp_path / 'h0'}" if model_dirs else ""
    d1 = f"\n    model_dir: {tmp_path / 'h1'}" if model_dirs else ""
    hosts = (
        f"  - ssh: localhost\n    ips: [127.0.0.1]{d0}\n"
        f"  - ssh: 127.0.0.1:{sshd.port}\n    ips: [127.0.0.1]{d1}\n"
    )
    path = tmp_path / "rig.yaml"
    path.write_text(sshd.hostfile(hosts, sys.executable))
    return path


def sync(*args):
    p = run_cli("sync", "--json", *args)
    return p, (json.loads(p.stdout) if p.stdout.strip() else None)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def held(directory: Path) -> set[str]:
    """The model files in a synced directory (its manifest aside, which must be there)."""
    names = {f.name for f in directory.iterdir()}
    assert MANIFEST in names
    return names - {MANIFEST}


def layer_files(model: Path, start: int, end: int) -> set[str]:
    """From the index, independently of cluster.core.shards: files with a layer in [start, end)
    or any weight outside the layers."""
    weight_map = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    files = set()
    for name, file in weight_map.items():
        m = re.search(r"layers\.(\d+)\.", name)
        if m is None or start <= int(m.group(1)) < end:
            files.add(file)
    return files


def test_pipeline_ranks_get_their_files_a_second_sync_sends_nothing_and_ranks_load_it(
    sshd, models, tmp_path
):
    model = Path(models["llama"])
    hf = rig(sshd, tmp_path)
    p, report = sync("--hostfile", hf, "--model", model)
    assert p.returncode == 0, p.stderr
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    meta = {f.name for f in model.iterdir() if f.suffix != ".safetensors"}
    half = layers // 2  # rank 0 holds the last layers, as mlx-lm's pipeline
    wanted = [meta | layer_files(model, half, layers), meta | layer_files(model, 0, half)]
    assert wanted[0] != wanted[1]
    for host, expected, d in zip(report["hosts"], wanted, ("h0", "h1"), strict=True):
        assert host["error"] is None
        there = held(tmp_path / d / "llama")
        assert there == expected  # exactly its files, no .part left
        assert all(sha(tmp_path / d / "llama" / n) == sha(model / n) for n in there)
        assert host["bytes_sent"] == sum((model / n).stat().st_size for n in expected)
        assert {f["action"] for f in host["files"]} == {"sent"}
    assert report["bytes_sent"] == sum(h["bytes_sent"] for h in report["hosts"])

    p, again = sync("--hostfile", hf, "--model", model)
    assert p.returncode == 0, p.stderr
    assert again["bytes_sent"] == 0
    assert all(f["action"] == "skipped" for h in again["hosts"] for f in h["files"])

    # the ranks load from each host's model_dir: the partial copies, not the original
    p = run_cli("launch", "--hostfile", hf, "--model", model, "--max-tokens", 30, PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(model, PROMPT, 30)
    # a tensor job on pipeline copies: the rank names the missing files and what to do
    p = run_cli("launch", "--hostfile", hf, "--model", model, "--mode", "tensor", PROMPT)
    assert p.returncode == 2
    assert "are missing" in p.stderr and "sync again with the --mode" in p.stderr


def test_truncated_and_corrupt_files_are_sent_again(sshd, models, tmp_path):
    model = Path(models["qwen2"])
    hf = rig(sshd, tmp_path)
    p, _ = sync("--hostfile", hf, "--model", model, "--mode", "tensor")
    assert p.returncode == 0, p.stderr
    weights = sorted(f.name for f in model.glob("*.safetensors"))
    assert held(tmp_path / "h1" / "qwen2") == {
        f.name for f in model.iterdir()
    }  # tensor: every file
    truncated = tmp_path / "h1" / "qwen2" / weights[0]
    size = truncated.stat().st_size
    truncated.write_bytes(truncated.read_bytes()[: size // 3])
    corrupt = tmp_path / "h0" / "qwen2" / weights[1]
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    corrupt.write_bytes(bytes(data))

    p, report = sync("--hostfile", hf, "--model", model, "--mode", "tensor")
    assert p.returncode == 0, p.stderr
    actions = {
        (h["index"], f["name"]): (f["action"], f["sent"])
        for h in report["hosts"]
        for f in h["files"]
    }
    assert actions[(1, weights[0])] == ("resumed", size - size // 3)
    assert actions[(0, weights[1])] == ("sent", corrupt.stat().st_size)
    assert report["bytes_sent"] == size - size // 3 + corrupt.stat().st_size
    assert sha(truncated) == sha(model / weights[0]) and sha(corrupt) == sha(model / weights[1])


def test_a_partial_copy_that_is_not_a_prefix_is_sent_whole(sshd, models, tmp_path):
    model = Path(models["llama"])
    hf = rig(sshd, tmp_path)
    name = sorted(f.name for f in model.glob("*.safetensors"))[0]
    (tmp_path / "h1" / "llama").mkdir(parents=True)
    (tmp_path / "h1" / "llama" / (name + ".part")).write_bytes(b"not the file")
    p, report = sync("--hostfile", hf, "--model", model, "--mode", "tensor")
    assert p.returncode == 0, p.stderr
    f = next(f for f in report["hosts"][1]["files"] if f["name"] == name)
    size = (model / name).stat().st_size
    assert f["action"] == "resent" and f["sent"] == size  # its prefix checked first: no waste
    assert sha(tmp_path / "h1" / "llama" / name) == sha(model / name)


def test_human_report_and_errors(sshd, models, tmp_path):
    model = Path(models["llama"])
    hf = rig(sshd, tmp_path, model_dirs=False)
    p = run_cli("sync", "--hostfile", hf, "--model", model)
    assert p.returncode == 1
    assert "host 1 (127.0.0.1:" in p.stdout and "no model_dir for this host" in p.stdout
    assert "--dest DIR" in p.stdout

    p = run_cli("sync", "--hostfile", hf, "--model", model, "--dest", tmp_path / "d")
    assert p.returncode == 0, p.stderr
    assert re.search(r"host 0 \(localhost\): \d+ files in .*/d/llama \(\d+ sent\)", p.stdout)
    assert "add `model_dir:" in p.stderr  # the ranks would not load from --dest otherwise

    p = run_cli("sync", "--hostfile", hf, "--model", tmp_path / "nope")
    assert p.returncode == 2 and "no such model directory" in p.stderr
    p = run_cli("sync", "--hostfile", hf, "--model", "someone/not-cached-anywhere", "--offline")
    assert p.returncode == 2 and "not in the local Hugging Face cache" in p.stderr
    assert "--offline" in p.stderr and "hf download someone/not-cached-anywhere" in p.stderr
    p = run_cli("sync", "--hostfile", hf, "--model", "someone/not-cached-anywhere")
    assert p.returncode == 2  # conftest points HF_ENDPOINT at a closed port: no internet
    assert "cannot download it from http://127.0.0.1:9" in p.stderr
    assert "download it elsewhere" in p.stderr and "Traceback" not in p.stderr
    p = run_cli("sync", "--hostfile", hf)
    assert p.returncode == 2 and "--model is required" in p.stderr


def test_entries_of_one_host_and_directory_are_copied_once(models, tmp_path):
    """Two entries for this machine with the same model_dir (a rank each): one copy, holding
    both ranks' files, and the second entry says where it went."""
    model = Path(models["llama"])
    hf = tmp_path / "rig.yaml"
    hf.write_text(f"model_dir: {tmp_path / 'm'}\nhosts:\n  - ssh: localhost\n  - ssh: 127.0.0.1\n")
    p, report = sync("--hostfile", hf, "--model", model)
    assert p.returncode == 0, p.stderr
    first, second = report["hosts"]
    assert second["same_as"] == 0 and second["bytes_sent"] == 0 and second["error"] is None
    assert held(tmp_path / "m" / "llama") == {
        f.name for f in model.iterdir()
    }  # the union of the two pipeline ranks' files: all of them
    assert first["bytes_sent"] == sum(f.stat().st_size for f in model.iterdir())


def start_a_big_sync(sshd, models, tmp_path, any_host: bool = False):
    """A sync of the llama model plus a 300 MiB file, caught once that file's copy on host 1
    (``any_host``: on the first host it reaches, the earliest moment its stream is under
    way) is under way: the sync, the big source file, and host 1's .part of it."""
    import os
    import shutil
    import signal
    import time

    from tests.support.processes import CLI

    model = tmp_path / "big"
    shutil.copytree(models["llama"], model)
    extra = model / "model-extra.safetensors"
    extra.write_bytes(os.urandom(300 * 1024 * 1024))  # big enough to be caught mid-copy
    hf = rig(sshd, tmp_path)
    args = [CLI, "sync", "--hostfile", hf, "--model", model, "--mode", "tensor", "--json"]

    # as from a terminal, where Ctrl-C reaches a command: SIGINT at its default action (a
    # suite started in the background by a script inherits SIGINT ignored, and Python then
    # keeps ignoring it)
    def terminal_like() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=terminal_like)  # fmt: skip
    part = tmp_path / "h1" / "big" / "model-extra.safetensors.part"
    parts = [tmp_path / h / "big" / part.name for h in ("h0", "h1")] if any_host else [part]

    def under_way() -> bool:
        return any(p.exists() and p.stat().st_size > 0 for p in parts)

    deadline = time.monotonic() + 120
    while not under_way():  # the copy of that file is under way
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    return proc, extra, part


def test_ctrl_c_keeps_the_partial_copy_and_the_next_sync_resumes_it(sshd, models, tmp_path):
    import signal

    proc, extra, part = start_a_big_sync(sshd, models, tmp_path)
    masks = [x for x in open(f"/proc/{proc.pid}/status") if x.startswith(("SigBlk", "SigIgn"))]
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "run it again to resume" in err, (masks, err[-500:])
    assert not receivers(tmp_path)  # neither here nor behind the SSH session
    kept = part.stat().st_size
    assert 0 < kept < extra.stat().st_size

    hf, model = tmp_path / "rig.yaml", extra.parent
    p, report = sync("--hostfile", hf, "--model", model, "--mode", "tensor")
    assert p.returncode == 0, p.stderr
    f = next(f for f in report["hosts"][1]["files"] if f["name"] == "model-extra.safetensors")
    assert f["action"] == "resumed" and f["sent"] == f["size"] - kept
    assert sha(tmp_path / "h1" / "big" / "model-extra.safetensors") == sha(extra)
    assert not part.exists()


def test_a_source_file_cut_short_mid_copy_fails_every_host_and_leaves_no_receiver(
    sshd, models, tmp_path
):
    """The laptop's own side breaks (a file truncated while sent): each host is told why, the
    command ends, and no receiver is left waiting for the rest of the stream."""
    import os
    import signal

    # cut as soon as the stream reaches a host: caught later, one host (the chain's first)
    # had sometimes taken the whole file already, and nothing was left to break for it
    proc, extra, part = start_a_big_sync(sshd, models, tmp_path, any_host=True)
    os.truncate(extra, 1024 * 1024)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # hung: Ctrl-C lets it stop its receivers
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    assert proc.returncode == 1, err
    hosts = json.loads(out)["hosts"]
    assert len(hosts) == 2
    for host in hosts:
        assert "changed while being sent" in host["error"], host
    assert not receivers(tmp_path)
    assert not (tmp_path / "h1" / "big" / "model-extra.safetensors").exists()


def test_a_repo_from_the_local_hugging_face_cache(models, tmp_path):
    """--model org/name is looked up in this machine's cache, never fetched."""
    import shutil

    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-llama" / "snapshots" / "0123abcd"
    shutil.copytree(models["llama"], snapshot)
    (cache / "models--someone--tiny-llama" / "refs").mkdir()
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text("0123abcd")
    hf = tmp_path / "rig.yaml"
    hf.write_text(f"model_dir: {tmp_path / 'm'}\nhosts:\n  - ssh: localhost\n    slots: 2\n")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    p = run_cli("sync", "--json", "--hostfile", hf, "--model", "someone/tiny-llama", env=env)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["model"] == str(snapshot)
    copied = tmp_path / "m" / "tiny-llama"
    assert held(copied) == {f.name for f in Path(models["llama"]).iterdir()}
    # and the ranks find it there under the repo's name
    ranks_run_the_repo(hf, models, env)


def ranks_run_the_repo(hf: Path, models, env: dict) -> None:
    """The ranks find someone/tiny-llama in their model_dir, and say what mlx-lm says."""
    p = run_cli(
        "launch",
        "--hostfile",
        hf,
        "--model",
        "someone/tiny-llama",
        "--max-tokens",
        12,
        PROMPT,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["llama"], PROMPT, 12)


def receivers(tmp_path: Path) -> list[str]:
    """Receiver processes writing under this test's directory, which only it started."""

    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in ps.splitlines() if "receive" in line and str(tmp_path) in line]


def remote_rig(sshd, tmp_path, n=2, prefix="r") -> Path:
    """``n`` entries for the loopback sshd, each its own model_dir: n hosts as far as sync
    can tell (a chain passes the files from one to the next over 127.0.0.1)."""
    hosts = "".join(
        f"  - ssh: 127.0.0.1:{sshd.port}\n    ips: [127.0.0.1]\n"
        f"    model_dir: {tmp_path / f'{prefix}{i}'}\n"
        for i in range(n)
    )
    path = tmp_path / f"{prefix}.yaml"
    path.write_text(sshd.hostfile(hosts, sys.executable))
    return path


def test_the_manifest_skips_unread_files_and_verify_reads_them(sshd, models, tmp_path):
    """An unchanged file is skipped on the manifest's word (so a change that keeps size and
    mtime goes unseen), a changed size or mtime is hashed again, --verify hashes everything."""
    import os

    model = Path(models["qwen2"])
    hf = rig(sshd, tmp_path)
    p, _ = sync("--hostfile", hf, "--model", model, "--mode", "tensor")
    assert p.returncode == 0, p.stderr
    copy = tmp_path / "h1" / "qwen2"
    manifest = json.loads((copy / MANIFEST).read_text())
    assert set(manifest) == held(copy)
    for name, entry in manifest.items():
        st = (copy / name).stat()
        assert entry == {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha(copy / name)}

    weights = sorted(f.name for f in model.glob("*.safetensors"))
    sneaky, touched, grown = (copy / w for w in weights[:3])
    st = sneaky.stat()
    data = bytearray(sneaky.read_bytes())
    data[100] ^= 0xFF
    sneaky.write_bytes(bytes(data))
    os.utime(sneaky, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    os.utime(touched)  # same bytes, a new mtime
    with open(grown, "ab") as f:
        f.write(b"more")

    p, report = sync("--hostfile", hf, "--model", model, "--mode", "tensor")
    assert p.returncode == 0, p.stderr
    actions = {f["name"]: f["action"] for f in report["hosts"][1]["files"]}
    assert actions[sneaky.name] == "skipped"  # the manifest vouched for it
    assert actions[touched.name] == "skipped"  # hashed again: equal
    assert actions[grown.name] == "sent" and sha(grown) == sha(model / grown.name)
    assert sha(sneaky) != sha(model / sneaky.name)
    assert json.loads((copy / MANIFEST).read_text())[touched.name]["mtime_ns"] == (
        touched.stat().st_mtime_ns
    )

    p, report = sync("--hostfile", hf, "--model", model, "--mode", "tensor", "--verify")
    assert p.returncode == 0, p.stderr
    actions = {f["name"]: f["action"] for f in report["hosts"][1]["files"]}
    assert actions[sneaky.name] == "sent" and sha(sneaky) == sha(model / sneaky.name)
    assert {a for n, a in actions.items() if n != sneaky.name} == {"skipped"}


def test_plain_tcp_transport_copies_and_resumes(sshd, models, tmp_path):
    model = Path(models["llama"])
    hf = remote_rig(sshd, tmp_path, 1)
    args = ("--hostfile", hf, "--model", model, "--mode", "tensor", "--transport", "tcp")
    p, report = sync(*args)
    assert p.returncode == 0, p.stderr
    (host,) = report["hosts"]
    assert host["transport"] == "tcp" and host["error"] is None
    copy = tmp_path / "r0" / "llama"
    assert held(copy) == {f.name for f in model.iterdir()}
    assert all(sha(copy / n) == sha(model / n) for n in held(copy))

    name = sorted(f.name for f in model.glob("*.safetensors"))[-1]
    size = (copy / name).stat().st_size
    with open(copy / name, "r+b") as f:
        f.truncate(size // 2)
    p, report = sync(*args)
    assert p.returncode == 0, p.stderr
    f = next(f for f in report["hosts"][0]["files"] if f["name"] == name)
    assert (f["action"], f["sent"]) == ("resumed", size - size // 2)
    assert sha(copy / name) == sha(model / name)


def test_hosts_pass_the_files_on_in_a_chain(sshd, models, tmp_path):
    """Three hosts, tensor mode (each needs every file): this machine streams to the first,
    which passes the stream to the second, and that to the third; each copy is whole."""
    model = Path(models["llama"])
    hf = remote_rig(sshd, tmp_path, 3)
    p, report = sync("--hostfile", hf, "--model", model, "--mode", "tensor", "--streams", "1")
    assert p.returncode == 0, p.stderr
    total = sum(f.stat().st_size for f in model.iterdir())
    upstreams = [(h["transport"], h["upstream"]) for h in report["hosts"]]
    assert upstreams == [("ssh", None), ("tcp", 0), ("tcp", 1)]
    for i, host in enumerate(report["hosts"]):
        assert host["error"] is None and host["bytes_sent"] == total
        copy = tmp_path / f"r{i}" / "llama"
        assert held(copy) == {f.name for f in model.iterdir()}
        assert all(sha(copy / n) == sha(model / n) for n in held(copy))

    # pipeline: each host keeps its own layers' files and passes on what the next ones need
    hf = remote_rig(sshd, tmp_path, 3, "p")
    p, report = sync("--hostfile", hf, "--model", model)
    assert p.returncode == 0, p.stderr
    copies = [held(tmp_path / f"p{i}" / "llama") for i in range(3)]
    weights = [{n for n in c if n.endswith(".safetensors")} for c in copies]
    assert set().union(*weights) == layer_files(model, 0, 10**6)
    assert all(w != weights[0] for w in weights[1:])  # not every host holds every file
    for i, names in enumerate(copies):
        assert all(sha(tmp_path / f"p{i}" / "llama" / n) == sha(model / n) for n in names)
        assert report["hosts"][i]["bytes_sent"] == sum((model / n).stat().st_size for n in names)

    # the same hosts, each fed from here
    hf = remote_rig(sshd, tmp_path, 3, "d")
    args = ("--hostfile", hf, "--model", model, "--mode", "tensor", "--fan-out", "direct")
    p, report = sync(*args)
    assert p.returncode == 0, p.stderr
    assert [(h["transport"], h["upstream"]) for h in report["hosts"]] == [("ssh", None)] * 3
    assert all(
        held(tmp_path / f"d{i}" / "llama") == held(tmp_path / "r0" / "llama") for i in range(3)
    )


def test_a_repo_missing_here_is_downloaded_only_the_files_the_ranks_need(models, tmp_path):
    """HF_ENDPOINT points at a stand-in hub serving a repo with more than the ranks read: a
    PyTorch copy, an `original/` folder, a safetensors file the index does not name."""
    import shutil

    from tests.support.hubstand import Hub

    repo = tmp_path / "repo"
    shutil.copytree(models["llama"], repo)
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 4096)
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.pth").write_bytes(b"\0" * 4096)
    (repo / "model-unused.safetensors").write_bytes(b"\0" * 4096)
    hub = Hub("someone/tiny-llama", repo)
    try:
        cache = tmp_path / "hub"
        env = {"HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1"}
        hf = tmp_path / "rig.yaml"
        hf.write_text(f"model_dir: {tmp_path / 'm'}\nhosts:\n  - ssh: localhost\n    slots: 2\n")
        args = ("sync", "--json", "--hostfile", hf, "--model", "someone/tiny-llama")

        p = run_cli(*args, "--offline", env=env)
        assert p.returncode == 2 and "--offline" in p.stderr and hub.fetched == []

        p = run_cli(*args, env=env)
        assert p.returncode == 0, p.stderr
        needed = {f.name for f in Path(models["llama"]).iterdir()}
        assert set(hub.fetched) == needed  # each once, and nothing the ranks do not read
        assert len(hub.fetched) == len(needed)
        snapshot = Path(json.loads(p.stdout)["model"])
        assert snapshot.is_relative_to(cache / "models--someone--tiny-llama" / "snapshots")
        assert {f.name for f in snapshot.iterdir()} == needed
        assert held(tmp_path / "m" / "tiny-llama") == needed
        assert "Traceback" not in p.stderr

        # the cache has it now: offline works, nothing fetched again, and the ranks run it
        fetched = len(hub.fetched)
        p = run_cli(*args, "--offline", env=env)
        assert p.returncode == 0, p.stderr
        assert len(hub.fetched) == fetched
        assert {f["action"] for f in json.loads(p.stdout)["hosts"][0]["files"]} == {"skipped"}
    finally:
        hub.close()
    env["HF_HUB_OFFLINE"] = "1"
    ranks_run_the_repo(hf, models, env)
