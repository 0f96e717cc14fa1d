"""`mlx-cluster bench`: a real sweep on a tiny model (ranks on this machine, mlx-lm's baseline
in the same run), its JSON/CSV/PNG, bad input, Ctrl-C. No timing is asserted: only that every
figure is there, is plausible, and that the ratios come from the figures of the same run."""

import csv
import hashlib
import json
import math
import os
import signal
import subprocess

import pytest

from cluster.core.hostfile import parse_hostfile
from cluster.rig.bench import (
    BASELINES,
    BenchPlan,
    Config,
    add_ratios,
    blank,
    configs,
    critical_collectives,
    first_ranks,
    spread,
)
from tests.support.processes import (
    CLI,
    _children,
    _cmdline,
    descendant_ranks,
    rank_pids,
    run_cli,
)

PROMPT_TOKENS, GEN_TOKENS, REPEAT = 24, 8, 2


def baseline_pids() -> list[int]:
    """This session's mlx_lm.benchmark processes (never another user's)."""
    return descendant_ranks(os.getpid(), _children(), _cmdline, "mlx_lm.benchmark")


def reference_sha(model_dir, prompt_tokens: int, gen_tokens: int, **step_args) -> str:
    """Single-process mlx-lm's greedy tokens for mlx_lm.benchmark's synthetic prompt
    (``step_args``: generate_step's, e.g. kv_bits)."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    tokenizer.eos_token_ids = set()
    mx.random.seed(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompt = mx.random.randint(0, vocab, (1, prompt_tokens)).tolist()[0]
    stream = stream_generate(model, tokenizer, prompt, max_tokens=gen_tokens, **step_args)
    tokens = [r.token for r in stream]
    return hashlib.sha256(str(tokens).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def sweep(models, tmp_path_factory):
    """One sweep, both modes at 1 and 2 ranks, our runs and mlx-lm's, every output file."""
    out = tmp_path_factory.mktemp("bench")
    files = {"json": out / "b.json", "csv": out / "b.csv", "plot": out / "b.png"}
    before = set(baseline_pids())
    p = run_cli(
        "bench",
        "--model",
        models["qwen2"],
        "--modes",
        "pipeline,tensor",
        "--ranks",
        "1,2",
        "--prompt-tokens",
        PROMPT_TOKENS,
        "--gen-tokens",
        GEN_TOKENS,
        "--repeat",
        REPEAT,
        "--warmup",
        1,
        *(x for k, f in files.items() for x in (f"--{k}", f)),
        timeout=600,
    )
    return p, files, set(baseline_pids()) - before


def test_sweep_finishes_with_every_figure(sweep, models):
    p, files, left = sweep
    assert p.returncode == 0, p.stderr
    assert not left, f"mlx_lm.benchmark processes left running: {left}"
    report = json.loads(files["json"].read_text())
    assert report["settings"]["prompt_tokens"] == PROMPT_TOKENS
    rows = report["results"]
    shape = [(r["impl"], r["mode"], r["ranks"]) for r in rows]
    assert shape == [
        ("mlx-cluster", None, 1),
        ("mlx-lm", None, 1),
        ("mlx-cluster", "pipeline", 2),
        ("mlx-lm", "pipeline", 2),
        ("mlx-cluster", "tensor", 2),
        ("mlx-lm", "tensor", 2),
    ]
    fields = set(blank(Config("mlx-cluster", None, 1), BenchPlan(model="m", modes=[], ranks=[])))
    layers = json.loads((models["qwen2"] / "config.json").read_text())["num_hidden_layers"]
    for r in rows:
        assert set(r) >= fields, f"{r['impl']} {r['mode']}: missing {fields - set(r)}"
        if (r["impl"], r["mode"]) == ("mlx-lm", "pipeline") and r["status"] == "failed":
            # mlx_lm.benchmark --pipeline often loses the ring here between two runs (a step
            # still in flight when the next run starts): a baseline failure is reported
            assert "[ring]" in r["reason"] and r["runs"] == []
            continue
        assert r["status"] == "ok", r["reason"]
        assert len(r["runs"]) == REPEAT
        for run in r["runs"]:
            assert run["generated"] == GEN_TOKENS  # EOS cannot end a run
            assert run["ttft_s"] > 0 and run["prefill_tps"] > 0 and run["generation_tps"] > 0
            assert math.isclose(run["prefill_tps"] * run["ttft_s"], PROMPT_TOKENS)
        for key in ("ttft_s", "prefill_tps", "generation_tps"):
            values = [run[key] for run in r["runs"]]
            s = r[key]
            assert s["min"] == min(values) and s["max"] == max(values)
            assert s["min"] <= s["median"] <= s["max"]
        assert r["start_to_first_token_s"] > r["ready_s"] > 0
        assert all(0 < m < 1 for m in r["peak_memory_gb"])  # GB, of a tiny model
        if r["impl"] != "mlx-cluster":
            continue
        assert len(r["peak_memory_gb"]) == r["ranks"]
        assert 0 < r["load_s"] < r["ready_s"]
        if r["ranks"] == 1:
            assert r["collectives_per_token"] is None
            continue
        # pipeline: one send between the two stages and the all_gather of the last hidden
        # state; tensor: an all_sum after attention and after the MLP of every layer
        want = 2 if r["mode"] == "pipeline" else 2 * layers
        assert r["collectives_per_token"] == want, r["collectives"]
        assert (
            r["allsum_bytes"]
            == 4 * json.loads((models["qwen2"] / "config.json").read_text())["hidden_size"]
        )  # one float32 hidden state
        assert 0 < r["allsum_latency_s"] < 1
        assert math.isclose(r["comm_s_per_token"], want * r["allsum_latency_s"])
        assert math.isclose(r["comm_share"], r["comm_s_per_token"] * r["generation_tps"]["median"])


