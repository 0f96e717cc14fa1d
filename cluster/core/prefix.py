"""A request's prompt as a chain of prefixes, for routing a fleet's requests by cached prefix.

The launcher has no tokenizer (the model's folder may be on the hosts only), so a prompt's
prefixes are named by what the launcher and rank 0 both hold: the request itself. The head
(the template's switches, the tools, the cache scope, the kind of prompt) is hashed first;
each message (or each ``TEXT_BLOCK`` characters of a completion's prompt) extends the chain.
Two requests share a link exactly when they share everything up to it, which is when the
chat template renders the same text up to it, so the hashes stand for the prompt cache's
prefixes: rank 0 reports the links of the prompts its cache holds (``Cached``), the router
asks which group holds the longest link of a new request. Each link carries the characters
up to its end, the router's measure of how much prefill a hit saves.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from cluster.core.spec import ServeRequest, to_dict

TEXT_BLOCK = 1024  # characters of a completion's prompt per link
CHARS_PER_TOKEN = 4  # the router's estimate of a prompt's tokens from its characters
HASH_HEX = 16  # a link's name: 64 bits of blake2b


@dataclass(frozen=True)
class Link:
    name: str  # the hash of everything up to the end of this link
    chars: int  # the characters of the prompt up to its end


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def rendered_chars(message: Any) -> int:
    """The characters of a message that a chat template writes into the prompt: its text,
    its tool calls, a tool's result; not the fields templates drop (``name``,
    ``reasoning_content``) nor the JSON around them. The router counts a prompt's tokens by
    these (and the tools' JSON), so a request's odd fields cannot make it misjudge the next."""
    if not isinstance(message, dict):
        return MESSAGE_CHARS + text_chars(message)
    return MESSAGE_CHARS + sum(text_chars(v) for k, v in message.items() if k not in UNRENDERED)


def text_chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(text_chars(v) for v in value)
    if isinstance(value, dict):
        return sum(text_chars(v) for v in value.values())
    return 0


UNRENDERED = frozenset({"name", "reasoning_content", "reasoning", "role", "tool_call_id"})
MESSAGE_CHARS = 16  # a template's markers around each message ("<|im_start|>user\n", ...)


def prefix_chain(request: ServeRequest) -> list[Link]:
    """The links of ``request``'s prompt, head first (its characters: the tools'). A count
    request (only counted) has the chain of its chat: it reads and leaves nothing in the
    cache, but names the same prompt."""
    kind = "completion" if request.kind == "completion" else "chat"
    head = {"kind": kind, "template": to_dict(request.template), "scope": request.cache_key}
    h = hashlib.blake2b(_canonical(head), digest_size=HASH_HEX // 2)
    tools = request.template.tools
    chars = len(_canonical(tools)) if tools and kind != "completion" else 0
    if kind == "completion":
        text = request.prompt
        parts = [(text[i : i + TEXT_BLOCK].encode(), len(text[i : i + TEXT_BLOCK]))
                 for i in range(0, len(text), TEXT_BLOCK)]  # fmt: skip
    else:
        parts = [(_canonical(m), rendered_chars(m)) for m in request.messages]
    chain = [Link(h.hexdigest(), chars)]
    for part, shown in parts:
        h = h.copy()
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
        chars += shown
        chain.append(Link(h.hexdigest(), chars))
    return chain


def longest_held(chain: list[Link], held: frozenset[str] | set[str]) -> int:
    """The characters of the longest prefix of ``chain`` whose link ``held`` names (0: none)."""
    for link in reversed(chain):
        if link.name in held:
            return link.chars
    return 0
