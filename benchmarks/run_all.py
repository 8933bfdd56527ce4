"""Run every benchmark briefly and keep its ratios: ``benchmarks/results/<date>.json``.

A regression guard, not a measurement to quote: each script runs with few repeats (about twenty
minutes in all on 2 cores), so compare a change against the file the last change left, and rerun
a script with its full defaults (its ``--help``) before believing a difference inside the spread.

    python benchmarks/run_all.py               # all, brief; prints the change against the last file
    python benchmarks/run_all.py --only startup,callback_overhead
    python benchmarks/run_all.py --compare benchmarks/results/2026-11-30.json

Each script prints its ratio lines through ``_common.ratio_line``, which also appends them as JSON
to the file named by ``$RUNKIT_BENCH_RESULTS``; this runner collects them per script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

# script -> brief arguments (the full defaults take several minutes each).
BRIEF = {
    "loop_parity": ["--sizes", "tiny,mid", "--repeats", "4"],  # issue 21's arguments
    # issue 21's own arguments: 8 fake GPUs at 0.3 ms a call, at least 5 repeats
    "callback_overhead": [
        "--gpus",
        "8",
        "--call-cost-ms",
        "0.3",
        "--repeats",
        "5",
        "--steps",
        "800",
    ],
    "startup": ["--repeats", "3"],
    "ddp_scaling": ["--repeats", "1", "--epochs", "3"],
    "gpu_throughput": ["--repeats", "1", "--epochs", "2"],  # exits 0 with no ratio without a GPU
}


def run_script(name: str, args: list[str], timeout: float) -> dict:
    """Run one benchmark; its ratio records, exit code and seconds."""
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as handle:
        records_file = Path(handle.name)
    env = {**os.environ, "RUNKIT_BENCH_RESULTS": str(records_file)}
    start = time.perf_counter()
    load_before = os.getloadavg()
    try:
        proc = subprocess.run(
            [sys.executable, str(BENCH_DIR / f"{name}.py"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        code, tail = proc.returncode, (proc.stdout + proc.stderr).strip().splitlines()[-5:]
    except subprocess.TimeoutExpired:
        code, tail = None, [f"timed out after {timeout:.0f} s"]
    lines = records_file.read_text().splitlines() if records_file.exists() else []
    records_file.unlink(missing_ok=True)
    return {
        "args": args,
        "exit_code": code,
        "seconds": round(time.perf_counter() - start, 1),
        # 1-minute load average before and after: on a shared machine, how loaded it was
        "load_average": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "ratios": [json.loads(line) for line in lines],
        "output_tail": tail if code != 0 else [],
    }


def newest_result(exclude: Path) -> Path | None:
    files = sorted(p for p in RESULTS_DIR.glob("*.json") if p != exclude)
    return files[-1] if files else None


def compare(previous: dict, current: dict) -> list[str]:
    """One line per ratio found in both: previous median -> now (change)."""
    lines = []
    for name, run in current["scripts"].items():
        before = {
            r["label"]: r for r in previous.get("scripts", {}).get(name, {}).get("ratios", [])
        }
        for record in run["ratios"]:
            old = before.get(record["label"])
            if old:
                change = record["median"] - old["median"]
                lines.append(
                    f"{name + ': ' + record['label']:<60} {old['median']:.3f} -> "
                    f"{record['median']:.3f} ({change:+.3f})"
                )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma separated script names")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per script")
    parser.add_argument("--out", type=Path, default=None, help="default: results/<date>.json")
    parser.add_argument("--compare", type=Path, default=None, help="default: the newest file")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(BRIEF)
    unknown = [n for n in names if n not in BRIEF]
    if unknown:
        parser.error(f"--only={args.only}: unknown {', '.join(unknown)}; known: {', '.join(BRIEF)}")
    out = args.out or RESULTS_DIR / f"{datetime.date.today().isoformat()}.json"
    result: dict = {"started": datetime.datetime.now().isoformat(timespec="seconds"), "scripts": {}}
    for name in names:
        print(f"benchmark {name} {' '.join(BRIEF[name])} ...", flush=True)
        run = run_script(name, BRIEF[name], args.timeout)
        result["scripts"][name] = run
        for record in run["ratios"]:
            print(f"  {record['label']:<40} {record['median']:.3f}", flush=True)
        if run["exit_code"] != 0:
            print(f"  exit code {run['exit_code']}: " + " | ".join(run["output_tail"]), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ratios written to {out}")
    previous = args.compare or newest_result(exclude=out)
    if previous is not None and previous.is_file():
        print(f"change against {previous}:")
        for line in compare(json.loads(previous.read_text()), result):
            print("  " + line)
    return 0 if all(run["exit_code"] == 0 for run in result["scripts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
