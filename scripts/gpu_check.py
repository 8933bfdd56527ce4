#!/usr/bin/env python3
"""One prepared GPU check: every GPU path of the template proven in one short run.

GPU machines are lent rarely and briefly, with nothing to download there, so everything is
prepared here and the check runs unattended, writes its own report and cannot hang:

    python scripts/gpu_check.py --fetch-wheels   # here: wheels the GPU machine lacks
    python scripts/gpu_check.py --dry-run        # here: wheels complete, every command composes
    python scripts/gpu_check.py                  # there, from the repository root (carry wheels/)

On the GPU machine it installs the wheels it lacks (into a temporary folder put on PYTHONPATH,
so the machine's Python is left alone), puts ``src/`` on PYTHONPATH (no build backend needed),
then runs each step as a subprocess in its own process group, with its own time limit, inside
an overall budget of BUDGET_S seconds. The report (``gpu_check.md`` and ``gpu_check.json``) goes
to ``$OUT`` when set, else to ``logs/gpu_check/<timestamp>/``; it is rewritten after every step,
so a run killed from outside still leaves what it had. Exit code 0 only if every step that was
not skipped passed. Only the standard library is imported at the top: the GPU machine has no
Hydra until this script installs it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS_DIR = ROOT / "wheels" / "gpu-py312"
# name==version per line, written by --fetch-wheels: what the GPU machine installs, exactly.
MANIFEST = "requirements.txt"

# ---- what the GPU machine has, and what we bring ------------------------------------------------
# Installed there, with no way to download anything.
GPU_MACHINE_HAS = (
    "torch",
    "lightning",
    "torchmetrics",
    "nvidia-ml-py",
    "rich",
    "matplotlib",
    "tensorboard",
    "pytest",
)
# Installed there as dependencies of the above (lightning needs PyYAML and packaging, torchmetrics
# numpy, torch typing-extensions): the wheels below may rely on them.
GPU_MACHINE_BRINGS = ("numpy", "pyyaml", "packaging", "typing-extensions")
# Missing there: brought along as wheels for CPython 3.12, x86-64 Linux, in WHEELS_DIR.
# import-linter (with grimp and click) only because tests/test_architecture.py imports it at module
# level: without it pytest cannot collect the suite, so `pytest -m gpu` would stop before any test.
WHEELS = (
    "hydra-core",
    "omegaconf",
    "antlr4-python3-runtime",
    "pytest-timeout",
    "pytest-xdist",  # pytest's settings here name its -n
    "execnet",
    "import-linter",
    "grimp",
    "click",
)
# Imported on the GPU machine after the install: proves the wheels and their dependencies work.
SETUP_IMPORTS = (
    "hydra",
    "omegaconf",
    "antlr4",
    "pytest_timeout",
    "xdist",
    "execnet",
    "importlinter",
    "grimp",
    "click",
    "yaml",
    "packaging",
)
# Folders of this repository whose modules tests import (from src/, or through sys.path).
LIBRARY = Path("lib") / "runkit"  # the vendored lightning-runkit: its source goes on PYTHONPATH
LOCAL_MODULE_DIRS = (
    "src",
    str(LIBRARY / "src"),
    "tests",
    str(LIBRARY / "tests"),
    "benchmarks",
    "scripts",
)
TARGET_PYTHON = "3.12"
TARGET_PLATFORM = "manylinux2014_x86_64"
# For evaluating environment markers of the wheels' requirements as the GPU machine would.
TARGET_MARKERS = {
    "python_version": TARGET_PYTHON,
    "python_full_version": f"{TARGET_PYTHON}.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "extra": "",
}

# ---- the steps: change keys here when configs move -----------------------------------------------
BUDGET_S = 480.0  # 8 minutes for everything, setup included
TAIL_LINES = 40
TRAIN_COMMON = (
    "trainer.max_epochs=3",
    "callbacks.progress_bar.refresh_rate=0",
    # An epoch on the digits lasts about a second on a big GPU: sample NVML often enough to see it.
    "callbacks.gpu_stats.interval_s=0.1",
    "paths.log_dir={log_dir}",
)
# Extra command-line arguments per step. {log_dir}: the step's own log folder; {run:STEP}: the run
# directory STEP left behind.
OVERRIDES: dict[str, tuple[str, ...]] = {
    "train_gpu": ("trainer=gpu", *TRAIN_COMMON),
    "eval_gpu": ("trainer=gpu", "ckpt_path={run:train_gpu}/model.pth", "paths.log_dir={log_dir}"),
    "train_dp": ("trainer=dp", "trainer.devices=1", *TRAIN_COMMON),
    "train_bf16_compile": (
        "trainer=gpu",
        "precision=auto",
        "callbacks.speed.compile=true",
        *TRAIN_COMMON,
    ),
    # FSDP2 over every visible GPU (1 here, all of them on a machine with more), then its
    # sharded checkpoint evaluated on one GPU.
    # monitor=null: the tested weights are the last ones, which eval_fsdp reads back.
    "train_fsdp": (
        "trainer=fsdp",
        "trainer.devices=-1",
        "precision=auto",
        "callbacks.model_checkpoint.monitor=null",
        *TRAIN_COMMON,
    ),
    "eval_fsdp": (
        "trainer=gpu",
        "ckpt_path={run:train_fsdp}/checkpoints/last.ckpt",
        "paths.log_dir={log_dir}",
    ),
    "pytest_gpu": ("-m", "gpu", "-p", "no:cacheprovider", "--timeout=150", "-n", "0"),
    "benchmark": ("--workloads", "mlp", "--repeats", "1", "--epochs", "2"),
}
# Regexes a step's output, train.log or config.yaml must match: proof that a switch took effect.
EXPECT: dict[str, tuple[str, ...]] = {
    "train_dp": (r"strategies\.dp\.DataParallelStrategy",),
    "train_bf16_compile": (r"precision=bf16", r"compile:\s*true"),
    "train_fsdp": (r"strategies\.fsdp\.FSDPStrategy", r"precision=bf16"),
}
# The training whose test accuracy an eval step must reproduce.
EVAL_OF = {"eval_gpu": "train_gpu", "eval_fsdp": "train_fsdp"}
# Per-GPU statistics in csv/metrics.csv: "gpu/" then any prefix (node, device) then the name, so a
# slightly different layout still matches; gpu/all/ (aggregates) and gpu_val/ are left out.
GPU_STATS = ("util_mean", "mem_used_gib_max", "power_w_mean", "energy_j")
GPM_KEY = re.compile(r"sm_active|gpm", re.IGNORECASE)  # the GPM keys of gpu_stats
MIN_TEST_ACC = 0.3  # 10 classes: chance is 0.1; three epochs reach far more unless numerics broke


def gpu_key(stat: str) -> re.Pattern[str]:
    """The column pattern of one per-GPU statistic, tolerant of the exact prefix."""
    return re.compile(rf"^gpu/(?!all/)(?:[^/]+/)*{re.escape(stat)}$")


# ---- wheels -------------------------------------------------------------------------------------


def normalize(name: str) -> str:
    """PEP 503 name, so hydra_core, Hydra-Core and hydra.core compare equal."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_wheel_name(filename: str) -> tuple[str, str, set[tuple[str, str, str]]] | None:
    """(distribution, version, {(python, abi, platform)}) of a wheel file name, None if not one."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        return None
    dist, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    tags = {(p, a, s) for p in py.split(".") for a in abi.split(".") for s in plat.split(".")}
    return normalize(dist), version, tags


def tag_installable(python: str, abi: str, plat: str) -> bool:
    """Whether a wheel tag installs on CPython 3.12 on manylinux x86-64 (the GPU machine)."""
    minor = re.fullmatch(r"cp3(\d+)", python)
    py_ok = python in ("py3", "py312", "cp312") or (
        abi == "abi3" and minor is not None and int(minor.group(1)) <= 12
    )
    abi_ok = abi in ("none", "abi3", "cp312")
    plat_ok = plat == "any" or re.fullmatch(r"manylinux(1|2010|2014|_\d+_\d+)_x86_64", plat)
    return bool(py_ok and abi_ok and plat_ok)


def wheel_requirements(path: Path) -> list[str]:
    """Names the wheel requires on the GPU machine (Requires-Dist, markers evaluated for it)."""
    with zipfile.ZipFile(path) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(metadata).decode("utf-8", "replace")
    names = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        spec = line.split(":", 1)[1].strip()
        requirement, _, marker = spec.partition(";")
        if marker.strip() and not marker_applies(marker.strip()):
            continue
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip())
        if match:
            names.append(normalize(match.group(0)))
    return names


def marker_applies(marker: str) -> bool:
    """Whether an environment marker holds on the GPU machine (conservative without packaging)."""
    try:
        from packaging.markers import Marker
    except ImportError:
        return "extra" not in marker
    return Marker(marker).evaluate(TARGET_MARKERS)


def read_manifest(folder: Path) -> dict[str, str]:
    """The name -> version pairs of the folder's requirements.txt ({} when there is none)."""
    path = folder / MANIFEST
    if not path.is_file():
        return {}
    pairs = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep:
            pairs[normalize(name)] = version.strip()
    return pairs


def installable_wheel(folder: Path, name: str, version: str | None) -> Path | None:
    """The wheel of ``name`` (at ``version``) in ``folder`` that installs on the GPU machine."""
    for path in sorted(folder.glob("*.whl")):
        parsed = parse_wheel_name(path.name)
        if (
            parsed
            and parsed[0] == normalize(name)
            and (version is None or parsed[1] == version)
            and any(tag_installable(*tag) for tag in parsed[2])
        ):
            return path
    return None


def check_wheels(
    folder: Path,
    required: Mapping[str, str | None],
    machine_has: Sequence[str] = GPU_MACHINE_HAS + GPU_MACHINE_BRINGS,
    project_requires: Sequence[str] = (),
) -> list[str]:
    """One line per problem that would stop the GPU machine installing or importing what it needs.

    ``required`` maps each package to bring to its version (None: any). Checked: a wheel for each,
    installable on CPython 3.12 manylinux x86-64; the manifest agrees; every requirement of those
    wheels, and every name in ``project_requires``, is on the machine or in the folder.
    """
    fetch = "run `python scripts/gpu_check.py --fetch-wheels`"
    if not folder.is_dir():
        return [f"wheels folder {folder} does not exist; {fetch}"]
    errors: list[str] = []
    found: dict[str, Path] = {}
    wheels = [(p, parse_wheel_name(p.name)) for p in sorted(folder.glob("*.whl"))]
    for name, version in required.items():
        want = normalize(name)
        candidates = [
            (p, parsed)
            for p, parsed in wheels
            if parsed and parsed[0] == want and (version is None or parsed[1] == version)
        ]
        good = installable_wheel(folder, name, version)
        wanted = f"{name}=={version}" if version else name
        if good:
            found[want] = good
        elif candidates:
            names = ", ".join(p.name for p, _ in candidates)
            errors.append(f"{wanted}: {names} does not install on CPython 3.12 x86-64; {fetch}")
        else:
            errors.append(f"missing wheel: {wanted} (no .whl for it in {folder}); {fetch}")
    manifest = read_manifest(folder)
    if not manifest:
        errors.append(f"{folder / MANIFEST} is missing or empty; {fetch}")
    for name, version in required.items():
        listed = manifest.get(normalize(name))
        if manifest and version and listed != version:
            errors.append(
                f"{MANIFEST} lists {name}=={listed}, this environment has {version}; {fetch}"
            )
    available = {normalize(n) for n in machine_has} | {normalize(n) for n in required}
    for want, path in found.items():
        try:
            needs = wheel_requirements(path)
        except (zipfile.BadZipFile, StopIteration, OSError) as error:
            errors.append(f"{path.name}: not a readable wheel ({error}); {fetch}")
            continue
        errors += [
            f"{want} needs {dep}, which is neither on the GPU machine nor in {folder}"
            for dep in needs
            if dep not in available
        ]
    errors += [
        f"the project needs {dep}, which is neither on the GPU machine nor in {folder}"
        for dep in map(normalize, project_requires)
        if dep not in available
    ]
    return errors


