"""A neighbour's request beside strict tools of 300 optional properties in the pythonic format
(issue 62): before, their grammar was 6 MB (3.5 s on rank 0's prepare thread, 5.5 s and
~0.5 GB on every rank) and a neighbour's 0.05 s request took 9.8-19 s behind three of them.

    python -m tests.bench.tool_neighbour --rounds 3 [--before /tmp/before-tree]

serve -n 2 (pipeline) of a tiny qwen2 whose template makes mlx-lm read pythonic calls; the
neighbour is a plain chat request of 16 greedy tokens, timed alone, then sent just after three
requests with the wide strict tool (each its own tool name, so no grammar is cached). Prints
the neighbour's seconds alone and beside, medians with ranges, and their ratio; with
``--before`` (a checkout to compare with: ``git worktree add``) the same for it, alternated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from tests.bench.one_path import ROOT, serve
from tests.support.serving import free_port, post, stop, wait_up

PYTHONIC = (
    "{%- if tools %}<|system|>Call tools as <|tool_call_start|>[name(key=value)]"
    "<|tool_call_end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def wide_tool(name: str, n: int = 300) -> dict:
    props = {f"field_{i}": {"type": "string"} for i in range(n)}
    return {"type": "function", "function": {"name": name, "strict": True,
            "parameters": {"type": "object", "properties": props}}}  # fmt: skip


def chat(port: int, model: str, content: str, tokens: int, tools=None) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": content}],
            "max_tokens": tokens, "temperature": 0}  # fmt: skip
    if tools:
        body["tools"] = tools
    began = time.monotonic()
    with post(port, "/v1/chat/completions", body) as r:
        json.loads(r.read())
    return time.monotonic() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--properties", type=int, default=300)
    ap.add_argument("--before", type=Path)
    args = ap.parse_args()
    from tests.support.tiny import make_model

    model = make_model(Path(tempfile.mkdtemp()) / "pythonic", "qwen2", seed=3,
                       chat_template=PYTHONIC,
                       extra_special=["<|tool_call_start|>", "<|tool_call_end|>"])  # fmt: skip
    trees = {"after": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    times: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in trees}
    for r in range(args.rounds):
        for name, tree in trees.items():
            alone, beside = times[name]
            port = free_port()
            proc = serve(tree, model, port)
            try:
                wait_up(port, proc)
                chat(port, model.name, "Warm up.", 2)
                alone.append(chat(port, model.name, "Name a color.", 16))
                wide = [threading.Thread(target=chat, args=(
                    port, model.name, f"Fill {r}.{i}", 64,
                    [wide_tool(f"t{r}_{i}", args.properties)])) for i in range(3)]  # fmt: skip
                for t in wide:
                    t.start()
                time.sleep(0.05)  # the wide ones are sent first, as in the review
                beside.append(chat(port, model.name, "Name a color.", 16))
                for t in wide:
                    t.join()
            finally:
                stop([proc])

    def cell(xs: list[float]) -> str:
        return f"{statistics.median(xs):.3f} [{min(xs):.3f}-{max(xs):.3f}]"

    print("| tree | neighbour alone s | beside 3 wide strict tools s | ratio (medians) |")
    print("|---|---|---|---|")
    for name, (alone, beside) in times.items():
        print(f"| {name} | {cell(alone)} | {cell(beside)} | "
              f"{statistics.median(beside) / statistics.median(alone):.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
