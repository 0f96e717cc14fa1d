"""Single-process mlx-lm (mlx-vlm for vision models): the baseline every sharded answer is
compared with. Each reference is computed in a process of its own with the BLAS a rank picks,
on one thread (REFERENCE_ENV), and remembered for the session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from cluster.core.blas import blas_env
from tests.support.tiny import FAMILIES, QUANTIZED, VLM_FAMILIES

CLI = shutil.which("mlx-cluster", path=str(Path(sys.executable).parent)) or "mlx-cluster"
PROMPT = "Tell me about lists"
VLM_PROMPT = "What is in the picture?"
MAX_TOKENS = 24
SHORT_TOKENS = 6  # CI's tensor cells at 3 and 4 ranks: with the logits (see check_cell)
LOGIT_TOLERANCE = 1e-3  # float32; reduction order across ranks moves logits by ~1e-6
MODES = ("pipeline", "tensor")
RANKS = (2, 3, 4)
TEXT_FAMILIES = [*(f for f in FAMILIES if f != "llama_q"), *QUANTIZED]
STATUSES = ("match", "close", "differs", "unsupported", "failed")


# Both sides of a cell use the BLAS a rank picks (cluster.core.blas), on one thread: pipeline mode
# then does the single process's arithmetic bit for bit, and a Δ of 0 means exactly that.
ONE_THREAD = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
REFERENCE_ENV = {**ONE_THREAD, **(blas_env("auto", 1, ONE_THREAD, sys.platform, 1) or {})}


_cache: dict = {}


def _single_process(*args) -> str | list[float]:
    """One reference, computed in a process with REFERENCE_ENV (the BLAS is chosen at start)."""
    if args not in _cache:
        p = subprocess.run(
            [sys.executable, "-m", "tests.support.reference", *map(str, args)],
            capture_output=True,
            text=True,
            env=REFERENCE_ENV,
            timeout=300,
        )
        if p.returncode != 0:
            raise RuntimeError(f"single-process reference {args} failed:\n{p.stderr}")
        _cache[args] = json.loads(p.stdout)
    return _cache[args]


def reference(
    model_dir: Path, prompt: str = PROMPT, max_tokens: int = MAX_TOKENS, kv_bits: int | None = None
) -> str:
    """What single-process mlx-lm generates, greedy, the way mlx_lm.generate builds the prompt
    (with ``kv_bits``: its KV cache quantized from the first token, group size 64)."""
    return _single_process("text", model_dir, prompt, max_tokens, *([kv_bits] if kv_bits else []))


def reference_logits(model_dir: Path, prompt: str = PROMPT) -> list[float]:
    """Single-process mlx-lm's next-token logits after the prompt."""
    key = ("logits", model_dir, prompt)
    if key not in _cache and ("text", model_dir, prompt, MAX_TOKENS) not in _cache:
        both = _single_process("both", model_dir, prompt, MAX_TOKENS)  # one process for two
        _cache[("text", model_dir, prompt, MAX_TOKENS)] = both["text"]
        _cache[key] = both["logits"]
    return _single_process(*key)


def reference_vlm(
    model_dir: Path, image: Path, prompt: str = VLM_PROMPT, max_tokens: int = MAX_TOKENS
) -> str:
    """What single-process mlx-vlm generates, greedy."""
    return _single_process("vlm", model_dir, prompt, max_tokens, image)


def _generated(model_dir: str, prompt: str, max_tokens: str, kv_bits: str | None = None):
    """Single-process mlx-lm's greedy text (mlx_lm.generate) and the next-token logits after
    the prompt as its first step computes them (a logits processor keeps them), as
    ``launch --logits`` reports both from one prefill."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    from node.decode.loop import record_first

    model, tokenizer = load(model_dir)
    ids = _prompt_ids(tokenizer, prompt)
    kv = {"kv_bits": int(kv_bits), "quantized_kv_start": 0} if kv_bits else {}
    first: list = []
    text = generate(model, tokenizer, ids, max_tokens=int(max_tokens), sampler=make_sampler(0.0),
                    logits_processors=[record_first(first)], **kv)  # fmt: skip
    return text, first[0].tolist()


def _text(model_dir: str, prompt: str, max_tokens: str, kv_bits: str | None = None) -> str:
    return _generated(model_dir, prompt, max_tokens, kv_bits)[0]


def _prompt_ids(tokenizer, prompt: str) -> list[int]:
    use_template = tokenizer.has_chat_template
    text = prompt
    if use_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return tokenizer.encode(text, add_special_tokens=not use_template)


def _logits(model_dir: str, prompt: str) -> list[float]:
    return _generated(model_dir, prompt, "1")[1]


def _vlm(model_dir: str, prompt: str, max_tokens: str, image: str) -> str:
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load

    model, processor = load(model_dir)
    text = apply_chat_template(processor, model.config, prompt, num_images=1)
    chunks = stream_generate(
        model, processor, text, image=[image], max_tokens=int(max_tokens), temperature=0.0
    )
    return "".join(r.text for r in chunks)


def _both(model_dir: str, prompt: str, max_tokens: str) -> dict:
    text, logits = _generated(model_dir, prompt, max_tokens)
    return {"text": text, "logits": logits}


def _many(listing: str) -> list:
    """Many references in one process: ``listing`` is a JSON file of [kind, *args] lists."""
    return [REFERENCES[kind](*args) for kind, *args in json.loads(Path(listing).read_text())]


REFERENCES = {"text": _text, "logits": _logits, "both": _both, "vlm": _vlm, "many": _many}


def prefetch_references(models: dict[str, Path], image: Path, scratch: Path) -> None:
    """Every model's reference (text and logits; text for a vision model) in one process, into
    the cache ``reference``, ``reference_logits`` and ``reference_vlm`` read."""
    keys = [
        ("vlm", m, VLM_PROMPT, MAX_TOKENS, image)
        if family in VLM_FAMILIES
        else ("both", m, PROMPT, MAX_TOKENS)
        for family, m in models.items()
    ]
    listing = scratch / "references.json"
    listing.write_text(json.dumps([[str(x) for x in key] for key in keys]))
    for key, value in zip(keys, _single_process("many", listing), strict=True):
        if key[0] == "both":
            _cache[("text", *key[1:])] = value["text"]
            _cache[("logits", key[1], PROMPT)] = value["logits"]
        else:
            _cache[key] = value


def make_image(path: Path) -> Path:
    """A fixed random 40x50 RGB picture."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path


if __name__ == "__main__":  # python -m tests.support.reference KIND ARGS... (a reference)
    kind, *rest = sys.argv[1:]
    json.dump(REFERENCES[kind](*rest), sys.stdout)


TURNS = ["Tell me about lists", "And tuples?", "Which is faster?"]


def reference_chat(model_dir, turns: list[str], max_tokens: int) -> tuple[list[str], list[int]]:
    """Single-process mlx-lm, turn by turn with the growing history: answers and prompt sizes."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    messages, answers, sizes = [], [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        answer = generate(model, tokenizer, ids, max_tokens=max_tokens, sampler=make_sampler(0.0))
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
        sizes.append(len(ids))
    return answers, sizes
