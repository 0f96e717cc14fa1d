"""A prompt's prefill: its step (how many tokens a forward pass takes), the job's step
arguments, and the watch after each step (progress, and a cancel every rank agrees on)."""

from __future__ import annotations

from collections.abc import Callable

from mlx_lm.generate import generation_stream

from node.rank.dist import rank0_stopped
from node.rank.watchdog import progress

PREFILL_STEP = 2048  # mlx-lm's prefill_step_size: a GPU wants big steps
PIPELINE_STEP_MIN = 256
STEPS_PER_STAGE = 8


def prefill_step(prompt_tokens: int, stages: int) -> int:
    """Prompt tokens per prefill step when the job does not say (--prefill-step).

    In pipeline mode a stage starts the next step while the stages after it work on the ones
    it sent, so k steps over N stages take (k + N - 1) / (k N) of one rank's time: the step
    halves from 2048 until the prompt makes STEPS_PER_STAGE x N steps, down to 256 tokens
    (measured with tests/bench/prefill_overlap.py: docs/benchmarks.md)."""
    step = PREFILL_STEP
    if stages > 1:
        while step > PIPELINE_STEP_MIN and prompt_tokens < STEPS_PER_STAGE * stages * step:
            step //= 2
    return step


STEP_ARGS: dict = {}  # this rank's job's generate_step arguments: --kv-bits, --prefill-step
STAGES = [1]  # this rank's job's pipeline stages (1 in tensor mode)


def use_step_args(kwargs: dict, stages: int = 1) -> None:
    """The job's --kv-bits and --prefill-step (if given) and its pipeline stages, for every
    generation of this rank (set once, before the first)."""
    STEP_ARGS.clear()
    STEP_ARGS.update(kwargs)
    STAGES[0] = stages


class PrefillCancelled(Exception):
    """Rank 0 cancelled during the prefill, and every rank agreed after the same chunk."""

    def __init__(self, done: int, total: int):
        super().__init__(f"cancelled after {done} of {total} prompt tokens")
        self.done, self.total = done, total


def prefill_watch(
    group=None,
    cancelled: Callable[[], bool] | None = None,
    cancellable: bool = False,
    on_prefill: Callable[[int, int], None] | None = None,
) -> Callable[[int, int], None]:
    """mlx-lm's prompt_progress_callback, called after every prefill chunk on every rank alike:
    the rank's progress ticks (a long prefill is not a stall), rank 0 reports it
    (``on_prefill``), and when the answer is ``cancellable`` every rank learns after each chunk
    whether rank 0 was cancelled (Ctrl-C in chat), so a prefill stops within one chunk."""
    distributed = group is not None and group.size() > 1

    def callback(done: int, total: int) -> None:
        progress.tick()
        if on_prefill is not None:
            on_prefill(done, total)
        if cancellable and 0 < done < total:
            stop = cancelled is not None and cancelled()
            if rank0_stopped(stop, group, generation_stream) if distributed else stop:
                raise PrefillCancelled(done, total)

    return callback