def test_ratios_come_from_the_same_run(sweep):
    p, files, _ = sweep
    results = json.loads(files["json"].read_text())["results"]
    rows = {(r["impl"], r["mode"], r["ranks"]): r for r in results}
    single = rows[("mlx-cluster", None, 1)]
    for mode in ("pipeline", "tensor"):
        ours, theirs = rows[("mlx-cluster", mode, 2)], rows[("mlx-lm", mode, 2)]
        if theirs["status"] != "ok":  # see test_sweep_finishes_with_every_figure
            assert ours["vs_mlx_lm"] is None
            continue
        for key in ("generation_tps", "prefill_tps"):
            assert math.isclose(ours["vs_single"][key], ours[key]["median"] / single[key]["median"])
            assert math.isclose(ours["vs_mlx_lm"][key], ours[key]["median"] / theirs[key]["median"])
            their_single = rows[("mlx-lm", None, 1)]
            assert math.isclose(
                theirs["vs_single"][key], theirs[key]["median"] / their_single[key]["median"]
            )
        share = 1 / (ours["ranks"] if mode == "tensor" else 1)
        step = share / single["generation_tps"]["median"] + ours["comm_s_per_token"]
        assert math.isclose(ours["predicted_generation_tps"], 1 / step)
        # mlx-lm reports n tokens over the time after the first; ours counts n-1
        for run in theirs["runs"]:
            want = run["generation_tps_reported"] * (GEN_TOKENS - 1) / GEN_TOKENS
            assert math.isclose(run["generation_tps"], want)
    assert math.isclose(
        single["vs_mlx_lm"]["generation_tps"],
        single["generation_tps"]["median"] / rows[("mlx-lm", None, 1)]["generation_tps"]["median"],
    )


def test_sharded_runs_decode_what_one_process_decodes(sweep, models):
    """Every configuration generated the tokens single-process mlx-lm generates for the same
    synthetic prompt (float32, greedy)."""
    p, files, _ = sweep
    rows = json.loads(files["json"].read_text())["results"]
    want = reference_sha(models["qwen2"], PROMPT_TOKENS, GEN_TOKENS)
    ours = [r for r in rows if r["impl"] == "mlx-cluster"]
    assert [r["tokens_sha"] for r in ours] == [want] * len(ours)
    assert all(r["same_tokens_as_single"] for r in ours if r["ranks"] > 1)


