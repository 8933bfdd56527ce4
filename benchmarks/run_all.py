"""Run every benchmark briefly and keep its ratios: ``benchmarks/results/<date>.json``.

A regression guard, not a measurement to quote: each script runs with few repeats (about twenty
minutes in all on 2 cores), so compare a change against the file the last change left, and rerun
a script with its full defaults (its ``--help``) before believing a difference inside the spread.

    python benchmarks/run_all.py               # all, brief; prints the change against the last file
    python benchmarks/run_all.py --only startup,callback_overhead
    python benchmarks/run_all.py --compare benchmarks/results/2026-11-30.json
    python benchmarks/run_all.py --compare results/old.json results/new.json   # two files, no run

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
    """One line per figure of the scripts in ``current``: the earlier median -> now (change).

    Marked: a median outside the earlier run's [min .. max] (a change beyond its run-to-run
    spread), a target met before and missed now (``REGRESSION``), and a figure only one of the
    two runs has. Figures pair by script and label.
    """
    lines = []
    for name, run in current["scripts"].items():
        before = {
            r["label"]: r for r in previous.get("scripts", {}).get(name, {}).get("ratios", [])
        }
        now = {r["label"]: r for r in run["ratios"]}
        for label in [*now, *(label for label in before if label not in now)]:
            old, new = before.get(label), now.get(label)
            head = f"{name + ': ' + label:<60}"
            if old is None or new is None:
                present = old or new
                which = "now only" if old is None else "earlier only"
                lines.append(f"{head} {present['median']:.3f} ({which})")
                continue
            change = new["median"] - old["median"]
            line = f"{head} {old['median']:.3f} -> {new['median']:.3f} ({change:+.3f})"
            if "min" in old and not old["min"] <= new["median"] <= old["max"]:
                line += f"  outside the earlier [{old['min']:.3f} .. {old['max']:.3f}]"
            if old.get("met") and new.get("met") is False:
                line += f"  REGRESSION: target >= {new['target']:g} met before, not now"
            lines.append(line)
    return lines


def print_comparison(previous: Path, current: dict) -> None:
    print(f"change against {previous}:")
    for line in compare(json.loads(previous.read_text()), current):
        print("  " + line)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma separated script names")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per script")
    parser.add_argument("--out", type=Path, default=None, help="default: results/<date>.json")
    parser.add_argument(
        "--compare",
        type=Path,
        nargs="+",
        metavar="FILE",
        default=None,
        help="the earlier file to compare this run with (default: the newest); with two files, "
        "compare the second with the first and run nothing",
    )
    args = parser.parse_args()
    earlier = args.compare or []
    if len(earlier) > 2 or not all(path.is_file() for path in earlier):
        parser.error(
            f"--compare {' '.join(map(str, earlier))}: one or two existing result files "
            "(benchmarks/results/*.json)"
        )
    if len(earlier) == 2:
        print_comparison(earlier[0], json.loads(earlier[1].read_text()))
        return 0
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
    previous = earlier[0] if earlier else newest_result(exclude=out)
    if previous is not None:
        print_comparison(previous, result)
    return 0 if all(run["exit_code"] == 0 for run in result["scripts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
