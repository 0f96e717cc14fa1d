"""`mlx-cluster launch` end to end: real rank processes over the ring backend on loopback."""

import json
import os
import shutil
import signal
import subprocess
import time

import pytest

from cluster.core.modelcheck import default_model_path
from tests.support.gpu import fake_nvidia_smi
from tests.support.long_context import long_text
from tests.support.processes import CLI, ROOT, rank_pid, rank_pids, run_cli, start_streaming
from tests.support.reference import reference
from tests.support.tiny import make_model

PROMPT = "Tell me about lists"


TOKENS = 40


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_sharded_output_equals_single_process(models, mode):
    """A prompt through the chat template, 40 tokens, in each mode. Every family at 2, 3 and
    4 ranks in each mode is the matrix's (tests/e2e/test_models.py, docs/models.md)."""
    family, ranks = "qwen2", 2  # the model with a chat template
    expected = reference(models[family], PROMPT, TOKENS)
    assert len(expected) > 20  # a real continuation, not an early EOS
    p = run_cli(
        "launch",
        "-n",
        ranks,
        "--mode",
        mode,
        "--model",
        models[family],
        "--max-tokens",
        TOKENS,
        PROMPT,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected
    assert f"generated {TOKENS} tokens" in p.stderr


def test_ranks_sharing_a_gpu_are_told_and_answer(models, tmp_path):
    """On a host whose nvidia-smi lists GPUs (a stand-in here), two ranks without `gpus:`
    would share GPU 0: the launcher says so once, with what to do, and the job goes on."""
    env = {**os.environ, "PATH": fake_nvidia_smi(tmp_path)}
    p = run_cli("launch", "-n", 2, "--model", models["llama"], "--max-tokens", 8, PROMPT,
                env=env)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["llama"], PROMPT, 8)
    warned = [line for line in p.stderr.splitlines() if "GPU 0 (NVIDIA H100 80GB HBM3" in line]
    assert len(warned) == 1, p.stderr
    assert "ranks 0 and 1 on localhost run on its CPU" in warned[0]  # MLX's CPU build here


def test_one_rank_equals_single_process(models):
    p = run_cli("launch", "-n", 1, "--model", models["llama"], "--max-tokens", TOKENS, PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["llama"], PROMPT, TOKENS)


def test_default_command_uses_embedded_model():
    """The README's command, as it is: no hostfile, no model, no options: 2 ranks, pipeline,
    the embedded model, which answers about lists (its chat template, greedy) and stops."""
    p = run_cli("launch", PROMPT)
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(default_model_path(), PROMPT, 256)
    assert p.stdout.startswith("A list display is a possibly empty series of expressions")
    assert "square brackets" in p.stdout and "(stop)" in p.stderr  # its own end, not a limit
    assert "starting 2 rank(s), ring backend, pipeline mode" in p.stderr


def test_prompt_from_stdin(models):
    expected = reference(models["qwen2"], PROMPT, 16)
    for args in (["-"], []):
        p = run_cli("launch", "--model", models["qwen2"], "--max-tokens", 16, *args, input=PROMPT)
        assert p.returncode == 0, p.stderr
        assert p.stdout == expected


def test_local_yaml_hostfile_is_the_default(models):
    p = run_cli(
        "launch",
        "--hostfile",
        ROOT / "hostfiles" / "local.yaml",
        "--model",
        models["llama"],
        "--max-tokens",
        16,
        PROMPT,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["llama"], PROMPT, 16)


def test_mlx_launch_json_hostfile(models, tmp_path):
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(
        json.dumps(
            {
                "backend": "ring",
                "envs": ["MLX_CLUSTER_TEST=1"],
                "hosts": [
                    {"ssh": "localhost", "ips": ["127.0.0.1"]},
                    {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]},
                ],
            }
        )
    )
    p = run_cli(
        "launch", "--hostfile", hostfile, "--model", models["llama"], "--max-tokens", 16, PROMPT
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["llama"], PROMPT, 16)


def test_nccl_without_mlxs_cuda_build_says_what_to_install():
    """This machine's MLX is the CPU build: the ranks say so as they join, with what to do,
    without a traceback or the network hint, and none is left."""
    before = set(rank_pids())
    p = run_cli("launch", "-n", 2, "--backend", "nccl", "--mode", "tensor", PROMPT)
    assert p.returncode == 2
    assert "failed while joining the distributed group" in p.stderr
    assert "MLX on this host has no nccl backend" in p.stderr and "mlx-cluster[cuda]" in p.stderr
    assert "Traceback" not in p.stderr and "firewall" not in p.stderr
    assert set(rank_pids()) <= before