def test_table_csv_and_plot(sweep):
    p, files, _ = sweep
    rows = json.loads(files["json"].read_text())["results"]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("| impl | mode | ranks |")
    assert len(lines) == 2 + len(rows)  # header, rule, one line per configuration
    assert "generation tok/s" in lines[0] and "bench [6/6]" in p.stderr  # progress: stderr
    table = list(csv.DictReader(files["csv"].open()))
    assert len(table) == len(rows)
    for line, r in zip(table, rows, strict=True):
        assert (line["impl"], line["ranks"]) == (r["impl"], str(r["ranks"]))
        assert line["status"] == r["status"]
        if r["status"] != "ok":
            assert line["generation_tps_median"] == "" and line["reason"] == r["reason"]
            continue
        assert float(line["generation_tps_median"]) == r["generation_tps"]["median"]
        assert float(line["ttft_s_max"]) == r["ttft_s"]["max"]
    assert files["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mlx_launch_baseline_and_unsupported_mode(models, tmp_path):
    """mlx.launch itself as a baseline; mlx-lm cannot pipeline llama: reported, not failed."""
    out = tmp_path / "b.json"
    before = set(baseline_pids())
    p = run_cli(
        "bench",
        "--model",
        models["llama"],
        "--modes",
        "pipeline,tensor",
        "--ranks",
        "2",
        "--baselines",
        "mlx-lm,mlx.launch",
        "--prompt-tokens",
        8,
        "--gen-tokens",
        4,
        "--repeat",
        1,
        "--warmup",
        0,
        "--json",
        out,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert not set(baseline_pids()) - before
    rows = {(r["impl"], r["mode"]): r for r in json.loads(out.read_text())["results"]}
    assert ("mlx-cluster", None) not in rows  # no 1 in --ranks, no single baseline
    for impl in ("mlx-lm", "mlx.launch"):
        assert rows[(impl, "pipeline")]["status"] == "unsupported"
        assert "pipelin" in rows[(impl, "pipeline")]["reason"]
        assert rows[(impl, "tensor")]["status"] == "ok"
    assert rows[("mlx.launch", "tensor")]["command"].split()[0].endswith("mlx.launch")
    assert rows[("mlx-cluster", "pipeline")]["vs_mlx_lm"] is None
    assert rows[("mlx-cluster", "tensor")]["vs_mlx_lm"]["generation_tps"] > 0
    assert "unsupported: ValueError: The model does not support pipelining" in p.stdout


def test_ctrl_c_stops_every_rank_and_keeps_what_was_measured(models, tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.Popen(
        [CLI, "bench", "--model", models["llama"], "--ranks", "1,2", "--modes", "tensor"]
        + ["--gen-tokens", "100000", "--prompt-tokens", "8", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stderr:  # wait until the first configuration is generating
            if "all ranks ready" in line:
                break
        assert rank_pids()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a failure above: leave no sweep running for later tests
            proc.terminate()  # bench stops its ranks and baselines on SIGTERM
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 130, stderr
    assert "bench stopped; 0 configuration(s) measured" in stderr
    assert json.loads(out.read_text())["results"] == []
    assert stdout.startswith("| impl |")
    assert not rank_pids()


def test_plan_helpers():
    """The pieces the sweep is made of, on cases a small sweep does not reach."""
    assert spread([]) is None and spread([None, 2.0, 1.0, 3.0])["median"] == 2.0
    # pipeline over 3 ranks: two sends one after the other, one all_gather on all at once
    three = [{"recv_like": 1, "all_gather": 1}, {"send": 1, "recv_like": 1, "all_gather": 1}]
    assert critical_collectives(three + [{"send": 1, "all_gather": 1}]) == 3
    assert critical_collectives([{"all_sum": 12}, {"all_sum": 12}]) == 12
    hf = parse_hostfile(
        {
            "backend": "jaccl",
            "hosts": [
                {"ssh": "a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3", "rdma_en4"]},
                {"ssh": "b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None, "rdma_en5"]},
                {"ssh": "c", "ips": ["10.0.0.3"], "rdma": ["rdma_en4", "rdma_en5", None]},
            ],
        }
    )
    two = first_ranks(hf, 2)
    assert [h.target for h in two.hosts] == ["a", "b"]
    assert [h.rdma for h in two.hosts] == [[None, "rdma_en3"], ["rdma_en3", None]]
    slots = first_ranks(parse_hostfile({"hosts": [{"ssh": "a", "slots": 2}, "b"]}), 3)
    assert [(h.target, h.slots) for h in slots.hosts] == [("a", 2), ("b", 1)]
    plan = BenchPlan(model="m", modes=["tensor"], ranks=[2], baselines=BASELINES)
    assert [(c.impl, c.ranks) for c in configs(plan)] == [
        ("mlx-cluster", 1),
        ("mlx-lm", 1),
        ("mlx-cluster", 2),
        ("mlx-lm", 2),
        ("mlx.launch", 2),
    ]
    rows = [blank(c, plan) for c in configs(plan)]
    rows[3]["status"] = "failed"  # mlx-lm at 2 ranks failed: compare with mlx.launch's
    for r, tps in zip(rows, (100.0, 90.0, 50.0, None, 25.0), strict=True):
        r["generation_tps"] = r["prefill_tps"] = {"median": tps, "min": tps, "max": tps}
    add_ratios(rows)
    assert rows[2]["vs_single"]["generation_tps"] == 0.5
    assert rows[2]["vs_mlx_lm"]["generation_tps"] == 2.0
    assert rows[4]["vs_single"]["generation_tps"] == 25.0 / 90.0  # mlx-lm's own 1 rank
    assert rows[2]["predicted_generation_tps"] is None  # no collectives counted
    rows[2]["comm_s_per_token"] = 0.005  # tensor on 2: half of 10 ms, plus 5 ms on the link
    add_ratios(rows)
    assert math.isclose(rows[2]["predicted_generation_tps"], 1 / (0.01 / 2 + 0.005))


def test_a_list_of_prompt_lengths_sweeps_each(models, tmp_path):
    """--prompt-tokens 8,32: every configuration at each length, mlx-lm beside it in the same
    run; ratios within a length; the table has the length; the plot shows first-token time
    and prefill tok/s against it."""
    out, plot = tmp_path / "b.json", tmp_path / "b.png"
    p = run_cli("bench", "--model", models["qwen2"], "--ranks", "1", "--baselines", "mlx-lm",
                "--prompt-tokens", "32,8", "--gen-tokens", 2, "--repeat", 1, "--warmup", 0,
                "--json", out, "--plot", plot)  # fmt: skip
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["prompt_lengths"] == [8, 32]
    rows = report["results"]
    assert [(r["impl"], r["prompt_tokens"]) for r in rows] == [
        ("mlx-cluster", 8), ("mlx-lm", 8), ("mlx-cluster", 32), ("mlx-lm", 32)
    ]  # fmt: skip
    for r in rows:
        assert r["status"] == "ok" and r["ttft_s"]["median"] > 0, r
    # a row is compared with mlx-lm at its own length
    assert rows[0]["vs_mlx_lm"]["prefill_tps"] == pytest.approx(
        rows[0]["prefill_tps"]["median"] / rows[1]["prefill_tps"]["median"]
    )
    head = p.stdout.splitlines()[0]
    assert "| ranks | prompt tokens | first token s |" in head, head
    assert plot.stat().st_size > 0


def test_kv_bits_and_prefill_step_reach_our_ranks_not_mlx_lm(kv_model):
    """bench --kv-bits: our ranks decode with the quantized cache (single-process mlx-lm's
    tokens with the same cache), mlx-lm's baseline is skipped with the reason (it has no such
    flag); --prefill-step goes to both."""
    flags = ["--prefill-step", "16", "--kv-bits", "4", "--kv-group-size", "64",
             "--quantized-kv-start", "0"]  # fmt: skip
    p = run_cli("bench", "--model", kv_model, "--modes", "pipeline", "--ranks", "2",
                "--prompt-tokens", PROMPT_TOKENS, "--gen-tokens", GEN_TOKENS, "--repeat", 1,
                "--warmup", 0, "--baselines", "mlx-lm", *flags, "--json", "-")  # fmt: skip
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert (report["settings"]["kv_bits"], report["settings"]["prefill_step"]) == (4, 16)
    rows = {(r["impl"], r["ranks"]): r for r in report["results"]}
    want = reference_sha(kv_model, PROMPT_TOKENS, GEN_TOKENS, kv_bits=4,
                         kv_group_size=64, quantized_kv_start=0, prefill_step_size=16)  # fmt: skip
    plain = reference_sha(kv_model, PROMPT_TOKENS, GEN_TOKENS)
    assert want != plain  # the quantized cache changes these tokens: the check means something
    ours = rows[("mlx-cluster", 2)]
    assert ours["status"] == "ok", ours
    assert ours["tokens_sha"] == want, ours
    assert " ".join(flags) in ours["command"], ours["command"]
    baseline = rows[("mlx-lm", 2)]
    assert baseline["status"] == "skipped" and "--kv-bits" in baseline["reason"], baseline


def reference_batch_sha(model_dir, prompt_tokens: int, gen_tokens: int, streams: int) -> str:
    """Single-process mlx-lm's greedy tokens for each of mlx_lm.benchmark's ``streams``
    synthetic prompts (one batch of them, seed 0), each decoded alone."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    tokenizer.eos_token_ids = set()
    mx.random.seed(0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = mx.random.randint(0, vocab, (streams, prompt_tokens)).tolist()
    tokens = [[r.token for r in stream_generate(model, tokenizer, p, max_tokens=gen_tokens)]
              for p in prompts]  # fmt: skip
    return hashlib.sha256(str(tokens).encode()).hexdigest()[:16]


def test_concurrent_streams_decode_each_prompts_lone_answer(models, tmp_path):
    """--concurrency 1,4: four prompts decoded together on 1 rank and on 2 (tensor), each
    stream the tokens single-process mlx-lm decodes for that prompt alone; mlx_lm.benchmark
    --batch-size 4 beside them; aggregate figures, ratios within a stream count."""
    out = tmp_path / "c.json"
    p = run_cli("bench", "--model", models["qwen2"], "--ranks", "1,2", "--modes", "tensor",
                "--concurrency", "1,4", "--baselines", "mlx-lm", "--prompt-tokens", 16,
                "--gen-tokens", GEN_TOKENS, "--repeat", 1, "--warmup", 1, "--json", out,
                timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["results"]
    assert [(r["impl"], r["ranks"], r["streams"]) for r in rows] == [
        ("mlx-cluster", 1, 1), ("mlx-lm", 1, 1), ("mlx-cluster", 2, 1), ("mlx-lm", 2, 1),
        ("mlx-cluster", 1, 4), ("mlx-lm", 1, 4), ("mlx-cluster", 2, 4), ("mlx-lm", 2, 4),
    ]  # fmt: skip
    assert all(r["status"] == "ok" for r in rows), [(r["impl"], r["reason"]) for r in rows]
    four = [r for r in rows if r["streams"] == 4 and r["impl"] == "mlx-cluster"]
    expected = reference_batch_sha(models["qwen2"], 16, GEN_TOKENS, 4)
    assert [r["tokens_sha"] for r in four] == [expected, expected]
    for r in four:
        assert r["runs"][0]["generated"] == 4 * GEN_TOKENS
        assert r["generation_tps"]["median"] > 0 and r["prefill_tps"]["median"] > 0
        assert r["vs_mlx_lm"]["generation_tps"] > 0  # against --batch-size 4, not 1 stream
    mlx_lm_four = next(r for r in rows if r["impl"] == "mlx-lm" and r["streams"] == 4)
    assert "--batch-size 4" in mlx_lm_four["command"]
    assert four[1]["vs_single"]["generation_tps"] == pytest.approx(
        four[1]["generation_tps"]["median"] / four[0]["generation_tps"]["median"]
    )
    assert "| ranks | streams | first token s |" in p.stdout.splitlines()[0]


def test_pipeline_micro_batches_decode_each_prompts_lone_answer(models, tmp_path):
    """--micro-batches 2 in pipeline mode: four prompts decoded together in two micro-batches,
    each stream the tokens single-process mlx-lm decodes for that prompt alone; the setting
    is in the JSON."""
    out = tmp_path / "m.json"
    p = run_cli("bench", "--model", models["endless"], "--ranks", "2", "--modes", "pipeline",
                "--micro-batches", 2, "--concurrency", 4, "--baselines", "none",
                "--prompt-tokens", 16, "--gen-tokens", GEN_TOKENS, "--repeat", 1,
                "--warmup", 0, "--json", out, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "the batch decodes in 2 micro-batches" in p.stderr  # applied, not one batch
    result = json.loads(out.read_text())
    assert result["settings"]["micro_batches"] == 2
    (row,) = result["results"]
    assert row["status"] == "ok" and row["runs"][0]["generated"] == 4 * GEN_TOKENS
    assert row["tokens_sha"] == reference_batch_sha(models["endless"], 16, GEN_TOKENS, 4)
