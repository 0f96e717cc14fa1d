"""node.cache.disk on one process: blocks written after an answer are read back into a cache
that continues the prompt exactly as a prefilled one; a corrupt, planted or foreign block is a
miss and is removed; the store stays under its bound and never touches a file it did not
write; it refuses a folder that is not its own; files are 0600 and folders 0700; a writer that
fails (a full disk, any error) turns writing off and memory stays flat; two processes writing
one folder leave only whole blocks. (Every rank agreeing, serve restarted and the plan in the
key: tests/e2e/test_disk_prompt_cache.py.)"""

import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from node.cache import disk as diskcache
from node.cache.disk import (
    BLOCK_TOKENS,
    STORE,
    DiskCache,
    NotOurs,
    block_hashes,
    local_layers,
    open_store,
    plan_key,
    weights_fingerprint,
    worth_reading,
)
from tests.support.kv import PLAN, SMALL, TOKENS, next_logits, prefilled, small_llama
from tests.support.tiny import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_llama(tmp_path_factory.mktemp("dc"))


def test_blocks_read_back_continue_the_prompt_exactly(model, tmp_path):
    path, m = model
    disk = DiskCache(tmp_path, PLAN, 1e9, local_layers(make_prompt_cache(m)))
    cache, _ = prefilled(m, TOKENS)
    assert disk.save(TOKENS, cache) == 3  # the complete blocks
    disk.flush()
    assert disk.save(TOKENS, cache) == 0  # already there
    restored, n = disk.restore(m, TOKENS)
    assert n == 3 * BLOCK_TOKENS
    rest = TOKENS[n:]
    want = next_logits(m, prefilled(m, TOKENS[:n])[0], rest)
    got = next_logits(m, restored, rest)
    assert mx.array_equal(got, want).item()
    assert disk.stats.hits == 1 and disk.stats.bytes_read > 0 and disk.stats.bytes_written > 0
    # another prompt that shares the first block only
    other = TOKENS[:BLOCK_TOKENS] + [9] * (2 * BLOCK_TOKENS)
    assert disk.restore(m, other)[1] == BLOCK_TOKENS
    # a prompt shorter than a block, or another start: a miss
    assert disk.restore(m, TOKENS[:100]) == (None, 0)
    assert disk.restore(m, [5] + TOKENS[1:]) == (None, 0)


@pytest.mark.parametrize("family", ["deepseek_v32", "longcat_flash"])
def test_a_cache_list_keeps_each_of_its_kv_caches_as_blocks(tmp_path, family):
    """DeepSeek V3.2 and GLM-5 keep a CacheList per layer (the latent, the indexer's keys),
    LongCat one of its two attentions: each KV cache in it is kept as blocks like a layer's
    (its part "i.j"), and a prompt read back continues exactly."""
    from mlx_lm import load

    m, _ = load(str(make_model(tmp_path / family, family, seed=1)))
    parts = local_layers(make_prompt_cache(m))
    assert parts and all(isinstance(p, str) and "." in p for p in parts), parts
    disk = DiskCache(tmp_path / "kv", PLAN, 1e9, parts)
    tokens = [t % 500 + 1 for t in TOKENS]
    assert disk.save(tokens, prefilled(m, tokens)[0]) == 3
    disk.flush()
    restored, n = disk.restore(m, tokens)
    assert n == 3 * BLOCK_TOKENS
    want = next_logits(m, prefilled(m, tokens[:n])[0], tokens[n:])
    assert mx.array_equal(next_logits(m, restored, tokens[n:]), want).item()


