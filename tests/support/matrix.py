"""The verification matrix: every tiny model family x mode x rank count, sharded vs single-process.

    python -m tests.tools.models_page --out docs/models.md   # regenerate the docs page
    python -m tests.tools.models_page --families llama,qwen3 # a quick look, on stdout

Each cell runs ``mlx-cluster launch`` as a user would (ranks on this machine, ring backend) and
compares it with single-process mlx-lm (mlx-vlm for vision models): the greedy text, and for text
models the next-token logits of the prompt (``launch --logits``). tests/e2e/test_models.py runs the
same comparisons (the cells of one mode and rank count in one start of their ranks,
tests/support/matrix_ranks.py) and checks the statuses recorded in docs/models.md.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from cluster.core.blas import blas_env
from tests.support.families import render as render_survey
from tests.support.families import survey
from tests.support.reference import (
    CLI,
    LOGIT_TOLERANCE,
    MAX_TOKENS,
    MODES,
    ONE_THREAD,
    PROMPT,
    RANKS,
    SHORT_TOKENS,
    VLM_PROMPT,
    make_image,
    reference,
    reference_logits,
    reference_vlm,
)
from tests.support.tiny import VLM_FAMILIES, make_model, make_vlm


@dataclass
class Cell:
    status: str  # one of STATUSES
    detail: str = ""  # max |Δlogit|, or why unsupported / failed
    # a second turn through serve's batch (matrix_ranks.second_turn): prompt, memory, disk,
    # same; measured where asked (the 2-rank cells)
    cache: dict | None = field(default=None, compare=False)


CACHE = ("second turn cached", "disk tier")  # docs/models.md's cache columns
CACHE_PROMPT = 300  # tokens of their first turn: one disk block (256) and then some


def cache_columns(cells: list[Cell]) -> tuple[str, str]:
    """docs/models.md's "second turn cached" and "disk tier" for a row: the fewest tokens any
    measured cell read of the first turn's prompt ("differs" where an answer from the cache
    was not the uncached one; "off" where the disk tier does not keep the family's caches)."""
    measured = [c.cache for c in cells if c.cache]
    if not measured:
        return "-", "-"
    if not all(m["same"] for m in measured):
        return "differs", "differs"
    prompt = measured[0]["prompt"]
    memory = f"{min(m['memory'] for m in measured)}/{prompt}"
    disks = [m["disk"] for m in measured]
    disk = "off" if any(d is None for d in disks) else f"{min(disks)}/{prompt}"
    return memory, disk


