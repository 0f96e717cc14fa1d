"""Train the embedded default model: a tiny Llama on the topic help that ships with Python.

The result lives in ``node/default_model`` so ``mlx-cluster launch`` works offline with no model
named. Retrain with ``pip install -e '.[train]' && python -m node.train_default``. Training runs in
PyTorch because MLX's CPU matmul is about ten times slower than PyTorch's on a Linux box; the
weights are written in mlx-lm's llama layout, and the script checks that mlx-lm computes the
same logits from them before it saves anything.
"""

import argparse
import json
import math
import time
from pathlib import Path

DEFAULT_DIR = Path(__file__).parent / "default_model"
DRAFT_DIR = Path(__file__).parent / "default_draft"
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


def corpus() -> list[str]:
    """The topic help of pydoc: about 460 kB of English prose about Python."""
    from pydoc_data.topics import topics

    return [topics[k].strip() for k in sorted(topics)]


def train_tokenizer(docs: list[str], vocab_size: int, out: Path):
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
    fast.save_pretrained(out)
    return fast


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


def main():
    import numpy as np
    import torch
    from safetensors.numpy import save_file

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=None, help="default: node/default_model "
                   "(node/default_draft with --draft)")  # fmt: skip
    p.add_argument("--draft", action="store_true", help="train the default model's draft, "
                   "with the default model's tokenizer")  # fmt: skip
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    cfg = DRAFT_CONFIG if args.draft else CONFIG
    args.out = args.out or (DRAFT_DIR if args.draft else DEFAULT_DIR)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = corpus()
    if args.draft:  # the draft must share the model's tokenizer, token for token
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(DEFAULT_DIR)
        tokenizer.save_pretrained(args.out)
    else:
        tokenizer = train_tokenizer(docs, CONFIG["vocab_size"], args.out)
    ids = []
    for d in docs:
        ids.extend(tokenizer.encode(d))
        ids.append(tokenizer.eos_token_id)
    tokens = torch.tensor(ids)
    print(f"corpus: {len(docs)} documents, {tokens.numel()} tokens", flush=True)

    torch.manual_seed(args.seed)
    model = build_torch_llama(cfg)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, args.steps // 20)

    def lr_at(step):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(args.seed)
    tic = time.time()
    for step in range(args.steps):
        starts = torch.randint(
            0, tokens.numel() - args.seq_len - 1, (args.batch_size,), generator=gen
        )
        window = tokens[starts[:, None] + torch.arange(args.seq_len + 1)[None]]
        logits = model(window[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            rate = (step + 1) / (time.time() - tic)
            print(f"step {step:5d}  loss {loss.item():.3f}  {rate:.2f} steps/s", flush=True)

    model.eval()
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
