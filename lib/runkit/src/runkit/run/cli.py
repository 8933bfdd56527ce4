"""The Hydra entry point of a project's tasks: where its configs are, and one line per mistake.
Free of torch and Lightning imports, so ``--help`` and ``--cfg job`` answer at once."""

from __future__ import annotations

import contextlib
import difflib
import itertools
import logging
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runkit import compat, quoting
from runkit.errors import RunError, exit_with, file_failure
from runkit.run.collector import pause_collector, resume_collector


class QuietFilter(logging.Filter):
    """Drops Lightning's advertising tips from the console and the run log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


class _FirstSacctWarning(logging.Filter):
    """Lets through the first of submitit's "Bypassing sacct error" warnings (no slurmdbd)."""

    said = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "Bypassing sacct error" not in str(record.msg):
            return True
        said, self.said = self.said, True
        return not said


def find_configs(package_file: str | Path, env_var: str | None = None) -> Path:
    """The directory holding ``train.yaml``: ``$env_var``, the package's, or a ``src/`` layout's."""
    from runkit.run.launch import register_resolvers

    register_resolvers()
    package = Path(package_file).resolve().parent
    candidates = [package / "configs", package.parent.parent / "configs"]
    if env_var and os.environ.get(env_var):
        candidates.insert(0, Path(os.environ[env_var]))
    for candidate in candidates:
        if (candidate / "train.yaml").is_file():
            return candidate
    raise RunError(f"no configs found; looked in {', '.join(map(str, candidates))}")


def hydra_entry(
    task: Callable[[Any], Any], config_name: str, config_dir: str | Path
) -> Callable[[], None]:
    """``task`` as a Hydra app: a mistake ends in one line and exit 2, a bug keeps its trace."""

    def main() -> None:
        pause_collector()  # on again once the heavy imports are done, or at the end
        import hydra

        from runkit.run.launch import FAILED_JOBS, destroy_process_group, register_resolvers
        from runkit.run.sweep import follow_sweep_parent
        from runkit.safety.signals import stop_on_signal

        os.environ["HYDRA_FULL_ERROR"] = "1"  # exceptions reach us instead of Hydra's printer
        # Lightning 2.6 on torch >= 2.10 warns about its own use of a torch API.
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated"
        )
        register_resolvers()  # ${run_id:...}: one run directory for all processes of a launch
        os.environ.setdefault("SUBMITIT_LOG_LEVEL", "NOCONFIG")  # submitit's lines through Hydra's
        logging.getLogger("submitit").addFilter(_FirstSacctWarning())
        follow_sweep_parent()  # a job of a parallel sweep ends with the sweep (kill -9 included)
        directory = Path(config_dir)
        app = hydra.main(version_base="1.3", config_path=str(directory), config_name=config_name)
        job = _reporting(task, directory)
        FAILED_JOBS.clear()  # an earlier app in this process (a test's) is not this sweep
        try:
            if (conflicted := conflicted_config(sys.argv[1:], directory)) is not None:
                raise RunError(conflicted)
            # Ctrl-C, SIGTERM: recorded, acted on at a safe point, 128+N; after the run too
            with stop_on_signal(until_exit=True):
                jobs = _sweep_to_show(sys.argv[1:])
                for number, (argv, values) in enumerate(jobs or [(sys.argv[1:], None)]):
                    if values is not None:
                        print(("---\n" if number else "") + f"# job #{number}: {' '.join(values)}")
                    sys.argv = [sys.argv[0], *argv]
                    app(job)()
                destroy_process_group()
        except Exception as err:
            mistake = user_mistake(err, config_dir=directory)
            if mistake is None:
                raise
            if getattr(mistake, "reported", False):  # a submitit job's, said in its own log
                raise SystemExit(mistake.exit_code) from None
            exit_with(mistake)
        finally:  # the job never ran (--help, --cfg, a mistake): the collector on again
            resume_collector(freeze=False)
        if FAILED_JOBS:
            raise SystemExit(FAILED_JOBS[0])

    return main


