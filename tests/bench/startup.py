"""Start-up of `mlx-cluster launch` against `mlx_lm.generate`, whole process, as a user runs
them: the embedded model, one token, alternated pairs, median ratio.

    python -m tests.bench.startup --pairs 7 --ranks 2

Ours is broken down from the lines it prints: ranks ready (imports, joining the group and
loading, from the launcher's start), the first token, and what the whole process takes
besides (the launcher's own start and the ranks' end). MLX's ring tries a connection refused
because its peer is not listening yet again only after 1 s: a run whose ranks were ready more
than RETRY_S after the fastest one's is counted as one that waited so, and the median is
given with and without them. (--verbose would say so for sure, but its ring log changes the
timing: with it nearly every 2-rank start waited.)
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time

from cluster.core.modelcheck import default_model_path
from tests.support.processes import CLI

RETRY_S = 0.7


def timed(argv: list[str]) -> tuple[float, str]:
    tic = time.perf_counter()
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    wall = time.perf_counter() - tic
    if p.returncode != 0:
        raise RuntimeError(f"{argv[:3]} failed: {p.stderr[-500:]}")
    return wall, p.stderr


def figure(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m[1]) if m else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=7)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    model = str(default_model_path())
    ours = [CLI, "launch", "-n", str(args.ranks), "--max-tokens", "1", "Hi"]
    theirs = [sys.executable, "-m", "mlx_lm", "generate", "--model", model, "--max-tokens", "1",
              "--prompt", "Hi"]  # fmt: skip
    rows = []
    for i in range(args.pairs):
        pair = {}
        for name, argv in (("ours", ours), ("mlx-lm", theirs))[:: 1 if i % 2 == 0 else -1]:
            pair[name] = timed(argv)
        wall, err = pair["ours"]
        rows.append({
            "ours": wall,
            "mlx-lm": pair["mlx-lm"][0],
            "ready": figure(r"all ranks ready after ([\d.]+) s", err),
            "first": figure(r"first token ([\d.]+) s after start", err),
        })  # fmt: skip
    fastest = min(r["ready"] for r in rows)
    for r in rows:  # MLX's ring waits 1 s before it tries a refused connection again
        r["retry"] = r["ready"] - fastest > RETRY_S
    print(f"| pair | mlx-cluster launch -n {args.ranks} | ranks ready | first token | "
          "the rest (launcher start, ranks' end) | mlx_lm.generate | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows, 1):
        retry = " (ring retry)" if r["retry"] else ""
        rest = r["ours"] - r["first"]
        print(f"| {i} | {r['ours']:.2f} s{retry} | {r['ready']:.2f} s | {r['first']:.2f} s | "
              f"{rest:.2f} s | {r['mlx-lm']:.2f} s | {r['ours'] / r['mlx-lm']:.2f}x |")  # fmt: skip
    ratios = [r["ours"] / r["mlx-lm"] for r in rows]
    clean = [r["ours"] / r["mlx-lm"] for r in rows if not r["retry"]]
    print(
        f"\nmedian ratio {statistics.median(ratios):.2f}x over {len(rows)} pairs; "
        f"{len(rows) - len(clean)} with a ring retry"
        + (f"; without them {statistics.median(clean):.2f}x" if clean else "")
    )


if __name__ == "__main__":
    main()
