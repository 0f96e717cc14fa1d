"""A tiny model that really calls a tool: trained here, in seconds, to answer a weather question
with a ``get_weather`` call in the json_tools format (Qwen's ``<tool_call>{...}</tool_call>``,
after a short ``<think>`` block), and to answer from the tool's result once it comes back.

The chat template renders tools, assistant tool calls and tool messages as Qwen's does (mlx-lm
infers its json_tools parser from it); the training sequences are rendered by that template,
so any client whose messages render the same prompt gets the trained answer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten

EOS = "<|endoftext|>"
SPECIAL = ["<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %} "
    "{{ tool.function.name }}({{ tool.function.parameters.properties | list | join(', ') }})"
    "{% endfor %}" + EOS + "\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}" + EOS + "\n"
    "{%- elif message.role == 'tool' %}<|im_start|>tool\n{{ message.content }}" + EOS + "\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}" + EOS + "\n"
    "{%- endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# for structured outputs (tests/e2e/test_structured.py): a second tool, and the weather tool with
# its city bounded: a tiny model sampled at 0.9 may never end a string
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
    "required": ["zone"], "additionalProperties": False}}}  # fmt: skip
BOUNDED_WEATHER = {"type": "function", "function": {**WEATHER_TOOL["function"], "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip
TOOLS = [BOUNDED_WEATHER, TIME_TOOL]
CITIES = {"Paris": 18, "Tokyo": 23, "Lima": 16, "Oslo": 4}
CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}


def question(city: str) -> str:
    return f"What is the weather in {city}?"


def thought(city: str) -> str:
    return f"The user wants the weather in {city}."


def tool_result(city: str) -> str:
    return json.dumps({"temperature": CITIES[city]})


def final_answer(city: str) -> str:
    return f"It is {CITIES[city]} degrees in {city}."


def conversation(city: str) -> list[tuple[list[dict], str]]:
    """(messages, the answer the model is trained to give) for both turns of one city."""
    call = {"name": "get_weather", "arguments": {"city": city}}
    first = [{"role": "user", "content": question(city)}]
    called = (
        f"<think>\n{thought(city)}\n</think>\n\n<tool_call>\n{json.dumps(call)}\n</tool_call>" + EOS
    )
    second = [
        *first,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": tool_result(city)},
    ]
    return [(first, called), (second, final_answer(city) + EOS)]


def make_tool_model(out: Path, steps: int = 200) -> Path:
    """Train, check that greedy decoding gives every trained answer, save; returns ``out``."""
    pairs = [pair for city in CITIES for pair in conversation(city)]
    return train_chat_model(out, [(m, [WEATHER_TOOL], a) for m, a in pairs], TEMPLATE, steps)


def train_chat_model(out: Path, rows3: list[tuple[list[dict], list | None, str]], template: str,
                     steps: int = 200) -> Path:  # fmt: skip
    """A tiny llama trained until greedy decoding gives each (messages, tools, answer)'s
    answer after the chat template's rendering of its messages and tools; saved in ``out``."""
    from mlx_lm.models import llama

    from tests.support.tiny import save_sharded, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    # the tokenizer is trained on the rendered conversations, so they take few tokens
    bootstrap = train_tokenizer(out, CONFIG["vocab_size"], template, SPECIAL)
    texts = [render(bootstrap, m, t) + answer for m, t, answer in rows3]
    tokenizer = train_tokenizer(out, CONFIG["vocab_size"], template, SPECIAL, corpus=texts * 20)
    config = {**CONFIG, "eos_token_id": tokenizer.eos_token_id}

    rows = []
    for messages, tools, answer in rows3:
        prompt = tokenizer.encode(render(tokenizer, messages, tools), add_special_tokens=False)
        reply = tokenizer.encode(answer, add_special_tokens=False)
        rows.append((prompt, reply))
    width = max(len(p) + len(r) for p, r in rows)
    inputs, targets, mask = [], [], []
    for prompt, reply in rows:
        seq = prompt + reply
        pad = width - len(seq) + 1
        inputs.append(seq[:-1] + [0] * pad)
        targets.append(seq[1:] + [0] * pad)
        mask.append([0] * (len(prompt) - 1) + [1] * len(reply) + [0] * pad)
    inputs, targets, mask = mx.array(inputs), mx.array(targets), mx.array(mask, mx.float32)

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    optimizer = optim.AdamW(learning_rate=1e-3, weight_decay=0.0)

    def loss_fn(model):
        logits = model(inputs)
        losses = nn.losses.cross_entropy(logits, targets, reduction="none")
        return (losses * mask).sum() / mask.sum()

    step = nn.value_and_grad(model, loss_fn)
    for i in range(steps):
        loss, grads = step(model)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        if os.environ.get("TOOLMODEL_VERBOSE") and i % 25 == 0:
            print(i, loss.item(), flush=True)
    for prompt, reply in rows:  # the trained answers, greedy, token for token
        got = greedy(model, prompt, len(reply), tokenizer.eos_token_id)
        assert got == reply, (
            f"the tool model did not learn its answers (loss {loss.item():.4f}): "
            f"{tokenizer.decode(got)!r} for {tokenizer.decode(reply)!r}"
        )
    weights = dict(tree_flatten(model.parameters()))
    save_sharded(weights, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def render(tokenizer, messages: list[dict], tools: list | None = (WEATHER_TOOL,)) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=list(tools) if tools else None, tokenize=False, add_generation_prompt=True
    )


def greedy(model, prompt: list[int], most: int, eos: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(most):
        token = model(mx.array(tokens)[None])[0, -1].argmax().item()
        tokens.append(token)
        if token == eos:
            break
    return tokens[len(prompt) :]


# python -m tests.support.toolmodel OUT (a subprocess: OpenBLAS preloaded)
if __name__ == "__main__":
    import sys

    make_tool_model(Path(sys.argv[1]))
