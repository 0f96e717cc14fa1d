"""docs/models.md: every tiny model family x mode x rank count, sharded against single-process
(tests/support/matrix.py).

    python -m tests.tools.models_page --out docs/models.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.support.matrix import render, run_matrix
from tests.support.reference import TEXT_FAMILIES
from tests.support.tiny import VLM_FAMILIES


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help="comma-separated (default: all)")
    parser.add_argument("--out", type=Path, help="write the markdown here (default: stdout)")
    args = parser.parse_args()
    families = args.families.split(",") if args.families else [*TEXT_FAMILIES, *VLM_FAMILIES]
    with tempfile.TemporaryDirectory(prefix="mlx-cluster-matrix-") as tmp:
        results = run_matrix(families, Path(tmp), log=lambda m: print(m, file=sys.stderr))
    text = render(results)
    if args.out:
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
