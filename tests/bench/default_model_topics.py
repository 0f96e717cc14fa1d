"""How often the embedded default model answers on topic: every question
tests/tools/train_default.py builds (its names, asked each way), greedy through mlx-lm; an
answer is on topic when its first 8 words are the topic opening's first 8 words.
For docs/default-model.md.

    python -m tests.bench.default_model_topics                       # every way of asking
    python -m tests.bench.default_model_topics "Tell me about {}"    # the ways given, '|' between
"""

from __future__ import annotations

import sys
import time
from pydoc_data.topics import topics  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402
from node.train_default import HELD_OUT_QUESTIONS, QUESTIONS, opening, topic_names  # noqa: E402

from cluster.core.modelcheck import default_model_path  # noqa: E402


def main() -> None:
    asks = sys.argv[1].split("|") if len(sys.argv) > 1 else QUESTIONS + HELD_OUT_QUESTIONS
    model, tokenizer = load(str(default_model_path()))
    names = sorted(topic_names().items())
    tic = time.perf_counter()
    for ask in asks:
        hits, missed = 0, []
        for name, key in names:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": ask.format(name)}], add_generation_prompt=True
            )
            steps = generate_step(mx.array(ids), model, sampler=make_sampler(0.0), max_tokens=40)
            words = tokenizer.decode([int(t) for t, _ in steps]).split()[:8]
            if words == opening(topics[key]).split()[:8]:
                hits += 1
            else:
                missed.append(name)
        kind = "held out" if ask in HELD_OUT_QUESTIONS else "trained"
        print(f"{ask!r} ({kind}): {hits}/{len(names)} on topic; missed: {', '.join(missed[:12])}"
              f"{' ...' if len(missed) > 12 else ''}", flush=True)  # fmt: skip
    print(f"{time.perf_counter() - tic:.0f} s")


if __name__ == "__main__":
    main()
