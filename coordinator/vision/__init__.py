"""Pictures for the Qwen3.5 / Qwen3.6 models: an mmproj's vision tower (`load_vision`), the picture
preprocessing llama.cpp's mtmd does, and the M-RoPE positions of a prompt's picture rows."""

from __future__ import annotations

from swarm.coordinator.vision.load import EncodedPicture, Vision, load_vision
from swarm.coordinator.vision.positions import mrope_positions, picture_positions, segments_of
from swarm.coordinator.vision.preprocess import PictureError

__all__ = [
    "EncodedPicture",
    "PictureError",
    "Vision",
    "load_vision",
    "mrope_positions",
    "picture_positions",
    "segments_of",
]
