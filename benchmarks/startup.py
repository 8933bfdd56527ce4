"""How long from the shell to the first training step, against ``python -c "import lightning"``.

Arms, each a fresh ``python`` process, interleaved over ``--repeats`` (rotated order), medians:

* ``import lightning``: the floor any Lightning script pays before it can do anything (and
  ``import lightning.pytorch``, the part the template imports, for comparison), timed to the
  end of the import (the process prints the time), not to its exit.
* ``train to first step``: ``python -m project.train`` with the default config (digits, the
  default ConvNet, every default callback, CSV logger; CPU). A benchmark-only callback, added on
  the command line (``+callbacks.first_step._target_=_common.first_step_stamp``, with
  ``benchmarks/`` on ``PYTHONPATH``), writes the time at the first ``on_train_batch_start``
  (after the sanity validation) and ends the process there; the arm's time is from just before
  the process is started to that stamp.
* ``--help`` and ``--cfg job``: must not import torch or Lightning; ``python -X importtime``
  tells which modules they loaded, and the table says so. Timed to the exit of the process.
* ``python -c pass``: the interpreter alone, for scale (to its exit).
* ``import lightning, collector off``: the same import after ``gc.disable()``: what the cyclic
  garbage collector's full collections cost the import (the entry point holds the collector off
  until its imports are done, ``runkit.run.collector``).

Printed: each arm's median as a ratio to ``import lightning`` (target, issue 21: first step <= 1.15x), with
the min and max of the per-repeat ratios.

    python benchmarks/startup.py                 # about a minute and a half
    python benchmarks/startup.py --repeats 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common

PY = sys.executable
STARTUP_TARGET = 1.15  # first step / `import lightning` (issue 21)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROJECT_", "PL_"))}
    env.update(extra)
    return env


def run_wall(command: list[str], env: dict[str, str], cwd: str) -> float:
    """Seconds from starting ``command`` to its exit."""
    start = time.perf_counter()
    subprocess.run(command, env=env, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def run_import(module: str, env: dict[str, str], cwd: str, prelude: str = "") -> float:
    """Seconds from starting ``python`` to the end of ``import module`` (after ``prelude``): the
    process prints the time there, so its exit (tearing torch down) is not counted, as in the
    first-step arm."""
    code = f"{prelude}import time, {module}; print(time.time())"
    start = time.time()
    done = subprocess.run(
        [PY, "-c", code], env=env, cwd=cwd, check=True, capture_output=True, text=True
    )
    return float(done.stdout.split()[-1]) - start


def run_to_first_step(tmp: Path, extra: list[str]) -> float:
    stamp_file = tmp / "first_step.txt"
    stamp_file.unlink(missing_ok=True)
    env = _env(
        PYTHONPATH=os.pathsep.join([str(_common.BENCH_DIR), os.environ.get("PYTHONPATH", "")]),
        **{_common.FIRST_STEP_ENV: str(stamp_file)},
    )
    command = [
        PY,
        "-m",
        "project.train",
        f"paths.log_dir={tmp / 'logs'}",
        "trainer.accelerator=cpu",
        "+callbacks.first_step._target_=_common.first_step_stamp",
        *extra,
    ]
    start = time.time()
    done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True)
    if done.returncode != 0 or not stamp_file.exists():
        raise SystemExit(f"train run failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return float(stamp_file.read_text()) - start


def heavy_imports(flag: str, tmp: Path) -> list[str]:
    """Top-level packages among torch/lightning/torchmetrics that ``project.train <flag>`` loads."""
    done = subprocess.run(
        [PY, "-X", "importtime", "-m", "project.train", flag],
        env=_env(),
        cwd=tmp,
        capture_output=True,
        text=True,
        check=True,
    )
    loaded = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()}
    return sorted(loaded & {"torch", "lightning", "pytorch_lightning", "torchmetrics"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--overrides", nargs="*", default=[], help="extra overrides for the train run"
    )
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: need at least 1")

    arms = [
        "import lightning",
        "import lightning.pytorch",
        "train to first step",
        "--help",
        "--cfg job",
        "python -c pass",
        "import lightning, collector off",
    ]
    times = _common.Arms(arms)
    with tempfile.TemporaryDirectory(prefix="startup_") as name:
        tmp = Path(name)
        commands = {
            "--help": [PY, "-m", "project.train", "--help"],
            "--cfg job": [PY, "-m", "project.train", "--cfg", "job"],
            "python -c pass": [PY, "-c", "pass"],
        }
        run_import("lightning", _env(), name)  # warm the file cache once
        for order in _common.interleaved(args.repeats, arms):
            for arm in order:
                if arm == "train to first step":
                    times.add(arm, run_to_first_step(tmp, args.overrides))
                elif arm == "import lightning, collector off":
                    prelude = "import gc; gc.disable(); "
                    times.add(arm, run_import("lightning", _env(), name, prelude))
                elif arm.startswith("import "):
                    times.add(arm, run_import(arm.removeprefix("import "), _env(), name))
                else:
                    times.add(arm, run_wall(commands[arm], _env(), name))
        imports = {flag: heavy_imports(flag, tmp) for flag in ("--help", "--cfg=job")}

    import lightning  # noqa: F401  (only for the versions in the machine line)
    import torch

    print("\nstart-up: time of each arm / time of `python -c 'import lightning'` (fresh processes)")
    print(f"machine: {_common.machine_summary()}; {args.repeats} repeats, interleaved")
    print(f"{'arm':<34} {'median':>7}   [min .. max]")
    for arm in arms:
        target = None
        ratios = times.ratios(arm, "import lightning")
        if arm == "train to first step":
            line = _common.ratio_line(arm, ratios)
            verdict = "met" if statistics.median(ratios) <= STARTUP_TARGET else "NOT met"
            line += f"   target <= {STARTUP_TARGET}: {verdict}"
        else:
            line = _common.ratio_line(arm, ratios, target)
        print(line)
    print(
        f"import lightning itself: median {times.median('import lightning'):.2f} s on this machine "
        f"(for scale only; torch {torch.__version__})"
    )
    for flag, loaded in imports.items():
        print(
            f"project.train {flag}: imports "
            + (", ".join(loaded) if loaded else "no torch, Lightning or torchmetrics (as required)")
        )


if __name__ == "__main__":
    main()
