"""The image parts of a chat request, from the content parts to the images the `Submit` carries.

1. `collect_image_parts`: every `{"type": "image_url"}` part, in prompt order, named by its place
   (`messages[0].content[1]`): a 400 for a model without a vision tower, past `max_images_per_request`, or for a
   URL that is neither a data URL nor (with `allow_image_urls`) http(s).
2. `load_images`: the bytes (a base64 data URL decoded; an http(s) URL fetched, `image_fetch`), then decoding and
   the model's image processor in a worker thread (`image_processing`, numpy and Pillow, imported on first use).
   A part that is undecodable, truncated or over a limit is a 400 naming it.
3. The chat template writes one `<|image_pad|>` per image part (`params.template_messages` gives it the parts);
   `place_images` expands each into the image's `num_tokens` placeholders, so `usage.prompt_tokens` counts them,
   and records where they lie (`ImageInput.offset`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from infer_protocol.config import Config
from infer_protocol.messages import ImageInput

from infer_server.errors import ApiError, invalid_request, unsupported
from infer_server.openai_models import ChatMessage
from infer_server.vision_spec import VisionSpec

if TYPE_CHECKING:
    from infer_server.image_processing import PreparedImage

_DATA_PREFIX = "data:"


@dataclass(frozen=True, slots=True)
class ImagePart:
    where: str  # the part's place in the request, e.g. "messages[0].content[1]"
    url: str


def collect_image_parts(messages: Sequence[ChatMessage], vision: VisionSpec | None, config: Config, *,
                        no_vision: str = "") -> list[ImagePart]:
    """`no_vision`: why `vision` is None (the 400's message)."""
    parts: list[ImagePart] = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type != "image_url":
                continue
            where = f"messages[{i}].content[{j}]"
            if vision is None:
                raise unsupported(where, f"this model takes no images ({no_vision}), so image parts are not served")
            if part.image_url is None:
                raise invalid_request(f"Missing required parameter: '{where}.image_url' (an image_url part needs its "
                                      "image_url).", param=where, code="missing_required_parameter")
            url = part.image_url.url
            if not url.startswith(_DATA_PREFIX) and not (config.allow_image_urls and _is_http(url)):
                detail = ("only data: and http(s) URLs are served" if config.allow_image_urls else
                          "only data: URLs (base64) are served; this server does not fetch image URLs")
                raise invalid_request(f"'{where}.image_url.url' is not a servable image URL: {detail}", param=where,
                                      code="invalid_image_url")
            parts.append(ImagePart(where=where, url=url))
    if len(parts) > config.max_images_per_request:
        raise invalid_request(f"the request holds {len(parts)} images; at most {config.max_images_per_request} are "
                              "accepted", param="messages", code="too_many_images")
    return parts


def _is_http(url: str) -> bool:
    return url.lower().startswith(("http://", "https://"))


def _too_large(where: str, detail: str) -> ApiError:
    return invalid_request(f"'{where}' is too large: {detail}", param=where, code="image_too_large")


def _undecodable(where: str, detail: str) -> ApiError:
    return invalid_request(f"'{where}' is not a servable image: {detail}", param=where, code="invalid_image")


def data_url_bytes(part: ImagePart, max_bytes: int) -> bytes:
    """The bytes of a `data:[<media type>][;base64],<data>` URL (base64 only: images are binary). The media type is
    not trusted: the decoder tells the format from the bytes."""
    header, comma, payload = part.url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise _undecodable(part.where, "a data URL image must be base64 (data:image/png;base64,...)")
    if len(payload) // 4 * 3 > max_bytes + 2:  # before decoding: base64 is 4 characters per 3 bytes
        raise _too_large(part.where, f"about {len(payload) // 4 * 3} bytes; at most {max_bytes} are accepted")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise _undecodable(part.where, "its data URL is not valid base64") from None
    if len(data) > max_bytes:
        raise _too_large(part.where, f"{len(data)} bytes; at most {max_bytes} are accepted")
    return data


async def _image_bytes(part: ImagePart, config: Config) -> bytes:
    if part.url.startswith(_DATA_PREFIX):
        return data_url_bytes(part, config.max_image_bytes)
    from infer_server.image_fetch import FetchError, fetch
    try:
        return await fetch(part.url, max_bytes=config.max_image_bytes, timeout=config.image_url_timeout_secs)
    except FetchError as exc:
        raise (_too_large if exc.too_large else _undecodable)(part.where, str(exc)) from None


async def load_images(parts: Sequence[ImagePart], vision: VisionSpec, config: Config) -> list[PreparedImage]:
    """Each part's image as the vision tower reads it (decoding and preprocessing run in a worker thread)."""
    blobs = [await _image_bytes(part, config) for part in parts]
    return await asyncio.to_thread(_prepare_all, parts, blobs, vision, config.max_image_pixels)


def _prepare_all(parts: Sequence[ImagePart], blobs: Sequence[bytes], vision: VisionSpec,
                 max_pixels: int) -> list[PreparedImage]:
    from infer_server.image_processing import ImageError, prepare
    out = []
    for part, data in zip(parts, blobs, strict=True):
        try:
            out.append(prepare(data, vision, max_pixels))
        except ImageError as exc:
            raise (_too_large if exc.too_large else _undecodable)(part.where, str(exc)) from None
    return out


def place_images(prompt_ids: list[int], images: Sequence[PreparedImage],
                 vision: VisionSpec) -> tuple[list[int], list[ImageInput]]:
    """The prompt with each image's placeholder expanded to its `num_tokens`, and the images as the wire carries
    them. The template must have written exactly one placeholder per image: a template that drops images, or
    content that writes the placeholder itself (allow_special_tokens_in_content), is a 400."""
    pad = vision.image_token_id
    found = prompt_ids.count(pad)
    if found != len(images):
        raise invalid_request(f"the chat template placed {found} image placeholders for {len(images)} images "
                              "(content must not hold the image placeholder token)", param="messages")
    if not images:
        return prompt_ids, []
    ids: list[int] = []
    inputs: list[ImageInput] = []
    it = iter(images)
    for token in prompt_ids:
        if token != pad:
            ids.append(token)
            continue
        image = next(it)
        inputs.append(image.wire(len(ids)))
        ids.extend([pad] * image.num_tokens)
    return ids, inputs
