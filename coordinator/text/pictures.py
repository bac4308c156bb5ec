"""Prompts holding pictures (Qwen3.5 / Qwen3.6 with an mmproj): the vision tower opened beside the text model,
a prompt's picture places expanded to their rows, and what the model reads for them (models.base.PictureRows).

As llama.cpp's mtmd does, a picture's place in a prompt's text is the marker `<__media__>` (a chat's image
content part becomes one before the chat template runs); each marker becomes `<|vision_start|>`, one
`<|image_pad|>` per row the vision tower makes of the picture, `<|vision_end|>`, and the text between markers
is tokenized piece by piece. The model reads the picture's rows in place of the `<|image_pad|>` embeddings at
M-RoPE positions (coordinator.vision.positions).

    vision = open_vision(meta, "mmproj.gguf", numerics)
    prompt = picture_prompt(tokenizer, vision, "<__media__>What is this?", [png_bytes])
    generate(model, prompt.tokens, params, pictures=prompt.pictures)
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from swarm.coordinator.models.base import PictureRows
from swarm.coordinator.text.tokenizer import GGUFTokenizer
from swarm.proto.numerics import Numerics
from swarm.sharding.errors import UserError

log = logging.getLogger(__name__)

MARKER = "<__media__>"  # a picture's place in a prompt's text (mtmd's default marker)
START, PAD, END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
PICTURE_ARCHS = ("qwen35moe",)  # text models whose attention reads (t, h, w) positions
CACHED_PICTURES = 16  # encoded pictures kept, by pixel hash: a conversation sent again reuses them


@dataclass(frozen=True)
class PicturePrompt:
    """A prompt's tokens (each picture as <|vision_start|>, its <|image_pad|> rows, <|vision_end|>), what the
    model reads for its pictures (None: no picture), and `keys`: the tokens with each picture's rows replaced
    by numbers from a hash of its pixels (negative: never a token id), so that a prompt held by a serve slot
    matches a later one only where the pictures are the same."""

    tokens: list[int]
    pictures: PictureRows | None
    keys: list[int]

    @property
    def picture_rows(self) -> int:
        """How many of the tokens are pictures' rows."""
        return int(self.pictures.at.numel()) if self.pictures is not None else 0


def find_mmproj(model: str | Path) -> Path | None:
    """The mmproj beside a model: `mmproj*.gguf` in a shard directory, or in the folder of a GGUF file; None
    where there is none. Several are an error (name one with --mmproj)."""
    path = Path(model)
    folder = path if path.is_dir() else path.parent
    found = sorted(p for p in folder.glob("mmproj*.gguf") if p.is_file())
    if len(found) > 1:
        raise UserError(
            f"{folder} holds several vision towers ({', '.join(p.name for p in found)}); name one with --mmproj"
        )
    return found[0] if found else None


def open_vision(
    meta: dict[str, Any],
    path: str | Path,
    numerics: Numerics,
    device: torch.device | str | None = None,
    min_tokens: int | None = None,
    max_tokens: int | None = None,
) -> PictureEncoder:
    """The vision tower of the mmproj at `path` for the text model of `meta` (coordinator.vision.Vision), with
    its cache of encoded pictures; a UserError where the text model cannot read pictures."""
    from swarm.coordinator.vision import load_vision
    from swarm.sharding.gguf_io import GGUFError

    arch = str(meta.get("general.architecture"))
    if arch not in PICTURE_ARCHS or not meta.get(f"{arch}.rope.dimension_sections"):
        raise UserError(
            f"--mmproj {path}: the text model ({arch}) does not read pictures; swarm reads them with "
            f"{', '.join(PICTURE_ARCHS)} models whose GGUF has rope.dimension_sections (Qwen3.5 / Qwen3.6)"
        )
    tokens = list(meta.get("tokenizer.ggml.tokens") or [])
    missing = [t for t in (START, PAD, END) if t not in tokens]
    if missing:
        raise UserError(f"--mmproj {path}: the text model's vocabulary has no {', '.join(missing)}")
    try:
        vision = load_vision(path, text_width=int(meta[f"{arch}.embedding_length"]), device=device,
                             numerics=numerics, min_tokens=min_tokens, max_tokens=max_tokens)  # fmt: skip
    except (GGUFError, OSError) as e:
        raise UserError(f"--mmproj {path}: {e}") from None
    return PictureEncoder(vision)


