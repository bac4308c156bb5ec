"""Serving several users at once: aggregate tokens/s and time to first token at 1, 2, 4, 8 concurrent requests.

    .venv/bin/python bench/serve.py [--reps 3] [--prompt-tokens 64] [--max-tokens 32] \
        [--llama-server /work/llamacpp-build/build/bin/llama-server]

On the real Qwen3.6-35B-A3B layer shape (bench/decode's model: `swarm synth` preset qwen3.6-35b-a3b, 4 layers,
Q4_K experts, Q8_0 dense), three servers side by side, each started cold in every repetition (rotating order)
and given one short warm-up request:
  - `swarm serve GGUF --local` (experts in process),
  - `swarm serve SHARD_DIR` over 4 loopback `swarm node` processes (one expert quarter each, found by --peer),
  - llama.cpp's own `llama-server -np 8` on the same GGUF, same threads,
  - the same llama-server with its layers on 4 loopback `ggml-rpc-server`s of one thread each (`--rpc ... -ngl
    99`, beside it in the same build directory): llama.cpp's own way across processes, as bench/decode's RPC row,
  - and, where it is built (`--llama-server-avx2`), the same llama-server built for the AVX2 baseline that
    swarm's ggml is built for (bench/_llama.py's AVX2_CMAKE): what of the gap is the instruction set.
For each concurrency N, N streamed requests (each its own prompt of --prompt-tokens random token ids, the same
ids for every server) are sent at once through the official `openai` client; aggregate tokens/s = completion
tokens of all N / wall time from the first send to the last token, and time to first token per request.
Medians over the repetitions. Figures go to the `bench:serve` section of docs/BENCHMARKS.md (`--section` names
another, for another workload).

Beside the servers, each repetition times the models alone, without HTTP: swarm's in-process model (as
`swarm serve --local` runs it) reading 1 and 8 prompts in one pass and stepping 1 and 8 sequences, and, where
it is built beside llama-server, llama.cpp's `llama-batched-bench` doing the same (`-npp P -ntg T -npl 1,8`,
same file, same threads; native and AVX2-baseline builds): what of a gap between the servers is the model's
kernels, and what is the serving around them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import logging
import multiprocessing
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import openai  # noqa: E402
from _doc import publish  # noqa: E402
from _engines import split  # noqa: E402
from _llama import AVX2_BUILD, DEFAULT_BUILD, batched_bench, llama_version  # noqa: E402
from _loopback import LOOPBACK  # noqa: E402
from _models import prepare  # noqa: E402
from _servers import N_NODES, LlamaServer, SwarmServe, Target  # noqa: E402
from gguf import Keys  # noqa: E402

from swarm.coordinator.config import EngineConfig
from swarm.sharding.gguf_io import open_gguf  # noqa: E402
from swarm.sharding.ranges import format_ranges  # noqa: E402
from swarm.sharding.slabs import read_manifest  # noqa: E402

log = logging.getLogger("bench.serve")
CONCURRENCY = (1, 2, 4, 8)
DEFAULT_LLAMA = DEFAULT_BUILD / "llama-server"  # the build docs/BENCHMARKS.md describes
AVX2_LLAMA = AVX2_BUILD / "llama-server"  # the same, built for the AVX2 baseline
DECODE_STEPS = 16  # decode steps timed in the model-level figures (after 2 that build the graphs)


def one_request(
    client: openai.OpenAI, model: str, prompt: list[int], max_tokens: int, t0: float
) -> tuple[float, float, int]:
    """(seconds to the first token, seconds to the last, completion tokens) of one streamed request."""
    first = None
    chunks = 0
    usage = None
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        if ch.choices and ch.choices[0].text:
            chunks += 1
            if first is None:
                first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (first if first is not None else end), end, int(usage if usage is not None else chunks)


def measure(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> dict[int, dict[str, float]]:
    client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=600)
    one_request(
        client, model, prompts[-1][:8], max_tokens=4, t0=time.perf_counter()
    )  # warm-up: page the weights in
    out: dict[int, dict[str, float]] = {}
    for n in CONCURRENCY:
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(n) as ex:
            results = list(
                ex.map(partial(one_request, client, model, max_tokens=max_tokens, t0=t0), prompts[:n])
            )
        wall = max(r[1] for r in results)
        tokens = sum(r[2] for r in results)
        out[n] = {"tps": tokens / wall, "ttft": statistics.median(r[0] for r in results), "tokens": tokens}
        log.info("  %d at once: %.1f tok/s aggregate, TTFT median %.2f s", n, out[n]["tps"], out[n]["ttft"])
    return out


def model_level(gguf: Path, threads: int, prompts: list[list[int]]) -> dict[str, float]:
    """Where a server's time goes, without HTTP: the in-process model (as `swarm serve --local` runs it: its heap
    policy, its warm-up passes) reading 1 and 8 prompts in one pass, and decode steps of 1 and 8 sequences. Run
    in a child process (its own threads)."""
    from swarm.compute.malloc import keep_freed_memory

    keep_freed_memory()
    import torch

    from swarm.compute.ggml import set_threads
    from swarm.coordinator.engine import open_engine
    from swarm.coordinator.serve.startup import warm_prompts

    set_threads(threads)
    engine = open_engine(gguf, EngineConfig(local=True, device="cpu"))
    m = engine.model
    m.warm_up()
    warm_prompts(m, 8, torch.device("cpu"))
    out: dict[str, float] = {}
    with torch.inference_mode():
        for b in (1, 8):
            states = [m.new_state() for _ in range(b)]
            ids = torch.tensor([t for p in prompts[:b] for t in p])
            t0 = time.perf_counter()
            m(ids, states, [len(p) for p in prompts[:b]], last_only=True)
            out[f"prefill{b}"] = len(ids) / (time.perf_counter() - t0)
            times = []
            for i in range(2 + DECODE_STEPS):  # the first 2 build this batch size's graphs: not timed
                t0 = time.perf_counter()
                m(torch.tensor([p[i % len(p)] for p in prompts[:b]]), states, [1] * b, last_only=True)
                times.append(time.perf_counter() - t0)
            out[f"decode{b}"] = b / statistics.median(times[2:])
    engine.close()
    return out


def vocab_size(gguf: Path) -> int:
    reader = open_gguf(gguf)
    field = reader.fields["tokenizer.ggml.tokens"]
    return len(field.data)


def expert_counts(gguf: Path) -> tuple[int, int]:
    """(experts per layer E, experts each token uses K) from the file's metadata."""
    from swarm.coordinator.loader import read_metadata

    meta = read_metadata(open_gguf(gguf))
    arch = meta[Keys.General.ARCHITECTURE]
    return int(meta[Keys.LLM.EXPERT_COUNT.format(arch=arch)]), int(
        meta[Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)]
    )