def run_cli(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    p = subprocess.run([CLI, *map(str, args)], capture_output=True, timeout=timeout, env=ONE_THREAD)
    return subprocess.CompletedProcess(
        p.args, p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8", "replace")
    )


def _reason(stderr: str) -> str:
    for line in stderr.splitlines():
        line = line.strip()
        if line.startswith("reason: "):
            return line[len("reason: ") :]
        if line.startswith(("error: ", "Error: ")) and " failed " not in line:
            return line.split(": ", 1)[1]
    return stderr.strip().splitlines()[-1] if stderr.strip() else "no message"


def check_cell(
    model_dir: Path,
    mode: str,
    ranks: int,
    image: Path | None = None,
    delta: bool = True,
    tokens: int = MAX_TOKENS,
) -> Cell:
    """One cell: launch as a user would, compare with single-process. ``delta=False`` skips
    the logits run when the text already matches (the status is then known). ``tokens``
    below MAX_TOKENS (CI's tensor cells at 3 and 4 ranks, where ranks outnumber this
    machine's cores and each token costs seconds): the logits, and that many tokens, which
    must begin single-process's MAX_TOKENS."""
    args = ["launch", "-n", ranks, "--mode", mode, "--model", model_dir]
    if image is None and delta:  # one launch gives both: the logits, then the text
        p = run_cli(*args, "--max-tokens", tokens, "--logits", PROMPT)
        if p.returncode not in (0, 2):
            return Cell("failed", f"--logits exit {p.returncode}: {_reason(p.stderr)}")
        if p.returncode == 0:
            answer = json.loads(p.stdout)
            want = reference_logits(model_dir)  # with the text, in one process
            same = same_text(answer["text"], reference(model_dir), tokens)
            return compare_logits(same, answer["logits"], want)
    if image is None:
        p = run_cli(*args, "--max-tokens", MAX_TOKENS, PROMPT)
        expected = reference(model_dir)
    else:
        p = run_cli(*args, "--image", image, "--max-tokens", MAX_TOKENS, VLM_PROMPT)
        expected = reference_vlm(model_dir, image)
    if p.returncode == 2:  # the tool refused: the model cannot be served this way
        return Cell("unsupported", _reason(p.stderr))
    if p.returncode != 0:
        return Cell("failed", f"exit {p.returncode}: {_reason(p.stderr)}")
    same = p.stdout == expected
    if image is not None:  # mlx-vlm has no plain forward pass to compare logits with
        return Cell("match" if same else "differs", "text")
    if same and not delta:
        return Cell("match", "text")
    q = run_cli(*args, "--logits", PROMPT)
    if q.returncode != 0:
        return Cell("failed", f"--logits exit {q.returncode}: {_reason(q.stderr)}")
    return compare_logits(same, json.loads(q.stdout)["logits"], reference_logits(model_dir))


def check_cells_together(
    models: dict[str, Path], mode: str, ranks: int, image: Path, scratch: Path,
    cache: bool = False,
) -> dict[str, Cell]:  # fmt: skip
    """The cells of one mode and rank count, every model in one start of the ranks
    (tests/support/matrix_ranks.py; ring over loopback, the environment ``launch -n``
    gives): the same
    comparisons as ``check_cell``; at 3 and 4 ranks (which share this machine's 2 cores, every
    token costing a wait in each collective) SHORT_TOKENS, whose text must begin
    single-process's MAX_TOKENS, and the logits over the whole vocabulary. A run that breaks
    fails every cell it did not finish, with the ranks' stderr."""
    from cluster.core.hostfile import local_hostfile
    from cluster.job.backends import ring_env
    from cluster.job.process import write_files

    cells = []
    for family, model in models.items():
        vlm = family in VLM_FAMILIES
        short = ranks > 2  # 2 ranks decode MAX_TOKENS in each mode; more ranks share 2 cores
        cells.append(
            {"family": family, "model": str(model), "image": str(image) if vlm else None,
             "prompt": VLM_PROMPT if vlm else PROMPT,
             "tokens": SHORT_TOKENS if short else MAX_TOKENS,
             "cache": str(scratch / f"disk-{mode}-{ranks}") if cache and not vlm else None}
        )  # fmt: skip
    job = scratch / f"{mode}-{ranks}"
    job.mkdir(parents=True, exist_ok=True)
    (job / "cells.json").write_text(json.dumps(cells))
    blas = blas_env("auto", ranks, ONE_THREAD, sys.platform, os.cpu_count()) or {}
    rank_program = "tests.support.matrix_ranks"
    procs = []
    try:
        for r in ring_env(local_hostfile(ranks)):
            env = {**ONE_THREAD, **blas, **r.env, **write_files(r.files, job / f"rank{r.rank}")}
            argv = [sys.executable, "-m", rank_program, "--mode", mode, "--world-size", str(ranks),
                    "--cells", str(job / "cells.json")]  # fmt: skip
            stderr = open(job / f"rank{r.rank}.err", "wb")
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True
                )  # fmt: skip
            )
            stderr.close()
        out, _ = procs[0].communicate(timeout=600)
        codes = [p.wait(timeout=60) for p in procs]
    finally:
        for p in procs:  # on a timeout or a broken rank: none of ours survives
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    answers = {a["family"]: a for a in map(json.loads, out.decode().splitlines())}
    results = {}
    for cell in cells:
        family = cell["family"]
        answer = answers.get(family)
        if answer is not None and "unsupported" in answer:  # refused while loading
            results[family] = Cell("unsupported", answer["unsupported"])
        elif answer is None:
            errors = " | ".join(
                (job / f"rank{i}.err").read_text(errors="replace")[-2000:] for i in range(ranks)
            )
            results[family] = Cell("failed", f"exit codes {codes}: {errors}")
        elif cell["image"]:
            expected = reference_vlm(Path(cell["model"]), image)
            same = same_text(answer["text"], expected, cell["tokens"])
            results[family] = Cell("match" if same else "differs", "text")
        else:
            model = Path(cell["model"])
            same = same_text(answer["text"], reference(model), cell["tokens"])
            results[family] = compare_logits(same, answer["logits"], reference_logits(model))
            results[family].cache = answer.get("cache")
    return results


