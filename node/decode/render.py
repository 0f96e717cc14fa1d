"""The prompt of a request: messages through the model's chat template (as mlx_lm.generate
renders them), and the request every rank decodes (its seed drawn, its grammar)."""

from __future__ import annotations

from cluster.core.spec import JobRequest, SharedRequest, Template
from node.decode.sampling import seeded

TEMPLATE_SWITCHES = ("tools", "enable_thinking", "reasoning_effort")


def render(tokenizer, messages: list[dict[str, str]], template: Template) -> list[int]:
    """Messages to prompt tokens as mlx_lm.generate does: the chat template when the tokenizer
    has one (with the request's system prompt, tools and reasoning switches), plain text
    otherwise."""
    system = template.system
    if tokenizer.has_chat_template:
        if system:
            messages = [{"role": "system", "content": system}, *messages]
        args = {
            key: getattr(template, key)
            for key in TEMPLATE_SWITCHES
            if getattr(template, key) is not None
        }
        try:
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **args
            )
        except Exception:
            folded = fold_system(messages)
            if folded == messages:
                raise
            text = tokenizer.apply_chat_template(  # a template that takes one system message
                folded, tokenize=False, add_generation_prompt=True, **args
            )
        return tokenizer.encode(text, add_special_tokens=False)
    parts = ([system] if system else []) + [m["content"] for m in messages]
    return tokenizer.encode("\n".join(parts))


def fold_system(messages: list[dict]) -> list[dict]:
    """Every system message joined, in order, into one at the start (for a template that
    takes a system message only there: Claude Code sends one after the first user turn,
    Codex several)."""
    systems = [m for m in messages if m.get("role") == "system"]
    if len(systems) <= 1 and (not systems or messages[0] is systems[0]):
        return messages
    text = "\n\n".join(str(m.get("content") or "") for m in systems)
    return [{"role": "system", "content": text}, *(m for m in messages if m["role"] != "system")]


def make_request(tokenizer, r: JobRequest) -> SharedRequest:
    """Rank 0's work order, as every rank gets it."""
    tokens = render(tokenizer, [{"role": "user", "content": r.prompt}], r.template)
    if not tokens:
        raise ValueError("the prompt is empty after tokenization")
    return shared_request(tokenizer, r, tokens)


def shared_request(tokenizer, r: JobRequest, tokens: list[int]) -> SharedRequest:
    """``tokens`` with the job's settings (launch's request, chat's every turn): the seed
    drawn, the grammar of --json-schema or --regex."""
    grammar = None
    if r.constraint is not None:
        from node.decode.grammar import shared_grammar

        grammar = shared_grammar(tokenizer, r.constraint, r.template.tools, tokens)
    return SharedRequest(seeded(r.sampling), tokens, grammar)
