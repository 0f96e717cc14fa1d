"""``launch``: one answer on every rank. Rank 0 builds the request (tokens through the chat
template, or a vision model's prompt and image) and shares it; every rank decodes it; rank 0
writes the text. ``--logits``: one JSON line with the first step's logits and the text."""

from __future__ import annotations

import json

from cluster.core.modelcheck import check_request
from cluster.core.protocol import Phase, Prefill
from cluster.core.spec import JobRequest, SharedRequest
from node.jobs import Job


def run_oneshot(job: Job) -> dict | None:
    """The answer on every rank; its stats (rank 0's)."""
    from node.decode.loop import generate
    from node.decode.vision import generate_vlm
    from node.rank.share import share_typed

    spec, loaded, emit, write = job.spec, job.loaded, job.emit, job.write
    make = (lambda: make_job_request(loaded, spec.request, spec.command)) if job.rank0 else None
    request = share_typed(SharedRequest, make, job.group, "prepare the request")
    if request is None:  # rank 0 always makes one
        raise RuntimeError("rank 0 shared no request")
    report = (lambda done, total: emit(Prefill(done, total))) if job.rank0 else None
    if spec.command == "logits":  # the prompt's logits, then the text, in one JSON line
        emit(Phase("generating", prompt_tokens=len(request.tokens)))
        pieces: list[str] = []
        first: list = []
        generate(loaded.model, loaded.tokenizer, request, pieces.append if write else None,
                 job.group, first_logits=first, on_prefill=report)  # fmt: skip
        if write:
            n = len(request.tokens)
            logits = first[0].tolist()
            write(json.dumps({"prompt_tokens": n, "logits": logits, "text": "".join(pieces)}))
            write("\n")
        return None
    if loaded.processor is not None:
        emit(Phase("generating"))
        return generate_vlm(loaded.model, loaded.processor, request, write, job.group)
    disk = job.disk
    tokens = request.tokens
    emit(Phase("generating", prompt_tokens=len(tokens)))
    cache, from_disk = (None, 0) if disk is None else disk.lookup(loaded.model, tokens)
    answer = generate(loaded.model, loaded.tokenizer, request, write, job.group,
                      prompt_cache=cache, feed=tokens[from_disk:] if cache is not None else None,
                      speculation=loaded.speculation, on_prefill=report,
                      from_disk=from_disk)  # fmt: skip
    if disk is not None:
        disk.save(tokens + answer.tokens, cache)
        disk.flush()  # the job ends: its blocks are on disk before it does
    return answer.stats


def make_job_request(loaded, r: JobRequest, command: str) -> SharedRequest:
    """Rank 0's request for this model: tokens for a text model; for a VLM, the templated
    prompt and the image bytes (every rank runs the processor on them)."""
    from node.decode.render import make_request
    from node.decode.sampling import seeded
    from node.decode.vision import make_vlm_request

    check_request(loaded.config, command, r.image is not None, repr(loaded.config["model_type"]))
    if loaded.processor is None:
        return make_request(loaded.tokenizer, r)
    if r.constraint is not None:
        raise ValueError("--json-schema and --regex need a text model (this one sees images)")
    return make_vlm_request(loaded.processor, loaded.model.config, r.prompt, r.image,
                            seeded(r.sampling))  # fmt: skip
