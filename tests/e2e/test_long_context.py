"""A 32,768-token prompt through `mlx-cluster launch`, sharded, against single-process mlx-lm
(tests/support/long_context.py; docs/long-context.md has the table of every family, mode and rank
count, and 64k and 128k, measured by hand: in CI, 3 families x 4 cells would take 6 minutes)."""

from tests.support.long_context import run_family
from tests.support.reference import LOGIT_TOLERANCE

TOKENS = 32768


def test_a_32k_token_prompt_gives_single_process_answer_in_both_modes(tmp_path):
    rows = run_family("llama", TOKENS, ["p2", "t2"], tmp_path)
    for row in rows:
        print(row)
    assert [(r["mode"], r["ranks"]) for r in rows] == [("pipeline", 2), ("tensor", 2)]
    for r in rows:
        assert r["status"] == "match", r  # the same greedy continuation
        assert r["prompt_tokens"] == TOKENS, r
        assert len(r["peak_gb"]) == 2 and all(gb > 0 for gb in r["peak_gb"]), r
    pipeline, tensor = rows
    assert pipeline["max_delta"] == 0, pipeline  # single-process arithmetic, bit for bit
    assert tensor["max_delta"] <= LOGIT_TOLERANCE, tensor  # the all-reduce's order of sums
