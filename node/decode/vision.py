"""A vision-language model's answer through mlx-vlm: each rank turns the same image bytes
(shared by rank 0 through share_object) into the same prompt tokens, so every rank runs
mlx-vlm's own generation loop in lockstep and samples the same token as a single-process
mlx-vlm run would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from cluster.core.spec import Sampling, SharedRequest
from node.model.vlm import _image


def make_vlm_request(
    processor, config: Any, prompt: str, image: bytes | None, sampling: Sampling
) -> SharedRequest:
    """Rank 0's work order: the templated prompt and the raw image bytes."""
    from mlx_vlm.prompt_utils import apply_chat_template

    if image is not None:
        _image(image)  # fail here, on rank 0, before the other ranks get it
    text = apply_chat_template(processor, config, prompt, num_images=1 if image else 0)
    return SharedRequest(sampling, vlm_prompt=str(text), image=image)


def generate_vlm(
    model, processor, request: SharedRequest, write: Callable[[str], None] | None, group=None
) -> dict[str, Any]:
    """mlx-vlm's stream_generate on every rank, with the same prompt, image and seed."""
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.generate.common import generation_stream

    from node.decode.loop import stream
    from node.decode.sampling import sampler
    from node.decode.text import AnswerText

    s = request.sampling
    mx.random.seed(int(s.seed or 0))  # rank 0 drew it (seeded): never None here
    images = [_image(request.image)] if request.image else None
    responses = stream_generate(
        model,
        processor,
        request.vlm_prompt or "",
        image=images,
        max_tokens=s.max_tokens,
        sampler=sampler(request),  # the text models' own, so every sampling option reaches both
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
    )
    text = AnswerText(s.stop)
    return stream(responses, write, text, group, gen_stream=generation_stream).stats
