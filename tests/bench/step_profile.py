"""Where one decode step's time goes, on each rank, with N streams decoded together.

    python -m tests.bench.step_profile --model /tmp/bm/llama-576 --streams 8,32

For 1 rank, pipeline 2 and tensor 2 (ring over loopback, one BLAS thread per rank, as serve's
ranks run here), each rank loads its share through node.model.load, decodes ``--streams``
synthetic prompts together through node.jobs.batch.Lockstep (serve's batch: mlx-lm's
BatchGenerator in lockstep), and once every stream decodes it times, per step:

- step: a whole generator step, as serve's rounds take them (``Lockstep.round``);
- forward: the model's call on the batch's caches, collectives included;
- compute: the same call with every collective replaced by a local stand-in of its shape
  (this rank's own arithmetic, nothing waited for);
- collectives: the step's collectives alone, with the shapes the shard sends;
- sampling: normalising the logits and the greedy choice, as the generator does them;
- order: one round's order shared from rank 0 (serve shares one every ``ROUND_STEPS`` steps),
  counted per step;
- rest: step - forward - sampling (the generator's and our Python between the array work);
- main thread CPU: the CPU time of the rank's Python thread per step (our and mlx-lm's Python,
  and MLX building and dispatching every operation of the step's graph to the thread that
  computes it); a rank alone runs it on the core its computation leaves free, two ranks on
  two cores run it on the cores they compute on;
- ops: the MLX operations in one forward pass of this rank (each dispatched and run on its own;
  on a CPU, RoPE, RMSNorm and attention are made of basic operations, on a GPU each is one
  kernel);
- rank CPU: the CPU time of all the rank's threads per step (computation, dispatch, and the
  ring's threads, which poll while a collective waits).

forward - compute is the time the rank spends in collectives or waiting for another rank's
work. Prints a markdown table; --json prints the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from cluster.core.blas import blas_env_here

COLLECTIVES = ("all_sum", "all_gather", "send", "recv", "recv_like")
PROMPT_TOKENS = 64


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def run_config(model: str, mode: str, ranks: int, streams: list[int], steps: int) -> list[dict]:
    """Start ``ranks`` workers (ring over loopback), return every rank's rows."""
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(ranks)]))
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
        if ranks > 1:
            env["MLX_HOSTFILE"] = str(hostfile)
        env.update(blas_env_here("auto", ranks, env) or {})  # as the launcher gives ours
        outs = [Path(tmp) / f"rank{r}.json" for r in range(ranks)]
        argv = [sys.executable, "-m", "tests.bench.step_profile", "--worker", "--model", model,
                "--mode", mode, "--ranks", str(ranks), "--streams",
                ",".join(map(str, streams)), "--steps", str(steps)]  # fmt: skip
        procs = [
            subprocess.Popen([*argv, "--out", str(out)], env={**env, "MLX_RANK": str(r)})
            for r, out in enumerate(outs)
        ]
        try:
            codes = [p.wait(timeout=900) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise RuntimeError(f"{mode} {ranks}: a worker failed ({codes})")
        return [row for out in outs for row in json.loads(out.read_text())]


@contextmanager
def local_collectives(size: int):
    """Every collective replaced by a stand-in of the same shape that waits for no one."""
    import mlx.core as mx

    originals = {name: getattr(mx.distributed, name) for name in COLLECTIVES}
    stand_ins = {
        "all_sum": lambda x, **kw: x,
        "all_gather": lambda x, **kw: mx.concatenate([x] * size),
        "send": lambda x, dst, **kw: x,
        "recv": lambda shape, dtype, src, **kw: mx.zeros(shape, dtype),
        "recv_like": lambda x, src, **kw: mx.zeros_like(x),
    }
    try:
        for name, fn in stand_ins.items():
            setattr(mx.distributed, name, fn)
        yield
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)


def recorded_collectives(model, batch_cache, tokens) -> list[tuple]:
    """The collectives one forward call makes: (name, shape, dtype, peer)."""
    import mlx.core as mx

    seen: list[tuple] = []
    originals = {name: getattr(mx.distributed, name) for name in COLLECTIVES}

    def recording(name, fn):
        def wrapper(x, *args, **kwargs):
            peer = args[-1] if args else kwargs.get("src", kwargs.get("dst"))
            seen.append((name, tuple(x.shape), x.dtype, peer))
            return fn(x, *args, **kwargs)

        return wrapper

    try:
        for name, fn in originals.items():
            setattr(mx.distributed, name, recording(name, fn))
        mx.eval(model(tokens, cache=batch_cache))
    finally:
        for name, fn in originals.items():
            setattr(mx.distributed, name, fn)
    return seen


def graph_ops(model, batch_cache, tokens) -> int:
    """How many operations one forward pass is: the primitives of its graph, counted in MLX's
    dot export (one node per primitive)."""
    import mlx.core as mx

    with tempfile.TemporaryDirectory() as tmp:
        dot = Path(tmp) / "step.dot"
        out = model(tokens, cache=batch_cache)
        mx.export_to_dot(str(dot), out)
        mx.eval(out)
        return dot.read_text().count('[label ="')


def replay(calls: list[tuple], group) -> None:
    """The recorded collectives alone, in order, as one graph."""
    import mlx.core as mx

    out = []
    for name, shape, dtype, peer in calls:
        x = mx.zeros(shape, dtype)
        if name == "all_sum":
            out.append(mx.distributed.all_sum(x, group=group))
        elif name == "all_gather":
            out.append(mx.distributed.all_gather(x, group=group))
        elif name == "send":
            out.append(mx.distributed.send(x, peer, group=group))
        elif name in ("recv", "recv_like"):
            out.append(mx.distributed.recv_like(x, peer, group=group))
        mx.eval(out[-1])  # a stage's sends and receives alternate with its compute


def timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls (after one untimed)."""
    fn()
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def worker(args) -> None:
    from node.model.load import load_shard
    from node.rank.dist import barrier, init_group

    group = init_group(args.ranks, "ring")
    loaded = load_shard(args.model, args.mode, group)
    loaded.tokenizer.eos_token_ids = set()  # every stream decodes to its budget
    rows = []
    for streams in map(int, args.streams.split(",")):
        row = profile(loaded, group, args.mode, streams, args.steps)
        rows.append({"mode": args.mode if args.ranks > 1 else "one rank", "ranks": args.ranks,
                     "rank": group.rank(), "streams": streams, **row})  # fmt: skip
        barrier(group)
    Path(args.out).write_text(json.dumps(rows))


def profile(loaded, group, mode: str, streams: int, steps: int) -> dict:
    """One rank's figures for ``streams`` streams decoding together."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    from cluster.core.spec import Order, Sampling, SharedRequest
    from node.jobs.batch import ROUND_STEPS, Lockstep
    from node.jobs.bench import synthetic_prompts
    from node.rank.dist import barrier
    from node.rank.share import share_order

    model, vocab = loaded.model, loaded.config["vocab_size"]
    prompts = synthetic_prompts(vocab, PROMPT_TOKENS, streams)
    batch = Lockstep(model, loaded.tokenizer, streams, streams, 0, group=group,
                     stages=group.size() if mode == "pipeline" else 1)  # fmt: skip
    budget = 4 * steps + 64
    batch.apply(Order(insert=[SharedRequest(Sampling(max_tokens=budget), p) for p in prompts]))
    while batch.prefilling:
        batch.round(None)
    for _ in range(2):
        batch.round(None)  # warm
    rounds = max(1, steps // ROUND_STEPS)
    barrier(group)
    tic, main_cpu, rank_cpu = time.perf_counter(), time.thread_time(), time.process_time()
    for _ in range(rounds):
        batch.round(None)
    steps_run = rounds * ROUND_STEPS
    step = (time.perf_counter() - tic) / steps_run
    main_cpu = (time.thread_time() - main_cpu) / steps_run
    rank_cpu = (time.process_time() - rank_cpu) / steps_run

    cache = batch.generators[0]._generation_batch.prompt_cache  # mlx-lm's caches
    tokens = mx.zeros((streams, 1), dtype=mx.uint32)

    def forward():
        with mx.stream(generation_stream):
            mx.eval(model(tokens, cache=cache))

    barrier(group)
    forward_s = timed(forward, steps)
    calls = recorded_collectives(model, cache, tokens)
    ops = graph_ops(model, cache, tokens)
    with local_collectives(group.size()):
        compute_s = timed(forward, steps)
    barrier(group)
    collectives_s = timed(lambda: replay(calls, group), steps) if calls else 0.0
    logits = mx.random.normal((streams, vocab)).astype(mx.float32)

    def sampling():
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(mx.argmax(logprobs, axis=-1), list(logprobs))  # as the generator does

    sampling_s = timed(sampling, steps)
    barrier(group)
    order_s = timed(lambda: share_order(Order() if group.rank() == 0 else None, group), steps)
    batch.close()
    mx.synchronize(generation_stream)
    return {"step_s": step, "forward_s": forward_s, "compute_s": compute_s,
            "collectives_s": collectives_s, "sampling_s": sampling_s,
            "order_s": order_s / ROUND_STEPS, "rest_s": step - forward_s - sampling_s,
            "main_cpu_s": main_cpu, "ops": ops, "rank_cpu_s": rank_cpu,
            "collective_calls": len(calls)}  # fmt: skip


def table(rows: list[dict]) -> str:
    ms = lambda s: f"{s * 1000:.1f}"  # noqa: E731
    lines = [
        "| configuration | streams | rank | step ms | forward | compute | in collectives "
        "or waiting | collectives alone | sampling | order (per step) | rest | ops | main thread "
        "CPU | rank CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = r["mode"] if r["ranks"] == 1 else f"{r['mode']} {r['ranks']}"
        lines.append(
            f"| {name} | {r['streams']} | {r['rank']} | {ms(r['step_s'])} | "
            f"{ms(r['forward_s'])} | {ms(r['compute_s'])} | "
            f"{ms(r['forward_s'] - r['compute_s'])} | {ms(r['collectives_s'])} "
            f"({r['collective_calls']}) | {ms(r['sampling_s'])} | {ms(r['order_s'])} | "
            f"{ms(r['rest_s'])} | {r['ops']} | {ms(r['main_cpu_s'])} | {ms(r['rank_cpu_s'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--streams", default="8,32")
    p.add_argument("--steps", type=int, default=32, help="timed steps (and repeats) per figure")
    p.add_argument("--modes", default="pipeline,tensor")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="pipeline", help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    streams = [int(s) for s in args.streams.split(",")]
    rows = run_config(args.model, "pipeline", 1, streams, args.steps)
    for mode in args.modes.split(","):
        rows += run_config(args.model, mode, 2, streams, args.steps)
    rows.sort(key=lambda r: (r["streams"], r["ranks"], r["mode"], r["rank"]))
    print(json.dumps(rows, indent=1) if args.json else table(rows))


if __name__ == "__main__":
    main()