class PictureEncoder:
    """A vision tower and the encoded pictures it keeps (by a hash of their preprocessed pixels)."""

    def __init__(self, vision: Any) -> None:
        self.vision = vision
        self.path: Path = vision.path
        self._cache: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, data: bytes) -> tuple[bytes, Any]:
        """(the hash of the picture's pixels, its EncodedPicture); a PictureError where the bytes are unusable."""
        pic = self.vision.prepare(data)
        h = hashlib.sha256(np.ascontiguousarray(pic.pixels).tobytes() + repr(pic.pixels.shape).encode())
        key = h.digest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return key, hit
        encoded = self.vision.encode_picture(pic)
        with self._lock:
            self._cache[key] = encoded
            while len(self._cache) > CACHED_PICTURES:
                self._cache.popitem(last=False)
        return key, encoded


def picture_prompt(
    tokenizer: GGUFTokenizer,
    vision: PictureEncoder | None,
    text: str,
    images: Sequence[bytes],
    parse_special: bool = True,
) -> PicturePrompt:
    """The prompt of `text` whose markers (MARKER) are the places of `images`, in order. Without pictures, the
    text's tokens as they are."""
    if not images:
        ids = tokenizer.encode(text, parse_special=parse_special)
        return PicturePrompt(ids, None, list(ids))
    if vision is None:
        raise UserError("this model reads no pictures: give the model's mmproj file with --mmproj")
    pieces = text.split(MARKER)
    if len(pieces) - 1 != len(images):
        raise UserError(
            f"the prompt has {len(pieces) - 1} picture places ({MARKER}) for {len(images)} pictures"
        )
    start, pad, end = (tokenizer.tokens.index(t) for t in (START, PAD, END))
    tokens: list[int] = []
    keys: list[int] = []
    at: list[int] = []
    rows: list[torch.Tensor] = []
    segments: list[int | tuple[int, int]] = []
    for i, piece in enumerate(pieces):
        ids = tokenizer.encode(piece, parse_special=parse_special) if piece else []
        if i:
            key, pic = vision.encode(images[i - 1])
            n = int(pic.rows.shape[0])
            base = int.from_bytes(key[:5], "big") << 20
            ids_pic = [pad] * n
            at.extend(range(len(tokens) + 1, len(tokens) + 1 + n))
            rows.append(pic.rows)
            tokens += [start, *ids_pic, end]
            keys += [start, *(-1 - (base | j) for j in range(n)), end]
            segments += [1, tuple(pic.grid), 1]
        tokens += ids
        keys += ids
        segments.append(len(ids))
    from swarm.coordinator.vision import mrope_positions

    pos, _ = mrope_positions([s for s in segments if s != 0])
    given = PictureRows(torch.tensor(at, dtype=torch.long), torch.cat(rows).float(), torch.from_numpy(pos))
    return PicturePrompt(tokens, given, keys)


def read_image_files(paths: Sequence[str]) -> list[bytes]:
    """The bytes of `swarm run --image` files; a UserError naming one that cannot be read."""
    out = []
    for p in paths:
        try:
            out.append(Path(p).read_bytes())
        except OSError as e:
            raise UserError(f"--image {p}: cannot read it ({e.strerror})") from None
    return out


def run_prompt(
    engine: Any, prompt: str, chat: bool, system: str | None, images: Sequence[bytes]
) -> PicturePrompt:
    """`swarm run`'s prompt with its --image pictures: where the text has no MARKER, the pictures come before
    it (in the user's message with --chat)."""
    from swarm.coordinator.text.chat import ChatTemplate

    if images and MARKER not in prompt:
        prompt = MARKER * len(images) + prompt
    if not chat:
        return picture_prompt(engine.tokenizer, engine.vision, prompt, images, parse_special=False)
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    text = ChatTemplate.from_tokenizer(engine.tokenizer).render(messages, add_generation_prompt=True)
    return picture_prompt(engine.tokenizer, engine.vision, text, images)