def check_test_imports(tests: Path, available: Sequence[str], root: Path = ROOT) -> list[str]:
    """One line per test module importing, at module level, what the GPU machine will not have.

    pytest imports every test module to collect it, so one such import stops `pytest -m gpu` before
    any GPU test runs. Import names are mapped to distributions as installed here; modules of the
    repository itself (LOCAL_MODULE_DIRS under ``root``) are fine.
    """
    owners = importlib.metadata.packages_distributions()
    have = {normalize(n) for n in available}
    dirs = [root / d for d in LOCAL_MODULE_DIRS] + [tests]

    def local(top: str) -> bool:
        return any((d / f"{top}.py").is_file() or (d / top).is_dir() for d in dirs)

    errors = []
    for path in sorted(tests.glob("**/*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names}:
                if top in sys.stdlib_module_names or local(top):
                    continue
                dists = {normalize(d) for d in owners.get(top, [])}
                if not dists & have:
                    what = ", ".join(sorted(dists)) or "not installed here either"
                    errors.append(
                        f"{path.name} imports {top} ({what}) at module level, which the GPU machine "
                        "lacks: pytest cannot collect it there; add it to WHEELS or importorskip it"
                    )
    return errors


def local_versions(names: Sequence[str] = WHEELS) -> dict[str, str]:
    """This environment's versions of ``names``: what CI tests, so what the GPU machine gets."""
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(
                f"error: {name} is not installed in {sys.executable}; "
                "run this with the project's environment (.venv/bin/python)"
            ) from None
    return versions


def project_requirements(root: Path = ROOT) -> list[str]:
    """Names in the [project].dependencies of the project's and the vendored library's
    pyproject.toml, less the library itself, whose source goes on PYTHONPATH ([] where tomllib
    is missing: Python 3.10)."""
    try:
        import tomllib
    except ImportError:
        return []
    names, vendored = [], set()
    for pyproject in (root / "pyproject.toml", root / LIBRARY / "pyproject.toml"):
        if not pyproject.is_file():
            continue
        data = tomllib.loads(pyproject.read_text())
        if pyproject.parent != root:
            vendored.add(normalize(data["project"]["name"]))
        for spec in data.get("project", {}).get("dependencies", []):
            match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", spec)
            if match:
                names.append(match.group(0))
    return [n for n in dict.fromkeys(names) if normalize(n) not in vendored]


def fetch_wheels(folder: Path = WHEELS_DIR) -> int:
    """Fill ``folder`` with exactly the wheels the GPU machine lacks, at this environment's versions.

    Binary wheels come from PyPI for CPython 3.12 manylinux x86-64; a package published only as an
    sdist (antlr4-python3-runtime 4.9.3) is built here, which is fine only when it is pure Python.
    """
    versions = local_versions()
    folder.mkdir(parents=True, exist_ok=True)
    keep = {(normalize(n), v) for n, v in versions.items()}
    for path in folder.glob("*.whl"):
        parsed = parse_wheel_name(path.name)
        if not parsed or (parsed[0], parsed[1]) not in keep:
            path.unlink()
            print(f"removed {path.name} (not wanted)")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    for name, version in versions.items():
        if installable_wheel(folder, name, version):
            print(f"have  {name}=={version}")
            continue
        download = [
            *pip,
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            TARGET_PYTHON,
            "--implementation",
            "cp",
            "--platform",
            TARGET_PLATFORM,
            "--dest",
            str(folder),
            f"{name}=={version}",
        ]
        if subprocess.run(download, capture_output=True, text=True).returncode == 0:
            print(f"got   {name}=={version}")
            continue
        build = [*pip, "wheel", "--no-deps", "--wheel-dir", str(folder), f"{name}=={version}"]
        result = subprocess.run(build, capture_output=True, text=True)
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            print(f"error: no wheel for {name}=={version}, and building one failed: {tail}")
            return 1
        print(f"built {name}=={version} from its sdist")
    (folder / MANIFEST).write_text("".join(f"{n}=={v}\n" for n, v in versions.items()))
    errors = check_wheels(folder, versions, project_requires=project_requirements())
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    if errors:
        return 1
    files = sorted(folder.glob("*.whl"))
    size = sum(p.stat().st_size for p in files) / 2**20
    print(f"\n{len(files)} wheels, {size:.1f} MiB, in {folder.relative_to(ROOT)}:")
    for path in files:
        print(f"  {path.name}")
    print(
        "\nOn the GPU machine, from the repository root (wheels/ is git-ignored: carry it along):\n"
        "    python scripts/gpu_check.py\n"
        'device tool: run(command="python scripts/gpu_check.py", carry=["wheels"], timeout_s=540)\n'
        "report: $OUT/gpu_check.md and $OUT/gpu_check.json"
    )
    return 0


# ---- running steps ------------------------------------------------------------------------------


class CheckFailed(Exception):
    """A step ran but its figures are wrong; the message is the one line for the report, and the
    figures read so far still go into it (they say how wrong)."""

    def __init__(self, message: str, figures: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.figures = figures or {}


class Skip(Exception):
    """A step has nothing to check (a feature not built yet, a step it relies on failed)."""


@dataclass
class Context:
    """What steps share: where to run, the environment, the run directories found so far."""

    root: Path
    work: Path
    env: dict[str, str]
    dry_run: bool = False
    artifacts: Path | None = None
    run_dirs: dict[str, Path] = field(default_factory=dict)
    deadline: float = float("inf")


@dataclass
class Step:
    """One check: a command (argv after the interpreter; empty for a check without one)."""

    name: str
    what: str
    argv: list[str]
    limit_s: float
    check: Callable[[Step, Context, str, Path], dict[str, Any]] | None = None
    # On a dry run: "compose" (append --cfg job --package trainer), "run" (as is, GPUs hidden),
    # "collect" (pytest --collect-only), "cpu" (append --allow-cpu: a benchmark's whole path on
    # the CPU), "none" (nothing to run).
    dry: str = "run"
    stdout_only: bool = False  # give the check stdout alone (JSON), not stdout + stderr


@dataclass
class StepResult:
    """One row of the report."""

    name: str
    what: str
    command: str
    status: str  # pass | fail | skip | timeout | dry-run
    seconds: float
    limit_s: float
    message: str = ""
    figures: dict[str, Any] = field(default_factory=dict)
    output_tail: list[str] = field(default_factory=list)


def kill_group(process: subprocess.Popen) -> None:
    """Stop a step and everything it started (DDP workers, compile workers): its process group.

    SIGTERM first (Lightning saves and exits), SIGKILL 5 s later to whatever is left.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=5)


def run_command(
    command: Sequence[str], ctx: Context, limit_s: float, log: Path, stdout_only: bool = False
) -> tuple[int | None, str]:
    """Run ``command`` in a new process group; (exit code or None on timeout, its output).

    Output goes to files, not pipes, so a chatty step can never block on a full pipe.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    err_log = log.with_suffix(".stderr.txt") if stdout_only else log
    with log.open("wb") as out, err_log.open("ab") as err:
        process = subprocess.Popen(
            list(command),
            cwd=ctx.root,
            env=ctx.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err if stdout_only else subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout=max(limit_s, 0.1))
        except subprocess.TimeoutExpired:
            code = None
        finally:
            kill_group(process)  # also on success: nothing a step started outlives it
    text = log.read_text("utf-8", "replace")
    if stdout_only and err_log.exists():
        text += err_log.read_text("utf-8", "replace")
    return code, text


def tail(text: str, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` non-empty lines, progress-bar redraws (\\r) split, each at most 300 chars."""
    kept = [line.rstrip()[:300] for line in re.split(r"[\r\n]+", text) if line.strip()]
    return kept[-lines:]


def substitute(argv: Sequence[str], step: Step, ctx: Context) -> list[str]:
    """Fill {log_dir} and {run:STEP} in ``argv``; Skip when a needed run directory is missing."""
    log_dir = ctx.work / step.name / "logs"

    def fill(arg: str) -> str:
        def run_dir(match: re.Match[str]) -> str:
            name = match.group(1)
            if name in ctx.run_dirs:
                return str(ctx.run_dirs[name])
            if ctx.dry_run:
                return str(ctx.work / name / "run-placeholder")
            raise Skip(f"{name} left no run directory")

        return re.sub(r"\{run:([a-z0-9_]+)\}", run_dir, arg.replace("{log_dir}", str(log_dir)))

    return [fill(arg) for arg in argv]


def run_step(step: Step, ctx: Context) -> StepResult:
    """Run one step within its limit and the overall deadline, and check what it left."""
    start = time.monotonic()
    limit = min(step.limit_s, ctx.deadline - start)
    result = StepResult(step.name, step.what, "", "fail", 0.0, round(step.limit_s, 1))
    try:
        argv = substitute(step.argv, step, ctx)
    except Skip as skip:
        result.status, result.message = "skip", str(skip)
        return result
    if ctx.dry_run and step.dry == "compose":  # the trainer section: what the step would run
        argv += ["--cfg", "job", "--package", "trainer"]
    elif ctx.dry_run and step.dry == "collect":
        argv += ["--collect-only", "-q"]
    elif ctx.dry_run and step.dry == "cpu":
        argv += ["--allow-cpu"]
    command = [sys.executable, *argv] if argv else []
    result.command = " ".join(command) if command else "(reads files of earlier steps)"
    if limit < 1.0:
        result.status = "timeout"
        result.message = "not started: the overall budget was spent"
        return result
    output, code = "", 0
    log = ctx.work / "output" / f"{step.name}.txt"
    if command and not (ctx.dry_run and step.dry == "none"):
        code, output = run_command(command, ctx, limit, log, step.stdout_only)
        if ctx.artifacts is not None:  # the whole output (its last MiB) next to the report
            (ctx.artifacts / "output").mkdir(parents=True, exist_ok=True)
            (ctx.artifacts / "output" / log.name).write_text(output[-(2**20) :])
    result.output_tail = tail(output)
    try:
        if code is None:
            result.status = "timeout"
            result.message = f"killed at its limit of {limit:.0f} s"
        elif code != 0:
            result.message = f"exit code {code}: {(tail(output, 1) or ['(no output)'])[0]}"
        elif ctx.dry_run and step.dry == "none":
            result.status = "dry-run"
            result.message = "nothing to run without a GPU"
        else:
            result.figures = step.check(step, ctx, output, log) if step.check else {}
            result.status = "dry-run" if ctx.dry_run else "pass"
    except CheckFailed as failed:
        result.message, result.figures = str(failed), failed.figures
    except Skip as skip:
        result.status, result.message = "skip", str(skip)
    except Exception as error:  # a bug in a check must not cost the other steps
        result.message = f"check crashed: {type(error).__name__}: {error}"
    result.seconds = round(time.monotonic() - start, 1)
    return result


def run_steps(
    steps: Sequence[Step],
    ctx: Context,
    budget_s: float = BUDGET_S,
    on_result: Callable[[list[StepResult]], None] | None = None,
    results: list[StepResult] | None = None,
) -> list[StepResult]:
    """Run ``steps`` in order within ``budget_s`` in all, appending to ``results`` as they finish
    (so whoever holds that list keeps them if a signal cuts the run); ``on_result`` sees it each time.
    """
    ctx.deadline = min(ctx.deadline, time.monotonic() + budget_s)
    results = [] if results is None else results
    for step in steps:
        results.append(run_step(step, ctx))
        if on_result:
            on_result(results)
    return results


# ---- checks -------------------------------------------------------------------------------------


def find_run_dir(output: str, step: Step, ctx: Context) -> Path:
    """The run directory a training or evaluation printed ("Run directory: ..."), else the newest."""
    printed = re.findall(r"Run directory: (\S+)", output)
    if printed and Path(printed[-1]).is_dir():
        return Path(printed[-1])
    found = sorted((ctx.work / step.name / "logs").glob("**/metrics.json"), key=os.path.getmtime)
    if not found:
        raise CheckFailed("no run directory: no 'Run directory:' line and no metrics.json")
    return found[-1].parent


def read_csv_rows(run: Path) -> tuple[Path, list[dict[str, str]]]:
    """The CSV logger's metrics.csv of a run (csv/metrics.csv or csv/<version>/metrics.csv)."""
    found = sorted((run / "csv").glob("**/metrics.csv"))
    if not found:
        raise CheckFailed(f"no csv/**/metrics.csv in {run}")
    with found[0].open(newline="") as handle:
        return found[0], list(csv.DictReader(handle))


def column_values(rows: list[dict[str, str]], pattern: re.Pattern[str]) -> dict[str, list[float]]:
    """Each matching column's non-empty values, as floats."""
    columns = {c for row in rows for c in row if c and pattern.search(c)}
    values: dict[str, list[float]] = {}
    for column in sorted(columns):
        numbers = [float(r[column]) for r in rows if (r.get(column) or "").strip()]
        if numbers:
            values[column] = numbers
    return values


def gpu_figures(rows: list[dict[str, str]], csv_path: Path) -> dict[str, Any]:
    """Per-GPU NVML statistics of training, checked plausible: the callback saw a busy GPU."""
    figures: dict[str, Any] = {}
    missing = []
    for stat in GPU_STATS:
        values = column_values(rows, gpu_key(stat))
        if not values:
            missing.append(stat)
            continue
        column, numbers = next(iter(values.items()))
        figures[column] = round(sum(numbers) if stat == "energy_j" else max(numbers), 3)
    if missing:
        gpu_columns = sorted({c for r in rows for c in r if c and c.startswith("gpu")})
        shown = ", ".join(gpu_columns[:8]) or "none"
        raise CheckFailed(f"no gpu/.../{{{','.join(missing)}}} in {csv_path.name} (gpu: {shown})")
    bounds = {"util_mean": (0, 100), "mem_used_gib_max": (0, 1024), "power_w_mean": (0, 2000)}
    for column, value in figures.items():
        stat = column.rsplit("/", 1)[-1]
        low, high = bounds.get(stat, (0, float("inf")))
        if not low < value <= high:
            raise CheckFailed(f"{column} = {value}: expected in ({low}, {high}]", figures)
    return figures


def expect(step: Step, texts: Sequence[str]) -> dict[str, Any]:
    """Each EXPECT regex of the step, found in one of ``texts``."""
    figures = {}
    for pattern in EXPECT.get(step.name, ()):
        match = next((m for t in texts if (m := re.search(pattern, t))), None)
        if match is None:
            raise CheckFailed(f"expected /{pattern}/ in the output, train.log or config.yaml")
        figures[f"matched /{pattern}/"] = match.group(0)
    return figures


def check_train(step: Step, ctx: Context, output: str, log: Path) -> dict[str, Any]:
    """A training on cuda:0: its summary says CUDA, it learned, NVML statistics were logged."""
    if ctx.dry_run:
        return {}
    run = find_run_dir(output, step, ctx)
    ctx.run_dirs[step.name] = run
    keep_artifacts(step.name, run, ctx)
    summary = json.loads((run / "metrics.json").read_text())
    acc = summary.get("metrics", {}).get("test/acc")
    figures: dict[str, Any] = {
        "run_dir": str(run),
        "accelerator": summary.get("accelerator"),
        "test/acc": acc,
        "wall_seconds": summary.get("wall_seconds"),
    }
    try:
        if "cuda" not in str(summary.get("accelerator", "")).lower():
            raise CheckFailed(
                f"metrics.json says accelerator={summary.get('accelerator')}, not CUDA"
            )
        if not isinstance(acc, int | float) or acc < MIN_TEST_ACC:
            raise CheckFailed(f"test/acc = {acc}: expected >= {MIN_TEST_ACC}")
        csv_path, rows = read_csv_rows(run)
        figures.update(gpu_figures(rows, csv_path))
        texts = [output] + [
            (run / name).read_text("utf-8", "replace")
            for name in ("train.log", "config.yaml")
            if (run / name).is_file()
        ]
        figures.update(expect(step, texts))
    except CheckFailed as failed:
        raise CheckFailed(str(failed), {**figures, **failed.figures}) from None
    return figures


def check_eval(step: Step, ctx: Context, output: str, log: Path) -> dict[str, Any]:
    """Weights evaluated on cuda:0 reproduce the test accuracy their training reported."""
    if ctx.dry_run:
        return {}
    run = find_run_dir(output, step, ctx)
    keep_artifacts(step.name, run, ctx)
    summary = json.loads((run / "metrics.json").read_text())
    acc = summary.get("metrics", {}).get("test/acc")
    trained = json.loads((ctx.run_dirs[EVAL_OF[step.name]] / "metrics.json").read_text())
    reference = trained.get("metrics", {}).get("test/acc")
    figures = {"accelerator": summary.get("accelerator"), "test/acc": acc, "trained": reference}
    if "cuda" not in str(summary.get("accelerator", "")).lower():
        message = f"metrics.json says accelerator={summary.get('accelerator')}, not CUDA"
        raise CheckFailed(message, figures)
    if acc is None or reference is None or abs(acc - reference) > 0.02:
        raise CheckFailed(f"test/acc = {acc}, but training reported {reference}", figures)
    return figures


def check_gpm(step: Step, ctx: Context, output: str, log: Path) -> dict[str, Any]:
    """GPM figures in the training CSV (Hopper and newer; a skip where the GPU has none)."""
    run = ctx.run_dirs.get("train_gpu")
    if run is None:
        raise Skip("train_gpu left no run directory")
    csv_path, rows = read_csv_rows(run)
    values = column_values(rows, GPM_KEY)
    if not values:
        raise Skip(f"not present: no sm_active/gpm column in {csv_path.name}")
    figures = {column: round(max(numbers), 3) for column, numbers in values.items()}
    if not any(v > 0 for v in figures.values()) or any(not 0 <= v <= 100 for v in figures.values()):
        raise CheckFailed(f"GPM figures implausible (all zero or outside [0, 100]): {figures}")
    return figures


def check_devices(step: Step, ctx: Context, output: str, log: Path) -> dict[str, Any]:
    """The listing names cuda:0."""
    if ctx.dry_run:
        return {}
    if "cuda:0" not in output:
        raise CheckFailed("the listing does not mention cuda:0")
    return {"lines": len(output.splitlines())}


def check_devices_json(step: Step, ctx: Context, output: str, log: Path) -> dict[str, Any]:
    """The JSON parses and counts at least one GPU (any count on a dry run)."""
    try:
        doc = json.loads(log.read_text())
    except ValueError as error:
        raise CheckFailed(f"stdout is not JSON: {error}") from None
    count = doc.get("device_count")
    gpus = doc.get("gpus") or []
    figures = {
        "device_count": count,
        "cuda_available": doc.get("cuda_available"),
        "gpus": [g.get("name") for g in gpus if isinstance(g, dict)],
        "driver": (doc.get("nvml") or {}).get("driver_version"),
    }
    if not isinstance(count, int) or count < (0 if ctx.dry_run else 1):
        raise CheckFailed(f"device_count = {count}: expected >= 1", figures)
    return figures


def check_pytest(step: Step, ctx: Context, output: str, log: Path) -> dict[str, Any]:
    """The GPU tests ran (at least one passed) with pytest-timeout loaded."""
    counts = {
        k: int(n)
        for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", output)
    }
    plugins = re.search(r"^plugins: (.*)$", output, re.MULTILINE)
    figures: dict[str, Any] = {**counts, "plugins": plugins.group(1) if plugins else ""}
    if ctx.dry_run:
        collected = re.search(r"(\d+)(?:/\d+)? tests? collected", output)
        figures["collected"] = int(collected.group(1)) if collected else 0
        if not figures["collected"]:
            raise CheckFailed("no gpu test collected", figures)
        return figures
    if not counts.get("passed"):
        raise CheckFailed(f"no gpu test passed: {counts}", figures)
    return figures


BENCHMARK_ARMS = ("template", "lightning", "plain")  # plain: the hand-written loop


def check_benchmark(step: Step, ctx: Context, output: str, log: Path) -> dict[str, Any]:
    """Throughput and MFU of the template, plain Lightning and the hand loop, measured in one
    run on the same GPU, with the template's ratio to each (a dry run takes the same path on
    the CPU with a tiny workload: ``--allow-cpu``, no MFU)."""
    figures: dict[str, Any] = {}
    for arm, rate, mfu in re.findall(
        rf"^\s*({'|'.join(BENCHMARK_ARMS)})\s+(\d+) samples/s.*MFU (.+?)\s*$", output, re.M
    ):
        figures[f"{arm} samples/s"] = int(rate)
        figures[f"{arm} MFU"] = mfu
    for label, median in re.findall(r"^\s*\S+ / (.+?), samples/s\s+([\d.]+)", output, re.M):
        figures[f"template / {label}"] = float(median)
    missing = [arm for arm in BENCHMARK_ARMS if f"{arm} samples/s" not in figures]
    if missing:
        raise CheckFailed(f"no 'samples/s' figure for {', '.join(missing)} in the output", figures)
    return figures


def keep_artifacts(name: str, run: Path, ctx: Context) -> None:
    """Copy a run's small files (metrics, CSV, log, curves) next to the report."""
    if ctx.artifacts is None:
        return
    dest = ctx.artifacts / name
    dest.mkdir(parents=True, exist_ok=True)
    for pattern in ("metrics.json", "config.yaml", "curves.png", "*.log", "csv/**/metrics.csv"):
        for path in run.glob(pattern):
            if path.is_file() and path.stat().st_size < 2 * 2**20:
                shutil.copy2(path, dest / path.name)


def default_steps() -> list[Step]:
    """Every GPU path of the template, most important first, so a short budget still says most."""
    py_m = ["-m"]
    return [
        Step("devices", "GPU listing", [*py_m, "runkit.devices"], 60, check_devices),
        Step(
            "devices_json",
            "GPU listing as JSON, device_count >= 1",
            [*py_m, "runkit.devices", "--json"],
            60,
            check_devices_json,
            stdout_only=True,
        ),
        Step(
            "train_gpu",
            "default training on cuda:0, NVML statistics in the CSV",
            [*py_m, "project.train", *OVERRIDES["train_gpu"]],
            150,
            check_train,
            dry="compose",
        ),
        Step("gpm_figures", "GPM figures", [], 10, check_gpm, dry="none"),
        Step(
            "eval_gpu",
            "model.pth evaluated on cuda:0 reproduces the test accuracy",
            [*py_m, "project.eval", *OVERRIDES["eval_gpu"]],
            90,
            check_eval,
            dry="compose",
        ),
        Step(
            "train_dp",
            "DataParallel on the one GPU",
            [*py_m, "project.train", *OVERRIDES["train_dp"]],
            120,
            check_train,
            dry="compose",
        ),
        Step(
            "train_bf16_compile",
            "bf16-mixed with torch.compile",
            [*py_m, "project.train", *OVERRIDES["train_bf16_compile"]],
            180,
            check_train,
            dry="compose",
        ),
        Step(
            "train_fsdp",
            "FSDP2 (trainer=fsdp) over every GPU, bf16 parameters, sharded checkpoints",
            [*py_m, "project.train", *OVERRIDES["train_fsdp"]],
            150,
            check_train,
            dry="compose",
        ),
        Step(
            "eval_fsdp",
            "the sharded last.ckpt evaluated on one GPU reproduces the test accuracy",
            [*py_m, "project.eval", *OVERRIDES["eval_fsdp"]],
            90,
            check_eval,
            dry="compose",
        ),
        Step(
            "pytest_gpu",
            "the tests marked gpu",
            [*py_m, "pytest", *OVERRIDES["pytest_gpu"]],
            200,
            check_pytest,
            dry="collect",
        ),
        Step(
            "benchmark",
            "throughput and MFU: the template, plain Lightning and a hand loop, briefly",
            ["benchmarks/gpu_throughput.py", *OVERRIDES["benchmark"]],
            180,
            check_benchmark,
            dry="cpu",
        ),
    ]


# ---- setup: wheels and environment -----------------------------------------------------------------

# Left by a parent process (a test, a DDP launcher) and changing how a child run behaves.
LEAKY_ENV = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PL_GLOBAL_SEED",
    "PROJECT_LOG_DIR",
    "RUNKIT_NVML_BACKEND",
    "RUNKIT_FAKE_NVML",
    "HYDRA_FULL_ERROR",
)


def step_env(root: Path, site: Path, dry_run: bool) -> dict[str, str]:
    """The steps' environment: src/ and the installed wheels importable, GPUs hidden on a dry run."""
    env = {k: v for k, v in os.environ.items() if k not in LEAKY_ENV}
    paths = [str(root / "src"), str(root / LIBRARY / "src")] + ([] if dry_run else [str(site)])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def install_wheels(folder: Path, site: Path, ctx: Context, limit_s: float) -> StepResult:
    """Install the wheels this machine lacks into ``site`` (all of them on a dry run), check imports.

    ``--target`` leaves the machine's Python alone and is allowed where PEP 668 forbids installs.
    """
    start = time.monotonic()
    result = StepResult("setup", "install the wheels this machine lacks", "", "fail", 0.0, limit_s)
    manifest = read_manifest(folder)
    installed = {}
    for name in WHEELS:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            installed[name] = importlib.metadata.version(name)
    wanted = [n for n in WHEELS if ctx.dry_run or n not in installed]
    result.figures = {"already installed": installed, "installing": wanted}
    missing = [n for n in wanted if normalize(n) not in manifest]
    if missing:
        result.message = f"not in {folder / MANIFEST}: {', '.join(missing)}; fetch the wheels first"
        return result
    lines: list[str] = []
    if wanted:
        specs = [f"{n}=={manifest[normalize(n)]}" for n in wanted]
        # A dry run installs as for the GPU machine's Python, whatever this one is.
        target = ["--python-version", TARGET_PYTHON, "--implementation", "cp"]
        target += ["--abi", f"cp{TARGET_PYTHON.replace('.', '')}", "--platform", TARGET_PLATFORM]
        command = [
            *(sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"),
            *("--no-index", "--no-deps", "--find-links", str(folder), "--target", str(site)),
            *(target if ctx.dry_run else []),
            *specs,
        ]
        result.command = " ".join(command)
        code, output = run_command(command, ctx, limit_s, ctx.work / "output" / "setup.txt")
        lines += tail(output)
        if code is None or (code != 0 and "No module named pip" not in output):
            result.status = "timeout" if code is None else "fail"
            result.message = f"pip install failed: {(tail(output, 1) or ['?'])[0]}"
            result.output_tail = lines
            return result
        if code != 0:  # no pip here: a wheel is a zip archive, unpacked it is installed enough
            for spec in specs:
                name, version = spec.split("==")
                for path in folder.glob("*.whl"):
                    if (parse_wheel_name(path.name) or ("", ""))[:2] == (normalize(name), version):
                        zipfile.ZipFile(path).extractall(site)
            lines.append(f"pip unavailable: unpacked {', '.join(specs)} into {site}")
    found = {
        normalize(d.metadata["Name"]): d.version
        for d in importlib.metadata.distributions(path=[str(site)])
    }
    result.figures["installed"] = found
    absent = [n for n in wanted if normalize(n) not in found]
    if absent:
        result.message = f"not installed after pip: {', '.join(absent)}"
        result.output_tail = lines
        return result
    if not ctx.dry_run:  # on a dry run the fake or real wheels stay out of the steps' way
        code_text = "import " + ", ".join(SETUP_IMPORTS)
        code, output = run_command(
            [sys.executable, "-c", code_text], ctx, 60, ctx.work / "output" / "imports.txt"
        )
        lines += tail(output)
        if code != 0:
            result.message = (
                f"after the install, `{code_text}` fails: {(tail(output, 1) or ['?'])[0]}"
            )
            result.output_tail = lines
            return result
    result.status = "dry-run" if ctx.dry_run else "pass"
    result.output_tail = lines
    result.seconds = round(time.monotonic() - start, 1)
    return result


def environment() -> dict[str, Any]:
    """Python, platform and package versions (from metadata: nothing heavy is imported)."""
    versions = {}
    for name in GPU_MACHINE_HAS + GPU_MACHINE_BRINGS + WHEELS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "packages (before setup)": versions,
    }


# ---- report -------------------------------------------------------------------------------------


def overall(results: Sequence[StepResult]) -> tuple[bool, dict[str, int]]:
    """(every step that was not skipped passed, the count per status)."""
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return all(r.status in ("pass", "skip", "dry-run") for r in results), counts


def write_report(out: Path, results: Sequence[StepResult], meta: dict[str, Any]) -> None:
    """gpu_check.json and gpu_check.md in ``out``, rewritten whole (so always complete)."""
    ok, counts = overall(results)
    doc = {**meta, "ok": ok, "counts": counts, "steps": [asdict(r) for r in results]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    md = [
        f"# GPU check ({meta['mode']}): {'PASS' if ok else 'FAIL'}",
        "",
        f"{meta['started']}, {meta.get('elapsed_s', 0):.0f} s of a {meta['budget_s']:.0f} s budget; "
        f"{summary}.",
        "",
        "| step | status | s | what | message |",
        "| --- | --- | --- | --- | --- |",
    ]
    md += [
        f"| {r.name} | {r.status} | {r.seconds:.1f} | {r.what} | {r.message.replace('|', '/')} |"
        for r in results
    ]
    md += ["", "## Environment", "", "```json", json.dumps(meta["environment"], indent=2), "```"]
    for r in results:
        md += ["", f"## {r.name}: {r.status}", "", f"{r.what}. {r.message}".strip(), ""]
        md += [f"`{r.command}`" if r.command else "(no command)", ""]
        if r.figures:
            md += ["```json", json.dumps(r.figures, indent=2, default=str), "```", ""]
        if r.output_tail:
            md += ["<details><summary>last lines of output</summary>", "", "```text"]
            md += [*r.output_tail, "```", "", "</details>"]
    (out / "gpu_check.md").write_text("\n".join(md) + "\n")


# ---- main ---------------------------------------------------------------------------------------


def interrupt(signum: int, frame: Any) -> None:
    """SIGTERM from outside (a device timeout) unwinds like Ctrl-C: the running step's process
    group is killed on the way out, and the report keeps what was done."""
    raise KeyboardInterrupt


def wheels_result(folder: Path) -> StepResult:
    """The dry run's wheel check as a report row, its problems also printed one per line."""
    errors = check_wheels(folder, local_versions(), project_requires=project_requirements())
    for tests in (ROOT / "tests", ROOT / LIBRARY / "tests"):
        errors += check_test_imports(tests, GPU_MACHINE_HAS + GPU_MACHINE_BRINGS + WHEELS)
    for line in errors:
        print(f"error: {line}", file=sys.stderr)
    return StepResult(
        "wheels",
        "the wheels folder holds what the GPU machine lacks",
        f"check_wheels({folder})",
        "fail" if errors else "dry-run",
        0.0,
        0.0,
        "; ".join(errors),
        {"folder": str(folder), "wheels": sorted(p.name for p in folder.glob("*.whl"))},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Fetch wheels, dry-run, or run the check; the exit code says whether everything passed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--fetch-wheels", action="store_true", help="fill the wheels folder (here)")
    mode.add_argument("--dry-run", action="store_true", help="check what can be without a GPU")
    parser.add_argument("--wheels", type=Path, default=WHEELS_DIR, help="the wheels folder")
    parser.add_argument("--steps", help="comma-separated steps to run (default: all)")
    parser.add_argument("--out", type=Path, help="report folder (default: $OUT, else logs/...)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for everything")
    args = parser.parse_args(argv)
    if args.fetch_wheels:
        return fetch_wheels(args.wheels.resolve())

    steps = default_steps()
    if args.steps:
        chosen = [s.strip() for s in args.steps.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in {step.name for step in steps}]
        if unknown:
            names = ", ".join(step.name for step in steps)
            parser.error(f"unknown step {', '.join(unknown)}; steps are {names}")
        steps = [step for step in steps if step.name in chosen]

    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    out = (out or ROOT / "logs" / "gpu_check" / stamp).resolve()
    work = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    site = work / "site-packages"
    ctx = Context(ROOT, work, step_env(ROOT, site, args.dry_run), args.dry_run, out / "artifacts")
    ctx.deadline = time.monotonic() + args.budget
    meta: dict[str, Any] = {
        "mode": "dry-run" if args.dry_run else "gpu",
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "budget_s": args.budget,
        "environment": environment(),
    }
    began = time.monotonic()
    results: list[StepResult] = []

    def report(done: list[StepResult]) -> None:
        meta["elapsed_s"] = round(time.monotonic() - began, 1)
        write_report(out, done, meta)
        r = done[-1]
        print(f"{r.name}: {r.status} ({r.seconds:.0f} s) {r.message}", flush=True)

    signal.signal(signal.SIGTERM, interrupt)
    try:
        if args.dry_run:
            results.append(wheels_result(args.wheels.resolve()))
            report(results)
        if results and results[-1].status == "fail":  # pip would only fail the same way
            results.append(StepResult("setup", "install the wheels", "", "skip", 0.0, 0.0))
            results[-1].message = "the wheels folder is incomplete"
        else:
            setup_limit = min(120.0, ctx.deadline - time.monotonic())
            results.append(install_wheels(args.wheels.resolve(), site, ctx, setup_limit))
        report(results)
        run_steps(steps, ctx, args.budget, on_result=report, results=results)
    except KeyboardInterrupt:
        results.append(StepResult("interrupted", "stopped from outside", "", "fail", 0.0, 0.0))
        report(results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok, counts = overall(results)
    print(f"{'PASS' if ok else 'FAIL'}: {counts}; report: {out / 'gpu_check.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
