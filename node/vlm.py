"""Vision-language models through mlx-vlm.

The language model is pipeline-sharded exactly like a text model (its layers live under
``language_model.model.layers``). The vision tower is small next to it and runs on every rank:
each rank turns the same image bytes (shared by rank 0 through share_object) into the same
prompt tokens, so every rank runs mlx-vlm's own generation loop in lockstep and samples the
same token as a single-process mlx-vlm run would.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from cluster.core.spec import Sampling, SharedRequest


def load_vlm(view: Path, model_dir: Path):
    """The lazily loaded mlx-vlm model (from the weight files in ``view``) and its processor."""
    from mlx_vlm.utils import load_image_processor, load_model, load_processor

    model = load_model(view, lazy=True, strict=False)
    # as mlx_vlm.utils.load does (after the model import has registered its processor class)
    eos = getattr(model.config, "eos_token_id", None)
    processor = load_processor(model_dir, True, eos_token_ids=eos)
    image_processor = load_image_processor(model_dir)
    if image_processor is not None:
        processor.image_processor = image_processor
    return model, processor


def make_vlm_request(
    processor, config: Any, prompt: str, image: bytes | None, sampling: Sampling
) -> SharedRequest:
    """Rank 0's work order: the templated prompt and the raw image bytes."""
    from mlx_vlm.prompt_utils import apply_chat_template

    if image is not None:
        _image(image)  # fail here, on rank 0, before the other ranks get it
    text = apply_chat_template(processor, config, prompt, num_images=1 if image else 0)
    return SharedRequest(sampling, vlm_prompt=text, image=image)


def _image(data: bytes):
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except (UnidentifiedImageError, OSError) as e:
        raise ValueError(
            f"--image: not an image file PIL can read ({type(e).__name__}); "
            "give a PNG, JPEG or another common format"
        ) from None
    return img


def generate_vlm(
    model, processor, request: SharedRequest, write: Callable[[str], None] | None, group=None
) -> dict[str, Any]:
    """mlx-vlm's stream_generate on every rank, with the same prompt, image and seed."""
    from mlx_vlm.generate import stream_generate
    from mlx_vlm.generate.common import generation_stream

    from .generate import AnswerText, stream
    from .sampling import sampler

    s = request.sampling
    mx.random.seed(s.seed)
    images = [_image(request.image)] if request.image else None
    responses = stream_generate(
        model,
        processor,
        request.vlm_prompt,
        image=images,
        max_tokens=s.max_tokens,
        sampler=sampler(request),  # the text models' own, so every sampling option reaches both
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
    )
    text = AnswerText(s.stop)
    return stream(responses, write, text, group, gen_stream=generation_stream).stats
