"""A rank: ``python -m node run --spec JOB.json``, and its launcher watcher, ``python -m node
watch`` (``node.rank.watchdog``; the rank starts it).

stdout carries only generated text (rank 0); stderr carries logs and one-line JSON events for
the launcher (``cluster.core.protocol``); stdin is the launcher's channel
(``node.rank.watchdog``). Exit codes: 0 done, 1 this rank failed, 3 this rank stopped because
rank 0 failed; killed (SIGKILL) by its watcher when the launcher was lost.
"""

from __future__ import annotations

import argparse
import atexit
import os
import sys
import threading
import time
import traceback
from typing import NoReturn

from cluster.core.blas import blas_env_here
from cluster.core.modelcheck import ModelError, SetupError, check_kv_quant, check_request
from cluster.core.protocol import (
    Error,
    Event,
    Memory,
    Notice,
    Phase,
    Ready,
    Stats,
    encode_event,
)
from cluster.core.spec import JobSpec
from node.jobs import Job

EXIT_FAILED = 1
EXIT_PEER_FAILED = 3
_stderr_lock = threading.Lock()


def is_peer_loss(e: Exception) -> bool:
    """MLX's collectives fail like this when another rank went away."""
    text = str(e)
    return (
        isinstance(e, RuntimeError)
        and ("[ring]" in text or "[jaccl]" in text)
        and ("lost" in text or "closed" in text or "failed" in text)
    )


def emit(event: Event) -> None:
    with _stderr_lock:
        sys.stderr.write(encode_event(event))
        sys.stderr.flush()


def log(message: str) -> None:
    with _stderr_lock:
        print(message, file=sys.stderr, flush=True)


# How long a rank waits for its peers to start (the launcher's START): longer than a heartbeat,
# since the launcher starts remote ranks one after another and a loaded host imports MLX for
# seconds; a launcher that is gone ends the rank sooner (its watcher).
START_WAIT_S = 120.0


