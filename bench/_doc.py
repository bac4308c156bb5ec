"""The one place benchmarks write their figures: a `<!-- bench:NAME -->` section of docs/BENCHMARKS.md."""

from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import time
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"


def _section_body(text: str, name: str) -> str:
    """What lies between the section's markers in `text` ("" where it has none)."""
    begin, end = _markers(name)
    found = re.search(re.escape(begin) + r"\n?(.*?)" + re.escape(end), text, re.S)
    return found.group(1) if found else ""


def _with_section(text: str, name: str, body: str) -> str:
    """`text` with `body` between the section's markers (replacing what was there, or appending the section)."""
    begin, end = _markers(name)
    body = body.strip("\n")
    block = body if body.startswith(begin) else f"{begin}\n{body}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        return pattern.sub(lambda _m: block, text)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def replace_section(name: str, body: str, doc: Path = DOC, within: str | None = None) -> None:
    """Put `body` between the section's markers (replacing what was there, or appending the section);
    `within`: the section lives inside that outer one, so that a bench writing one of several inner sections
    (one per model) keeps the others."""
    old = doc.read_text() if doc.exists() else "# Benchmarks\n"
    if within is not None:
        body = _with_section(_section_body(old, within), name, body)
        name = within
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(_with_section(old, name, body))


def publish(name: str, text: str, write: bool, within: str | None = None) -> None:
    """Print a bench's section and, unless told not to, write it into docs/BENCHMARKS.md."""
    print(text)
    if write:
        replace_section(name, text, within=within)


def command(script: str, argv: list[str] | None) -> str:
    """How a bench was run, for its section: `python bench/SCRIPT ARGS`."""
    return f"python bench/{script}" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))


def cpu_kind() -> str:
    """The CPU's model name and its widest x86 vector extension (the kinds the figures differ between)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return ", ".join(x for x in (model, vector) if x) or "unknown CPU"


def machine() -> str:
    """This machine, the time and the load on it (other work shares its cores), for a section's header."""
    return (
        f"{platform.machine()} ({cpu_kind()}), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} "
        f"at the start; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """A bench's argument parser with the options every bench of the decode models takes: --workdir (where
    bench/_models.py keeps its models) and --no-write (print the section instead of writing it)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--workdir", default="/work/bench-models/decode")
    p.add_argument("--no-write", action="store_true", help="print the section only")
    return p


def bench_args(p: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """The parsed options, with `argv` (what the section's command line shows) and `load` (the 1-minute load
    average before the run)."""
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else sys.argv[1:]
    args.load = os.getloadavg()[0]
    return args
