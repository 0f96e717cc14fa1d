"""Tokenizers that speak each tool-call format mlx-lm parses (``mlx_lm/tool_parsers``), for
the grammar of forced and strict calls (node.decode.toolcalls): a small byte-level BPE whose
markers are single tokens, as in the real tokenizers (special where theirs are special), and
``tool_parser_type`` set so that mlx-lm's loader picks the family's parser.

``walk`` is a model that samples anything the grammar allows: a token at random among those
the mask leaves, drawn towards markers and JSON's punctuation so that an answer ends. What it
writes is what a model at a high temperature could write; every call it makes must come back
from the family's parser with arguments that follow the tool's schema."""

from __future__ import annotations

import json
import random
from pathlib import Path

EOS = "<|endoftext|>"
# family -> (markers that are special tokens, markers that are plain added tokens, template)
FAMILIES: dict[str, tuple[list[str], list[str], str]] = {
    "json_tools": ([], ["<tool_call>", "</tool_call>"], ""),
    "mistral": (["[TOOL_CALLS]"], [], ""),
    "mistral[ARGS]": (["[TOOL_CALLS]", "[ARGS]"], [], "{# [TOOL_CALLS]name[ARGS]{...} #}"),
    "qwen3_coder": ([], ["<tool_call>", "</tool_call>", "<function=", "</function>",
                         "<parameter=", "</parameter>"], ""),
    "glm47": (["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>"], [], ""),
    "laguna": (["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>"], [], ""),
    "longcat": ([], ["<longcat_tool_call>", "</longcat_tool_call>", "<longcat_arg_key>",
                     "</longcat_arg_key>", "<longcat_arg_value>", "</longcat_arg_value>"], ""),
    "kimi_k2": (["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"],
                [], ""),
    "kimi_k3": (["<|open|>", "<|sep|>", "<|close|>"], [], ""),
    "minimax_m2": (["<minimax:tool_call>", "</minimax:tool_call>"],
                   ["<invoke name=", "</invoke>", "<parameter name=", "</parameter>"], ""),
    "muse_spark": ([], ["<atem:function_calls>", "</atem:function_calls>",
                        "<atem:invoke name=", "</atem:invoke>", "<atem:parameter name=",
                        "</atem:parameter>"], ""),
    "minicpm5": ([], ["<function name=", "</function>", "<param name=", "</param>"], ""),
    "gemma4": (["<|tool_call>", "<tool_call|>", '<|"|>'], [], ""),
    "function_gemma": (["<start_function_call>", "<end_function_call>", "<escape>"], [], ""),
    "pythonic": (["<|tool_call_start|>", "<|tool_call_end|>"], [], ""),
}  # fmt: skip

CORPUS = [
    'The weather in Paris is {"city": "Paris", "days": 3, "metric": true} today.',
    "call get_weather(city='Lima', unit=\"celsius\") and then answer, 12.5 or -3 or null.",
    "Lists [1, 2, 3] and objects {} hold values: true, false, null, 0.25, 1e3.",
    "<b>bold</b> & CDATA <![CDATA[x]]> a:b, c:d; name=value\n\ttab",
] * 8


def make_tokenizer(out: Path, family: str):
    """A tokenizer of ``family`` (a key of FAMILIES), loaded as mlx-lm loads a model's."""
    from mlx_lm.tokenizer_utils import load
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special, plain, template = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    if special:
        fast.add_special_tokens({"additional_special_tokens": special})
    if plain:  # as Qwen's <tool_call>: added, not special, not normalized
        fast.add_tokens([AddedToken(m, normalized=False, special=False) for m in plain])
    fast.chat_template = template or "{% for m in messages %}{{ m.content }}{% endfor %}"
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tool_parser_type"] = family.split("[")[0]
    config_path.write_text(json.dumps(config))
    return load(out)


def walk(wrapper, path: Path, grammar: str, seed: int, steps: int = 4000) -> tuple[str, bool]:
    """Sample under ``grammar`` (see the module's docstring): the answer's text, and whether
    the grammar ended it (False: it ran out of ``steps``)."""
    import llguidance
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = len(wrapper._tokenizer)
    eos = wrapper.eos_token_id
    lltok = llguidance.LLTokenizer(str(path / "tokenizer.json"), n_vocab=vocab, eos_token=[eos])
    from node.decode.grammar import limits

    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0, limits=limits())
    assert not matcher.is_error(), matcher.get_error()
    rng = random.Random(seed)
    preferred = set(wrapper._tokenizer.all_special_ids) | {
        t for t, a in wrapper._tokenizer.added_tokens_decoder.items()
    }
    for text in ['"', "}", "]", ",", ">", "<", "1", "true", ")", "\n", ":", "=", "]]>"]:
        ids = wrapper._tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            preferred.add(ids[0])
    bitmask = allocate_token_bitmask(1, vocab)
    tokens: list[int] = []
    for _ in range(steps):
        fill_next_token_bitmask(matcher, bitmask)
        bits = np.unpackbits(bitmask[0].view(np.uint8), bitorder="little")[:vocab]
        allowed = np.flatnonzero(bits).tolist()
        assert allowed, (matcher.get_error(), wrapper._tokenizer.decode(tokens))
        if eos in allowed and rng.random() < 0.5:
            break
        near = [t for t in allowed if t in preferred and t != eos]
        pool = near if near and rng.random() < 0.7 else [t for t in allowed if t != eos]
        token = rng.choice(pool or allowed)
        if token == eos:
            break
        assert matcher.consume_token(token), matcher.get_error()
        tokens.append(token)
        if matcher.is_stopped():
            break
    else:
        return wrapper._tokenizer.decode(tokens), False
    return wrapper._tokenizer.decode(tokens), True
