"""Snapshots of a cache that cannot be cut back: where a later prompt may start.

A plain KV cache holding a prompt and its answer serves any prompt that shares a prefix with
them: it is trimmed back to the shared part (mlx-lm's ``trim_prompt_cache``). The caches of
this year's models cannot be: a linear-attention layer (Qwen3.5/3.6, Qwen3-Next, Kimi-Linear:
``ArraysCache``) keeps one state that every token changed, and a sliding window
(``RotatingKVCache``: gpt-oss, Step-3.5, MiMo, Gemma) has overwritten its oldest keys. One
such layer makes the whole model's cache untrimmable.

So, for such a model, the state is kept as it stands at chosen points of each prompt, while
it is prefilled: at the end of the prompt less its last token (the next turn of the
conversation repeats the prompt and adds to it; mlx-lm's server keeps the same one), and at
block boundaries at doubling distances from its start (256, 512, 1024, ... tokens: a prompt
that shares only a system prompt, or part of a long history, with an earlier one restores a
state at least half as long as the shared part). Doubling keeps what one prompt's snapshots
hold to about twice its own cache, where a snapshot every block would hold the square of its
length. mlx-lm's BatchGenerator prefills a prompt given as segments and can hand out a copy
of a sequence's cache at the end of each segment (``insert_segments``, ``extract_cache``): the
points are the segments' ends. Each snapshot goes into the prompt cache under its tokens,
counted in its bytes and dropped like any entry; mlx-lm's ``fetch_nearest_cache`` already
starts from the longest entry that is a prefix of a new prompt.
"""

from __future__ import annotations

from mlx_lm.models.cache import make_prompt_cache

from node.model.stage import always_trimmable

FIRST_SNAPSHOT = 256  # tokens: the first block boundary kept (node.cache.disk.BLOCK_TOKENS)
# the most a prompt keeps in memory (doubling from 256 to 256k tokens, and its end): the
# prompt cache's count of entries grows by as many per answer it keeps (bytes bound them all)
SNAPSHOTS_PER_PROMPT = 12


def trimmable(model) -> bool:
    """Whether this model's cache can always be cut back to any prefix (then no snapshots
    are needed: the answer's cache serves every shorter prompt). Asked of the kinds, not of
    a fresh cache: a sliding window cuts back only while it has not filled. The same on
    every rank (a pipeline stage's skipped slots answer for the layer they stand for)."""
    return cuts_back(make_prompt_cache(model))


def cuts_back(cache: list) -> bool:
    """Whether every slot of a cache list can always be cut back (``trimmable``)."""
    return all(always_trimmable(c) for c in cache)


def snapshot_points(total: int, cached: int, disk: bool = False) -> list[int]:
    """The prompt lengths (token counts) at which a prompt of ``total`` tokens, of which
    ``cached`` come from a cache already, keeps a snapshot: doubling block boundaries, then
    ``total - 1`` (the last token is fed by the first decoding step). ``disk``: also the last
    block boundary before it, which the disk tier keeps (it keeps states at block boundaries
    only: node.cache.disk), so that a restart restores all but the prompt's last block."""
    points = []
    at = FIRST_SNAPSHOT
    while at < total - 1:
        if at > cached:
            points.append(at)
        at *= 2
    last_block = (total - 1) // FIRST_SNAPSHOT * FIRST_SNAPSHOT
    if disk and last_block > cached and last_block not in points and last_block < total - 1:
        points.append(last_block)
    if total - 1 > cached:
        points.append(total - 1)
    return points


def in_memory(length: int, total: int) -> bool:
    """Whether the snapshot at ``length`` tokens of a ``total``-token prompt is kept in
    memory (the end of the prompt, doubling block boundaries) or only on disk."""
    blocks = length // FIRST_SNAPSHOT
    doubling = length % FIRST_SNAPSHOT == 0 and blocks > 0 and blocks & (blocks - 1) == 0
    return length == total - 1 or doubling


def segments(
    tokens: list[int], cached: int, snapshots: bool, disk: bool = False
) -> list[list[int]]:
    """The tokens after ``cached``, cut at the snapshot points (one segment without
    snapshots). The last segment is the last token alone, as mlx-lm's generator would make
    it, so the segment before it ends at the snapshot that serves the next turn."""
    rest = tokens[cached:]
    if not snapshots or len(rest) < 2:
        return [rest]
    cuts = [cached, *snapshot_points(len(tokens), cached, disk), len(tokens)]
    return [tokens[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
