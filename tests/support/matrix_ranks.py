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

from cluster.core.spec import JobRequest, Sampling, SharedRequest  # noqa: E402
from node.decode.loop import generate  # noqa: E402
from node.decode.vision import generate_vlm  # noqa: E402
from node.jobs.oneshot import make_job_request  # noqa: E402
from node.model.load import load_shard  # noqa: E402
from node.rank.dist import barrier, init_group  # noqa: E402
from node.rank.share import share_typed  # noqa: E402


def run_cell(cell: dict, mode: str, group) -> dict | None:
    loaded = load_shard(cell["model"], mode, group)
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
    barrier(group)
    return answer if rank0 else None


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
