"""Train the embedded default model: a tiny Llama on the topic help that ships with Python.

The result lives in ``node/default_model`` so ``mlx-cluster launch`` works offline with no model
named. Retrain with ``pip install -e '.[train]' && python -m node.train_default``. Training runs in
PyTorch because MLX's CPU matmul is about ten times slower than PyTorch's on a Linux box; the
weights are written in mlx-lm's llama layout, and the script checks that mlx-lm computes the
same logits from them before it saves anything.

Two phases: the model first learns the corpus' prose (``--steps``), then learns to answer
(``--qa-steps``): question/answer pairs made from the corpus itself ("Tell me about lists" ->
the opening of the "List displays" topic), rendered through the chat template it ships with,
mixed with more of the corpus so that it keeps its prose. ``--init DIR`` starts the second
phase from a model already trained (the first phase is skipped).
"""

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

NODE = Path(__file__).resolve().parent.parent.parent / "node"  # where the embedded models ship
DEFAULT_DIR = NODE / "default_model"
DRAFT_DIR = NODE / "default_draft"
EOS = "<|endoftext|>"

CONFIG = {
    "model_type": "llama",
    "hidden_size": 192,
    "num_hidden_layers": 6,
    "intermediate_size": 576,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
    "rms_norm_eps": 1e-5,
    "vocab_size": 2048,
    "max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "rope_traditional": False,
    "tie_word_embeddings": True,
}


# The default model's draft (``--draft-model default``): the same tokenizer and corpus, a
# third of the width and two layers, so that it costs a fraction of a decode step.
DRAFT_CONFIG = {
    **CONFIG,
    "hidden_size": 96,
    "num_hidden_layers": 2,
    "intermediate_size": 288,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
}


# The conversation as plain text, one question and one answer per turn; an answer ends with the
# end-of-text token, which is what stops generation.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n"
    "{% elif m['role'] == 'user' %}Question: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}Answer: {{ m['content'] }}" + EOS + "\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Answer:{% endif %}"
)

# What people call a topic, beyond its own title and pydoc's index: the words a question uses.
ALIASES = {
    "lists": ["lists", "a list", "Python lists", "list comprehensions", "list displays"],
    "typesseq-mutable": ["mutable sequences", "list methods"],
    "typesmapping": ["dictionaries", "dicts", "a dictionary", "a dict", "mappings"],
    "dict": ["dictionary displays", "dict comprehensions"],
    "string-methods": ["strings", "a string", "str", "string methods", "text"],
    "strings": ["string literals", "bytes literals", "f-strings"],
    "formatstrings": ["string formatting", "format strings", "str.format"],
    "typesseq": ["tuples", "a tuple", "sequences", "ranges", "sequence types"],
    "for": ["for loops", "the for loop", "loops", "iteration"],
    "while": ["while loops", "the while loop"],
    "if": ["if statements", "conditionals", "elif"],
    "function": ["functions", "a function", "def", "defining functions", "decorators"],
    "typesfunctions": ["function objects"],
    "class": ["classes", "a class", "defining classes", "inheritance"],
    "exceptions": ["exceptions", "errors", "an exception"],
    "try": ["try and except", "exception handling", "catching exceptions", "finally"],
    "raise": ["raising exceptions", "raise"],
    "import": ["imports", "importing", "import", "importing modules"],
    "typesmodules": ["modules", "a module"],
    "yield": ["generators", "yield"],
    "lambda": ["lambdas", "lambda functions", "anonymous functions", "lambda"],
    "integers": ["integers", "ints", "integer literals"],
    "floating": ["floats", "floating point numbers", "float literals"],
    "numbers": ["numbers", "numeric literals"],
    "imaginary": ["complex numbers", "imaginary numbers"],
    "booleans": ["booleans", "and, or and not", "boolean operations"],
    "truth": ["truth values", "truthiness"],
    "bltin-null-object": ["None", "the None object"],
    "bltin-ellipsis-object": ["Ellipsis", "the ellipsis"],
    "context-managers": ["context managers", "a context manager"],
    "with": ["the with statement", "with"],
    "async": ["coroutines", "async functions", "async and await"],
    "await": ["await"],
    "slicings": ["slicing", "slices"],
    "subscriptions": ["subscripts", "indexing"],
    "operator-summary": ["operators", "operator precedence", "precedence"],
    "debugger": ["the debugger", "pdb", "debugging"],
    "naming": ["names", "variables", "scopes", "scope", "namespaces"],
    "comparisons": ["comparisons", "comparison operators"],
    "assignment": ["assignment", "assignments"],
    "augassign": ["augmented assignment", "+="],
    "objects": ["objects", "values and types"],
    "types": ["types", "the type hierarchy", "built-in types"],
    "typesmethods": ["methods", "a method"],
    "specialnames": ["special methods", "dunder methods", "magic methods"],
    "in": ["membership tests", "the in operator"],
    "pass": ["pass"],
    "break": ["break"],
    "continue": ["continue"],
    "return": ["return", "return values"],
    "del": ["del", "deleting names"],
    "global": ["global", "global variables"],
    "nonlocal": ["nonlocal"],
    "assert": ["assert", "assertions"],
    "identifiers": ["identifiers", "keywords"],
    "execmodel": ["the execution model", "code blocks"],
}

