"""Float32 answers packed without losing a bit (`F32_PLANES`): the low three bytes of every value as they are,
byte plane by byte plane, then the plane of top bytes (the sign and seven of the eight exponent bits) Huffman
coded with zlib.

The mantissa bytes of an expert's outputs are as good as random and do not compress; the top bytes take only
a few values in a row (its magnitudes span a few powers of two), so Huffman coding alone halves or more that
plane: about 15 % off a float32 answer, at tens of MB/s on one core, on links where every byte counts
(`--wire q8`). Decoding gives the float32 values bit for bit, NaN payloads and signed zeros included.

Layout of `n` values: plane 0 (the lowest byte of each value, n bytes), plane 1, plane 2, then the zlib
stream of plane 3. Only numpy and zlib: a node never loads torch.
"""

from __future__ import annotations

import zlib

import numpy as np

PLANES = "f32-planes"  # the answer type to ask a node for (compute_request's out_dtype)
_LOW_PLANES = 3


class PlanesError(ValueError):
    """Bytes that are not `n` values packed as planes; the text says what is wrong."""


def pack_planes(values: np.ndarray) -> bytes:
    """float32 values (any shape) as planes: 3n raw bytes, then the top plane's zlib stream."""
    a = np.ascontiguousarray(values, dtype="<f4").reshape(-1).view(np.uint8).reshape(-1, 4)
    low = np.ascontiguousarray(a[:, :_LOW_PLANES].T).tobytes()
    coder = zlib.compressobj(1, zlib.DEFLATED, 15, 9, zlib.Z_HUFFMAN_ONLY)
    top = coder.compress(np.ascontiguousarray(a[:, _LOW_PLANES]).tobytes()) + coder.flush()
    return low + top


def unpack_planes(data: bytes, n: int) -> np.ndarray:
    """The n float32 values (little-endian, flat) packed in `data`; PlanesError when the bytes do not hold
    exactly n values (a short low part, a top plane that is not zlib, too short, too long or trailed)."""
    low_bytes = _LOW_PLANES * n
    if len(data) < low_bytes:
        raise PlanesError(f"{len(data)} bytes cannot hold the {low_bytes} low-byte planes of {n} values")
    decoder = zlib.decompressobj()
    try:
        top = decoder.decompress(memoryview(data)[low_bytes:], n + 1)  # a bomb stops past n bytes
    except zlib.error as e:
        raise PlanesError(f"the top-byte plane is not a zlib stream ({e})") from None
    if len(top) != n or not decoder.eof or decoder.unused_data:
        raise PlanesError(
            f"the top-byte plane holds {len(top)}{'+' if len(top) > n else ''} bytes"
            f"{'' if decoder.eof else ' in an unfinished stream'}"
            f"{' and bytes after it' if decoder.unused_data else ''}, not the {n} of the values"
        )
    low = np.frombuffer(data, np.uint8, low_bytes).reshape(_LOW_PLANES, n)
    out = np.frombuffer(top, np.uint8).astype("<u4") << 24  # each value's bytes put in place as a whole word
    for k in range(_LOW_PLANES):  # (faster than writing the planes into every fourth byte)
        out |= low[k].astype("<u4") << (8 * k)
    return out.view("<f4").astype(np.float32, copy=False)
