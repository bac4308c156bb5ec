"""What a rig device really gets, measured: its CPU share (CPU seconds over wall seconds of a busy loop in it),
and the latency its CFS throttling adds to a short piece of work that arrives at a random moment.

A device with a quarter of a core by quota runs at the core's full speed until its quota of the period is
spent, then waits for the next period. A real device a quarter as fast would instead start at once and take
four times as long: work of `w` CPU seconds takes w / share. On the rig, with the kernel's default 100 ms period,
a short job arriving with quota left runs at full speed (faster than the device it stands for) and one arriving
after a burst waits up to 75 ms; with too short a period the kernel does not hold the quota (the device gets more
than its share in a short job, less over seconds). Measured on this 2-core VM while other work ran (2 ms jobs, a
quarter core): median 4.8 ms at a 4 ms period, 8.01 ms at the rig's 10 ms, 2.1 ms at 100 ms, against the 8.0 ms a
quarter-speed device takes; the tails (p99 23-33 ms at every period) were the other work's, not the period's.

    python bench/_rig_check.py [--cpus 1] [--share 0.25]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _rig import DeviceSpec, Rig  # noqa: E402

BUSY = """
import sys, time
seconds = float(sys.argv[1])
wall0, cpu0 = time.perf_counter(), time.process_time()
while time.perf_counter() - wall0 < seconds:
    pass
print((time.process_time() - cpu0) / (time.perf_counter() - wall0))
"""

ECHO = """
import os, sys, time
work = float(sys.argv[1])
while os.read(0, 1):
    t0 = time.thread_time()
    while time.thread_time() - t0 < work:
        pass
    os.write(1, b"x")
"""


def cpu_shares(rig: Rig, specs: list[DeviceSpec], seconds: float = 3.0) -> dict[str, float]:
    """Each device's CPU seconds per wall second over one busy loop each, all at the same time."""
    procs = {
        s.name: rig.popen(rig.device(s), [sys.executable, "-c", BUSY, str(seconds)], stdout=subprocess.PIPE)
        for s in specs
    }
    return {name: float(p.communicate()[0]) for name, p in procs.items()}


@dataclass(frozen=True)
class Latency:
    """Round trips of `work` CPU seconds on the device: their median and 99th percentile, and what a real
    device with the same share would take (work / share)."""

    period_us: int
    work: float
    median: float
    p99: float
    worst: float
    real: float


def throttle_latency(rig: Rig, spec: DeviceSpec, work: float = 2e-3, n: int = 200) -> Latency:
    """Requests of `work` CPU seconds to a process on the device, each at a random moment up to twice what a real
    device would take for it after the last answer (the device busy about a third of the time, as a node
    between layers is): more work than one period's quota, so the throttling shows."""
    assert spec.cpu_share is not None
    proc = rig.popen(
        rig.device(spec),
        [sys.executable, "-c", ECHO, str(work)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    rng = random.Random(7)
    trips = []
    try:
        for i in range(n + 10):
            time.sleep(rng.uniform(0, 2 * work / spec.cpu_share))
            t0 = time.perf_counter()
            proc.stdin.write(b"x")
            proc.stdin.flush()
            proc.stdout.read(1)
            if i >= 10:  # the first requests pay the interpreter's warm-up
                trips.append(time.perf_counter() - t0)
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
    trips.sort()
    return Latency(
        spec.period,
        work,
        statistics.median(trips),
        trips[int(0.99 * len(trips))],
        trips[-1],
        work / spec.cpu_share,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpus", default="1", help="the cpuset the measured devices share")
    p.add_argument("--share", type=float, default=0.25, help="each device's cores by quota")
    p.add_argument("--devices", type=int, default=4, help="devices sharing the cpuset for the share figure")
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    out: dict[str, object] = {}
    with Rig() as rig:
        specs = [DeviceSpec(f"share{i}", cpus=args.cpus, cpu_share=args.share) for i in range(args.devices)]
        out["shares"] = cpu_shares(rig, specs, args.seconds)
        out["latency"] = [
            throttle_latency(
                rig, DeviceSpec(f"lat{period}", cpus=args.cpus, cpu_share=args.share, period_us=period)
            )
            for period in (4000, None, 100_000)
        ]
    for name, got in out["shares"].items():  # type: ignore[attr-defined]
        print(f"{name}: {got:.3f} of a core (quota {args.share})")
    for lat in out["latency"]:  # type: ignore[attr-defined]
        print(
            f"period {lat.period_us / 1000:g} ms: {lat.work * 1e3:g} ms of work took median "
            f"{lat.median * 1e3:.2f} ms, p99 {lat.p99 * 1e3:.2f} ms, max {lat.worst * 1e3:.2f} ms (a device with that share: {lat.real * 1e3:.2f} ms)"
        )
    print(json.dumps({"shares": out["shares"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