# Ways to ask; the last ones are kept out of training, to check how far the answers generalise.
QUESTIONS = [
    "Tell me about {}",
    "Tell me about {}.",
    "What is {}?",
    "What are {}?",
    "Explain {}.",
    "Explain {} in Python.",
    "How do {} work in Python?",
    "Describe {}.",
    "{}",
    "What can you tell me about {}?",
    "I want to learn about {}.",
    "Can you explain {}?",
]
HELD_OUT_QUESTIONS = ["Could you tell me about {}?", "Give me an overview of {}."]


def opening(text: str, words: int = 60, most: int = 110) -> str:
    """A topic's opening prose, unwrapped: its first paragraphs up to about ``words`` words,
    with grammar rules, tables, signatures and version notes left out; "" when it has none."""

    def is_prose(p: str) -> bool:
        lines = p.splitlines()
        return (
            bool(lines)
            and not lines[0].startswith((" ", "+", "|", "*", "object.", "class ", "**"))
            and "::=" not in p
            and not re.match(r"(New|Changed|Added|Deprecated) in version", p)
            and not set(lines[-1]) <= set("=-*~")
            and len(p.split()) >= 6
        )

    body = text.strip().split("\n", 2)[2]  # after the title and its underline
    kept, n = [], 0
    for p in re.split(r"\n\s*\n", body):
        p = p.strip("\n")
        if not is_prose(p):
            if n >= 25:
                break
            continue
        s = " ".join(line.strip() for line in p.splitlines())
        kept.append(s[:-1] + "." if s.endswith(":") else s)
        n += len(s.split())
        if n >= words:
            break
    out = "\n\n".join(kept)
    if len(out.split()) > most:  # cut at the last sentence end before `most` words
        cut = " ".join(out.split(" ")[:most])
        end = max(cut.rfind(". "), cut.rfind(".\n"))
        out = cut[: end + 1] if end > 0 else cut
    return out


def topic_names() -> dict[str, str]:
    """Each name a question may use -> the pydoc topic that answers it: the aliases above, then
    each topic's title, then pydoc's own index (help("LISTS"), help("def"))."""
    import pydoc
    from pydoc_data.topics import topics

    names: dict[str, str] = {}

    def add(name: str, key: str):
        if key in topics and opening(topics[key]):
            names.setdefault(name, key)

    for key, aliases in ALIASES.items():
        for a in aliases:
            add(a, key)
    for key in topics:
        title = topics[key].strip().splitlines()[0].replace('"', "")
        add(title.lower() if " " in title else title, key)
    for name, target in pydoc.Helper.topics.items():  # LISTS, NUMBERS; not LISTLITERALS
        joined = any(w in name for w in ("LITERALS", "METHODS", "OBJECTS", "ATTRIBUTES",
                                         "IDENTIFIERS", "NAMES", "FEATURES", "MANAGERS", "VALUE",
                                         "ASSIGNMENT"))  # fmt: skip
        if isinstance(target, tuple) and not joined:
            add(name.lower(), target[0])
    for word, target in pydoc.Helper.keywords.items():
        if isinstance(target, tuple):
            add(f"the {word} keyword", target[0])
    return names