ServerRuns = dict[str, list[dict[int, dict[str, float]]]]  # server -> per repetition: concurrency -> figures


def _med(runs: ServerRuns, name: str, n: int, key: str) -> float:
    return statistics.median(r[n][key] for r in runs[name])


def _servers_table(args: argparse.Namespace, names: list[str], runs: ServerRuns, llama: str) -> list[str]:
    lines = [
        f"## bench/serve: several users at once, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each",
        "",
        f"`.venv/bin/python bench/serve.py --reps {args.reps} --prompt-tokens {args.prompt_tokens} "
        f"--max-tokens {args.max_tokens}{'' if args.section == 'serve' else ' --section ' + args.section}` on {platform.machine()} ({args.cpu}), {args.threads} threads per server; "
        f"model: Qwen3.6-35B-A3B layer shape, 4 layers, Q4_K experts, Q8_0 dense ({args.gguf_gb:.1f} GB); "
        f"{llama}. Medians of {args.reps} repetitions, each server started cold per repetition (one warm-up "
        f"request). N streamed requests at once, {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each.",
        "",
        "| server | " + " | ".join(f"{n} at once: tok/s, TTFT s" for n in CONCURRENCY) + " | 8 vs 1 |",
        "| --- | " + " | ".join("---:" for _ in CONCURRENCY) + " | ---: |",
    ]
    for name in names:
        cells = [f"{_med(runs, name, n, 'tps'):.1f}, {_med(runs, name, n, 'ttft'):.2f}" for n in CONCURRENCY]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {_med(runs, name, 8, 'tps') / _med(runs, name, 1, 'tps'):.2f}x |"
        )
    return lines


def _against_llama(names: list[str], runs: ServerRuns) -> list[str]:
    lines: list[str] = []
    for llama_name in (n for n in names if n.startswith("llama")):
        lines += [
            "",
            f"Aggregate at 8 against {llama_name}'s, side by side in each repetition (median of the ratios):",
            "",
        ]
        for name in names:
            if name.startswith("llama"):
                continue
            ratios = [a[8]["tps"] / b[8]["tps"] for a, b in zip(runs[name], runs[llama_name], strict=True)]
            lines.append(f"- {name}: {statistics.median(ratios):.2f}x")
    return lines


