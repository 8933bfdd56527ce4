"""How every process of a launch finds its run: one job per DDP child, one directory per launch.

Lightning starts ranks > 0 by re-running ``sys.argv``, which in a sweep holds ``-m`` and every
value (Lightning #11300): :func:`job_scope` narrows it to the current job. :func:`run_id` names
one directory for all processes (SLURM job and step, torchrun id, else the time), and
:func:`requeued_checkpoint` finds what an earlier attempt of a requeued or restarted launch saved.
SLURM reuses job ids, so a job is known by its first attempt's start, kept in its comment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from runkit.errors import RunError
from runkit.quoting import config_options
from runkit.safety.signals import rank_zero, slurm_job_id

log = logging.getLogger(__name__)

SWEEP_JOB_ENV = "RUNKIT_SWEEP_JOB"  # the sweep job's number, inherited by its DDP children
SAVED_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", SWEEP_JOB_ENV)
CHILD_GRACE_S = 60.0  # how long rank 0 waits at a job's end for its children to exit
JOB_TOKEN_FILE = "slurm_job"  # in a SLURM job's run directory: <cluster>:<job id>:<first start>

FAILED_JOBS: list[int] = []
"""Exit codes of the sweep jobs that failed, their line printed: the sweep ends with the first.
Hydra sees them complete with a NaN objective (a sweeper's failed trial): no second report."""
_launchers: list[list[Any]] = []  # per running sweep job: the launchers whose children it collects


@contextmanager
def job_scope() -> Iterator[None]:
    """Run one Hydra job so that the DDP children started inside it run this job and no other.
    Does nothing outside a sweep and where the ranks were started by someone else."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        yield
        return
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        with _submitit_job():
            yield
        return
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or launched_externally():
        if SWEEP_JOB_ENV in os.environ and "LOCAL_RANK" in os.environ:
            rank, num = os.environ["LOCAL_RANK"], os.environ[SWEEP_JOB_ENV]
            task = " ".join(hydra_cfg.overrides.task)
            log.info("Rank %s runs sweep job #%s: %s", rank, num, task)
        yield
        return
    saved_argv, saved_run_dir = list(sys.argv), hydra_cfg.run.dir
    saved_env = {key: os.environ.get(key) for key in SAVED_ENV}
    task, hydra = hydra_cfg.overrides.task, hydra_cfg.overrides.hydra
    sys.argv = single_job_argv(sys.argv[0], task, hydra, sys.argv[1:])
    _set_run_dir(hydra_cfg, str(hydra_cfg.runtime.output_dir))
    os.environ[SWEEP_JOB_ENV] = str(hydra_cfg.job.num)
    launchers: list[Any] = []
    _launchers.append(launchers)
    try:
        yield
    finally:
        _launchers.remove(launchers)
        _finish_children(launchers)
        sys.argv = saved_argv
        _set_run_dir(hydra_cfg, saved_run_dir)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _submitit_job() -> Iterator[None]:
    """A sweep job of ``hydra/launcher=slurm``: submitit's SIGUSR2 is a stop (every rank saves),
    then submitit's own handler requeues the job into the same folder."""
    import signal

    from runkit.safety.signals import stop_on_signal

    try:
        with stop_on_signal():
            yield
    except SystemExit as stop:
        handler = signal.getsignal(signal.SIGUSR2)  # submitit's again, after the block
        if stop.code == 128 + signal.SIGUSR2 and callable(handler):
            handler(signal.SIGUSR2, None)
        raise


def single_job_argv(program: str, task: Any, hydra: Any, argv: Sequence[str] = ()) -> list[str]:
    """The command line that runs one job of a sweep as a single run: the config options of
    ``argv``, the job's overrides ``task``, the ``hydra`` overrides and ``hydra.mode=RUN``."""
    kept = [str(o) for o in hydra if not str(o).lstrip("~+").startswith("hydra.mode=")]
    return [program, *config_options(argv), *map(str, task), *kept, "hydra.mode=RUN"]


def track(trainer: Any) -> None:
    """Remember ``trainer``'s launcher, so the current job can collect the children it starts."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if _launchers and launcher is not None and hasattr(launcher, "procs"):
        _launchers[-1].append(launcher)


def launched_externally(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the ranks were started by something else than Lightning in this process."""
    env = os.environ if environ is None else environ
    return any(k in env for k in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "LSB_JOBID")) or (
        _slurm_tasks(env) > 1
    )