def test_rank_crash_while_loading(models, tmp_path):
    """Rank 1 alone reads the file of layers 0-1; it is truncated, so only rank 1 fails."""
    broken = tmp_path / "broken"
    shutil.copytree(models["llama"], broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    victim = broken / index["weight_map"]["model.layers.0.self_attn.q_proj.weight"]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    p = run_cli("launch", "--model", broken, "--max-tokens", 8, PROMPT, timeout=120)
    assert p.returncode == 1
    assert "error: rank 1 of 2 on localhost failed while loading the model" in p.stderr
    assert "last lines of rank 1 (localhost)" in p.stderr
    assert "every other rank was stopped" in p.stderr
    assert p.stdout == ""


def test_ranks_whose_tokenizers_differ_are_refused_at_start(models, tmp_path):
    """Two copies of one model, one with two tokens swapped in its tokenizer.json (another
    revision): rank 1 says so at start and the job stops (exit 2), before any prompt."""
    for side in ("a", "b"):
        shutil.copytree(models["qwen2"], tmp_path / side / "m")
    tokenizer = tmp_path / "b" / "m" / "tokenizer.json"
    data = json.loads(tokenizer.read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    tokenizer.write_text(json.dumps(data))
    hostfile = tmp_path / "rig.yaml"
    hostfile.write_text("backend: ring\nhosts:\n" + "".join(
        f"  - {{ssh: localhost, ips: [127.0.0.1], model_dir: {tmp_path / side}}}\n"
        for side in ("a", "b")))  # fmt: skip
    p = run_cli("launch", "--hostfile", hostfile, "--model", tmp_path / "a" / "m",
                "--max-tokens", 8, PROMPT, timeout=120)  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert "error: rank 1 of 2 on localhost failed" in p.stderr
    assert "this rank's tokenizer" in p.stderr and "(rank 1 differs)" in p.stderr
    assert "mlx-cluster sync" in p.stderr and p.stdout == ""


def start_long_job(model):
    """A job that generates far longer than the test waits."""
    return start_streaming("--model", model, "--max-tokens", 1000000, PROMPT)


def finish(proc, timeout=20):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, err.decode()


def test_ctrl_c_stops_every_rank(models):
    proc = start_long_job(models["endless"])
    assert len(rank_pids()) == 2
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    assert code == 130
    assert "stopped by SIGINT; all ranks stopped" in err
    assert rank_pids() == []


def test_ctrl_c_during_a_long_prefill_stops_every_rank_at_once(tmp_path):
    """A 16k-token prompt (minutes of prefill on this CPU): once the launcher shows the
    prefill's progress, Ctrl-C ends the job (130) and every rank without waiting for the
    prefill; the seconds it took are printed (measured: docs/long-context.md)."""
    model = make_model(tmp_path / "long", "llama", seed=1, max_position_embeddings=65536)
    prompt = long_text(model, 16384)
    proc = subprocess.Popen([CLI, "launch", "--model", str(model), "--max-tokens", "4", "-"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    proc.stdin.write(prompt.encode())
    proc.stdin.close()
    proc.stdin = None  # communicate() must not flush it
    seen = []
    for line in proc.stderr:  # the launcher's progress line, once the prefill is under way
        seen.append(line.decode())
        if line.startswith(b"mlx-cluster: prefill ") or b"] prefill " in line:
            break
    assert proc.poll() is None, "".join(seen)
    assert len(rank_pids()) == 2
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    code, err = finish(proc)
    took = time.monotonic() - start
    print(f"Ctrl-C during a 16k-token prefill: exit {code} after {took:.2f} s")
    assert code == 130, "".join(seen) + err
    assert "stopped by SIGINT; all ranks stopped" in err
    assert rank_pids() == []
    assert took < 5, took  # the prefill had minutes to go: it was not waited for


def test_sigterm_stops_every_rank(models):
    proc = start_long_job(models["endless"])
    proc.send_signal(signal.SIGTERM)
    code, err = finish(proc)
    assert code == 128 + signal.SIGTERM
    assert rank_pids() == []


def test_killed_rank_mid_generation_stops_the_job(models):
    proc = start_long_job(models["endless"])
    victim = rank_pid(1)
    os.kill(victim, signal.SIGKILL)
    code, err = finish(proc)
    assert code == 1
    assert "error: rank 1 of 2 on localhost was killed by signal 9 while generating" in err
    assert rank_pids() == []


def test_closed_stdout_stops_every_rank(models):
    """`mlx-cluster launch ... | head -c 20`: the reader leaves, the ranks stop, no traceback."""
    p = subprocess.run(
        f"'{CLI}' launch --model '{models['endless']}' --max-tokens 1000000 hi | head -c 20; "
        "exit ${PIPESTATUS[0]}",
        shell=True,
        executable="/bin/bash",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 141, p.stderr
    assert "Traceback" not in p.stderr
    assert rank_pids() == []


def test_seeded_sampling_agrees_across_ranks_and_runs(models):
    """temp > 0: the shared seed makes every rank pick the same token, and runs repeat."""
    import mlx.core as mx
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(models["llama"]))
    mx.random.seed(7)
    expected = generate(
        model, tokenizer, tokenizer.encode(PROMPT), max_tokens=24, sampler=make_sampler(0.8)
    )
    args = [
        "launch",
        "--model",
        models["llama"],
        "--max-tokens",
        24,
        "--temp",
        0.8,
        "--seed",
        7,
        PROMPT,
    ]
    first = run_cli(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == expected
    for mode in ("pipeline", "tensor"):
        again = run_cli(*args, "--mode", mode)
        assert again.returncode == 0, again.stderr
        assert again.stdout == run_cli(*args, "--mode", mode).stdout


def test_pipeline_rank_reads_only_its_files(models):
    """6 layers, 2 per file: rank 0 holds layers 3-5, rank 1 layers 0-2 (mlx-lm's order)."""
    index = json.loads((models["llama"] / "model.safetensors.index.json").read_text())
    file_of = index["weight_map"]
    p = run_cli("launch", "--verbose", "--model", models["llama"], "--max-tokens", 4, PROMPT)
    assert p.returncode == 0, p.stderr
    lines = {
        r: next(
            line
            for line in p.stderr.splitlines()
            if line.startswith(f"[rank {r} localhost] loaded in")
        )
        for r in (0, 1)
    }
    assert "layers 3-5" in lines[0] and "layers 0-2" in lines[1]
    assert file_of["model.layers.0.mlp.up_proj.weight"] not in lines[0]
    assert file_of["model.layers.5.mlp.up_proj.weight"] not in lines[1]
    for r in (0, 1):
        assert file_of["model.embed_tokens.weight"] in lines[r]
        assert file_of["lm_head.weight"] in lines[r]


def ready_lines(stderr):
    return {
        int(line.split()[1]): line
        for line in stderr.splitlines()
        if line.startswith("[rank ") and " loaded in " in line
    }


def test_explicit_split(models):
    p = run_cli(
        "launch",
        "--verbose",
        "--split",
        "4,2",
        "--model",
        models["llama"],
        "--max-tokens",
        TOKENS,
        PROMPT,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["llama"], PROMPT, TOKENS)
    lines = ready_lines(p.stderr)
    assert "layers 2-5" in lines[0] and "layers 0-1" in lines[1]


def test_split_weighted_by_memory(models, tmp_path):
    hf = tmp_path / "h.yaml"
    hf.write_text(
        "hosts:\n  - {ssh: localhost, memory_gb: 96}\n"
        "  - {ssh: 127.0.0.1, memory_gb: 32}\n  - {ssh: localhost, memory_gb: 32}\n"
    )
    p = run_cli(
        "launch",
        "--verbose",
        "--hostfile",
        hf,
        "--model",
        models["qwen2"],
        "--max-tokens",
        TOKENS,
        PROMPT,
    )
    assert p.returncode == 0, p.stderr
    assert "pipeline split, layers per rank: 3,2,1" in p.stderr  # 1 each, 3 more as 3:1:1
    assert p.stdout == reference(models["qwen2"], PROMPT, TOKENS)  # mlx-lm's own pipeline()
    lines = ready_lines(p.stderr)
    assert "layers 3-5" in lines[0] and "layers 1-2" in lines[1] and "layers 0-0" in lines[2]


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_quantized_kv_cache_equals_single_process(kv_model, mode):
    """--kv-bits 4 from the first token: each rank quantizes its own layers' (pipeline) or
    heads' (tensor) cache, and the text is single-process mlx-lm's with the same cache."""
    expected = reference(kv_model, PROMPT, TOKENS, kv_bits=4)
    assert expected != reference(kv_model, PROMPT, TOKENS)  # quantizing changes this text
    p = run_cli("launch", "-n", 2, "--mode", mode, "--model", kv_model, "--kv-bits", 4,
                "--quantized-kv-start", 0, "--max-tokens", TOKENS, PROMPT)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == expected
