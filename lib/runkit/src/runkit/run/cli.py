"""What every Hydra entry point of a project shares: where its configs are, and errors.

Kept free of torch and Lightning imports, so ``--help`` and ``--cfg job`` answer at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runkit import compat, quoting
from runkit.errors import RunError, file_failure
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
    """The directory holding a project's ``train.yaml``, found from its package's ``__file__``.

    An installed wheel carries the configs inside the package (``<package>/configs``); a clone or
    an editable install of a ``src/`` layout uses the top-level ``configs/`` that users edit.
    ``env_var``, when set in the environment, points somewhere else entirely. Registers the
    resolvers the configs use (``${env_or:...}``, ``${run_id:...}``), so that a config composed
    outside the CLI (a test, a notebook) resolves as the CLI's does.
    """
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
    """Wrap ``task`` as a Hydra app whose user mistakes end in one line on stderr and exit 2.

    Args:
        task: the function a job runs, given the composed config.
        config_name: the primary config in ``config_dir`` (``train``, ``eval``).
        config_dir: the project's configs (:func:`find_configs`).

    Hydra prints multi-line reports with a hint about ``HYDRA_FULL_ERROR``; for a mistake the user
    typed (an unknown key, a bad value) one precise line is kinder, and a real bug still shows its
    full traceback.
    """

    def main() -> None:
        pause_collector()
        try:
            _main()
        finally:
            # The job never ran (--help, --cfg, a mistake): on again, unless the job already
            # turned it on or the caller had it off (then this does nothing).
            resume_collector(freeze=False)

    def _main() -> None:
        import hydra
        import yaml
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        os.environ["HYDRA_FULL_ERROR"] = "1"  # let exceptions reach us instead of Hydra's printer
        # Lightning 2.6 on torch >= 2.10 warns about its own use of a torch API; not the user's concern.
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated"
        )
        from runkit.run.launch import register_resolvers
        from runkit.run.sweep import follow_sweep_parent

        register_resolvers()  # ${run_id:...}: one run directory for all processes of a launch
        # submitit's two handlers and Hydra's printed each of its lines three times; through
        # Hydra's alone, and its warning at every poll of a cluster without accounting once.
        os.environ.setdefault("SUBMITIT_LOG_LEVEL", "NOCONFIG")
        logging.getLogger("submitit").addFilter(_FirstSacctWarning())
        follow_sweep_parent()  # a job of a parallel sweep ends with the sweep (kill -9 included)
        app = hydra.main(version_base="1.3", config_path=str(config_dir), config_name=config_name)
        from runkit.safety.signals import stop_on_signal

        _quiet_reported_failures()
        conflicted = conflicted_config(sys.argv[1:], Path(config_dir))
        if conflicted is not None:
            _fail(conflicted, 2)
        try:
            # Ctrl-C, SIGTERM: recorded, acted on at a safe point, 128+N; after the run too
            with stop_on_signal(until_exit=True):
                jobs = _sweep_to_show(sys.argv[1:])
                if jobs is None:
                    app(_reporting(task))()
                for number, argv in enumerate(jobs or []):
                    print(("---\n" if number else "") + f"# job #{number}: {' '.join(argv[1])}")
                    sys.argv = [sys.argv[0], *argv[0]]
                    app(_reporting(task))()
        except ReportedJobError as err:  # a sweep job's one line is printed already
            raise SystemExit(err.exit_code) from None
        except RunError as err:
            _fail(str(err), err.exit_code)
        except (HydraException, OmegaConfBaseException) as err:
            _fail(one_line(err), 2)
        except yaml.YAMLError as err:  # a config file (the user's own experiment, say) is damaged
            _fail(yaml_problem(err), 2)
        except UnicodeDecodeError as err:  # Hydra reads config files as UTF-8
            problem = undecodable_config(err, sys.argv[1:], Path(config_dir))
            if problem is None:  # not a config file: a data file, say; a bug's traceback then
                raise
            _fail(problem, 2)
        # Hydra: --cfg with --info, say (argparse lets both through); after UnicodeDecodeError,
        # which is a ValueError too
        except ValueError as err:
            if not str(err).startswith("Only one of --run, --multirun"):
                raise
            _fail(str(err), 2)
        except OSError as err:  # Hydra creating the run directory under a file, a full disk...
            failure = file_failure(err)
            if failure is None:
                raise
            _fail(str(failure), failure.exit_code)

    return main


def _reporting(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Run ``task``; a user mistake inside it becomes one line, and a run that never started
    leaves no directory behind.

    In a single run the process exits at once. In a multirun the error is printed and re-raised
    as :class:`ReportedJobError`, so Hydra finishes the other jobs of the sweep and the sweep then
    ends with exit 2, without a second report of the same mistake.
    """

    def job(cfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from runkit.run.launch import job_scope, sweep_objective
        from runkit.run.preflight import check_config, discard_unused, is_worker_process

        try:
            check_config(cfg)  # again per job: the values of a sweep's jobs differ
            resume_collector(freeze=True)  # the heavy imports are done (check_config's targets)
            # In a sweep, DDP children run this job only (runkit.run.launch).
            with job_scope():
                return sweep_objective(cfg, task(cfg))
        except Exception as err:
            hydra_cfg = HydraConfig.get()
            mistake = _user_mistake(err, hydra_cfg.runtime.output_dir)
            if mistake is None:
                raise
            if is_worker_process():
                _worker_fails(mistake)
            with contextlib.suppress(OSError):  # a directory deleted or made unwritable: left
                discard_unused(Path(hydra_cfg.runtime.output_dir))
            if hydra_cfg.mode == RunMode.MULTIRUN:
                print(f"error: {mistake}", file=sys.stderr)
                raise ReportedJobError(str(mistake), mistake.exit_code) from err
            _fail(str(mistake), mistake.exit_code)
        finally:
            from runkit.gpus.claims import finish_job

            finish_job()  # the job's claimed GPUs go back; the next job of a sweep measures anew

    return job


WORKER_WAIT_S = 20.0
"""How long a worker Lightning started waits for rank 0 to report a mistake before it does."""
_PARENT = os.getppid()  # at start: for a worker Lightning started, rank 0


def _worker_fails(mistake: RunError) -> None:
    """End a DDP worker on a user's mistake, leaving the one line to rank 0.

    Rank 0 meets the same mistake (the ranks run the same config), says it once and removes the
    run directory; a second line per rank and a second removal racing the first (which failed
    with a false "cannot create or write train.log") are noise. A worker Lightning started is
    rank 0's child: it waits for rank 0 to end, and says the mistake itself only if rank 0 has
    not ended by then (a mistake of this rank alone). Exiting first would let Lightning's
    observer kill rank 0 before it speaks.
    """
    import time

    if "LOCAL_RANK" in os.environ and not os.environ.get("TORCHELASTIC_RUN_ID"):
        deadline = time.monotonic() + WORKER_WAIT_S
        while os.getppid() == _PARENT and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() != _PARENT:  # rank 0 has ended: it has said it
            raise SystemExit(mistake.exit_code)
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
    _fail(f"rank {rank}: {mistake}", mistake.exit_code)


class ReportedJobError(RunError):
    """A sweep job's mistake whose one line is printed already: the sweep ends with its code."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self) -> tuple[Any, ...]:  # launchers in other processes pickle job results
        return (type(self), (str(self), self.exit_code))


def _quiet_reported_failures() -> None:
    """Keep Hydra from reporting a sweep job whose one line is printed already.

    When a sweeper reads a failed job's result, Hydra writes ``Error executing job with
    overrides: [...]`` and re-raises the job's exception; for a :class:`ReportedJobError` that
    would be a second report of the same mistake. Other failures (bugs) keep Hydra's line.
    """
    from hydra.core.utils import JobReturn, JobStatus

    hydras = JobReturn.__dict__.get("return_value")
    if not isinstance(hydras, property) or getattr(hydras.fget, "quiet_when_reported", False):
        return  # another Hydra, or done already

    def return_value(self: Any) -> Any:
        failure = compat.job_failure(self)  # the job's exception, without Hydra's report
        if self.status == JobStatus.FAILED and isinstance(failure, ReportedJobError):
            raise failure
        return hydras.fget(self)

    return_value.quiet_when_reported = True
    JobReturn.return_value = property(return_value, hydras.fset)


def _sweep_to_show(argv: list[str]) -> list[tuple[list[str], list[str]]] | None:
    """For ``-m ... --cfg job``: each job's command line without ``-m`` and its overrides, so that
    Hydra, which takes ``--cfg`` in single runs only, can show each job's config; else ``None``.

    Only the command line's sweeps are expanded (a sweeper's own search space is not).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        args = compat.hydra_args_parser().parse_args(argv)  # Hydra's own argument parser
    except SystemExit:  # a bad flag: Hydra's own run says so
        return None
    if not (args.multirun and args.cfg):
        return None
    single = [arg for arg in argv if arg not in ("-m", "--multirun")]
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
    flags = [arg for arg in single if arg not in args.overrides]
    return [([*flags, *values], list(values)) for values in itertools.product(*choices)]


