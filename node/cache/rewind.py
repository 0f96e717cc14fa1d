"""Speculative decoding on caches that cannot be cut back: the state before each pass, put back.

mlx-lm's speculative step verifies K drafted tokens in one pass of the model, then trims every
cache by the tokens it rejected (``trim_prompt_cache``), and refuses a cache that cannot be
trimmed. A linear attention's state (Qwen3.5/3.6, Qwen3-Next) and a sliding window that has
filled (gpt-oss, Gemma) cannot be: they hold no per-token history to cut.

So such a model's calls are remembered: before each pass, what every local layer's cache
holds (a plain KV cache's length; a window's keys and values, copied, as it writes them in
place; a linear attention's arrays, which each pass replaces rather than changes). Trimming
``n`` tokens puts back the state from before the pass those tokens came in, and the pass's
tokens that were kept are fed again at the front of the next pass (the next verify pass, whose
last positions' logits are the ones the step reads): the text is the plain decoding's, and
the cost is those tokens once more in a pass that runs anyway. The caches keep their classes
(the model's own code checks them) as subclasses that say they can be trimmed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache, make_prompt_cache

from node.cache.snapshots import cuts_back
from node.model.stage import SkippedCache, always_trimmable

KINDS = (RotatingKVCache, ArraysCache)  # what a Rewinder can put back
_subclasses: dict[type, type] = {}


def rewindable(cache: list) -> str | None:
    """Why these caches cannot be rewound (None: they can, or need not be)."""
    for c in cache:  # (another stage's slot holds nothing to put back)
        if not always_trimmable(c) and not isinstance(c, (*KINDS, SkippedCache)):
            return (f"speculative decoding cannot roll back a {type(c).__name__} (it keeps no "
                    "per-token history, and its state cannot be put back)")  # fmt: skip
    return None


class Rewinder:
    """The calls of one model on one cache list since the last rewind (at most ``keep``)."""

    def __init__(self, cache: list, keep: int = 64):
        self.cache = cache
        self.history: deque[tuple[list, mx.array]] = deque(maxlen=keep)
        self.pending: mx.array | None = None  # kept tokens of a rewound pass, to feed again
        self.trimming = False

    def before(self, inputs: mx.array) -> mx.array:
        """A pass is about to run on ``inputs``: its inputs, with the tokens to feed again at
        the front; what the caches hold now is remembered."""
        if self.pending is not None:
            inputs = mx.concatenate([self.pending, inputs], axis=1)
            self.pending = None
        self.history.append(([_save(c) for c in self.cache], inputs))
        return inputs

    def trim(self, n: int) -> int:
        """Put back the state before the passes that fed the last ``n`` tokens."""
        left = n
        while left > 0 and self.history:
            saved, inputs = self.history.pop()
            for c, s in zip(self.cache, saved, strict=True):
                _put_back(c, s)
            fed = inputs.shape[1]
            if fed > left:
                self.pending = inputs[:, : fed - left]
                left = 0
            else:
                left -= fed
        return n - left


def _save(c: Any) -> Any:
    if isinstance(c, SkippedCache):
        return None
    if isinstance(c, RotatingKVCache):  # written in place: copied
        return tuple(mx.array(x) if isinstance(x, mx.array) else x for x in c.state)
    if isinstance(c, ArraysCache):  # each pass puts new arrays in its list
        cache, left_padding, lengths = c.state
        return (list(cache), left_padding, lengths)
    return c.offset  # a cache that trims (KVCache, QuantizedKVCache)


def _put_back(c: Any, saved: Any) -> None:
    if saved is None:
        return
    if isinstance(c, KINDS):
        c.state = saved
    else:  # its own trim, not the Rewinder's
        c.__class__.__mro__[1].trim(c, c.offset - saved)


def _trimmable_class(cls: type) -> type:
    """``cls``, saying it can be trimmed, trimming through its Rewinder."""
    if cls not in _subclasses:

        def is_trimmable(self) -> bool:
            return True

        def trim(self, n: int) -> int:
            rewinder = self._rewinder
            if rewinder.trimming:  # the first layer's trim rewound them all
                return n
            rewinder.trimming = True
            return rewinder.trim(n)

        _subclasses[cls] = type(cls.__name__, (cls,), {"is_trimmable": is_trimmable, "trim": trim})
    return _subclasses[cls]


def speculating(model, proposer, cache: list, stream) -> Iterator[Any]:
    """mlx-lm's speculative ``stream(model, proposer)`` over ``cache`` (the model's layers,
    then the proposer's), each side rewound by a Rewinder where its caches cannot be
    trimmed; at the end, the tokens a last rewind left are fed, so the cache holds what
    decoding kept (chat keeps it for the next turn)."""
    slots = len(make_prompt_cache(model))  # gemma4: none for the layers that share KV
    mine, theirs = cache[:slots], cache[slots:]
    if slots != len(model.layers):  # mlx-lm splits the list at len(model.layers)
        model = Slots(model, slots)
    for part in (mine, theirs):
        if (why := rewindable(part)) is not None:
            raise ValueError(why)
    with ExitStack() as stack:
        if not cuts_back(mine):
            model = stack.enter_context(rewinding(model, mine))
        if theirs and not cuts_back(theirs):
            proposer = stack.enter_context(rewinding(proposer, theirs))
        yield from stream(model, proposer)
        for m in (model, proposer):
            if isinstance(m, Rewinding):
                m.flush()


@contextmanager
def rewinding(model, cache: list, keep: int = 64) -> Iterator[Any]:
    """``model`` whose passes over ``cache`` can be rewound while the block runs (the caches
    are their own classes again after it); yields the model to call."""
    rewinder = Rewinder(cache, keep)
    changed = []
    for c in cache:
        if isinstance(c, SkippedCache):
            continue
        changed.append((c, type(c)))
        c._rewinder = rewinder
        c.__class__ = _trimmable_class(type(c))
    try:
        yield Rewinding(model, rewinder)
    finally:
        for c, cls in changed:
            c.__class__ = cls
            del c._rewinder


class Rewinding:
    """The model, each pass remembered by its Rewinder (and a rewound pass's kept tokens fed
    again at the front of the next)."""

    def __init__(self, model, rewinder: Rewinder):
        self.model = model
        self.rewinder = rewinder

    def __call__(self, inputs: mx.array, *args, **kwargs) -> mx.array:
        self.rewinder.trimming = False
        return self.model(self.rewinder.before(inputs), *args, **kwargs)

    def flush(self) -> None:
        """Feed what a last rewind left to feed (the cache then holds every kept token)."""
        if self.rewinder.pending is not None:
            self(self.rewinder.pending[:, :0], cache=self.rewinder.cache)
            mx.eval([c.state for c in self.rewinder.cache if not isinstance(c, SkippedCache)])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class Slots:
    """The model, saying it has as many layers as its cache has slots: mlx-lm's speculative
    step cuts the cache list (the model's, then the draft's) at ``len(model.layers)``."""

    def __init__(self, model, slots: int):
        self.model = model
        self.layers = model.layers[:slots]

    def __call__(self, *args, **kwargs) -> mx.array:
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)