def write_text(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run(spec: JobSpec) -> None:
    """One rank's job: join the group, load this rank's share, then the command's job
    (``JOBS``), every rank alike."""
    from node.decode.prefill import use_step_args
    from node.model.load import load_shard
    from node.rank.dist import barrier, init_group
    from node.rank.gpu import report_gpu
    from node.rank.memory import apply_memory_limits
    from node.rank.watchdog import wait_for_start

    report_gpu(emit, spec.device)
    emit(Phase("init"))
    # every rank joins at the launcher's START, together (cluster.core.protocol.START)
    if not wait_for_start(max(spec.launcher_timeout, START_WAIT_S)):
        raise RuntimeError("the launcher never said START: another rank did not get ready")
    group = init_group(spec.world_size, spec.backend)
    write = write_text if group.rank() == 0 else None
    if spec.command == "links":  # doctor --links: the backend alone, no model
        from node.rank.links import run_links

        emit(Ready(0.0))
        run_links(group, spec.backend, emit)
        return
    if spec.command == "serve" and spec.measure_links and spec.world_size > 1:
        from node.rank.links import AT_START, run_links  # before the model: links idle, memory free

        emit(Phase("links"))
        run_links(group, spec.backend, emit, AT_START)
    limit = apply_memory_limits()
    if limit is not None:
        what = "Metal memory and wired limits" if limit[0] == "Metal" else "CUDA memory limit"
        log(f"{what}: {limit[1] / 1e9:.1f} GB")
    emit(Phase("loading"))
    tic = time.perf_counter()
    text_only = spec.request.image is None  # a VLM's conversion: its text model (mlx-lm's)
    loaded = load_shard(spec.model, spec.mode, group, spec.split, spec.split_weights, text_only)
    if spec.draft.on:
        from node.model.draft import load_draft

        loaded.speculation = load_draft(spec.draft, loaded, group)
    door = None
    if spec.command == "serve" and spec.handoff.role == "decode":  # KV comes from prefill groups
        from node.cache.handoff import open_door

        door = open_door(loaded, spec, group.rank(), log)
    barrier(group)
    layers = None if loaded.layers is None else list(loaded.layers)
    emit(Ready(time.perf_counter() - tic, layers=layers, files=loaded.files, door=door))
    check_kv_quant(loaded.config, spec.kv_quant.kv_bits, spec.kv_quant.kv_group_size)
    steps = {"prefill_step_size": spec.prefill_step} if spec.prefill_step else {}
    use_step_args({**spec.kv_quant.generate_kwargs(), **steps}, spec.stages)
    if loaded.processor is None:  # a grammar's tokens, built when the first grammar comes
        from cluster.core.modelcheck import text_config
        from node.decode.grammar import use_tokenizer
        from node.model.load import check_same_tokenizer

        vocab = text_config(loaded.config).get("vocab_size") or loaded.tokenizer.vocab_size
        use_tokenizer(loaded.path, loaded.tokenizer.eos_token_ids, vocab)
        check_same_tokenizer(loaded, vocab, group)
    if spec.command in ("chat", "serve", "bench"):  # every rank alike; one-shot jobs: rank 0
        check_request(loaded.config, spec.command, False, repr(loaded.config["model_type"]))
    disk = None
    if spec.command in ("chat", "serve", "generate"):
        from node.cache.disk import open_disk_cache

        disk = open_disk_cache(loaded, spec, group, log, lambda m: emit(Notice(m)))
    JOBS[spec.command](Job(spec, group, loaded, emit, log, write, disk))


def serve(job: Job) -> None:
    from node.jobs.serve import run_serve

    run_serve(job)


def chat(job: Job) -> None:
    from node.jobs.chat import run_chat

    run_chat(job)
    finish(job)


def bench(job: Job) -> None:
    from node.jobs.bench import run_bench

    run_bench(job)
    finish(job)


def oneshot(job: Job) -> None:
    from node.jobs.oneshot import run_oneshot

    finish(job, run_oneshot(job))


def finish(job: Job, stats: dict | None = None) -> None:
    """The end of a job that is not serve: each rank's peak memory, then every rank meets,
    then rank 0's stats (the launcher reports them once every rank is done)."""
    import mlx.core as mx

    from node.rank.dist import barrier

    emit(Memory(mx.get_peak_memory() / 1e9))
    barrier(job.group)
    if stats is not None and job.group.rank() == 0:
        emit(Stats(**stats))


JOBS = {"serve": serve, "chat": chat, "bench": bench, "generate": oneshot, "logits": oneshot}


def reexec_with_blas(spec: JobSpec, argv: list[str]) -> None:
    """On Linux, start this rank again with the host's OpenBLAS preloaded (cluster.core.blas); the
    process keeps its PID, pipes and arguments. Returns when nothing changes."""
    extra = blas_env_here(spec.blas, spec.ranks_on_host, dict(os.environ))
    if extra is None:
        return
    _stderr_lock.acquire()  # no heartbeat line half-written when the process is replaced
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "node", *argv], {**os.environ, **extra})


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m node", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    run_p = sub.add_parser("run", help="run one rank of a job")
    run_p.add_argument("--spec", required=True, help="path of the job spec (JSON)")
    watch_p = sub.add_parser("watch", help="watch the launcher for a rank (it starts this)")
    watch_p.add_argument("--rank-pid", type=int, required=True)
    watch_p.add_argument("--timeout", type=float, required=True)
    watch_p.add_argument("--lifeline", type=int, required=True)
    watch_p.add_argument("--job-dir", help="the rank's folder, removed if the launcher is lost")
    args = parser.parse_args(argv)
    if args.cmd == "watch":
        from node.rank.watchdog import watch_launcher

        watch_launcher(args.rank_pid, args.timeout, args.lifeline, job_dir=args.job_dir)
        return 0
    from node.rank.watchdog import hold_start, start_heartbeat

    hold_start()  # before Phase("init"): START may come to any of the process's threads
    # Beat from the first moment: importing MLX and the model code takes seconds of CPU, more
    # on a loaded host, and the launcher's heartbeat timeout counts from the rank's start.
    start_heartbeat(emit)
    try:
        with open(args.spec) as f:
            spec = JobSpec.from_json(f.read())
    except (OSError, ValueError) as e:
        log(f"error: cannot read the job spec {args.spec}: {e}")
        emit(Error(f"cannot read the job spec: {e}", t=time.time()))
        return EXIT_FAILED
    reexec_with_blas(spec, argv)
    from node.rank.gpu import use_device

    use_device(spec.device)  # after the BLAS is chosen, before mlx-lm is imported
    from node.rank.share import PeerFailed
    from node.rank.watchdog import start_launcher_link

    start_launcher_link(spec.launcher_timeout, os.path.dirname(os.path.abspath(args.spec)))
    try:
        run(spec)
    except PeerFailed as e:
        emit(Error(str(e), t=time.time(), peer=True))
        return EXIT_PEER_FAILED
    except (ModelError, ValueError, FileNotFoundError) as e:
        log(f"error: {e}")
        # "model": the model cannot be served as asked (bad input), not a broken copy of it
        cause = "model" if isinstance(e, ModelError) else None
        cause = "setup" if isinstance(e, SetupError) else cause
        emit(Error(str(e), t=time.time(), cause=cause))
        return EXIT_FAILED
    except Exception as e:
        with _stderr_lock:
            traceback.print_exc()
        # a collective's "peer lost" is an effect of another rank's failure, not a cause
        emit(Error(f"{type(e).__name__}: {e}", t=time.time(), peer=is_peer_loss(e)))
        return EXIT_FAILED
    return 0


def exit_now(code: int) -> NoReturn:
    """End the rank once its job is done, without the interpreter's teardown of mlx, mlx-lm and
    transformers (0.12-0.14 s here, a tenth of a one-token launch; docs/benchmarks.md): the
    atexit handlers run and the output is flushed, then the process ends. The watcher sees its
    lifeline close as before; every file the job writes is closed or flushed by the job."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the launcher is gone, or the stream was closed
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
