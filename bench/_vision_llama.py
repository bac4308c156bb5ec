"""llama.cpp's mtmd beside swarm's vision tower: one `llama-mtmd-cli` run per timed encoding (bench/vision.py).

llama-mtmd-cli needs a text model of the projector's output width (mtmd checks it): a `swarm synth` Qwen3.6
text GGUF of 2 layers (llama.cpp's hybrid memory needs one recurrent and one attention layer). Its warm-up
encodes a 1472 x 1472 picture (2,116 rows), longer than the timed encode itself, so it runs with
--no-warmup; the process is stopped as soon as mtmd reports the encode, before the text model reads the rows.
"""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CLI = Path("/work/llamacpp-build/build/bin/llama-mtmd-cli")
# mtmd_helper_eval_chunks logs the first, llama-mtmd-cli's batched path (this commit's) the second; both time
# the encode alone
ENCODED = re.compile(r"(?:image slice encoded in|mtmd batch encoding done in) (\d+) ms")
GRID = re.compile(r"image_tokens->n([xy]) = (\d+)")


@dataclass(frozen=True)
class LlamaEncode:
    seconds: float
    rows: int
    grid: tuple[int, int]  # (rows, columns) of the merged grid


def parse_log(lines: list[str]) -> LlamaEncode | None:
    """The encode's figures from llama-mtmd-cli's verbose log, None until the encode line has come."""
    grid: dict[str, int] = {}
    for line in lines:
        found = GRID.search(line)
        if found:
            grid[found.group(1)] = int(found.group(2))
        done = ENCODED.search(line)
        if done:
            if set(grid) != {"x", "y"}:
                raise RuntimeError("llama-mtmd-cli reported an encode without its image grid (nx, ny)")
            return LlamaEncode(int(done.group(1)) / 1000, grid["x"] * grid["y"], (grid["y"], grid["x"]))
    return None


def encode_once(cli: Path, text_model: Path, mmproj: Path, picture: Path, threads: int) -> LlamaEncode:
    """One llama-mtmd-cli process: load, encode `picture` once, stop."""
    cmd = [
        str(cli), "-m", str(text_model), "--mmproj", str(mmproj), "--image", str(picture), "-p", "Describe.",
        "-n", "1", "-t", str(threads), "-c", "4096", "--temp", "0", "--no-warmup", "-v",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    result: LlamaEncode | None = None
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if ENCODED.search(line):
                result = parse_log(lines)
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    if result is None:
        tail = "".join(lines[-15:])
        raise RuntimeError(
            f"{' '.join(cmd)} ended (rc {proc.returncode}) without encoding the picture:\n{tail}"
        )
    time.sleep(0.2)  # let the killed process's memory go before the next run starts
    return result
