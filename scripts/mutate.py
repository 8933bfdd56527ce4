"""Mutation testing of one module with its fast tests (``make mutate MODULE=checkpoints``).

mutmut (configured under ``[tool.mutmut]`` in pyproject.toml) changes one thing at a time inside
the module's functions (a flipped comparison, and/or, a constant off by one, True/False, a
deleted call...) and runs the tests that reach the changed function; a mutant no test notices
"survived". This script runs it on a fresh copy of the tree (mutmut writes a ``mutants/``
folder, and the working tree may be in use), narrows it to one module and its fast tests, and
prints the score of the non-equivalent mutants. Mutants that cannot change behaviour are listed,
each with its reason, in docs/mutation/equivalent.md: a listed mutant that no longer survives
with the same change is reported as stale, never silently excused.

    python scripts/mutate.py checkpoints
    python scripts/mutate.py finite_loss
    python scripts/mutate.py lib/runkit/src/runkit/gpus/resolve.py \\
        --tests lib/runkit/tests/test_devices.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: mutmut brings the toml package there
    import toml as tomllib  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "docs" / "mutation" / "equivalent.md"
# Where the library's package lives in the tree; mutmut's dotted names map back there first.
LIBRARY_SRC = "lib/runkit/src/"
SOURCE_ROOTS = (LIBRARY_SRC, "src/")

# The modules that guard data, devices and GPU figures, each with the fast tests
# that are its own. `-m "not slow"` is added to every run: slow tests never count.
MODULES: dict[str, tuple[list[str], list[str]]] = {
    # checkpoint I/O and loading, the crash-safe writes under it, the allow-list of _target_s
    "checkpoints": (
        [
            "lib/runkit/src/runkit/safety/checkpoints.py",
            "lib/runkit/src/runkit/safety/writes.py",
            "lib/runkit/src/runkit/safety/trusted.py",
        ],
        [
            "lib/runkit/tests/test_checkpointing.py",
            "lib/runkit/tests/test_untrusted_files.py",
            "lib/runkit/tests/test_fsdp.py",  # its fast tests: the sharded directories
        ],
    ),
    # device resolution and selection, CUDA_VISIBLE_DEVICES, the NVML reader, the listing
    "gpus": (
        ["lib/runkit/src/runkit/gpus/*.py"],
        [
            "lib/runkit/tests/test_devices.py",
            "lib/runkit/tests/test_devices_cli.py",
            "lib/runkit/tests/test_gpu_claims.py",
            "lib/runkit/tests/test_fake_nvml.py",
        ],
    ),
    # the GPU statistics callback, its sampler, statistics and report, by their fast tests.
    "gpu_stats": (
        [
            f"lib/runkit/src/runkit/gpu_stats/{name}.py"
            for name in ("callback", "exchange", "sampler", "statistics")
        ],
        ["lib/runkit/tests/test_gpu_stats.py", "lib/runkit/tests/test_gpu_telemetry.py"],
    ),
    # stop signals: recorded at once, repeats judged, forked children left out (in-process tests
    # only count: the CLI and fresh-interpreter tests run the unmutated tree)
    "signals": (
        ["lib/runkit/src/runkit/safety/signals.py"],
        ["lib/runkit/tests/test_signals.py"],
    ),
    # a small module to try the tool on
    "finite_loss": (
        ["lib/runkit/src/runkit/safety/finite_loss.py"],
        ["lib/runkit/tests/test_finite_loss.py"],
    ),
}

IGNORED_IN_COPY = shutil.ignore_patterns(
    ".venv", ".git", "logs", "mutants", "outputs", "multirun", "lightning_logs", "wheels",
    "__pycache__", ".pytest_cache", ".ruff_cache", ".import_linter_cache", "notebooks",
)  # fmt: skip
KILLED = {"killed", "timeout", "segfault"}


@dataclass
class Equivalent:
    name: str
    change: str
    reason: str


def normalise(code: str) -> str:
    """The change as one comparable line: no backticks, single spaces."""
    return " ".join(code.replace("`", "").split())


def read_equivalents(path: Path) -> dict[str, Equivalent]:
    """Rows ``| mutant name | changed line | reason |`` of the equivalent-mutants table (a ``|``
    inside a cell is written ``\\|``)."""
    if not path.is_file():
        return {}
    rows = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())]
        cells = cells[1:-1]  # the text outside the first and last pipe
        if len(cells) == 3 and "__mutmut_" in cells[0]:
            name = cells[0].strip("`")
            rows[name] = Equivalent(name, normalise(cells[1]), cells[2])
    return rows


def resolve_module(module: str, tests: list[str] | None) -> tuple[list[str], list[str]]:
    if module in MODULES:
        files, default_tests = MODULES[module]
        return files, tests or default_tests
    if not tests:
        sys.exit(
            f"error: no tests known for {module!r}; pass --tests, or one of: {', '.join(MODULES)}"
        )
    path = Path(module)
    files = [f"{module.rstrip('/')}/*.py"] if (ROOT / path).is_dir() else [module]
    return files, tests


def copy_tree(destination: Path) -> None:
    """The tree, with the library's package also under the copy's ``src/``, beside the project's:
    mutmut names a module by its path below ``src/`` (or the root), and a mutant whose name is not
    the module's import name is never found by the tests."""
    if destination.exists():
        shutil.rmtree(destination)
    shutil.copytree(ROOT, destination, ignore=IGNORED_IN_COPY, symlinks=True)
    library = destination / LIBRARY_SRC / "runkit"
    shutil.copytree(library, destination / "src" / "runkit", ignore=IGNORED_IN_COPY)