def _user_mistake(err: BaseException | None, run_dir: str | None = None) -> RunError | None:
    """The user's mistake behind ``err``, as a RunError, or ``None`` for a bug.

    Hydra wraps errors raised while instantiating; an error of Hydra or OmegaConf itself (an
    interpolation to a key that does not exist, a class that rejects its arguments) and a
    damaged YAML file (read by the task, say a run's ``config.yaml``) are mistakes too. A file
    that fails is the environment's failure in ``run_dir`` (:func:`~runkit.errors.file_failure`).
    """
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    first = err
    while err is not None:
        if isinstance(err, RunError):
            return err
        if isinstance(err, YAMLError):
            return RunError(yaml_problem(err))
        if isinstance(err, OSError) and (failure := file_failure(err, run_dir)) is not None:
            return failure
        err = err.__cause__
    if isinstance(first, HydraException | OmegaConfBaseException):
        return RunError(one_line(first))
    return None


def yaml_problem(err: BaseException) -> str:
    """``<file> is not valid YAML (line 4, column 1): <what the parser expected>``."""
    mark = getattr(err, "problem_mark", None)
    where = getattr(mark, "name", None) or "a config file"
    position = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    parts = [getattr(err, "context", None), getattr(err, "problem", None)]
    what = ", ".join(str(part) for part in parts if part) or " ".join(str(err).split())
    return f"{where} is not valid YAML{position}: {what}"