def qa_conversations(seed: int, held_out: bool = False) -> list[list[dict[str, str]]]:
    """Chat conversations of one or two turns; each answer is its topic's opening."""
    from pydoc_data.topics import topics

    rng = random.Random(seed)
    names = topic_names()
    asks = HELD_OUT_QUESTIONS if held_out else QUESTIONS
    turns = [
        (ask.format(name), opening(topics[key]))
        for name, key in sorted(names.items())
        for ask in asks
    ]

    def turn(q: str, a: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    convs = [turn(q, a) for q, a in turns]
    if not held_out:  # second turns: an answer that follows a conversation, not only a start
        for _ in range(len(turns) // 4):
            first, second = rng.sample(turns, 2)
            convs.append(turn(*first) + turn(*second))
    return convs


def encode_conversation(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """The conversation's tokens as the chat template renders it, and a mask of the answers'
    tokens (their end-of-text included), which are the ones the model learns to produce. Each
    answer's prompt tokenizes as it will at run time (the template's prompt, alone)."""
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the text rendered so far
    for i in range(0, len(messages), 2):
        prompt = tokenizer.apply_chat_template(
            messages[: i + 1], tokenize=False, add_generation_prompt=True
        )
        new = tokenizer.encode(prompt[len(done) :], add_special_tokens=False)
        answer = tokenizer.encode(" " + messages[i + 1]["content"], add_special_tokens=False)
        newline = tokenizer.encode("\n", add_special_tokens=False)
        ids += new + answer + [tokenizer.eos_token_id] + newline
        mask += [0] * len(new) + [1] * (len(answer) + 1) + [0] * len(newline)
        done = prompt + " " + messages[i + 1]["content"] + EOS + "\n"
    whole = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.encode(whole, add_special_tokens=False) == ids, whole[:200]
    return ids, mask


def corpus() -> list[str]:
    """The topic help of pydoc: about 460 kB of English prose about Python."""
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics)]


def train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.model_max_length = CONFIG["max_position_embeddings"]
    return fast  # saved with its chat template by save_tokenizer


def save_tokenizer(tokenizer, out: Path) -> None:
    """The tokenizer and its chat template, without the loading flags transformers writes
    into tokenizer_config.json (where it was loaded from is nobody's business)."""
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    path.write_text(json.dumps(config, indent=2) + "\n")


def build_torch_llama(cfg: dict):
    """mlx-lm's llama (rotate-half RoPE, SwiGLU, RMSNorm, tied head) in PyTorch."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    d, h = cfg["hidden_size"], cfg["num_attention_heads"]
    hd = d // h
    eps = cfg["rms_norm_eps"]

    def rope(x):  # x: B, H, L, hd
        L = x.shape[2]
        inv = cfg["rope_theta"] ** (-torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.arange(L, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, d, bias=False)
            self.v_proj = nn.Linear(d, d, bias=False)
            self.o_proj = nn.Linear(d, d, bias=False)

        def forward(self, x):
            B, L, _ = x.shape

            def heads(t):
                return t.view(B, L, h, hd).transpose(1, 2)

            q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
            o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
            return self.o_proj(o.transpose(1, 2).reshape(B, L, d))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            n = cfg["intermediate_size"]
            self.gate_proj = nn.Linear(d, n, bias=False)
            self.up_proj = nn.Linear(d, n, bias=False)
            self.down_proj = nn.Linear(n, d, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()
            self.mlp = MLP()
            self.input_layernorm = nn.RMSNorm(d, eps=eps)
            self.post_attention_layernorm = nn.RMSNorm(d, eps=eps)

        def forward(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], d)
            self.layers = nn.ModuleList(Block() for _ in range(cfg["num_hidden_layers"]))
            self.norm = nn.RMSNorm(d, eps=eps)

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02)

        def forward(self, ids):
            x = self.model.embed_tokens(ids)
            for layer in self.model.layers:
                x = layer(x)
            return self.model.norm(x) @ self.model.embed_tokens.weight.T

    return Llama()


def check_with_mlx(out: Path, torch_model, sample) -> float:
    """Largest |logit difference| between PyTorch and mlx-lm on a sample: proves the layout."""
    import mlx.core as mx
    import numpy as np
    import torch
    from mlx_lm import load

    model, _ = load(str(out))
    ref = torch_model(torch.tensor(sample)[None]).detach().numpy()
    got = np.array(model(mx.array(sample)[None]))
    return float(np.abs(ref - got).max())


def answer_greedy(model, tokenizer, question: str, max_tokens: int = 40) -> str:
    """The model's greedy answer to one question, in PyTorch (the checks during training)."""
    import torch

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_tokens):
            nxt = int(model(torch.tensor(ids + out)[None])[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            out.append(nxt)
    return tokenizer.decode(out)


def on_topic_share(model, tokenizer, convs: list, n: int = 60, seed: int = 0) -> float:
    """The share of ``n`` sampled questions whose greedy answer starts as their topic's opening
    (its first 8 words)."""
    sample = random.Random(seed).sample(convs, min(n, len(convs)))
    hits = 0
    for conv in sample:
        want = conv[1]["content"].split()[:8]
        hits += answer_greedy(model, tokenizer, conv[0]["content"], 40).split()[:8] == want
    return hits / len(sample)


def train(model, batch, steps: int, lr: float, label: str):
    """AdamW with a warm-up and a cosine decay; ``batch(step)`` gives a list of (inputs,
    targets) of any widths, the targets -100 where no loss is taken; the loss is the mean over
    every target token of them all."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def lr_at(step):
        if step < warmup:
            return lr * (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    model.train()
    tic = time.time()
    for step in range(steps):
        parts = batch(step)
        counted = sum(int((t != -100).sum()) for _, t in parts)
        loss = sum(
            torch.nn.functional.cross_entropy(
                model(x).flatten(0, 1), t.flatten(), ignore_index=-100, reduction="sum"
            )
            for x, t in parts
        ) / max(1, counted)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            rate = (step + 1) / (time.time() - tic)
            print(f"{label} step {step:5d}  loss {loss.item():.3f}  {rate:.2f} steps/s", flush=True)
    model.eval()


def main():
    import numpy as np
    import torch
    from safetensors.numpy import save_file
    from transformers import PreTrainedTokenizerFast

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None, help="default: node/default_model "
                   "(node/default_draft with --draft)")  # fmt: skip
    p.add_argument("--draft", action="store_true", help="train the default model's draft, "
                   "with the default model's tokenizer")  # fmt: skip
    p.add_argument("--init", type=Path, default=None, help="start from this model's weights and "
                   "tokenizer and skip the first phase")  # fmt: skip
    p.add_argument("--steps", type=int, default=1500, help="first phase: the corpus' prose")
    p.add_argument("--qa-steps", type=int, default=1200, help="second phase: answers")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--qa-lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    cfg = DRAFT_CONFIG if args.draft else CONFIG
    args.out = args.out or (DRAFT_DIR if args.draft else DEFAULT_DIR)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = corpus()
    if args.init or args.draft:  # the draft must share the model's tokenizer, token for token
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            args.init or DEFAULT_DIR, clean_up_tokenization_spaces=False
        )
    else:
        tokenizer = train_tokenizer(docs, CONFIG["vocab_size"])
    tokenizer.chat_template = CHAT_TEMPLATE
    save_tokenizer(tokenizer, args.out)
    ids = []
    for d in docs:
        ids.extend(tokenizer.encode(d))
        ids.append(tokenizer.eos_token_id)
    tokens = torch.tensor(ids)
    convs = qa_conversations(args.seed)
    qa = [encode_conversation(tokenizer, c) for c in convs]
    held_out = qa_conversations(args.seed, held_out=True)
    print(f"corpus: {len(docs)} documents, {tokens.numel()} tokens; {len(qa)} conversations, "
          f"{sum(len(x) for x, _ in qa)} tokens", flush=True)  # fmt: skip

    torch.manual_seed(args.seed)
    model = build_torch_llama(cfg)
    if args.init:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(args.init / "model.safetensors")))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    gen = torch.Generator().manual_seed(args.seed)

    def prose(n):
        starts = torch.randint(0, tokens.numel() - args.seq_len - 1, (n,), generator=gen)
        window = tokens[starts[:, None] + torch.arange(args.seq_len + 1)[None]]
        return window[:, :-1], window[:, 1:]

    def answers(n):
        """``n`` conversations padded to the longest, loss on their answers only."""
        picks = torch.randint(0, len(qa), (n,), generator=gen).tolist()
        width = max(len(qa[i][0]) for i in picks)
        inputs = torch.full((n, width), tokenizer.eos_token_id)
        targets = torch.full((n, width), -100)
        for row, i in enumerate(picks):
            x, m = torch.tensor(qa[i][0]), torch.tensor(qa[i][1])
            inputs[row, : len(x)] = x
            targets[row, : len(x) - 1] = torch.where(m[1:] == 1, x[1:], -100)
        return inputs[:, :-1], targets[:, :-1]

    def mixed(step):
        """Half answers (whole conversations, up to their end-of-text), half prose windows;
        two batches of their own widths."""
        return [answers(args.batch_size // 2), prose(args.batch_size // 2)]

    if not args.init:
        train(model, lambda step: [prose(args.batch_size)], args.steps, args.lr, "prose")
    if args.qa_steps:
        train(model, mixed, args.qa_steps, args.qa_lr, "answers")
        seen, unseen = (
            on_topic_share(model, tokenizer, convs),
            on_topic_share(model, tokenizer, held_out),
        )
        print(f"on topic (first 8 words): trained questions {seen:.0%}, "
              f"held-out phrasings {unseen:.0%}", flush=True)  # fmt: skip
        for q in ("Tell me about lists", "What is a dictionary?", "Explain for loops."):
            print(f"  {q!r} -> {answer_greedy(model, tokenizer, q)!r}")

    weights = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    save_file(weights, str(args.out / "model.safetensors"), metadata={"format": "mlx"})
    config = dict(cfg, eos_token_id=tokenizer.eos_token_id, torch_dtype="float32")
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with torch.no_grad():
        diff = check_with_mlx(args.out, model, ids[:64])
    print(f"max |logit(torch) - logit(mlx-lm)| = {diff:.2e}")
    if diff > 1e-3:
        raise SystemExit("mlx-lm disagrees with the trained model: the weight layout is wrong")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
