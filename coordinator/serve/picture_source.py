"""A chat's picture as bytes, from its image_url part: a `data:` URL (base64), or with --allow-image-urls an
http(s) URL fetched within a size and a time limit. Whatever is wrong is a 400 saying what."""

from __future__ import annotations

import base64
import binascii
import time
import urllib.error
import urllib.request
from typing import Any

# the most bytes a picture may have, sent or fetched (llama-server takes about as much in a request)
MAX_PICTURE_BYTES = 32 << 20
FETCH_SECONDS = 10.0  # the whole fetch of a remote picture


def picture_bytes(src: Any, message: int, allow_urls: bool) -> bytes:
    """The bytes of the picture at `src` (an image_url part's url) of messages[message]."""
    from swarm.coordinator.serve.api_error import ApiError

    where = f"messages[{message}]: image_url"
    if not isinstance(src, str) or not src:
        raise ApiError(400, f"{where} needs a 'url': a data: URL or an http(s) one", param="messages")
    if src.startswith("data:"):
        head, comma, payload = src.partition(",")
        if not comma or not head.endswith(";base64"):
            raise ApiError(400, f"{where}: a data: URL must be base64 ('data:image/png;base64,...')",
                           param="messages")  # fmt: skip
        if len(payload) > MAX_PICTURE_BYTES * 4 // 3 + 4:
            raise ApiError(
                400, f"{where}: the picture is over {MAX_PICTURE_BYTES >> 20} MiB", param="messages"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"{where}: the data: URL is not valid base64", param="messages") from None
    if not src.startswith(("http://", "https://")):
        raise ApiError(400, f"{where}: only data: and http(s) URLs are read", param="messages")
    if not allow_urls:
        raise ApiError(
            400, f"{where}: this server does not fetch pictures from URLs; send the picture itself as a "
            "data: URL (base64), or start `swarm serve` with --allow-image-urls", param="messages",
        )  # fmt: skip
    return fetch(src, where)


def fetch(url: str, where: str) -> bytes:
    from swarm.coordinator.serve.api_error import ApiError

    deadline = time.monotonic() + FETCH_SECONDS
    data = b""
    try:
        with urllib.request.urlopen(url, timeout=FETCH_SECONDS) as r:  # noqa: S310 (http(s) only, checked)
            while len(data) <= MAX_PICTURE_BYTES:
                if time.monotonic() > deadline:
                    raise ApiError(400, f"{where}: {url} took over {FETCH_SECONDS:.0f} s", param="messages")
                piece = r.read(1 << 16)
                if not piece:
                    break
                data += piece
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ApiError(400, f"{where}: cannot fetch {url}: {e}", param="messages") from None
    if len(data) > MAX_PICTURE_BYTES:
        raise ApiError(400, f"{where}: {url} is over {MAX_PICTURE_BYTES >> 20} MiB", param="messages")
    return data
