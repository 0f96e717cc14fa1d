"""llguidance against xgrammar on one tokenizer and two schemas: compile time and time per
mask (mid-answer, one thread). xgrammar is not a dependency (it pulls in torch): run this in a
virtual environment of its own.

    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install xgrammar llguidance transformers
    /tmp/xg/bin/python -m tests.bench.grammar_engines MODEL_DIR   # a folder with tokenizer.json
"""

import json
import sys
import time

import llguidance as lg
import xgrammar as xgr
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from transformers import PreTrainedTokenizerFast

SCHEMAS = {  # (schema, the answer so far when the mask is asked for)
    "array of 40 ints": (
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
         "minItems": 40, "maxItems": 40},
        "[12, 345, 6",
    ),
    "person (pydantic-like)": (
        {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 10},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "maxItems": 2, "items": {
                "type": "object", "properties": {"kind": {"enum": ["cat", "dog", "fish"]},
                                                 "legs": {"type": "integer"}},
                "required": ["kind", "legs"], "additionalProperties": False}},
            "happy": {"type": "boolean"}},
         "required": ["name", "age", "pets", "happy"], "additionalProperties": False},
        '{"name": "Al',
    ),
}  # fmt: skip
REPEAT = 500


def main(path: str) -> None:
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{path}/tokenizer.json")
    ltok = lg.LLTokenizer(f"{path}/tokenizer.json")
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)),
                                   max_threads=1)  # fmt: skip
    print(f"| schema ({len(tok)} tokens) | llguidance compile | mask | xgrammar compile | mask |")
    print("|---|---|---|---|---|")
    for name, (schema, prefix) in SCHEMAS.items():
        start = time.perf_counter()
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        m = lg.LLMatcher(ltok, lg.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        l_compile = time.perf_counter() - start
        assert m.consume_tokens(ltok.tokenize_str(prefix)), m.get_error()
        bits = allocate_token_bitmask(1, ltok.vocab_size)
        start = time.perf_counter()
        for _ in range(REPEAT):
            fill_next_token_bitmask(m, bits)
        l_mask = (time.perf_counter() - start) / REPEAT
        start = time.perf_counter()
        grammar = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                               separators=(", ", ": "))  # fmt: skip
        x_compile = time.perf_counter() - start
        xm = xgr.GrammarMatcher(grammar)
        for i in tok.encode(prefix):
            assert xm.accept_token(i), i
        xbits = xgr.allocate_token_bitmask(1, len(tok))
        start = time.perf_counter()
        for _ in range(REPEAT):
            xm.fill_next_token_bitmask(xbits)
        x_mask = (time.perf_counter() - start) / REPEAT
        print(f"| {name} | {l_compile * 1e3:.1f} ms | {l_mask * 1e6:.0f} us | "
              f"{x_compile * 1e3:.1f} ms | {x_mask * 1e6:.0f} us |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