def undecodable_config(err: UnicodeDecodeError, argv: list[str], config_dir: Path) -> str | None:
    """``<file> is not UTF-8 text (byte 0xff at position 43); save it as UTF-8``, or ``None``
    when no config file is to blame.

    Hydra's error names no file, so the config directories in use (the template's and any
    ``--config-dir``) are searched for the YAML files that do not decode.
    """
    bad = [str(p) for p in _config_files(argv, config_dir) if _undecodable(p)]
    if not bad:
        return None
    byte = err.object[err.start : err.start + 1].hex()
    where = f"byte 0x{byte} at position {err.start}"
    return f"{', '.join(bad)} is not UTF-8 text ({where}); save it as UTF-8"


_CONFLICT_MARKER = re.compile(rb"^(?:<{7}|>{7})(?: |$)|^={7}$", re.M)


def conflicted_config(argv: list[str], config_dir: Path) -> str | None:
    """``configs/train.yaml:22 has merge-conflict markers ...``, or ``None``.

    ``copier update`` (and git) leave a conflict as ``<<<<<<<``/``=======``/``>>>>>>>`` lines and
    exit 0; such a file may even parse as YAML, and train on half of each side. Checked before
    Hydra reads anything, so the run stops before its directory exists.
    """
    for path in _config_files(argv, config_dir):
        try:
            found = _CONFLICT_MARKER.search(path.read_bytes())
        except OSError:  # unreadable is another problem, reported where it is read
            continue
        if found is not None:
            line = found.string.count(b"\n", 0, found.start()) + 1
            shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else path
            return (
                f"{shown}:{line} has merge-conflict markers (<<<<<<< ======= >>>>>>>, left by "
                "copier update or git); keep the lines you want and delete the markers"
            )
    return None


