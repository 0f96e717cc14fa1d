"""Constrained decoding in one process (node.decode.grammar): sampled answers under a JSON schema
validate, for schemas hypothesis makes up too; a forced tool call is the model's own markup
with arguments under the tool's schema; a grammar waits for a think block the prompt opened;
a request's trial run leaves its matcher at the start; bad grammars are refused where they are
asked for (cluster.core.grammar). Across ranks, in both modes, and through the official
clients: tests/e2e/test_structured.py."""

from __future__ import annotations

import jsonschema
from mlx_lm import load

from cluster.core.spec import Constraint, Sampling, SharedRequest
from node.decode import grammar as node_grammar
from node.decode.loop import generate


def answer(model, tokenizer, req) -> tuple[str, str]:
    got = generate(model, tokenizer, req, None)
    tokens = [t for t in got.tokens if t not in tokenizer.eos_token_ids]
    return tokenizer.decode(tokens), got.stats["finish_reason"]


def test_a_forced_tool_call_is_the_model_s_markup_with_arguments_under_its_schema(tool_model):
    """tool_choice required / a named tool, on the tool model (json_tools markup): the call
    mlx-lm's parser reads back names the tool, with arguments the schema allows, even though
    the model was trained to think first (the grammar leaves it no room to)."""
    from tests.support.toolmodel import TOOLS

    model, tokenizer = load(str(tool_model))
    node_grammar.use_tokenizer(tool_model, tokenizer.eos_token_ids, 512)
    tools = TOOLS
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], tools=tools,
                                           add_generation_prompt=True)  # fmt: skip
    for choice in ("get_time", "required"):
        for seed in range(3):
            shared = node_grammar.shared_grammar(tokenizer, Constraint(tools=choice), tools,
                                                 prompt)  # fmt: skip
            req = SharedRequest(Sampling(max_tokens=120, temp=1.0, seed=seed), prompt, shared)
            text = answer(model, tokenizer, req)[0]
            inner = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
            call = tokenizer.tool_parser(inner, tools)
            assert choice == "required" or call["name"] == choice
            schema = next(t for t in tools if t["function"]["name"] == call["name"])
            jsonschema.validate(call["arguments"], schema["function"]["parameters"])
