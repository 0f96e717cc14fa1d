"""node.diskcache on one process: blocks written after an answer are read back into a cache
that continues the prompt exactly as a prefilled one; a corrupt block is a miss and is removed;
the folder stays under its bound; two processes writing one folder leave only whole blocks.
(Every rank agreeing, serve restarted and the plan in the key: tests/test_serve.py.)"""

import multiprocessing
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from tiny import make_model

from node.diskcache import (
    BLOCK_TOKENS,
    DiskCache,
    block_hashes,
    local_layers,
    plan_key,
    weights_fingerprint,
    worth_reading,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128}  # fmt: skip
    path = make_model(tmp_path_factory.mktemp("dc") / "m", "llama", seed=1, **small)
    m, _ = load(str(path))
    return path, m


def prefilled(m, tokens):
    cache = make_prompt_cache(m)
    logits = m(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return cache, logits[0, -1]


def next_logits(m, cache, tokens):
    return m(mx.array(tokens)[None], cache=cache)[0, -1]


TOKENS = [3 + (i * 7) % 400 for i in range(3 * BLOCK_TOKENS + 10)]


def test_blocks_read_back_continue_the_prompt_exactly(model, tmp_path):
    path, m = model
    disk = DiskCache(tmp_path, "plan", 1e9, local_layers(make_prompt_cache(m)))
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


def test_a_corrupt_or_truncated_block_is_a_miss_and_is_removed(model, tmp_path):
    path, m = model
    disk = DiskCache(tmp_path, "plan", 1e9, local_layers(make_prompt_cache(m)))
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
    probe = DiskCache(tmp_path / "probe", "plan", 1e9, layers)
    probe.save(TOKENS, prefilled(m, TOKENS)[0])
    probe.flush()
    block = probe.path(block_hashes(TOKENS)[0]).stat().st_size
    disk = DiskCache(tmp_path / "bounded", "plan", 4.5 * block, layers)
    first = [7] * (2 * BLOCK_TOKENS + 1)
    disk.save(first, prefilled(m, first)[0])
    disk.flush()
    os.utime(disk.path(block_hashes(first)[0]), (1, 1))  # the oldest
    disk.save(TOKENS, prefilled(m, TOKENS)[0])  # 3 more blocks: 5 > 4.5
    disk.flush()
    sizes = [f.stat().st_size for f in (tmp_path / "bounded").rglob("*.safetensors")]
    assert sum(sizes) <= 4.5 * block and len(sizes) == 4
    assert not disk.path(block_hashes(first)[0]).exists()


def _writer(folder: str, model_dir: str, layers: list[int], offset: int) -> None:
    m, _ = load(model_dir)
    disk = DiskCache(Path(folder), "plan", 1e9, layers)
    for i in range(3):  # the same blocks as the other process, and some of its own
        tokens = TOKENS if i % 2 == 0 else [offset + 1] * (BLOCK_TOKENS * 2 + 1)
        disk.save(tokens, prefilled(m, tokens)[0])
    disk.flush()


def test_two_processes_on_one_folder_leave_only_whole_blocks(model, tmp_path):
    path, m = model
    layers = local_layers(make_prompt_cache(m))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), str(path), layers, k))
             for k in (10, 20)]  # fmt: skip
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    assert not list(tmp_path.rglob("*.tmp"))
    disk = DiskCache(tmp_path, "plan", 1e9, layers)
    assert disk.restore(m, TOKENS)[1] == 3 * BLOCK_TOKENS
    for k in (10, 20):
        assert disk.restore(m, [k + 1] * (BLOCK_TOKENS * 2 + 1))[1] == 2 * BLOCK_TOKENS


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
    from node.diskcache import DiskStats

    stats = DiskStats()
    assert worth_reading(stats, 100.0)(1000, 10**9)  # nothing measured yet: try the disk
    stats.bytes_read, stats.read_s = 10**9, 1.0  # 1 GB/s
    assert worth_reading(stats, 100.0)(1000, 10**9)  # 1 s against 10 s of prefill
    assert not worth_reading(stats, 10_000.0)(1000, 10**9)  # 1 s against 0.1 s


def test_a_full_disk_is_a_warning_and_a_miss_never_a_crash(model, tmp_path, monkeypatch):
    import errno

    import safetensors.numpy

    path, m = model
    said = []
    disk = DiskCache(tmp_path, "plan", 1e9, local_layers(make_prompt_cache(m)), said.append)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    disk.save(TOKENS, prefilled(m, TOKENS)[0])
    disk.flush()
    assert len(said) == 1 and "No space left on device" in said[0]  # once, not per block
    assert disk.writer.is_alive()
    assert disk.restore(m, TOKENS) == (None, 0)
    assert not list(tmp_path.rglob("*.tmp"))
