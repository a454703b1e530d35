"""Images to what the vision tower reads: decoding with Pillow, and the Qwen2-VL image processor in numpy.

`preprocess` equals transformers' `Qwen2VLImageProcessorPil` (the processor Qwen3.5 and Qwen2/3-VL use) on the same
settings: RGB (transparency composited onto white), a bicubic resize by Pillow to `smart_resize`'s size (sides
multiples of patch_size * merge_size, area within [min_pixels, max_pixels], aspect ratio kept), rescale to [0, 1]
and normalize in float32, then the flattened patches `[t*h*w, C*T*P*P]` in spatial-merge-block order, the single
frame repeated over the temporal patch. The rescale and normalize are a per-channel table of the 256 byte values
(`value_table`): the patches stay uint8 here and on the wire, and the worker looks up their float32 values on its
device (`infer_worker.application.patch_values`). `tests/server/test_images.py` checks the looked-up patches
against transformers.

Imported only when a request carries an image: the server starts without numpy and Pillow loaded.
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from infer_protocol.messages import ImageInput
from infer_server.vision_spec import VisionSpec

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_ASPECT_RATIO = 200  # smart_resize refuses more (as transformers does)


class ImageError(ValueError):
    """The bytes are not a servable image; `too_large` tells an over-limit image from an undecodable one."""

    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


@dataclass(frozen=True, slots=True)
class PreparedImage:
    patches: np.ndarray  # [grid_t * grid_h * grid_w, C * T * P * P] uint8, C order
    value_table: np.ndarray  # [C, 256] float32: the value of byte b in channel c
    grid_thw: tuple[int, int, int]
    num_tokens: int  # placeholder tokens: grid_t * grid_h * grid_w / merge_size**2
    content_hash: str

    def wire(self, offset: int) -> ImageInput:
        """The image as `Submit` carries it, its placeholders from `offset` in the prompt."""
        return ImageInput(offset=offset, num_tokens=self.num_tokens, grid_thw=self.grid_thw,
                          patches=self.patches.tobytes(),
                          shape=(int(self.patches.shape[0]), int(self.patches.shape[1])),
                          value_table=self.value_table.tobytes(), content_hash=self.content_hash)


def decode(data: bytes, max_pixels: int) -> Image.Image:
    """The image in `data` (PNG, JPEG or WebP; the first frame of an animation), decoded to RGB. The size is checked
    from the header before the pixels are decoded, so a small file cannot expand into a huge bitmap."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(f"the image is {width}x{height} = {width * height} pixels; at most {max_pixels} are "
                             "accepted", too_large=True)
        image.load()  # a truncated or corrupt file fails here (LOAD_TRUNCATED_IMAGES stays off)
        rgb = to_rgb(image)
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise ImageError(str(exc), too_large=True) from None
    except Exception as exc:  # noqa: BLE001 - Pillow's plugins fail on hostile bytes with many exception types
        raise ImageError(f"not a decodable PNG, JPEG or WebP image ({type(exc).__name__}: {exc})") from None
    if width < 1 or height < 1:
        raise ImageError("the image has no pixels")
    return rgb


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The size the image is resized to: sides multiples of `factor`, area within [min_pixels, max_pixels], the
    aspect ratio as close as the rounding allows (transformers' qwen2_vl smart_resize)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"the image's aspect ratio {max(height, width) / min(height, width):.1f} exceeds "
                         f"{MAX_ASPECT_RATIO}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized(image: Image.Image, spec: VisionSpec) -> np.ndarray:
    """The RGB image at its `smart_resize` size, channels first `[3, H, W]` uint8."""
    if spec.do_resize:
        height, width = smart_resize(image.height, image.width, spec.factor, spec.min_pixels, spec.max_pixels)
        image = image.resize((width, height), resample=Image.Resampling(spec.resample))
    return np.ascontiguousarray(np.moveaxis(np.asarray(image), -1, 0))


@functools.lru_cache(maxsize=8)
def value_table(spec: VisionSpec) -> np.ndarray:
    """`[3, 256]` float32: what each byte value of each channel becomes, computed as transformers computes it per
    pixel (rescale in float64 then float32, normalize in float32), so a look-up gives the same bits, faster."""
    values = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256))
    if spec.do_rescale:
        table = (values.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    else:
        table = values.astype(np.float32)
    if spec.do_normalize:
        table = (table - np.asarray(spec.image_mean, dtype=np.float32)[:, None]) / np.asarray(
            spec.image_std, dtype=np.float32)[:, None]
    return table


def patchify(pixels: np.ndarray, spec: VisionSpec) -> tuple[np.ndarray, tuple[int, int, int]]:
    """`[C, H, W]` -> the flattened patches `[h*w, C*T*P*P]` (ordered by merge block, then within it; each row
    channel major, then temporal, row, column) and the grid."""
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    channels, height, width = pixels.shape
    if height % (p * m) or width % (p * m):
        raise ImageError(f"the image's size {width}x{height} is not a multiple of {p * m} (do_resize is off)")
    gh, gw = height // p, width // p
    blocks = pixels.reshape(channels, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    frames = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], t, p, p))  # one frame, T copies
    return np.ascontiguousarray(frames.reshape(gh * gw, channels * t * p * p)), (1, gh, gw)


def content_hash(pixels: np.ndarray, spec: VisionSpec) -> str:
    """What the prefix cache keys an image on: the resized pixels and the settings that turn them into patches
    (4x fewer bytes than the patches, which repeat each frame over the temporal patch)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{spec!r}|{pixels.shape}|".encode())
    h.update(memoryview(pixels).cast("B"))
    return h.hexdigest()


def preprocess(image: Image.Image, spec: VisionSpec) -> PreparedImage:
    """An RGB image -> its uint8 patches with their value table, grid, placeholder count and content hash."""
    pixels = resized(image, spec)
    patches, grid = patchify(pixels, spec)
    tokens = grid[0] * grid[1] * grid[2] // spec.merge_size**2
    return PreparedImage(patches=patches, value_table=value_table(spec), grid_thw=grid, num_tokens=tokens,
                         content_hash=content_hash(pixels, spec))


def prepare(data: bytes, spec: VisionSpec, max_pixels: int) -> PreparedImage:
    """Encoded image bytes -> the tower's input (blocking: the server runs it in a thread)."""
    return preprocess(decode(data, max_pixels), spec)
