"""What a one-conversation command shows in the terminal: status lines, the answer streamed as it comes,
and the run's report."""

from __future__ import annotations

import sys
from typing import Any


def status_line(text: str) -> None:
    """A line about what is happening, for a person watching the terminal (not for pipes and logs)."""
    if sys.stderr.isatty():
        print(text, file=sys.stderr, flush=True)


def stream_answer(
    engine: Any,
    ids: list[int],
    params: Any,
    out: Any = None,
    drafter: Any = None,
    mtp_drafter: Any = None,
    pictures: Any = None,
) -> tuple[list[int], Any]:
    """Generate, printing text as it comes (to stdout by default); (generated ids, GenerationStats). `pictures`:
    the prompt's pictures (coordinator.pictures)."""
    from swarm.coordinator.decode.one import GenerationStats, generate

    out = out or sys.stdout
    stats = GenerationStats()
    detok = engine.tokenizer.stream(skip_control=True)
    generated = []
    for token in generate(
        engine.model,
        ids,
        params,
        engine.device,
        stats,
        checker=engine.checker,
        drafter=drafter,
        mtp_drafter=mtp_drafter,
        pictures=pictures,
    ):
        generated.append(token)
        if token not in params.stop_ids:
            out.write(detok.push(token))
            out.flush()
    out.write(detok.flush() + "\n")
    out.flush()
    return generated, stats


def report(engine: Any, stats: Any, err: Any = None) -> None:
    """Speed and where the experts went, to stderr by default."""
    from swarm.coordinator.experts.remote.dispatch import SwarmExperts

    err = err or sys.stderr
    print(
        f"prefill: {stats.prompt_tokens} tokens, {stats.prefill_tps:.1f} tok/s | "
        f"decode: {stats.generated_tokens} tokens, {stats.decode_tps:.1f} tok/s | finish: {stats.finish_reason}",
        file=err,
    )
    if stats.extra.get("drafted"):
        x = stats.extra
        print(
            f"  drafts: {x['accepted']} of {x['drafted']} kept ({x['accepted'] / x['drafted']:.0%}), "
            f"{x['tokens_per_pass']:.2f} tokens per decode pass",
            file=err,
        )
    if isinstance(engine.experts, SwarmExperts):
        for address in sorted(engine.experts.calls_per_node):
            print(
                f"  node {address}: {engine.experts.calls_per_node[address]} calls, "
                f"{engine.experts.rows_per_node[address]} rows",
                file=err,
            )
        if engine.experts.failovers:
            print(f"  failovers: {engine.experts.failovers}", file=err)
        if engine.experts.dropped_pairs:
            print(
                f"  DEGRADED: {engine.experts.dropped_pairs} (token, expert) pairs had no live holder and were "
                "left out; this answer is not the model's exact one",
                file=err,
            )
        auditor = engine.experts.auditor
        if auditor is not None:
            r = auditor.report
            print(f"  audits: {r.audits} answers and {r.probes} probe calls checked", file=err)
            for address, why in sorted(r.banned.items()):
                print(f"  BANNED {address}: {why}", file=err)
            if stats.extra.get("redone_passes"):
                print(
                    f"  passes done again without the banned nodes: {stats.extra['redone_passes']}", file=err
                )
        if engine.experts.hedges:
            print(
                f"  hedged calls: {engine.experts.hedges} (a replica answered first {engine.experts.hedge_wins} times)",
                file=err,
            )
    else:
        print("  experts computed in process (--local)", file=err)

