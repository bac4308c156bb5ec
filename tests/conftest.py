"""Shared test helpers: where the reference fixtures live."""

from __future__ import annotations

from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def flip_bytes(path: Path, start: int, end: int | None = None, every: int = 97, mask: int = 0x5A) -> None:
    """XOR `mask` into one byte in `every` of [start + 7, end) of a file, in place (a running node may have
    it mapped); the same call again puts the file back as it was."""
    end = Path(path).stat().st_size if end is None else end
    with open(path, "r+b") as f:
        for at in range(start + 7, end, every):
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ mask]))


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES
