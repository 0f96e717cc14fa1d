"""`mlx-cluster bench`: a real sweep on a tiny model (ranks on this machine, mlx-lm's baseline
in the same run), its JSON/CSV/PNG, bad input, Ctrl-C. No timing is asserted: only that every
figure is there, is plausible, and that the ratios come from the figures of the same run."""

import pytest

from cluster.rig.bench import (
    BenchPlan,
    Config,
    blank,
    configs,
)
from tests.support.processes import ROOT, invoke


@pytest.mark.parametrize(
    "args, message",
    [
        (["--ranks", "0"], "each 1 or more"),
        (["--ranks", "two"], "comma-separated list of rank counts"),
        (["--ranks", ""], "comma-separated list of rank counts"),
        (["--modes", "pipeline,sideways"], "comma-separated list of pipeline, tensor"),
        (["--modes", ","], "comma-separated list of pipeline, tensor"),
        (["--baselines", "exo"], "single, mlx-lm, mlx.launch, or none"),
        (["--gen-tokens", "1"], "--gen-tokens"),
        (["--ranks", "1,3", "--hostfile", ROOT / "hostfiles/local.yaml"], "has only 2 rank(s)"),
        (["--modes", "tensor", "--ranks", "9"], "--modes tensor --ranks 9"),
        (["--modes", "pipeline", "--ranks", "7"], "--modes pipeline --ranks 7"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    p = invoke("bench", *args)
    assert p.returncode == 2, p.stderr
    assert message in p.stderr, p.stderr
    assert p.stdout == ""


def test_each_prompt_length_gets_the_whole_sweep_and_a_column():
    from cluster.rig.bench import table

    plan = BenchPlan(model="m", modes=["pipeline"], ranks=[1, 2], prompt_lengths=[8, 32])
    got = [(c.impl, c.mode, c.ranks, c.prompt_tokens) for c in configs(plan)]
    assert got == [(impl, mode, n, p) for p in (8, 32) for impl, mode, n in [
        ("mlx-cluster", None, 1), ("mlx-lm", None, 1), ("mlx-cluster", "pipeline", 2),
        ("mlx-lm", "pipeline", 2)]]  # fmt: skip
    rows = [{**blank(c, plan), "status": "failed", "reason": "x"} for c in configs(plan)[:2]]
    assert "| ranks | first token s |" in table(rows)  # one length: no column
    rows[1]["prompt_tokens"] = 32
    assert "| ranks | prompt tokens | first token s |" in table(rows)


def test_prefill_step_goes_to_mlx_lm_benchmark_too():
    from cluster.rig.bench import mlx_lm_command

    plan = BenchPlan(model="m", modes=["pipeline"], ranks=[2], prefill_step=512)
    argv = mlx_lm_command(Config("mlx-lm", "pipeline", 2, False, 1024), plan, "python")
    assert argv[argv.index("--prefill-step-size") + 1] == "512"


def test_each_concurrency_gets_the_sweep_mlx_lm_its_batch_size_and_a_column():
    """--concurrency 1,4: every configuration at each stream count, mlx_lm.benchmark with
    --batch-size beside it; speculative decoding only at one stream; a streams column."""
    from cluster.core.spec import Draft
    from cluster.rig.bench import mlx_lm_command, table

    plan = BenchPlan(model="m", modes=["tensor"], ranks=[1, 2], concurrency=[1, 4],
                     draft=Draft(prompt_lookup=2))  # fmt: skip
    got = [(c.impl, c.mode, c.ranks, c.draft, c.streams) for c in configs(plan)]
    assert got == [
        ("mlx-cluster", None, 1, False, 1), ("mlx-cluster", None, 1, True, 1),
        ("mlx-lm", None, 1, False, 1), ("mlx-cluster", "tensor", 2, False, 1),
        ("mlx-cluster", "tensor", 2, True, 1), ("mlx-lm", "tensor", 2, False, 1),
        ("mlx-cluster", None, 1, False, 4), ("mlx-lm", None, 1, False, 4),
        ("mlx-cluster", "tensor", 2, False, 4), ("mlx-lm", "tensor", 2, False, 4),
    ]  # fmt: skip
    four = configs(plan)[-1]
    argv = mlx_lm_command(four, plan, "python")
    assert argv[argv.index("--batch-size") + 1] == "4"
    assert "--batch-size" not in mlx_lm_command(configs(plan)[2], plan, "python")
    rows = [{**blank(c, plan), "status": "failed", "reason": "x"} for c in configs(plan)[5:7]]
    assert "| ranks | streams | first token s |" in table(rows)
    assert "| 1 | 4 | failed: x |" in table(rows)
