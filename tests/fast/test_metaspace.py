"""A model whose tokenizer.json has a Metaspace decoder (SentencePiece conversions: Llama 2,
Mistral, Gemma) is constrained too (issue 62): llguidance's reader answers "can't determine
decoder type", so rank 0 and every rank hand it the token table instead (node.decode.grammar:
TokenTable); answers sampled under a schema parse back as that schema's JSON."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from cluster.core.grammar import json_schema
from node.decode import grammar as node_grammar

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
          "days": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["city", "days", "ok"], "additionalProperties": False}  # fmt: skip
CORPUS = ['The weather in Paris is {"city": "Paris", "days": 3, "ok": true} today.',
          "Lists [1, 2, 3] and objects {} hold values: true, false, null.\n"] * 20  # fmt: skip
SPECIAL = ["<unk>", "<s>", "</s>"]


@pytest.fixture
def metaspace(tmp_path):
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    pieces = [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL + pieces,
                                  show_progress=False)  # fmt: skip
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    before = node_grammar._SOURCE
    eos = tok.token_to_id("</s>")
    node_grammar.use_tokenizer(tmp_path, [eos], tok.get_vocab_size() + 5)  # logits are wider
    yield tok, eos
    node_grammar._SOURCE = before
    node_grammar.tokens.cache_clear()


def test_a_metaspace_tokenizer_is_constrained_through_its_token_table(metaspace):
    tok, eos = metaspace
    with pytest.raises(ValueError, match="can't determine decoder type"):
        llguidance.LLTokenizer(str(node_grammar._SOURCE[0]))  # what failed before
    grammar = json_schema(SCHEMA)
    node_grammar.check(grammar)
    vocab = node_grammar.tokens().vocab
    for seed in range(6):
        rng = random.Random(seed)
        matcher = node_grammar.fresh(grammar)
        mask = allocate_token_bitmask(1, vocab)
        ids: list[int] = []
        for _ in range(400):
            fill_next_token_bitmask(matcher, mask)
            bits = np.unpackbits(mask[0].view(np.uint8), bitorder="little")[:vocab]
            allowed = np.flatnonzero(bits).tolist()
            assert allowed and all(t < tok.get_vocab_size() for t in allowed)
            if eos in allowed:
                break
            token = rng.choice(allowed)
            assert matcher.consume_token(token), matcher.get_error()
            ids.append(token)
        else:
            pytest.fail(f"no end within 400 tokens: {tok.decode(ids)!r}")
        jsonschema.validate(json.loads(tok.decode(ids)), SCHEMA)