def _model_alone(
    args: argparse.Namespace, levels: list[dict[str, float]], experts: tuple[int, int]
) -> list[str]:
    """The in-process model without HTTP, and the ceiling batching puts on its decode."""
    lv = {k: statistics.median(x[k] for x in levels) for k in levels[0]}
    e, k = experts
    distinct = e * (1 - (1 - k / e) ** 8)
    return [
        "",
        f"The in-process model without HTTP (the same {args.threads} threads; medians): reading 1 prompt of "
        f"{args.prompt_tokens} tokens in one pass {lv['prefill1']:.0f} tok/s, 8 prompts in one pass "
        f"{lv['prefill8']:.0f} tok/s; decode steps of 1 sequence {lv['decode1']:.1f} tok/s, of 8 sequences "
        f"{lv['decode8']:.1f} tok/s ({lv['decode8'] / lv['decode1']:.2f}x; medians of {DECODE_STEPS} steps).",
        "",
        f"That last ratio is the ceiling of what batching gives this model's decode on these cores: a step of 8 "
        f"sequences costs {8 * lv['decode1'] / lv['decode8']:.1f}x a step of one, because 8 tokens each routed "
        f"to {k} of {e} experts touch about {distinct:.0f} distinct experts per layer (uniform routing, as "
        f"random weights give) against {k}, and every one of them is read and multiplied. An aggregate "
        f"over whole requests (prompts read, then decode) cannot exceed it by much (prompts read together "
        f"gain little, and a lone request pays the same per-request costs); llama-server's own 8-vs-1 in the "
        f"table is under it too.",
    ]