def in_copy(pattern: str) -> str:
    """A source pattern of the tree as mutmut sees it in the copy (see :func:`copy_tree`)."""
    return "src/" + pattern.removeprefix(LIBRARY_SRC)


def set_mutmut_config(pyproject: Path, files: list[str], tests: list[str]) -> None:
    """Narrow the copy's [tool.mutmut] to the module and its tests, keeping the rest of it."""
    text = pyproject.read_text(encoding="utf-8")
    settings = tomllib.loads(text).get("tool", {}).get("mutmut", {})
    settings.update(
        source_paths=["src/"],
        only_mutate=[in_copy(f) for f in files],
        pytest_add_cli_args_test_selection=tests,
    )
    # Strings, lists of strings, numbers and booleans: their JSON is valid TOML.
    section = "[tool.mutmut]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in settings.items())
    text, count = re.subn(r"(?ms)^\[tool\.mutmut\]\n.*?(?=^\[|\Z)", section + "\n", text)
    if count == 0:
        text += "\n" + section
    pyproject.write_text(text, encoding="utf-8")


def mutmut(copy: Path, *args: str, log: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m mutmut ...`` in the copy, its mutated sources (the library's and the
    project's packages) first on every child's path, ahead of the editable installs.

    The folder must exist before Python starts: a path entry that is missing at startup is
    cached as unimportable, and the tests would silently import the unmutated package.
    """
    mutated_src = copy / "mutants" / "src"
    mutated_src.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(mutated_src)}
    out = log.open("w", encoding="utf-8") if log else subprocess.PIPE
    try:
        return subprocess.run(
            [sys.executable, "-m", "mutmut", *args],
            cwd=copy,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    finally:
        if log:
            out.close()


_SHOW_ALL = """
import contextlib, io, json, sys
from mutmut.__main__ import cli
diffs = {}
for name in sys.argv[1:]:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            cli.main(["show", name], standalone_mode=False)
    except Exception as err:  # a mutant mutmut cannot show: say so rather than stop
        out.write(f"(mutmut show failed: {type(err).__name__}: {err})")
    diffs[name] = out.getvalue()
print(json.dumps(diffs))
"""


def show_all(copy: Path, names: list[str]) -> dict[str, str]:
    """``mutmut show`` of each mutant, in one process (a process each takes seconds)."""
    if not names:
        return {}
    shown = subprocess.run(
        [sys.executable, "-c", _SHOW_ALL, *names],
        cwd=copy,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(shown.stdout.splitlines()[-1])


def added_lines(diff: str) -> str:
    """The mutated line(s) of a ``mutmut show`` diff."""
    lines = [ln[1:] for ln in diff.splitlines() if ln.startswith("+") and not ln.startswith("+++")]
    return normalise(" ".join(lines))


def module_of(mutant: str) -> str:
    """``runkit.a.b.x_f__mutmut_3`` -> ``lib/runkit/src/runkit/a/b.py`` (the file that exists)."""
    dotted = re.split(r"\.x[_ǁ]", mutant, maxsplit=1)[0].replace(".", "/") + ".py"
    return next((r + dotted for r in SOURCE_ROOTS if (ROOT / r / dotted).is_file()), dotted)


def table_row(
    module: str, names: list[str], killed: set[str], excused: set[str], command: str
) -> str:
    n_killed = sum(n in killed for n in names)
    n_excused = sum(n in excused for n in names)
    considered = len(names) - n_excused
    score = 100 * n_killed / considered if considered else 100.0
    return f"| {module} | {len(names)} | {n_killed} | {n_excused} | {score:.1f} % | `{command}` |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("module", help=f"one of {', '.join(MODULES)}, or a path under src/")
    parser.add_argument("--tests", nargs="+", help="test files (default: the module's own)")
    parser.add_argument("--workdir", type=Path, help="where to copy the tree (default: a temp dir)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="score the results already in --workdir (after rerunning some mutants there with "
        "'mutmut run NAME'), without copying or running anything",
    )
    args = parser.parse_args(argv)

    files, tests = resolve_module(args.module, args.tests)
    tests = [t for t in tests if (ROOT / t).is_file()]
    if not tests:
        sys.exit(f"error: none of the test files for {args.module!r} exist")
    workdir = args.workdir or Path(tempfile.gettempdir()) / f"mutate-{Path(args.module).stem}"
    copy = workdir.resolve()
    if args.report_only:
        if not (copy / "mutants").is_dir():
            sys.exit(f"error: --report-only: no mutmut results in {copy}; run without it first")
    else:
        print(f"copying the tree to {copy}", flush=True)
        copy_tree(copy)
        set_mutmut_config(copy / "pyproject.toml", files, tests)
        print(f"mutating {' '.join(files)} with {' '.join(tests)} (-m 'not slow')", flush=True)
        log = copy / "mutmut-run.log"
        run = mutmut(copy, "run", f"--max-children={args.max_children}", log=log)
        if run.returncode != 0:
            print(log.read_text(encoding="utf-8")[-4000:])
            sys.exit(f"error: mutmut run failed (exit {run.returncode}); log in {log}")

    listing = mutmut(copy, "results", "--all=true").stdout
    statuses = dict(re.findall(r"^\s+(\S+__mutmut_\d+): (.+)$", listing, flags=re.M))
    equivalents = read_equivalents(EQUIVALENT_FILE)
    killed = [n for n, s in statuses.items() if s in KILLED]
    excused, survivors, stale = [], [], []
    diffs = show_all(copy, sorted(set(statuses) - set(killed)))
    for name, diff in diffs.items():
        change = added_lines(diff)
        known = equivalents.get(name)
        if known and known.change == change:
            excused.append(name)
        else:
            survivors.append((name, statuses[name], diff))
            if known:
                stale.append(f"{name}: listed as `{known.change}`, now `{change}`")
    stale += [f"{n}: listed as equivalent but {statuses[n]}" for n in killed if n in equivalents]

    report = copy / "survivors.txt"
    report.write_text("".join(f"# {n}: {s}\n{d}\n" for n, s, d in survivors), encoding="utf-8")
    for name, status, diff in survivors:
        print(f"\n# {name}: {status}\n{diff}")
    for line in stale:
        print(f"stale equivalent entry: {line}")
    command = f"make mutate MODULE={args.module}"
    print("\n| module | mutants | killed | equivalent | score (non-equivalent) | command |")
    print("|---|---|---|---|---|---|")
    by_module: dict[str, list[str]] = {}
    for name in statuses:
        by_module.setdefault(module_of(name), []).append(name)
    rows = [(m, by_module[m]) for m in sorted(by_module)]
    if len(rows) > 1:
        rows.append(("all of them", list(statuses)))
    for module, names in rows:
        print(table_row(module, names, set(killed), set(excused), command))
    print(f"\n{len(survivors)} surviving mutants (diffs in {report})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
