"""Vision-language models through mlx-vlm.

The language model is pipeline-sharded exactly like a text model (its layers live under
``language_model.model.layers``). The vision tower is small next to it and runs on every rank.
Decoding: node.decode.vision.
"""

from __future__ import annotations

import io
from pathlib import Path


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