def _models_side_by_side(
    args: argparse.Namespace, levels: list[dict[str, float]], batched: dict[str, list[dict[str, float]]]
) -> list[str]:
    keys = ("prefill1", "prefill8", "decode1", "decode8")
    lines = [
        "",
        f"The models alone, side by side in each repetition (tok/s, medians; {args.prompt_tokens}-token prompts, "
        f"{args.max_tokens} tokens generated): swarm's in-process model as above, llama.cpp's "
        f"`llama-batched-bench -npp {args.prompt_tokens} -ntg {args.max_tokens} -npl 1,8 -t {args.threads}` "
        "(its decode figure averages every step, the first ones too; ours is the median step).",
        "",
        "| model | 1 prompt read | 8 prompts read | decode, 1 sequence | decode, 8 sequences |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    rows = [("swarm, in process", levels)] + list(batched.items())
    for name, figures in rows:
        cells = [f"{statistics.median(f[k] for f in figures):.1f}" for k in keys]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for name, figures in batched.items():
        ratios = [
            f"{k} {statistics.median(a[k] / b[k] for a, b in zip(levels, figures, strict=True)):.2f}x"
            for k in keys
        ]
        lines += [
            "",
            f"swarm against {name}, run by run (median of the ratios): " + ", ".join(ratios) + ".",
        ]
    return lines


def render(
    args: argparse.Namespace,
    names: list[str],
    runs: ServerRuns,
    llama: str,
    levels: list[dict[str, float]],
    experts: tuple[int, int],
    batched: dict[str, list[dict[str, float]]],
) -> str:
    lines = [f"<!-- bench:{args.section} -->", *_servers_table(args, names, runs, llama)]
    lines += _against_llama(names, runs)
    if levels:
        lines += _model_alone(args, levels, experts)
    if levels and batched:
        lines += _models_side_by_side(args, levels, batched)
    lines += ["", f"<!-- /bench:{args.section} -->"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA)
    p.add_argument(
        "--llama-server-avx2", type=Path, default=AVX2_LLAMA, help="llama-server built for the AVX2 baseline"
    )
    p.add_argument("--workdir", type=Path, default=Path("/work/bench-models/decode"))
    p.add_argument("--only", default=None, help="comma-separated server names to run (default all)")
    p.add_argument("--no-write", action="store_true", help="print, do not write docs/BENCHMARKS.md")
    p.add_argument(
        "--section", default="serve", help="the docs/BENCHMARKS.md section to write (one per workload)"
    )
    return p.parse_args(argv)


def make_targets(
    args: argparse.Namespace, gguf: Path, shard_dir: Path, ctx: int, work: Path
) -> tuple[list[Target], str]:
    """The servers to run (--only), and which llama-server they include."""
    common = [
        "--parallel",
        "8",
        "--ctx-size",
        str(ctx),
        "--threads",
        str(args.threads),
        "--model-id",
        gguf.stem,
    ]
    n_expert = read_manifest(shard_dir).n_expert
    node_specs = [
        (shard_dir, ["--host", LOOPBACK, "--experts", format_ranges(r), "--threads", "1", "--no-verify"])
        for r in split(n_expert, N_NODES)
    ]
    targets: list[Target] = [
        SwarmServe(gguf, ["--local", *common], work / "local", "swarm serve --local"),
        SwarmServe(
            shard_dir,
            ["--no-mdns", *common],
            work / "nodes",
            f"swarm serve, {N_NODES} loopback nodes",
            node_specs,
        ),
    ]
    llama = "llama.cpp not run"
    if args.llama_server.exists():
        targets.append(LlamaServer(args.llama_server, gguf, args.threads, 8, ctx, work))
        llama = f"llama-server {llama_version(args.llama_server)}"
        rpc_server = args.llama_server.parent / "ggml-rpc-server"
        if rpc_server.exists():
            targets.append(
                LlamaServer(args.llama_server, gguf, args.threads, 8, ctx, work,
                            f"over {N_NODES} loopback rpc-servers", rpc_server)
            )  # fmt: skip
        if args.llama_server_avx2.exists():
            targets.append(
                LlamaServer(args.llama_server_avx2, gguf, args.threads, 8, ctx, work, "AVX2 baseline build")
            )
    if args.only:
        keep = set(args.only.split(","))
        targets = [t for t in targets if t.name in keep]
    return targets, llama


def batched_benches(args: argparse.Namespace) -> dict[str, Path]:
    """The llama-batched-bench binaries built beside the llama-servers, by row name."""
    return {
        name: path.parent / "llama-batched-bench"
        for name, path in (
            ("llama.cpp (llama-batched-bench)", args.llama_server),
            ("llama.cpp built for the AVX2 baseline (llama-batched-bench)", args.llama_server_avx2),
        )
        if (path.parent / "llama-batched-bench").exists()
    }


def run_reps(
    args: argparse.Namespace,
    gguf: Path,
    prompts: list[list[int]],
    targets: list[Target],
    benches: dict[str, Path],
    work: Path,
) -> tuple[ServerRuns, list[dict[str, float]], dict[str, list[dict[str, float]]]]:
    """Each repetition: the models alone, then every server (started cold) in rotating order."""
    runs: ServerRuns = {t.name: [] for t in targets}
    levels: list[dict[str, float]] = []
    batched: dict[str, list[dict[str, float]]] = {name: [] for name in benches}
    for rep in range(args.reps):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            levels.append(pool.submit(model_level, gguf, args.threads, prompts).result())
        log.info("rep %d: model level %s", rep + 1, {k: round(v, 1) for k, v in levels[-1].items()})
        for name, binary in benches.items():
            batched[name].append(
                batched_bench(binary, gguf, args.threads, args.prompt_tokens, args.max_tokens)
            )
            log.info("rep %d: %s %s", rep + 1, name, {k: round(v, 1) for k, v in batched[name][-1].items()})
        order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
        for t in order:
            (work / t.name.replace(" ", "_")).mkdir(exist_ok=True)
            log.info("rep %d: %s", rep + 1, t.name)
            url = t.start()
            try:
                runs[t.name].append(measure(url, t.model, prompts, args.max_tokens))
            finally:
                t.stop()
    return runs, levels, batched


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args.workdir.mkdir(parents=True, exist_ok=True)
    gguf, shard_dir = prepare("qwen35moe", 4, args.workdir)
    args.gguf_gb = gguf.stat().st_size / 1e9
    args.cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        "?",
    )
    rng = random.Random(0)
    vocab = vocab_size(gguf)
    prompts = [
        [rng.randrange(256, vocab - 256) for _ in range(args.prompt_tokens)] for _ in range(max(CONCURRENCY))
    ]
    ctx = args.prompt_tokens + args.max_tokens + 64
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))  # the servers' logs: kept only when a run fails
    try:
        targets, llama = make_targets(args, gguf, shard_dir, ctx, work)
        benches = batched_benches(args)
        runs, levels, batched = run_reps(args, gguf, prompts, targets, benches, work)
    except BaseException:
        print(f"bench/serve: the servers' logs are kept in {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    text = render(args, [t.name for t in targets], runs, llama, levels, expert_counts(gguf), batched)
    publish(args.section, text, not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
