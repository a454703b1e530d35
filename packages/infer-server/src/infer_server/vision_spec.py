"""What the server needs to know of a model's vision side: whether it has one, its image placeholder token, and its
image processor's settings (`preprocessor_config.json`), read once with the other model assets.

A model has a vision tower when its `config.json` declares a `vision_config` (Qwen3.5, Qwen2/3-VL). Its image
processor is the Qwen2-VL one (`Qwen2VLImageProcessor`): its defaults apply to the fields the file leaves out, and
the vision config's patch sizes to a model directory without the file. Plain data, no numpy: the server imports
numpy and Pillow only when a request carries an image (`infer_server.images`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infer_server.tokenizer import Tokenizer

log = logging.getLogger(__name__)

IMAGE_PAD = "<|image_pad|>"  # the placeholder the Qwen chat templates write once per image
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # OPENAICLIP_MEAN / _STD: Qwen2VLImageProcessor's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC


@dataclass(frozen=True, slots=True)
class VisionSpec:
    image_token_id: int  # the placeholder token: the template writes one per image, the server expands it
    patch_size: int
    temporal_patch_size: int
    merge_size: int  # merge_size x merge_size patches become one placeholder token (one embedding)
    min_pixels: int  # the resized image's area bounds (size.shortest_edge / longest_edge in the file)
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float = 1 / 255
    resample: int = _BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one placeholder token covers factor x factor pixels."""
        return self.patch_size * self.merge_size


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _first_int(*values: Any) -> int | None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def read_vision_spec(model_dir: str | Path, tokenizer: Tokenizer) -> VisionSpec | None:
    """The model's vision spec, or None when its config.json declares no vision_config (a text-only model)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    vision = config.get("vision_config")
    if not isinstance(vision, dict):
        return None
    image_token_id = _first_int(config.get("image_token_id"), config.get("image_token_index"),
                                tokenizer.token_to_id(IMAGE_PAD))
    if image_token_id is None:
        log.warning("%s declares a vision_config but no image token (image_token_id, or %s in the tokenizer): "
                    "images are not served", model_dir, IMAGE_PAD)
        return None
    pre = _read_json(model_dir / "preprocessor_config.json")
    if not pre:
        log.warning("%s has no preprocessor_config.json: images are preprocessed with Qwen2VLImageProcessor's "
                    "defaults and the vision config's patch sizes", model_dir)
    size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
    patch = _first_int(pre.get("patch_size"), vision.get("patch_size")) or 14
    return VisionSpec(
        image_token_id=image_token_id,
        patch_size=patch,
        temporal_patch_size=_first_int(pre.get("temporal_patch_size"), vision.get("temporal_patch_size")) or 2,
        merge_size=_first_int(pre.get("merge_size"), vision.get("spatial_merge_size")) or 2,
        # as Qwen2VLImageProcessor.__init__: min_pixels / max_pixels override size's edges
        min_pixels=_first_int(pre.get("min_pixels"), size.get("shortest_edge")) or 56 * 56,
        max_pixels=_first_int(pre.get("max_pixels"), size.get("longest_edge")) or 28 * 28 * 1280,
        image_mean=tuple(float(v) for v in pre.get("image_mean", CLIP_MEAN)),
        image_std=tuple(float(v) for v in pre.get("image_std", CLIP_STD)),
        rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
        resample=int(pre.get("resample", _BICUBIC)),
        do_resize=bool(pre.get("do_resize", True)),
        do_rescale=bool(pre.get("do_rescale", True)),
        do_normalize=bool(pre.get("do_normalize", True)),
    )
