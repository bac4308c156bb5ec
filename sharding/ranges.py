"""Id ranges as users type them: "0-63", "0-7,16,32-39"."""

from __future__ import annotations

import re
from collections.abc import Iterable

from swarm.sharding.errors import UserError


def parse_ranges(text: str, what: str = "ids") -> list[int]:
    """ "0-3,8" -> [0, 1, 2, 3, 8] (sorted, unique). Raises UserError naming `what` on bad syntax."""
    ids: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise UserError(
                f"bad {what} range {part!r} in {text!r}; write ranges like 0-63 or 0-7,16,32-39"
            ) from None
        if a < 0 or b < a:
            raise UserError(f"bad {what} range {part!r}: need 0 <= first <= last")
        ids.update(range(a, b + 1))
    if not ids:
        raise UserError(f"empty {what} range {text!r}; write ranges like 0-63 or 0-7,16,32-39")
    return sorted(ids)


def format_ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 3, 8] -> "0-3,8"."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(set(ids)):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """ "4GiB", "4G", "4GB", "512MiB", "123456" -> bytes. K/M/G/T are powers of 1024 with or without the "i":
    this is a memory budget, and people write "4G" meaning 4 GiB."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise UserError(f"bad size {text!r}; write it like 4GiB, 512MiB or a number of bytes")
    value, unit = float(m.group(1)), m.group(2).lower()
    return int(value * 1024 ** " kmgt".index(unit or " "))


def format_slabs(keys: Iterable[tuple[int, int]]) -> str:
    """ "0-3:0-7;5:1-2": layer ranges : expert ranges, one group per distinct expert set (as `swarm node
    --slab` takes them)."""
    from swarm.proto.codec import from_ranges, group_slabs

    return ";".join(
        f"{format_ranges(from_ranges(ls))}:{format_ranges(from_ranges(es))}" for ls, es in group_slabs(keys)
    )