def same_text(got: str, expected: str, tokens: int) -> bool:
    """The text of ``tokens`` tokens against single-process's MAX_TOKENS: equal, or (fewer
    tokens) a start of it."""
    return got == expected if tokens == MAX_TOKENS else bool(got) and expected.startswith(got)


def compare_logits(same: bool, got: list[float], want: list[float]) -> Cell:
    largest = max(abs(a - b) for a, b in zip(got, want, strict=True))
    if same:
        return Cell("match", f"{largest:.1g}")
    return Cell("close" if largest <= LOGIT_TOLERANCE else "differs", f"{largest:.2g}")


def build_models(base: Path, families: list[str]) -> dict[str, Path]:
    """Seed 1 for text models and mlx-vlm's default for vision ones, as tests/e2e/test_models.py."""
    built = {}
    for family in families:
        if family in VLM_FAMILIES:
            built[family] = make_vlm(base / family, family)
        else:
            built[family] = make_model(base / family, family, seed=1)
    return built


def run_matrix(
    families: list[str], base: Path, ranks=RANKS, modes=MODES, log=None
) -> dict[str, dict[str, Cell]]:
    models = build_models(base, families)
    image = make_image(base / "picture.png")
    results: dict[str, dict[str, Cell]] = {}
    for family, model_dir in models.items():
        row = results.setdefault(family, {})
        for mode in modes:
            for n in ranks:
                cell = check_cell(model_dir, mode, n, image if family in VLM_FAMILIES else None)
                row[f"{mode} {n}"] = cell
                if log:
                    log(f"{family:12} {mode:8} {n}: {cell.status} {cell.detail}")
    for mode in modes:  # the cache columns: a second turn at 2 ranks, as the CI suite runs it
        together = check_cells_together(models, mode, 2, image, base, cache=True)
        for family, cell in together.items():
            if f"{mode} 2" in results[family]:
                results[family][f"{mode} 2"].cache = cell.cache
    return results