def test_a_corrupt_or_truncated_block_is_a_miss_and_is_removed(model, tmp_path):
    path, m = model
    disk = DiskCache(tmp_path, PLAN, 1e9, local_layers(make_prompt_cache(m)))
    disk.save(TOKENS, prefilled(m, TOKENS)[0])
    disk.flush()
    names = block_hashes(TOKENS)
    second, third = disk.path(names[1]), disk.path(names[2])
    data = bytearray(second.read_bytes())
    data[-5] ^= 0xFF  # a flipped bit in the arrays: the checksum catches it
    second.write_bytes(bytes(data))
    third.write_bytes(third.read_bytes()[:100])  # truncated
    restored, n = disk.restore(m, TOKENS)
    assert n == BLOCK_TOKENS  # the first block only
    assert not second.exists()  # removed; the third is after it, found next time
    assert disk.restore(m, TOKENS)[1] == BLOCK_TOKENS
    cache = prefilled(m, TOKENS)[0]
    assert disk.save(TOKENS, cache) == 1  # the second, again (the third is there, truncated)
    disk.flush()
    assert disk.restore(m, TOKENS)[1] == 2 * BLOCK_TOKENS  # the third: unreadable, removed
    assert not third.exists()
    assert disk.save(TOKENS, cache) == 1
    disk.flush()
    assert disk.restore(m, TOKENS)[1] == 3 * BLOCK_TOKENS


def test_the_folder_stays_under_its_bound_least_recently_used_first(model, tmp_path):
    path, m = model
    layers = local_layers(make_prompt_cache(m))
    probe = DiskCache(tmp_path / "probe", PLAN, 1e9, layers)
    probe.save(TOKENS, prefilled(m, TOKENS)[0])
    probe.flush()
    block = probe.path(block_hashes(TOKENS)[0]).stat().st_size
    disk = DiskCache(tmp_path / "bounded", PLAN, 4.5 * block, layers)
    first = [7] * (2 * BLOCK_TOKENS + 1)
    disk.save(first, prefilled(m, first)[0])
    disk.flush()
    os.utime(disk.path(block_hashes(first)[0]), (1, 1))  # the oldest
    disk.save(TOKENS, prefilled(m, TOKENS)[0])  # 3 more blocks: 5 > 4.5
    disk.flush()
    sizes = [f.stat().st_size for f in (tmp_path / "bounded").rglob("*.safetensors")]
    assert sum(sizes) <= 4.5 * block and len(sizes) == 4
    assert not disk.path(block_hashes(first)[0]).exists()


def test_the_key_covers_weights_and_plan(model, tmp_path):
    path, _ = model
    fp = weights_fingerprint(path)
    assert fp == weights_fingerprint(path) and len(fp) == 24
    base = {"weights": fp, "family": "llama", "mode": "pipeline", "ranks": 2, "rank": 0,
            "layers": [1], "split": None, "kv_bits": None}  # fmt: skip
    keys = {plan_key(**base)}
    for change in ({"mode": "tensor"}, {"ranks": 3}, {"rank": 1}, {"split": [1, 1]},
                   {"kv_bits": 4}, {"weights": "other"}, {"family": "qwen2"}):  # fmt: skip
        keys.add(plan_key(**{**base, **change}))
    assert len(keys) == 8


def test_reading_is_chosen_only_when_faster_than_prefilling():
    from node.cache.disk import DiskStats

    stats = DiskStats()
    assert worth_reading(stats, 100.0)(1000, 10**9)  # nothing measured yet: try the disk
    stats.bytes_read, stats.read_s = 10**9, 1.0  # 1 GB/s
    assert worth_reading(stats, 100.0)(1000, 10**9)  # 1 s against 10 s of prefill
    assert not worth_reading(stats, 10_000.0)(1000, 10**9)  # 1 s against 0.1 s


