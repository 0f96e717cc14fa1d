"""Sharding breadth: the verification matrix of docs/models.md, vision models, memory per rank."""

import json

import mlx.core as mx
import pytest

from tests.support.matrix import (
    CACHE,
    CACHE_PROMPT,
    build_models,
    cache_columns,
    check_cell,
    check_cells_together,
    parse,
)
from tests.support.processes import ROOT, run_cli
from tests.support.reference import (
    LOGIT_TOLERANCE,
    MAX_TOKENS,
    MODES,
    RANKS,
    SHORT_TOKENS,
    TEXT_FAMILIES,
    VLM_PROMPT,
    make_image,
    prefetch_references,
    reference_vlm,
)
from tests.support.tiny import QUANTIZED, VLM_FAMILIES, make_model, make_vlm

DOCS = parse((ROOT / "docs" / "models.md").read_text())


# The suite's columns. docs/models.md also has 4 ranks in each mode, from `python -m
# tests.tools.models_page` (every cell through launch): 4 ranks on 2 cores cost about a minute
# of the suite, and 3 ranks already split heads unevenly and replicate KV heads.
CI_RANKS = tuple(n for n in RANKS if n <= 3)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    """Every cell of docs/models.md's table, computed once: the cells of each mode and rank
    count share one start of their ranks (matrix.check_cells_together), the single-process
    references one process. -> family -> column -> Cell."""
    base = tmp_path_factory.mktemp("matrix")
    models = build_models(base, [*TEXT_FAMILIES, *VLM_FAMILIES])
    image = make_image(base / "picture.png")
    prefetch_references(models, image, base)
    table: dict = {family: {} for family in models}
    for mode in MODES:
        for n in CI_RANKS:
            together = check_cells_together(models, mode, n, image, base, cache=n == 2)
            for family, cell in together.items():
                table[family][f"{mode} {n}"] = cell
    return table


@pytest.mark.parametrize("family", [*TEXT_FAMILIES, *VLM_FAMILIES])
def test_matrix_row_is_what_docs_say(family, matrix):
    """Each cell as docs/models.md records it; the required cells match single-process."""
    assert family in DOCS, (
        f"docs/models.md has no row for {family}; run python -m tests.tools.models_page"
    )
    assert set(matrix[family]) <= set(DOCS[family]), "docs/models.md's columns changed"
    for column, cell in matrix[family].items():
        recorded = DOCS[family][column]
        assert cell.status == recorded, f"{family} {column}: {cell.status} ({cell.detail})"
        if family in QUANTIZED and column != "tensor 2" and column.startswith("tensor"):
            # a tiny 4-bit model's widths are whole 64-wide groups for 2 ranks only: 3 and 4
            # are refused before loading, naming the groups and the other mode
            if cell.status == "unsupported":
                assert "quantization groups" in cell.detail and "--mode pipeline" in cell.detail
                continue
        # every family matches in both modes at 2, 3 and 4 ranks
        assert cell.status == "match", f"{family} {column}: {cell}"
        if column.startswith("pipeline") and family not in VLM_FAMILIES:
            assert cell.detail == "0", f"pipeline logits must be exact: {cell}"
        if column.startswith("tensor") and family not in VLM_FAMILIES:  # recorded tolerance
            assert float(cell.detail) <= LOGIT_TOLERANCE, f"tensor logits: {cell}"


@pytest.mark.parametrize("family", TEXT_FAMILIES)
def test_a_second_turn_is_cached_as_docs_say(family, matrix):
    """docs/models.md's cache columns: a conversation's second turn through serve's batch at 2
    ranks in both modes reads the first turn from memory and, after a restart, from disk,
    with the answer a batch without a cache gives (every cache kind: snapshots where a cache
    cannot be cut back)."""
    got = cache_columns(list(matrix[family].values()))
    assert got == (DOCS[family][CACHE[0]], DOCS[family][CACHE[1]])
    assert got[0] == f"{CACHE_PROMPT + 4}/{CACHE_PROMPT + 4}", got  # all of it, every family


def test_one_matrix_cell_through_launch_as_the_docs_page_runs_it(matrix, tmp_path):
    """tests/tools/models_page.py (which writes docs/models.md) runs each cell through ``mlx-cluster
    launch``: one cell that way gives what the batched cells gave."""
    model = make_model(tmp_path / "gemma2", "gemma2", seed=1)
    cell = check_cell(model, "tensor", 3, tokens=SHORT_TOKENS)
    assert cell == matrix["gemma2"]["tensor 3"], cell


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    base = tmp_path_factory.mktemp("vlm")
    return make_vlm(base / "paligemma"), base


