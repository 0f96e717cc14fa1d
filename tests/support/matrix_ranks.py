"""One rank of a batch of matrix cells: many models, one mode and rank count, one ring.

    python -m tests.support.matrix_ranks --mode tensor --cells CELLS.json  # MLX_RANK, MLX_HOSTFILE

tests/e2e/test_models.py runs the model matrix this way: the cells of one mode and rank count share
one start-up of their ranks (on this machine's two cores a rank's start costs seconds) instead of
one ``mlx-cluster launch`` each. Each model goes through the code a launch runs on every rank:
``node.load.load_shard``, the request rank 0 builds and shares (``make_job_request``,
``share_from_rank0``) and ``generate`` with its first logits (``generate_vlm`` for a vision model).
What a launch adds around them (the launcher, START, events) is proven by tests/e2e/test_launch.py.
Rank 0 writes one JSON line per cell on stdout: family, text and (text models) the logits.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import mlx.core as mx  # noqa: E402

from cluster.core.modelcheck import ModelError  # noqa: E402
from cluster.core.spec import JobRequest, Sampling, SharedRequest  # noqa: E402
from node.cache.disk import agree_min  # noqa: E402
from node.decode.loop import generate  # noqa: E402
from node.decode.vision import generate_vlm  # noqa: E402
from node.jobs.oneshot import make_job_request  # noqa: E402
from node.model.load import load_shard  # noqa: E402
from node.rank.dist import barrier, init_group  # noqa: E402
from node.rank.share import share_typed  # noqa: E402
from tests.support.matrix import CACHE_PROMPT  # noqa: E402


def run_cell(cell: dict, mode: str, group) -> dict | None:
    refused = None
    try:
        loaded = load_shard(cell["model"], mode, group)
    except ModelError as e:  # a refusal, as launch gives it: every rank agrees to skip the cell
        refused = str(e)
    if agree_min(int(refused is None), group) == 0:
        why = refused or "another rank refused this model"
        return {"family": cell["family"], "unsupported": why} if group.rank() == 0 else None
    rank0 = group.rank() == 0
    image = Path(cell["image"]).read_bytes() if cell.get("image") else None
    request = JobRequest(
        prompt=cell["prompt"], sampling=Sampling(max_tokens=cell["tokens"]), image=image
    )
    command = "launch" if image else "logits"
    make = (lambda: make_job_request(loaded, request, command)) if rank0 else None
    shared = share_typed(SharedRequest, make, group, "prepare the request")
    pieces: list[str] = []
    write = pieces.append if rank0 else None
    answer: dict = {"family": cell["family"]}
    if image is not None:
        generate_vlm(loaded.model, loaded.processor, shared, write, group)
    else:
        first: list = []
        generate(loaded.model, loaded.tokenizer, shared, write, group, first_logits=first)
        answer["logits"] = first[0].tolist()
    answer["text"] = "".join(pieces)
    if image is None and cell.get("cache"):
        answer["cache"] = second_turn(loaded, group, Path(cell["cache"]))
    barrier(group)
    return answer if rank0 else None


def second_turn(loaded, group, folder: Path) -> dict:
    """A conversation's second turn through serve's batch (node.jobs.batch.Lockstep, every
    rank), as docs/models.md's cache columns report it: the first turn answered, then the
    prompt, its answer and more tokens; how many came from the prompt cache in memory, then
    from the disk tier in a batch started afresh (a restart; None where the family's caches
    are kinds the disk tier does not keep), and whether both answers are the one a batch
    without any cache gives."""
    from mlx_lm.models.cache import make_prompt_cache

    from cluster.core.spec import Order
    from node.cache.disk import DiskCache, local_layers, plan_key, state_layers
    from node.jobs.batch import Lockstep, batchable

    vocab = loaded.tokenizer.vocab_size

    def answer(batch, prompt: list[int]) -> tuple[list[int], int]:
        request = SharedRequest(Sampling(max_tokens=4), prompt)
        ((_, cached, why),) = batch.apply(Order(insert=[request]))
        assert why is None, why
        out: list[int] = []
        while batch.live:
            batch.round(lambda r: out.append(r.token))
        return out, cached

    first = [(7 * i) % (vocab - 2) + 1 for i in range(CACHE_PROMPT)]
    if not batchable(loaded.model):  # serve decodes each request alone (node.jobs.serve)
        return second_turn_alone(loaded, group, first)
    fresh = make_prompt_cache(loaded.model)
    layers = local_layers(fresh)
    disk = None
    if agree_min(int(layers is not None), group):
        key = plan_key(rank=group.rank(), model=str(loaded.path))
        disk = DiskCache(folder, key, 1e9, layers or [], group=group, states=state_layers(fresh))

    def batch(size: int, tier=None) -> Lockstep:
        return Lockstep(loaded.model, loaded.tokenizer, 4, 4, size, group=group, disk=tier)

    memory = batch(10, disk)
    said, _ = answer(memory, first)
    turn = first + said + [3, 4, 5]
    got, cached = answer(memory, turn)
    if disk is not None:
        disk.flush()
    memory.close()
    plain = batch(0)
    want, _ = answer(plain, turn)
    plain.close()
    # what the second turn shares with the first: its prompt and its answer
    result = {"prompt": len(first) + len(said), "memory": cached, "disk": None,
              "same": got == want}  # fmt: skip
    if disk is not None:
        again = batch(10, disk)  # a restart: memory empty, the disk as the first batch left it
        got, cached = answer(again, turn)
        again.close()
        result.update(disk=cached, same=result["same"] and got == want)
    return result


def second_turn_alone(loaded, group, first: list[int]) -> dict:
    """``second_turn`` for a model whose caches cannot batch: serve's requests decoded alone
    keep one stream's cache between them (node.cache.turns.TurnCache, as decode_alone uses
    it; memory only)."""
    from node.cache.turns import TurnCache

    turns = TurnCache(loaded.model, 1e9, None, None, group)

    def answer(prompt: list[int], cached: bool) -> tuple[list[int], int]:
        request = SharedRequest(Sampling(max_tokens=4), prompt)
        if not cached:
            return generate(loaded.model, loaded.tokenizer, request, None, group).tokens, 0
        cache, feed = turns.prepare(prompt)
        got = generate(loaded.model, loaded.tokenizer, request, None, group, prompt_cache=cache,
                       feed=feed, on_prefill=turns.prefilled)  # fmt: skip
        turns.done(prompt, got.tokens)
        return got.tokens, len(prompt) - len(feed)

    said, _ = answer(first, True)
    turn = first + said + [3, 4, 5]
    got, cached = answer(turn, True)
    want, _ = answer(turn, False)
    return {"prompt": len(first) + len(said), "memory": cached, "disk": None, "same": got == want}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mode", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--cells", required=True, help="JSON list of {family, model, ...}")
    args = parser.parse_args()
    cells = json.loads(Path(args.cells).read_text())
    group = init_group(args.world_size, "ring")
    for cell in cells:
        answer = run_cell(cell, args.mode, group)
        if answer is not None:
            print(json.dumps(answer), flush=True)
        gc.collect()
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
