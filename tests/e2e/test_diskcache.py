"""The disk tier with two processes writing one store at once: only whole blocks are left
(node.cache.disk; everything else of it in one process: tests/fast/test_diskcache.py)."""

import multiprocessing
from pathlib import Path

import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from node.cache.disk import BLOCK_TOKENS, DiskCache, local_layers
from tests.support.kv import PLAN, TOKENS, prefilled, small_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return small_llama(tmp_path_factory.mktemp("dc"))


def _writer(folder: str, model_dir: str, layers: list[int], offset: int) -> None:
    m, _ = load(model_dir)
    disk = DiskCache(Path(folder), PLAN, 1e9, layers)
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
    disk = DiskCache(tmp_path, PLAN, 1e9, layers)
    assert disk.restore(m, TOKENS)[1] == 3 * BLOCK_TOKENS
    for k in (10, 20):
        assert disk.restore(m, [k + 1] * (BLOCK_TOKENS * 2 + 1))[1] == 2 * BLOCK_TOKENS
