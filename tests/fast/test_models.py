"""Sharding breadth: the verification matrix of docs/models.md, vision models, memory per rank."""

from tests.support.processes import ROOT


def test_docs_list_what_the_rules_recognise_in_mlx_lms_other_families():
    from tests.support.families import render, survey

    assert render(survey()) in (ROOT / "docs" / "models.md").read_text(), (
        "docs/models.md is out of date: run python -m tests.tools.models_page --out docs/models.md"
    )
