"""Fetching an http(s) image URL, only where `allow_image_urls` is on: one GET with a deadline over the whole fetch
(connection to last byte) and a byte limit checked while the body streams in, so a slow or endless body costs at
most `image_url_timeout_secs` and `max_image_bytes`."""

from __future__ import annotations

import asyncio

import httpx

MAX_REDIRECTS = 3


class FetchError(ValueError):
    def __init__(self, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.too_large = too_large


async def fetch(url: str, *, max_bytes: int, timeout: float) -> bytes:
    try:
        async with asyncio.timeout(timeout):
            return await _get(url, max_bytes, timeout)
    except TimeoutError:
        raise FetchError(f"fetching the image took longer than {timeout:g} s") from None
    except httpx.HTTPError as exc:
        raise FetchError(f"fetching the image failed: {type(exc).__name__}: {exc}") from None


async def _get(url: str, max_bytes: int, timeout: float) -> bytes:
    async with httpx.AsyncClient(follow_redirects=True, max_redirects=MAX_REDIRECTS, timeout=timeout) as client:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise FetchError(f"fetching the image answered HTTP {response.status_code}")
            declared = response.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise FetchError(f"the image is {declared} bytes; at most {max_bytes} are accepted", too_large=True)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise FetchError(f"the image exceeds {max_bytes} bytes", too_large=True)
            return bytes(body)
