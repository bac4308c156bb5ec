"""The one place benchmarks write their figures: a `<!-- bench:NAME -->` section of docs/BENCHMARKS.md."""

from __future__ import annotations

import os
import platform
import re
import sys
import time
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def replace_section(name: str, body: str, doc: Path = DOC) -> None:
    """Put `body` between the section's markers (replacing what was there, or appending the section)."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = body.strip("\n")
    block = text if text.startswith(begin) else f"{begin}\n{text}\n{end}"
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    new = (
        pattern.sub(lambda _m: block, old)
        if pattern.search(old)
        else old.rstrip("\n") + "\n\n" + block + "\n"
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(new)


def publish(name: str, text: str, write: bool) -> None:
    """Print a bench's section and, unless told not to, write it into docs/BENCHMARKS.md."""
    print(text)
    if write:
        replace_section(name, text)


def command(script: str, argv: list[str] | None) -> str:
    """How a bench was run, for its section: `python bench/SCRIPT ARGS`."""
    return f"python bench/{script}" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))


def machine() -> str:
    """This machine and the time, for a section's header."""
    return (
        f"{platform.machine()}, {os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