def _config_files(argv: list[str], config_dir: Path) -> list[Path]:
    """The YAML files of the config directories in use: the project's and any ``--config-dir``."""
    options = quoting.config_options(argv)
    dirs = [config_dir, *(Path(v) for o, v in itertools.pairwise(options) if o == "--config-dir")]
    return [p for d in dirs if d.is_dir() for p in sorted(d.rglob("*.yaml"))]


def _undecodable(path: Path) -> bool:
    try:
        path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return True
    except OSError:  # unreadable is another problem, reported where it is read
        pass
    return False


def one_line(err: BaseException) -> str:
    """Fold an exception from Hydra or OmegaConf (often several lines) into one readable line.

    A :class:`RunError` raised inside Hydra (a plugin refusing its settings) is that line itself.
    """
    cause = err.__cause__
    while cause is not None:
        if isinstance(cause, RunError):
            return str(cause)
        cause = cause.__cause__
    unknown = _unknown_key(err)
    if unknown:
        return unknown
    parts = [str(err)]
    cause = err.__cause__
    while cause is not None:
        if str(cause) and str(cause) not in parts[-1]:
            parts.append(str(cause))
        cause = cause.__cause__
    text = " ".join(" ".join(line.strip() for line in part.splitlines()) for part in parts)
    text = text.replace("  ", " ")
    if "LexerNoViableAlt" in text:  # Hydra's grammar takes é, $... only inside quotes
        text = text.replace(" ^ ", " ")
        typed = [arg for arg in sys.argv[1:] if "=" in arg and arg in text]
        key, _, value = typed[0].partition("=") if typed else ("paths.log_dir", "", "/data/my runs")
        text += (
            "; quote a value with spaces, non-ASCII or special characters, e.g. "
            + quoting.override(key, value)
        )
    return text


MOVED_KEYS = {
    "trainer.precision": (
        "precision",
        "the run's precision is the top-level key precision (configs/train.yaml; auto: "
        "bf16-mixed on a GPU with bf16, else 32-true)",
    ),
}
"""Keys a user may expect under one node that the template reads elsewhere: where, and why."""


def _unknown_key(err: BaseException) -> str | None:
    """For ``trainer.devicez=2``: name the key, suggest the nearest real one, mention ``+``.

    For a key the template reads elsewhere (:data:`MOVED_KEYS`), the hint is that key with the
    user's value, ready to paste: ``+trainer.precision=...`` would be refused later.
    """
    import difflib

    from omegaconf.errors import OmegaConfBaseException

    cause = err.__cause__
    if not isinstance(cause, OmegaConfBaseException) or "not in struct" not in str(cause):
        return None
    full_key, key = str(cause.full_key), str(cause.key)
    if full_key in MOVED_KEYS:
        target, why = MOVED_KEYS[full_key]
        typed = [a.partition("=")[2] for a in sys.argv[1:] if a.partition("=")[0] == full_key]
        hint = quoting.command([f"{target}={typed[0]}"]) if typed else f"{target}=..."
        return f"{full_key} is not a key of the config: {why}; write {hint}"
    parent = getattr(cause, "parent_node", None)
    siblings = [str(k) for k in parent] if parent is not None else []
    close = difflib.get_close_matches(key, siblings, n=1)
    prefix = full_key[: -len(key)]
    hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
    return (
        f"{full_key} is not a key of the config{hint}; keys here: {', '.join(siblings)}; "
        f"to add a new key on purpose, write +{full_key}=..."
    )


def _fail(message: str, code: int) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(code)