def render(results: dict[str, dict[str, Cell]]) -> str:
    """docs/models.md: the table, then the reasons behind 'unsupported' and 'failed'."""
    columns = list(next(iter(results.values())))
    notes: list[str] = []
    lines = [
        "# Verified model families",
        "",
        "Generated by `python -m tests.tools.models_page --out docs/models.md`;",
        "`tests/e2e/test_models.py` runs the same cells at 2 and 3 ranks in CI (4 ranks: this",
        "page's own run) and fails when a status differs from this page (there, the cells of one",
        "mode and rank count share one start of their ranks: `tests/support/matrix_ranks.py`).",
        "",
        "Each family is a tiny random float32 checkpoint built by `tests/support/tiny.py` (4-8",
        "layers; see `FAMILIES` and `VLM_FAMILIES` there); a `_q4` row is its family converted",
        "to 4 bits as `mlx_lm.convert -q` does (64-wide groups; `QUANTIZED` there: wider, so",
        "every quantized width is whole groups). A cell runs `mlx-cluster launch -n N",
        "--mode M` on this machine (ring backend over loopback) and compares it with",
        f"single-process mlx-lm (mlx-vlm for vision models): {MAX_TOKENS} greedy tokens of text,",
        "and the next-token logits of the prompt (`launch --logits`). Both sides use the BLAS a",
        "rank picks (OpenBLAS where the host has it, see `--blas`), on one thread.",
        "",
        "- **match**: the same text; the number is the largest |Δlogit| against single-process",
        "  (0 for pipeline mode, which does the same arithmetic; 1e-5 to 5e-4 for tensor mode,",
        "  where the all-reduce sums partial products in another order; the largest logits of",
        "  these tiny models are 10 to 30).",
        "- Tensor mode splits every family by the role of its layers' parts",
        "  (`node/model/tensor.py`); at 3 and 4 ranks the heads split unevenly and KV heads are",
        "  replicated where the ranks outnumber them (6 heads and 2 KV heads at 4 ranks: 2/2/1/1",
        "  heads); elsewhere the heads go by whole KV groups when that loads the busiest rank",
        "  less (cluster/core/tensorplan.py).",
        "  deepseek_v3's latent attention goes through mlx-lm's own shard() (even splits only),",
        "  as do qwen3_5, gpt_oss and longcat_flash; qwen3_next's linear attention (a gated",
        "  delta net) splits by its key heads, each rank keeping its own heads' state;",
        "  kimi_linear's delta attention splits by its heads, its latent attention by query",
        "  heads (the latent on every rank); nemotron_h's Mamba-2 mixers split by their groups",
        "  (and the heads that read them), its layers, under `backbone`, pipeline with a cache",
        "  slot per Mamba or attention block only.",
        f"- **close**: the text diverges, but every logit is within {LOGIT_TOLERANCE:g}.",
        "- **differs**: the text diverges and a logit is further off (a bug).",
        "- **unsupported**: the tool refuses before or while loading, with the reason below.",
        "- **failed**: the run broke (a bug).",
        f"- **{CACHE[0]}**: a conversation's second turn through serve's batch at 2 ranks",
        f"  (both modes; `tests/support/matrix_ranks.py`): of the first turn's {CACHE_PROMPT}",
        "  prompt tokens and 4 answer tokens, how many the prompt cache gave (the fewest over",
        "  the cells; a family whose cache cannot be cut back keeps snapshots, `node/cache/`);",
        f"  **{CACHE[1]}**: the same turn after a restart, from each rank's disk (its last",
        "  256-token block boundary; `off`: a cache kind the tier does not keep). Both answers",
        "  equal a batch's without any cache, or the cell says `differs`.",
        "- Long prompts (32k to 128k tokens): [below](#long-context).",
        "",
        f"Measured with mlx {version('mlx')}, mlx-lm {version('mlx-lm')}, mlx-vlm "
        f"{version('mlx-vlm')} on {platform.system()} {platform.machine()}.",
        "",
        "| family | "
        + " | ".join(f"{c} ranks" for c in columns)
        + " | "
        + " | ".join(CACHE)
        + " |",
        "|---|" + "---|" * (len(columns) + len(CACHE)),
    ]
    for family, row in results.items():
        cells = []
        for cell in row.values():
            if cell.status in ("unsupported", "failed"):
                if cell.detail not in notes:
                    notes.append(cell.detail)
                cells.append(f"{cell.status} [{notes.index(cell.detail) + 1}]")
            elif cell.detail == "text":
                cells.append(f"{cell.status} (text)")
            else:
                cells.append(f"{cell.status} (Δ {cell.detail})")
        name = f"{family} (vision)" if family in VLM_FAMILIES else family
        cells += cache_columns(list(row.values()))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Reasons:", ""]
        lines += [f"{i}. {note}" for i, note in enumerate(notes, start=1)]
    lines += ["", "## Long context", "", *long_context_section()]
    lines += [
        "",
        "## Tensor mode in mlx-lm's other families",
        "",
        "Tensor mode splits a layer by the role of its parts (`node/model/tensor.py`), so it",
        "serves any family built of the usual ones. `python -m tests.support.families` builds",
        "each mlx-lm family from one small generic config and asks of every layer what `launch",
        "--mode tensor` asks before it shards. This says whether the rules recognise the",
        "layers, not that a run matches: the families in the table above are the ones run and",
        "compared. A family may also look different under its real config (optional norms, MoE",
        "on some layers only).",
        "",
        render_survey(survey()),
    ]
    return "\n".join(lines).rstrip("\n") + "\n"


LONG_CONTEXT = Path(__file__).parent.parent.parent / "docs" / "long-context.md"


def long_context_section() -> list[str]:
    """docs/long-context.md's table (measured by hand with tests/support/long_context.py:
    minutes per cell on this CPU), between its ``<!-- table -->`` marks."""
    text = LONG_CONTEXT.read_text()
    table = text.split("<!-- table -->")[1].split("<!-- /table -->")[0].strip("\n")
    return [
        "A long prompt through `launch --logits`, sharded, against single-process mlx-lm: the",
        "greedy continuation and the next-token logits (`tests/support/long_context.py`; CI runs",
        "llama's 32k cells at 2 ranks). Models, method and costs:",
        "[long-context.md](long-context.md).",
        "",
        *table.splitlines(),
    ]


def parse(markdown: str) -> dict[str, dict[str, str]]:
    """The statuses recorded in docs/models.md: family -> column -> status."""
    lines = markdown.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| family "))
    rows = []
    for line in lines[start:]:  # the first table only (docs/models.md has others below it)
        if not line.startswith("|"):
            break
        rows += [line] if line.startswith("| ") else []
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    columns = [c.removesuffix(" ranks") for c in header[1:]]
    table = {}
    for line in rows[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        family = cells[0].removesuffix(" (vision)")
        table[family] = {
            col: cell if col in CACHE else cell.split()[0]
            for col, cell in zip(columns, cells[1:], strict=True)
        }
    return table