def test_image_bytes_reach_every_rank(vlm):
    """Two pictures, two answers, each the one single-process mlx-vlm gives for it."""
    model, base = vlm
    first = make_image(base / "a.png")
    second = base / "b.png"
    from PIL import Image

    Image.open(first).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(second)
    answers = []
    for image in (first, second):
        p = run_cli(
            "launch", "-n", 3, "--model", model, "--image", image, "--max-tokens", MAX_TOKENS,
            VLM_PROMPT,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        assert p.stdout == reference_vlm(model, image)
        answers.append(p.stdout)
    assert answers[0] != answers[1]


def test_image_errors_before_any_rank_starts(vlm, models, tmp_path):
    model, base = vlm
    picture = make_image(base / "c.png")
    p = run_cli("launch", "--model", models["llama"], "--image", picture, "hi")
    assert p.returncode == 2
    assert "--image needs a vision-language model" in p.stderr
    assert "starting" not in p.stderr
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not a picture")
    p = run_cli("launch", "--model", model, "--image", junk, "hi")
    assert p.returncode == 2
    assert "is not an image file PIL can read" in p.stderr


def test_missing_weight_is_named(models, tmp_path):
    """A weight absent from the files (strict=False loading would keep it random) is an
    error that names it, from the rank that needs it."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(models["llama"], broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    path = broken / index["weight_map"][name]
    weights = mx.load(str(path))
    del weights[name]
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})
    p = run_cli("launch", "--model", broken, "--max-tokens", 4, "hi")
    assert p.returncode == 2, p.stderr
    assert "lack 1 weight(s) this rank needs: model.layers.1.mlp.up_proj.weight" in p.stderr
    # layer 1 is held by rank 1 of 2 (rank 0 holds the last layers)
    assert "error: rank 1 of 2 on localhost failed while loading the model" in p.stderr


def peak_memory(stderr: str) -> list[float]:
    line = next(x for x in stderr.splitlines() if x.startswith("mlx-cluster: peak memory:"))
    return [float(part.split()[2]) for part in line.split(": ", 2)[2].split(", ")]


WEIGHTY = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, head_dim=64)


BIG = {  # weights-dominated sizes (about 50-110 MB float32) for each layer kind
    "llama": dict(intermediate_size=1536, num_key_value_heads=8),
    "gemma2": dict(intermediate_size=1536, num_key_value_heads=2, query_pre_attn_scalar=64),
    "phi3": dict(intermediate_size=1536, num_key_value_heads=8),
    "mixtral": dict(intermediate_size=512, num_key_value_heads=2),
}


@pytest.mark.parametrize("mode, family", [("pipeline", "llama"), *(("tensor", f) for f in BIG)])
def test_each_rank_holds_about_half(mode, family, tmp_path_factory):
    """Every rank's peak at N=2 is under 0.6 of the single-process peak: tensor mode's dense,
    fused (phi3) and expert (mixtral) layers, and replicated-nothing KV heads."""
    model = make_model(tmp_path_factory.mktemp("big") / "m", family, **WEIGHTY, **BIG[family])
    single = run_cli("launch", "-n", 1, "--model", model, "--max-tokens", 4, "hi")
    assert single.returncode == 0, single.stderr
    (alone,) = peak_memory(single.stderr)
    sharded = run_cli("launch", "-n", 2, "--mode", mode, "--model", model, "--max-tokens", 4, "hi")
    assert sharded.returncode == 0, sharded.stderr
    ranks = peak_memory(sharded.stderr)
    assert len(ranks) == 2
    assert alone > 0.05, single.stderr  # the weights are counted
    print(f"{family} {mode}: peak per rank {ranks} GB, single process {alone} GB")
    assert max(ranks) < 0.6 * alone, (ranks, alone)


def test_replicated_kv_heads_are_reported_before_loading(models):
    """qwen2's 12 heads and 6 KV heads at 4 ranks: 3 query heads each, which use KV heads
    unevenly (0, 0, 1), so each rank holds one KV head per query head; the preflight says what
    that costs, and the text is single-process mlx-lm's."""
    from tests.support.reference import reference

    p = run_cli("launch", "-n", 4, "--mode", "tensor", "--model", models["qwen2"],
                "--max-tokens", 12, "Tell me about lists")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert p.stdout == reference(models["qwen2"], "Tell me about lists", 12)
    note = next(x for x in p.stderr.splitlines() if "KV heads replicated" in x)
    assert note.endswith("the ranks hold 3, 3, 3, 3 of the model's 6 KV heads (2.00x the KV "
                         "cache and k/v projections of an even split)"), note  # fmt: skip
    assert p.stderr.index("KV heads replicated") < p.stderr.index("all ranks ready")
