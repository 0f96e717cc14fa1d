"""Speculative decoding on a sharded model: who proposes the next tokens.

mlx-lm's speculative step drafts K tokens, then the main model verifies K+1 in one pass and
keeps the longest agreeing prefix plus its own next token; every cache is trimmed by what was
rejected. On a rig the main model's pass is the expensive part (one round trip per pipeline
stage, two all_sums per layer in tensor mode), so K accepted tokens cost one pass, not K.

Every rank proposes the same tokens without talking: the draft model is loaded whole on every
rank (its input, the tokens so far, is the same everywhere, and so is the random state), or
the proposals come from prompt look-up, a deterministic function of those tokens. The text is
the main model's: a proposal is kept only where the main model's own choice agrees with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from cluster.core.modelcheck import ModelError
from cluster.core.spec import Draft
from node.rank.numbers import host_ints

NO_MATCH = -1


class TokenHistory:
    """The look-up "cache": the tokens seen so far, trimmed like a KV cache on a rejection.

    With ``ngram`` it also indexes every n-gram (n up to ``ngram``) that has a token after it:
    the n-gram -> where it last started. A look-up is then a dict access, not a scan of a long
    prompt on every drafted token. A trim leaves the index as it is; an entry that points past
    the end, or at tokens that changed, is caught when it is read."""

    def __init__(self, ngram: int = 0):
        self.tokens: list[int] = []
        self.ngram = ngram
        self.starts: dict[tuple[int, ...], int] = {}

    @property
    def state(self):
        return []

    @property
    def offset(self) -> int:
        return len(self.tokens)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        if n:
            del self.tokens[-n:]
        return n

    def empty(self) -> bool:
        return not self.tokens

    def extend(self, new: list[int]) -> None:
        tokens = self.tokens
        for token in new:
            tokens.append(token)
            end = len(tokens) - 1  # the n-grams that end just before this token
            for n in range(1, min(self.ngram, end) + 1):
                self.starts[tuple(tokens[end - n : end])] = end - n

    def follower(self, n: int) -> int | None:
        """The token after the latest earlier occurrence of the last ``n`` tokens, if any."""
        tokens = self.tokens
        tail = tuple(tokens[-n:])
        start = self.starts.get(tail)
        if start is None:  # entries are never removed: it never occurred
            return None
        if start + n < len(tokens) and tuple(tokens[start : start + n]) == tail:
            return tokens[start + n]
        for start in range(len(tokens) - n - 1, -1, -1):  # a stale entry (a trim): scan
            if tuple(tokens[start : start + n]) == tail:
                return tokens[start + n]
        return None


class PromptLookup:
    """A draft "model" that proposes the token that followed the latest earlier occurrence of
    the last ``n`` tokens (n from ``ngram`` down to 1) in the prompt and the answer so far:
    strong where an answer quotes its context (code, agents, summaries). Its logits put all
    the weight on that token, so any sampler picks it."""

    def __init__(self, ngram: int, vocab_size: int):
        self.ngram = ngram
        self.vocab_size = vocab_size

    def make_cache(self) -> list[TokenHistory]:
        return [TokenHistory(self.ngram)]

    def __call__(self, inputs: mx.array, cache: list[TokenHistory]) -> mx.array:
        history = cache[0]
        history.extend(host_ints(inputs.reshape(-1)))
        guess = self.propose(history)
        logits = mx.full((1, 1, self.vocab_size), -1e9, dtype=mx.float32)
        logits[0, 0, guess] = 0.0
        return logits

    def propose(self, history: TokenHistory) -> int:
        for n in range(min(self.ngram, len(history.tokens) - 1), 0, -1):
            found = history.follower(n)
            if found is not None:
                return found
        return history.tokens[-1]  # nothing to go on: a repeat is as good a guess as any


def vocab_size(model) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:  # a config that nests the language model's (qwen3_5: text_config)
        text = getattr(args, "text_config", None)
        size = text.get("vocab_size") if isinstance(text, dict) else None
    if size is None:
        raise ModelError("prompt look-up needs the model's vocab_size in its config")
    return size


@dataclass
class Speculation:
    proposer: Any  # a draft model, or PromptLookup: called like a model, with its own cache
    k: int  # tokens it proposes per verifying pass


class SharedDraft:
    """``--draft-on rank0``: the draft model runs on rank 0 only; each of its calls ends with
    an all_sum of its last logits (rank 0 gives them, the others zeros), so every rank samples
    the same proposal from the same logits. The other ranks keep only a count of the tokens."""

    def __init__(self, model, group, vocab_size: int):
        self.model = model  # rank 0's draft; None elsewhere
        self.group = group
        self.vocab_size = vocab_size

    def make_cache(self) -> list:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model) if self.model is not None else [TokenHistory()]

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        if self.model is None:
            cache[0].extend(inputs.reshape(-1).tolist())
            mine = mx.zeros((1, 1, self.vocab_size), dtype=mx.float32)
        else:
            mine = self.model(inputs, cache=cache)[:, -1:, : self.vocab_size].astype(mx.float32)
            if mine.shape[-1] < self.vocab_size:  # a draft with a smaller head: pad it
                pad = mx.full((1, 1, self.vocab_size - mine.shape[-1]), -1e9, mx.float32)
                mine = mx.concatenate([mine, pad], axis=-1)
        return mx.distributed.all_sum(mine, group=self.group)


def load_draft(draft: Draft, loaded, group) -> Speculation:
    """The proposer every rank builds alike (``--draft-on rank0``: rank 0's draft, shared)."""
    if loaded.processor is not None:
        raise ModelError("speculative decoding is for text models; drop --draft-model and "
                         "--prompt-lookup for a vision-language model")  # fmt: skip
    if draft.prompt_lookup:
        return Speculation(PromptLookup(draft.prompt_lookup, vocab_size(loaded.model)),
                           draft.num_draft_tokens)  # fmt: skip
    from mlx_lm.utils import load_model, load_tokenizer

    from node.model.load import resolve_model

    shared = draft.draft_on == "rank0" and group.size() > 1
    if shared and group.rank() != 0:
        return Speculation(
            SharedDraft(None, group, vocab_size(loaded.model)), draft.num_draft_tokens
        )
    if draft.draft_model is None:
        raise ModelError("speculative decoding needs --draft-model or a prompt-lookup proposer")
    path = resolve_model(draft.draft_model)
    if not (path / "config.json").exists():
        raise ModelError(
            f"draft model {draft.draft_model}: no checkpoint there on this host; the draft must "
            "be at the same path on every host (mlx-cluster sync copies --model only: sync the "
            "draft with --model too), or name a Hugging Face repo"
        )
    draft_model, _ = load_model(path)
    draft_tokenizer = load_tokenizer(path)
    if draft_tokenizer.get_vocab() != loaded.tokenizer.get_vocab():
        raise ModelError(
            f"draft model {draft.draft_model}: its tokenizer is not the model's; a draft must "
            "share the main model's tokenizer (the same family, a smaller size)"
        )
    mx.eval(draft_model.parameters())
    if shared:
        return Speculation(
            SharedDraft(draft_model, group, vocab_size(loaded.model)), draft.num_draft_tokens
        )
    return Speculation(draft_model, draft.num_draft_tokens)