def test_a_model_with_the_same_shapes_and_other_weights_has_another_key(model, tmp_path):
    """A fine-tune of one base: same config, index and tensor headers, other weights. Also one
    tensor changed in place (the bytes of one layer): another fingerprint."""
    import shutil

    path, _ = model
    other = make_model(tmp_path / "other", "llama", seed=2, **SMALL)

    def headers(folder):
        out = []
        for f in sorted(folder.glob("*.safetensors")):
            data = f.read_bytes()
            out.append((f.name, len(data), data[: 8 + int.from_bytes(data[:8], "little")]))
        return out

    assert headers(path) == headers(other)  # what the old fingerprint hashed: all equal
    assert weights_fingerprint(path) != weights_fingerprint(other)
    edited = tmp_path / "edited"
    shutil.copytree(path, edited)
    shard = sorted(edited.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of the last tensor's last bytes
    shard.write_bytes(bytes(data))
    assert weights_fingerprint(edited) != weights_fingerprint(path)
    store = tmp_path / STORE
    store.mkdir()
    assert weights_fingerprint(path, store) == weights_fingerprint(path)  # remembered ...
    assert (store / "fingerprints.json").exists()
    assert weights_fingerprint(path, store) == weights_fingerprint(path)  # ... and read back
    # a file replaced by one of the same size and mtime (cp -p, rsync -t) is read again
    remembered = weights_fingerprint(edited, store)
    st = shard.stat()
    data[-3] ^= 0x01  # back to the original's bytes, in a new file with the old times
    fresh = shard.with_suffix(".new")
    fresh.write_bytes(bytes(data))
    os.utime(fresh, ns=(st.st_atime_ns, st.st_mtime_ns))
    fresh.replace(shard)
    assert shard.stat().st_size == st.st_size and shard.stat().st_mtime_ns == st.st_mtime_ns
    assert weights_fingerprint(edited, store) != remembered
    assert weights_fingerprint(edited, store) == weights_fingerprint(edited)


def test_store_layout_permissions_and_what_it_refuses(model, tmp_path):
    path, m = model
    disk = DiskCache(tmp_path, PLAN, 1e9, local_layers(make_prompt_cache(m)))
    disk.save(TOKENS, prefilled(m, TOKENS)[0])
    disk.flush()
    store = tmp_path / STORE
    assert (store / diskcache.MARKER).exists()
    blocks = list(store.rglob("*.safetensors"))
    assert len(blocks) == 3 and all(b.stat().st_mode & 0o777 == 0o600 for b in blocks)
    folders = [store, *[p for p in store.rglob("*") if p.is_dir()]]
    assert all(f.stat().st_mode & 0o777 == 0o700 for f in folders), folders
    assert (store / diskcache.KEY_FILE).stat().st_mode & 0o777 == 0o600
    # a folder named like the store that the cache did not make, with something in it
    foreign = tmp_path / "elsewhere"
    (foreign / STORE).mkdir(parents=True)
    (foreign / STORE / "notes.txt").write_text("mine")
    with pytest.raises(NotOurs, match="did not write"):
        DiskCache(foreign, PLAN, 1e9, [0, 1])
    assert (foreign / STORE / "notes.txt").read_text() == "mine"
    if os.getuid() == 0:  # another user's store: refused, not used
        theirs = tmp_path / "theirs"
        DiskCache(theirs, PLAN, 1e9, [0, 1])
        os.chown(theirs / STORE, 65534, 65534)
        with pytest.raises(NotOurs, match="another user"):
            DiskCache(theirs, PLAN, 1e9, [0, 1])


def test_ranks_of_one_host_make_a_new_store_at_once(tmp_path):
    """Two ranks open a new store in the same instant: the other's marker or key half made
    (its temporary file) is not a stranger's file; both get the store and the same key."""
    import threading

    half = tmp_path / "half" / STORE
    half.mkdir(parents=True)
    (half / f"{diskcache.MARKER}.4242.77{diskcache.TMP_SUFFIX}").write_bytes(b"")
    (half / f"{diskcache.KEY_FILE}.4242.77{diskcache.TMP_SUFFIX}").write_bytes(b"")
    assert open_store(tmp_path / "half")[0] == half
    for n in range(40):  # the same through real threads released together
        root = tmp_path / f"race{n}"
        start, keys, errors = threading.Barrier(4), [], []

        def one(root=root, start=start, keys=keys, errors=errors):
            start.wait()
            try:
                keys.append(open_store(root)[1])
            except NotOurs as e:
                errors.append(e)

        threads = [threading.Thread(target=one) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert errors == [] and len(set(keys)) == 1, (n, errors)


def test_files_the_cache_did_not_write_survive_any_bound(model, tmp_path):
    """A models folder, a file named like a block outside the store's layout, another
    program's .tmp file: none is removed however low the bound."""
    path, m = model
    keep = tmp_path / "models" / "keep" / "model.safetensors"
    keep.parent.mkdir(parents=True)
    keep.write_bytes(b"x" * (8 << 20))
    disk = DiskCache(tmp_path, PLAN, 1e9, local_layers(make_prompt_cache(m)))
    name = block_hashes(TOKENS)[0]
    stray = tmp_path / STORE / "odd" / f"{name}.safetensors"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"y" * 1000)
    other_tmp = tmp_path / STORE / PLAN / "ab" / "notes.tmp"
    other_tmp.parent.mkdir(parents=True)
    other_tmp.write_bytes(b"z")
    disk.limit = 1  # every block of its own goes as soon as it is written
    disk.save(TOKENS, prefilled(m, TOKENS)[0])
    disk.flush()
    assert disk.stats.bytes_written > 0
    assert not disk.path(name).exists()
    assert keep.stat().st_size == 8 << 20 and stray.exists() and other_tmp.exists()


def test_planted_foreign_or_misshapen_blocks_are_misses(model, tmp_path, monkeypatch):
    path, m = model
    layers = local_layers(make_prompt_cache(m))
    cache = prefilled(m, TOKENS)[0]
    theirs = DiskCache(tmp_path / "theirs", PLAN, 1e9, layers)  # another store, another key
    theirs.save(TOKENS, cache)
    theirs.flush()
    ours = DiskCache(tmp_path / "ours", PLAN, 1e9, layers)
    said = []
    ours.log = said.append
    name = block_hashes(TOKENS)[0]
    # a block copied in from elsewhere (its plan's manifest too): its signature is not ours
    for f in (theirs.path(name), theirs.folder / diskcache.MANIFEST):
        target = ours.folder / f.relative_to(theirs.folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(f.read_bytes())
    ours.manifest = None
    assert ours.restore(m, TOKENS) == (None, 0)
    assert "signature" in said[-1] and not ours.path(name).exists()
    # a block signed with our key whose arrays do not have the plan's shapes
    ours.save(TOKENS, cache)
    ours.flush()
    assert ours.restore(m, TOKENS)[1] == 3 * BLOCK_TOKENS
    k = f"k{layers[0]}"
    arrays = {f"{kind}{i}": getattr(cache[i], "keys" if kind == "k" else "values")[..., :256, :]
              for i in layers for kind in "kv"}  # fmt: skip
    arrays[k] = arrays[k][:, :1]  # one head fewer than the plan's
    ours.path(name).unlink()
    ours._write(name, arrays, {a: "float32" for a in arrays})
    assert ours.restore(m, TOKENS) == (None, 0)
    assert f"has {k} of shape" in said[-1]
    # a block this user may not touch (another user's, in a shared folder): a miss, no crash
    ours.save(TOKENS, cache)
    ours.flush()
    good = block_hashes(TOKENS)[1]
    data = bytearray(ours.path(good).read_bytes())
    data[-5] ^= 0xFF
    ours.path(good).write_bytes(bytes(data))

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "utime", denied)
    monkeypatch.setattr(Path, "unlink", denied)
    assert ours.restore(m, TOKENS)[1] == BLOCK_TOKENS  # the first block; the second is bad
    assert ours.path(good).exists()  # could not be removed: left as it is


def test_a_writer_that_fails_turns_writing_off_and_memory_stays_flat(model, tmp_path,
                                                                     monkeypatch):  # fmt: skip
    """safetensors raises its own error (not OSError) on a full disk: the writer lives,
    says it once, lets go of what waits, and nothing more is queued."""
    import safetensors.numpy

    path, m = model
    said = []
    disk = DiskCache(tmp_path, PLAN, 1e9, local_layers(make_prompt_cache(m)), said.append)

    class SafetensorError(Exception):
        pass

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save", full)
    cache = prefilled(m, TOKENS)[0]
    assert disk.save(TOKENS, cache) == 3
    disk.flush()
    assert len(said) == 1 and "No space left on device" in said[0]  # once, not per block
    assert disk.writer.is_alive() and not disk.writing
    assert disk.queued_bytes == 0 and not disk.queued
    for _ in range(5):
        assert disk.save(TOKENS, cache) == 0  # nothing more is queued
    assert disk.queued_bytes == 0 and len(said) == 1
    assert disk.restore(m, TOKENS) == (None, 0)
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_writer_s_queue_is_bounded_in_bytes_and_never_twice(model, tmp_path, monkeypatch):
    import threading

    path, m = model
    disk = DiskCache(tmp_path, PLAN, 1e9, local_layers(make_prompt_cache(m)))
    cache = prefilled(m, TOKENS)[0]
    go = threading.Event()
    real = disk._write
    monkeypatch.setattr(disk, "_write", lambda *a: (go.wait(30), real(*a)))
    block = 2 * 2 * 2 * BLOCK_TOKENS * 16 * 4  # layers x k,v x heads x tokens x dim x float32
    monkeypatch.setattr(diskcache, "MAX_QUEUED_BYTES", int(1.5 * block))
    assert disk.save(TOKENS, cache) == 1  # one block fits the bound, the others are skipped
    assert disk.save(TOKENS, cache) == 0  # and it is not queued again while it waits
    assert disk.queued_bytes == block
    go.set()
    disk.flush()
    assert disk.queued_bytes == 0
    assert disk.save(TOKENS, cache) == 1  # the next one, now that the first is written


@pytest.mark.skipif(os.getuid() != 0, reason="mounts a tiny filesystem (root)")
def test_a_full_filesystem_is_said_once_and_the_rank_goes_on(model, tmp_path):
    import subprocess

    path, m = model
    root = tmp_path / "tiny"
    root.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", str(root)],
                             capture_output=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs here: {mounted.stderr.decode()}")
    try:
        said = []
        disk = DiskCache(root, PLAN, 1e9, local_layers(make_prompt_cache(m)), said.append)
        cache = prefilled(m, TOKENS)[0]
        for _ in range(3):
            disk.save(TOKENS, cache)
            disk.flush()
        other = [9] * (3 * BLOCK_TOKENS + 1)
        disk.save(other, prefilled(m, other)[0])
        disk.flush()
        assert len(said) == 1 and "No space left" in said[0], said
        assert not disk.writing and disk.queued_bytes == 0 and disk.writer.is_alive()
        assert disk.save(other, prefilled(m, other)[0]) == 0
        n = disk.restore(m, TOKENS)[1]  # what was written whole is still read
        assert n % BLOCK_TOKENS == 0 and not list(root.rglob("*.tmp"))
    finally:
        subprocess.run(["umount", str(root)], check=True)


def test_blocks_of_another_layout_under_the_same_key_are_a_miss(model, tmp_path):
    """The plan key names every part of a rank's layout; a store where another layout wrote
    under the same key (a bug, a key made without the layers) is a miss, never a crash."""
    path, m = model
    layers = local_layers(make_prompt_cache(m))
    first = DiskCache(tmp_path, PLAN, 1e9, layers)
    assert first.save(TOKENS, prefilled(m, TOKENS)[0]) == 3
    first.flush()
    assert first.restore(m, TOKENS)[1] == 3 * BLOCK_TOKENS
    fewer = DiskCache(tmp_path, PLAN, 1e9, layers[:-1])
    assert fewer.restore(m, TOKENS) == (None, 0)