def ranks_start_together(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every rank was started at once by a launcher (torchrun, SLURM tasks)."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or _slurm_tasks(env) > 1


def join_restarted_group(trainer: Any, environ: Mapping[str, str] | None = None) -> None:
    """In a group torchrun restarted, set up the process group before Lightning does, under
    ``runkit/attempt_<N>/`` in torchrun's store: torch's own connection reads the dead attempt's
    addresses there and fails or hangs. Does nothing in a first attempt."""
    env = os.environ if environ is None else environ
    restart = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if restart == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from datetime import timedelta

    import torch.distributed as dist
    from lightning.pytorch.strategies import ParallelStrategy

    strategy = trainer.strategy
    if dist.is_initialized() or not isinstance(strategy, ParallelStrategy):
        return
    backend = getattr(strategy, "process_group_backend", None)  # the user's, else the device's
    backend = backend or ("nccl" if strategy.root_device.type == "cuda" else "gloo")
    world = _int(env.get("WORLD_SIZE"))
    port, timeout = _int(env.get("MASTER_PORT")), timedelta(minutes=30)
    store = dist.TCPStore(env["MASTER_ADDR"], port, world, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"runkit/attempt_{restart}/", store)
    dist.init_process_group(backend, store=prefixed, rank=_int(env.get("RANK")), world_size=world)


def _set_run_dir(hydra_cfg: Any, value: str | None) -> None:
    from omegaconf import read_write

    with read_write(hydra_cfg):
        hydra_cfg.run.dir = value


def destroy_process_group() -> None:
    """Once a process's work is done, as torch asks: a gloo group left to the interpreter's exit
    may abort the process ("terminate called without an active exception")."""
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _finish_children(launchers: list[Any]) -> None:
    """The process group goes first (a child blocked in a collective then fails), then each
    child gets a grace period before it is killed."""
    procs: list[subprocess.Popen] = []
    for launcher in launchers:
        procs += launcher.procs
        launcher.procs.clear()  # Lightning's watchdog would kill the sweep on a child's exit
    destroy_process_group()
    for proc in procs:
        try:
            code = proc.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning("DDP child %d did not exit %.0f s after its job", proc.pid, CHILD_GRACE_S)
            proc.kill()
            code = proc.wait()
        if code != 0:
            log.warning("DDP child %d of this job exited with code %s", proc.pid, code)


def sweep_objective(cfg: Any, result: Any) -> Any:
    """What the entry point returns to Hydra: the ``optimized_metric`` as a float when set
    (the sweepers' objective), else the task's own result."""
    key = cfg.get("optimized_metric") if hasattr(cfg, "get") else None
    if not key:
        return result
    if not isinstance(result, Mapping) or key not in result:
        known = ", ".join(sorted(result)) if isinstance(result, Mapping) else "none"
        raise RunError(f"optimized_metric={key!r} is not a metric of this run; it has: {known}")
    return float(result[key])


def run_id(pattern: str, environ: Mapping[str, str] | None = None) -> str:
    """The name of this run's directory, the same in every process of one launch."""
    env = os.environ if environ is None else environ
    job = slurm_job_id(env)
    requeue = f"-requeue{_int(env.get('SLURM_RESTART_COUNT'))}" if _restarted(env) else ""
    if job and _slurm_tasks(env) > 1:
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
        start = slurm_first_start(env)
        first = f"{datetime.fromisoformat(start).strftime(pattern)}_" if start else ""
        return f"{first}slurm-{job}" + (f".{step}" if step else "") + requeue
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    if elastic and elastic != "none":
        restart = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
        return f"torchrun-{elastic}" + (f"-restart{restart}" if restart else "")
    world = _int(env.get("WORLD_SIZE"))
    # Lightning's own DDP children (LOCAL_RANK, no torchrun id) are handed hydra.run.dir.
    if world > 1 and (elastic == "none" or "LOCAL_RANK" not in env):
        raise RunError(
            f"WORLD_SIZE={world}: every process of this launch needs the same run directory and "
            "nothing names it; pass hydra.run.dir=<dir> (the same on every node) or give torchrun "
            "a unique --rdzv-id"
        )
    stamp = datetime.now().strftime(pattern)
    return f"{stamp}_slurm-{job}{requeue}" if job else stamp


def requeued_checkpoint(
    run_dir: str | Path,
    overrides: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Path | None:
    """After a SLURM requeue or a torchrun restart: the newest complete checkpoint an earlier
    run of this job with the same ``overrides`` (by default this run's) left beside ``run_dir``.
    A torchrun launch whose earlier run finished is a rerun of a used ``--rdzv-id``: one line."""
    env = os.environ if environ is None else environ
    current = Path(run_dir).resolve()
    start = slurm_first_start(env)
    token = f"{env.get('SLURM_CLUSTER_NAME', '')}:{slurm_job_id(env)}:{start}" if start else None
    if token and rank_zero(env):
        (current / JOB_TOKEN_FILE).write_text(token + "\n", encoding="utf-8")
    earlier_runs = _earlier_runs(env)
    if earlier_runs is None:
        return None
    what, name = earlier_runs
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    resuming = _restarted(env) or "TORCHELASTIC_RUN_ID" in env
    found, finished = _earlier_checkpoints(env, current, name, token, resuming, overrides)
    if finished and "TORCHELASTIC_RUN_ID" in env:
        raise RunError(
            f"torchrun --rdzv-id={env['TORCHELASTIC_RUN_ID']} has run to its end already, in "
            f"{finished[0]}; give torchrun a new --rdzv-id to train again"
        )
    if not resuming:
        return None
    newest = max(found, key=lambda p: p.stat().st_mtime).resolve() if found else None
    if rank_zero(env):
        said = (
            f": resuming from {newest}" if newest else "; no checkpoint of this command to resume"
        )
        log.info("%s%s", what, said)
    return newest


def _earlier_checkpoints(
    env: Mapping[str, str],
    current: Path,
    name: re.Pattern[str],
    token: str | None,
    resuming: bool,
    overrides: list[str],
) -> tuple[list[Path], list[Path]]:
    """The complete checkpoints of this job's earlier runs of the same command, and those runs
    that finished; runs of an earlier job with the same id are left out, in one line."""
    found: list[Path] = []
    finished: list[Path] = []
    others: list[str] = []
    submitit = env.get("SUBMITIT_EXECUTOR") == "slurm"  # a sweep job: requeued into its folder
    for earlier in [current] if submitit else current.parent.iterdir():
        if not submitit and (earlier == current or not name.search(earlier.name)):
            continue
        if token and _read(earlier / JOB_TOKEN_FILE) != token:
            others.append(earlier.name)
        elif resuming and _overrides(earlier) == [str(o) for o in overrides]:
            if (earlier / "metrics.json").is_file():
                finished.append(earlier)
            found += [p for p in (earlier / "checkpoints").glob("*.ckpt") if complete_checkpoint(p)]
    if others and rank_zero(env):
        log.info(
            "SLURM job %s: %d run(s) in %s (%s...) are of an earlier job with this id; "
            "this job does not resume from them",
            slurm_job_id(env), len(others), current.parent, max(others),
        )  # fmt: skip
    return found, finished


def _earlier_runs(env: Mapping[str, str]) -> tuple[str, re.Pattern[str]] | None:
    """For a SLURM job or a restarted torchrun group: what happened, in words, and the pattern
    of its earlier attempts' run directories (:func:`run_id`)."""
    if job := slurm_job_id(env):
        pattern = rf"(^|_)slurm-{re.escape(job)}(\.\d+)?(-requeue\d+)?$"
        return f"SLURM job {job} was requeued", re.compile(pattern)
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    restart = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if elastic and elastic != "none" and restart > 0:
        limit = env.get("TORCHELASTIC_MAX_RESTARTS")
        what = f"torchrun restarted the group (restart {restart}{f' of {limit}' if limit else ''})"
        return what, re.compile(rf"^torchrun-{re.escape(elastic)}(-restart\d+)?$")
    return None


def complete_checkpoint(checkpoint: Path) -> bool:
    """A whole checkpoint file, or a sharded checkpoint directory (``trainer=fsdp``)."""
    if checkpoint.is_dir():
        from runkit.safety.checkpoints import is_sharded_checkpoint  # torch: only when needed

        return is_sharded_checkpoint(checkpoint)
    return zipfile.is_zipfile(checkpoint)


def _overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides a run recorded (``.hydra/overrides.yaml``)."""
    import yaml

    try:
        data = yaml.safe_load(_read(run_dir / ".hydra" / "overrides.yaml") or "")
    except yaml.YAMLError:
        return None
    return [str(o) for o in data] if isinstance(data, list) else None


_first_starts: dict[str, str | None] = {}


def slurm_first_start(environ: Mapping[str, str] | None = None) -> str | None:
    """When this SLURM job's first attempt started, the same in every task and requeued attempt:
    the first attempt's rank 0 keeps it in the job's comment (``runkit-start=...``), since SLURM
    keeps no such time across a requeue. ``None`` where ``squeue`` cannot say."""
    env = os.environ if environ is None else environ
    job = slurm_job_id(env)
    if job is None:
        return None
    if job not in _first_starts:
        try:
            out = subprocess.run(
                ["squeue", "-h", "-j", job, "-o", "%S|%k"], capture_output=True, text=True,
                timeout=60,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            out = ""
        start, _, comment = out.partition("|")
        comment = "" if comment == "(null)" else comment
        kept = re.search(r"runkit-start=(\S+)", comment)
        valid = re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", start)
        _first_starts[job] = kept.group(1) if kept else start if valid else None
        if not kept and valid and rank_zero(env):  # the first attempt (or one requeued before)
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                comment = f"comment={comment} runkit-start={start}".replace("= ", "=")
                subprocess.run(["scontrol", "update", f"job={job}", comment], timeout=60)
    return _first_starts[job]


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _restarted(env: Mapping[str, str]) -> bool:
    return _int(env.get("SLURM_RESTART_COUNT")) > 0


def rank_suffix(environ: Mapping[str, str] | None = None) -> str:
    """``_rank<N>`` for ranks > 0 started by torchrun or SLURM (they share the run directory)."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK") or (env.get("SLURM_PROCID") if _slurm_tasks(env) > 1 else None)
    return f"_rank{rank}" if rank not in (None, "", "0") else ""


def env_or(name: str, default: str) -> str:
    """``${env_or:VAR,default}``: ``default`` when the variable is unset *or empty*."""
    return os.environ.get(name) or default


def register_resolvers() -> None:
    """Make ``${run_id:...}``, ``${rank_suffix:}`` and ``${env_or:...}`` available (idempotent)."""
    from omegaconf import OmegaConf

    for name, resolver, cache in (
        ("env_or", env_or, False),
        ("run_id", run_id, True),
        ("rank_suffix", rank_suffix, True),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver, use_cache=cache)


def _slurm_tasks(env: Mapping[str, str]) -> int:
    return _int(env.get("SLURM_NTASKS")) if slurm_job_id(env) else 0


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0