def _reporting(task: Callable[[Any], Any], config_dir: Path) -> Callable[[Any], Any]:
    """Run ``task``; a mistake is one line (a multirun job returns NaN), no directory left."""

    def job(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from runkit.gpus.claims import finish_job
        from runkit.run.launch import FAILED_JOBS, job_scope, sweep_objective
        from runkit.run.preflight import check_config, discard_unused, is_worker_process

        try:
            check_config(cfg)  # again per job: the values of a sweep's jobs differ
            resume_collector(freeze=True)  # the heavy imports are done (check_config's targets)
            with job_scope():  # in a sweep, DDP children run this job only
                return sweep_objective(cfg, task(cfg))
        except Exception as err:
            hydra_cfg = HydraConfig.get()
            mistake = user_mistake(err, hydra_cfg.runtime.output_dir, config_dir)
            if mistake is None:
                raise
            if is_worker_process():
                _worker_fails(mistake)
            with contextlib.suppress(OSError):  # a directory deleted or made unwritable: left
                discard_unused(Path(hydra_cfg.runtime.output_dir))
            if hydra_cfg.mode != RunMode.MULTIRUN:
                exit_with(mistake)
            print(f"error: {mistake}", file=sys.stderr)
            if os.environ.get("SUBMITIT_EXECUTOR"):  # a job of its own: its result says it
                mistake.reported = True  # type: ignore[attr-defined]
                raise mistake from None
            FAILED_JOBS.append(mistake.exit_code)
            return math.nan
        finally:
            finish_job()  # the job's claimed GPUs go back; the next job measures anew

    return job


WORKER_WAIT_S = 20.0  # how long a worker waits for rank 0 to report a mistake before it does
_PARENT = os.getppid()  # at start: for a worker Lightning started, rank 0


def _worker_fails(mistake: RunError) -> None:
    """End a DDP worker on a mistake, leaving the line to rank 0 unless rank 0 outlives the wait."""
    if "LOCAL_RANK" in os.environ and not os.environ.get("TORCHELASTIC_RUN_ID"):
        deadline = time.monotonic() + WORKER_WAIT_S
        while os.getppid() == _PARENT and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() != _PARENT:  # rank 0 has ended: it has said it
            raise SystemExit(mistake.exit_code)
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
    exit_with(mistake, f"rank {rank}: ")


def _sweep_to_show(argv: list[str]) -> list[tuple[list[str], list[str]]] | None:
    """For ``-m ... --cfg job`` (Hydra shows ``--cfg`` for single runs only): each job's command
    line without ``-m`` and its overrides; else ``None``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = compat.hydra_args_parser().parse_args(argv)  # Hydra's own argument parser
    except SystemExit:  # a bad flag: Hydra's own run says so
        return None
    if not (args.multirun and args.cfg):
        return None
    choices: list[list[str]] = []
    for override in OverridesParser.create().parse_overrides(args.overrides):
        if not override.is_sweep_override():
            choices.append([str(override.input_line)])
        elif not override.is_discrete_sweep():
            raise RunError(
                f"{override.input_line} is an interval: it has no list of jobs for --cfg to show; "
                f"give {override.key_or_group} a list of values (a,b,...) to see each job's config"
            )
        else:
            key = override.get_key_element()
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
    flags = [a for a in argv if a not in ("-m", "--multirun") and a not in args.overrides]
    return [([*flags, *values], list(values)) for values in itertools.product(*choices)]


def user_mistake(
    err: BaseException, run_dir: str | None = None, config_dir: Path | None = None
) -> RunError | None:
    """The user's mistake behind ``err`` or its causes as one line; ``None``: a bug."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    cause: BaseException | None = err
    while cause is not None:
        if isinstance(cause, RunError):
            return cause
        if isinstance(cause, YAMLError):  # <file> is not valid YAML (line 4, column 1): <why>
            mark = getattr(cause, "problem_mark", None)
            where = getattr(mark, "name", None) or "a config file"
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            parts = [getattr(cause, "context", None), getattr(cause, "problem", None)]
            what = ", ".join(str(part) for part in parts if part) or " ".join(str(cause).split())
            return RunError(f"{where} is not valid YAML{at}: {what}")
        if isinstance(cause, OSError) and (failure := file_failure(cause, run_dir)) is not None:
            return failure
        if isinstance(cause, UnicodeDecodeError) and config_dir is not None:
            problem = undecodable_config(cause, sys.argv[1:], config_dir)
            return None if problem is None else RunError(problem)  # a data file: a bug's trace
        cause = cause.__cause__
    if isinstance(err, HydraException | OmegaConfBaseException):
        return RunError(_unknown_key(err) or one_line(err))
    return None


def undecodable_config(err: UnicodeDecodeError, argv: list[str], config_dir: Path) -> str | None:
    """``<file> is not UTF-8 text (...)``, or ``None`` when every config file in use decodes."""
    bad = []
    for path in _config_files(argv, config_dir):
        with contextlib.suppress(OSError):  # unreadable is another problem, reported elsewhere
            try:
                path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                bad.append(str(path))
    if not bad:
        return None
    where = f"byte 0x{err.object[err.start : err.start + 1].hex()} at position {err.start}"
    return f"{', '.join(bad)} is not UTF-8 text ({where}); save it as UTF-8"


_CONFLICT_MARKER = re.compile(rb"^(?:<{7}|>{7})(?: |$)|^={7}$", re.M)


def conflicted_config(argv: list[str], config_dir: Path) -> str | None:
    """``configs/train.yaml:22 has merge-conflict markers ...`` (copier update and git leave
    them and exit 0), or ``None``."""
    for path in _config_files(argv, config_dir):
        with contextlib.suppress(OSError):  # unreadable is another problem, reported elsewhere
            if (found := _CONFLICT_MARKER.search(path.read_bytes())) is not None:
                line = found.string.count(b"\n", 0, found.start()) + 1
                shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else path
                return (
                    f"{shown}:{line} has merge-conflict markers (<<<<<<< ======= >>>>>>>, left by "
                    "copier update or git); keep the lines you want and delete the markers"
                )
    return None


def _config_files(argv: list[str], config_dir: Path) -> list[Path]:
    options = quoting.config_options(argv)
    dirs = [config_dir, *(Path(v) for o, v in itertools.pairwise(options) if o == "--config-dir")]
    return [p for d in dirs if d.is_dir() for p in sorted(d.rglob("*.yaml"))]


def one_line(err: BaseException) -> str:
    """An exception and its causes in one line."""
    parts = [str(err)]
    cause = err.__cause__
    while cause is not None:
        if str(cause) and str(cause) not in parts[-1]:
            parts.append(str(cause))
        cause = cause.__cause__
    text = " ".join(" ".join(line.strip() for line in part.splitlines()) for part in parts)
    text = text.replace("  ", " ")
    if "LexerNoViableAlt" in text:  # Hydra's grammar takes é, $... only inside quotes
        typed = [arg for arg in sys.argv[1:] if "=" in arg and arg in text]
        key, _, value = typed[0].partition("=") if typed else ("paths.log_dir", "", "/data/my runs")
        text = text.replace(" ^ ", " ") + (
            "; quote a value with spaces, non-ASCII or special characters, e.g. "
            + quoting.override(key, value)
        )
    return text


def _unknown_key(err: BaseException) -> str | None:
    """For ``trainer.devicez=2``: the key, the nearest real one, and ``+`` to add one."""
    from omegaconf.errors import OmegaConfBaseException

    cause = err.__cause__
    if not isinstance(cause, OmegaConfBaseException) or "not in struct" not in str(cause):
        return None
    full_key, key = str(cause.full_key), str(cause.key)
    if full_key == "trainer.precision":
        typed = [a.partition("=")[2] for a in sys.argv[1:] if a.partition("=")[0] == full_key]
        hint = quoting.command([f"precision={typed[0]}"]) if typed else "precision=..."
        return (
            f"{full_key} is not a key of the config: the run's precision is the top-level key "
            "precision (configs/train.yaml; auto: bf16-mixed on a GPU with bf16, else 32-true); "
            f"write {hint}"
        )
    parent = getattr(cause, "parent_node", None)
    siblings = [str(k) for k in parent] if parent is not None else []
    close = difflib.get_close_matches(key, siblings, n=1)
    hint = f" (did you mean {full_key[: -len(key)]}{close[0]}?)" if close else ""
    return (
        f"{full_key} is not a key of the config{hint}; keys here: {', '.join(siblings)}; "
        f"to add a new key on purpose, write +{full_key}=..."
    )
