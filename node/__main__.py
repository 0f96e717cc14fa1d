"""A rank: ``python -m node run --spec JOB.json``.

stdout carries only generated text (rank 0); stderr carries logs and one-line JSON events for
the launcher. Exit codes: 0 done, 1 this rank failed, 3 this rank stopped because rank 0 failed.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
import time
import traceback

from cluster.modelcheck import ModelError, check_request
from cluster.protocol import encode_event

from .share import PeerFailed

COMMANDS = ("generate", "logits", "chat", "serve", "bench")
EXIT_FAILED = 1
EXIT_PEER_FAILED = 3
HEARTBEAT_S = 1.0
_stderr_lock = threading.Lock()


def is_peer_loss(e: Exception) -> bool:
    """MLX's collectives fail like this when another rank went away."""
    text = str(e)
    return (
        isinstance(e, RuntimeError)
        and ("[ring]" in text or "[jaccl]" in text)
        and ("lost" in text or "closed" in text or "failed" in text)
    )


def emit(kind: str, **fields) -> None:
    with _stderr_lock:
        sys.stderr.write(encode_event(kind, **fields))
        sys.stderr.flush()


def start_heartbeat() -> None:
    """A beat every second, also while the main thread waits in a collective (MLX releases
    the GIL there): the launcher takes a rank that stops beating for stopped or hung."""

    def beat():
        while True:
            emit("beat")
            time.sleep(HEARTBEAT_S)

    threading.Thread(target=beat, daemon=True, name="heartbeat").start()


def write_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(spec: dict) -> None:
    from .dist import barrier, init_group
    from .generate import generate, prompt_logits
    from .load import load_shard
    from .share import share_object
    from .vlm import generate_vlm

    emit("phase", phase="init")
    group = init_group(spec["world_size"])
    rank = group.rank()
    from .memory import apply_metal_limits

    limit = apply_metal_limits()
    if limit is not None:
        with _stderr_lock:
            print(f"Metal memory and wired limits: {limit / 1e9:.1f} GB", file=sys.stderr)
    emit("phase", phase="loading")
    tic = time.perf_counter()
    loaded = load_shard(
        spec["model"], spec["mode"], group, spec.get("split"), spec.get("split_weights")
    )
    barrier(group)
    emit("ready", load_s=time.perf_counter() - tic, layers=loaded.layers, files=loaded.files)

    command = spec.get("command", "generate")
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    if command in ("chat", "serve", "bench"):  # every rank alike; one-shot jobs: rank 0
        check_request(loaded.config, command, False, repr(loaded.config["model_type"]))
    if command == "serve":
        from .serve import run_serve

        run_serve(loaded, group, spec, emit)
        return
    if command == "bench":
        from .bench import run_bench

        run_bench(loaded, group, spec, emit)
        emit_memory()
        barrier(group)
        return
    if command == "chat":
        from .chat import run_chat

        run_chat(loaded, group, spec, emit, write_text if rank == 0 else None)
        emit_memory()
        barrier(group)
        return
    request = None
    if rank == 0:
        try:
            request = make_job_request(loaded, spec["request"], command)
        except Exception as e:  # tell the other ranks before failing, so none waits forever
            share_object({"error": f"{type(e).__name__}: {e}"}, group)
            raise
    request = share_object(request, group)
    if "error" in request:
        raise PeerFailed(f"rank 0 failed to prepare the request: {request['error']}")
    write = write_text if rank == 0 else None
    if command == "logits":
        emit("phase", phase="generating", prompt_tokens=len(request["tokens"]))
        logits = prompt_logits(loaded.model, request["tokens"])
        if write:
            write(json.dumps({"prompt_tokens": len(request["tokens"]), "logits": logits}) + "\n")
        emit_memory()
        barrier(group)
        return
    if loaded.processor is not None:
        emit("phase", phase="generating")
        stats = generate_vlm(loaded.model, loaded.processor, request, write, group)
    else:
        emit("phase", phase="generating", prompt_tokens=len(request["tokens"]))
        stats = generate(loaded.model, loaded.tokenizer, request, write, group).stats
    emit_memory()
    barrier(group)
    if rank == 0:
        emit("stats", **stats)


def emit_memory() -> None:
    """This rank's peak memory (MLX's count: weights, caches, activations)."""
    import mlx.core as mx

    emit("memory", peak_memory_gb=mx.get_peak_memory() / 1e9)


def make_job_request(loaded, r: dict, command: str) -> dict:
    """Rank 0's request for this model: tokens for a text model; for a VLM, the templated
    prompt and the image bytes (every rank runs the processor on them)."""
    from .generate import make_request
    from .sampling import settings
    from .vlm import make_vlm_request

    image = base64.b64decode(r["image_b64"]) if r.get("image_b64") else None
    check_request(loaded.config, command, image is not None, repr(loaded.config["model_type"]))
    if loaded.processor is None:
        return make_request(loaded.tokenizer, r)
    return make_vlm_request(loaded.processor, loaded.model.config, r["prompt"], image, settings(r))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m node", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="run one rank of a job")
    run_p.add_argument("--spec", required=True, help="path of the job spec (JSON)")
    args = parser.parse_args(argv)
    start_heartbeat()
    try:
        with open(args.spec) as f:
            spec = json.load(f)
        run(spec)
    except PeerFailed as e:
        emit("error", message=str(e), peer=True, t=time.time())
        return EXIT_PEER_FAILED
    except (ModelError, ValueError, FileNotFoundError) as e:
        with _stderr_lock:
            print(f"error: {e}", file=sys.stderr, flush=True)
        # "model": the model cannot be served as asked (bad input), not a broken copy of it
        cause = "model" if isinstance(e, ModelError) else None
        emit("error", message=str(e), t=time.time(), cause=cause)
        return EXIT_FAILED
    except Exception as e:
        with _stderr_lock:
            traceback.print_exc()
        if is_peer_loss(e):  # an effect of another rank's failure, not a cause
            emit("error", message=f"{type(e).__name__}: {e}", peer=True, t=time.time())
            return EXIT_FAILED
        emit("error", message=f"{type(e).__name__}: {e}", t=time.time())
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
