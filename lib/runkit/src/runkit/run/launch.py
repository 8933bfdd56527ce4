"""How DDP processes find their run: one directory per run, one job per launched child.

Two problems, both from the fact that every DDP process runs the Hydra entry point itself.

**A sweep with DDP** (``python -m <package>.train -m ... trainer.devices=2``). Lightning starts
ranks > 0 by re-running ``sys.argv`` with ``hydra.run.dir=<HydraConfig.run.dir>`` appended. In a
sweep that command still holds ``-m`` and every sweep value, so each child re-runs the *whole*
sweep, in lockstep with rank 0 by luck only (Lightning #11300): an adaptive sweeper (Optuna)
hands the child other parameters, a failed job desynchronises the rest, and ``run.dir`` names no
job folder. :func:`job_scope` wraps each job of a sweep in the process that launches the
children, and for the length of the job:

* sets ``sys.argv`` to exactly this job: the entry module, the job's own overrides
  (``HydraConfig.overrides.task``: the grid values or the sweeper's draw), the Hydra overrides of
  the command line, and ``hydra.mode=RUN``: no ``-m``, no other values;
* points ``HydraConfig.run.dir`` at the job's folder (``runtime.output_dir``), which is what
  Lightning appends as ``hydra.run.dir``, so the child writes beside rank 0;
* afterwards, whatever happened: collects the job's children (those still running after a grace
  period are killed), destroys the process group, and removes the launch variables Lightning set
  (``LOCAL_RANK``, ``MASTER_PORT``...), so the next job launches fresh children on a fresh port.

Rewriting what Lightning re-executes, rather than replacing its launcher, keeps Lightning's own
child command and environment handling (a private class that changes between releases) and
confines the change to two values restored after the job. Children started by the launcher must
be registered with :func:`track` (``builders.build_trainer`` does it).

**One directory under torchrun and SLURM**. The default run directory is a timestamp, different
in every process. :func:`run_id` (the ``${run_id:<strftime pattern>}`` resolver used by
``configs/hydra/default.yaml``) gives processes of one launch the same name instead:
``slurm-<job>.<step>`` for a multi-task SLURM step, ``torchrun-<rdzv id>`` under torchrun, and
otherwise the timestamp (``<timestamp>_slurm-<job>`` inside a single-task SLURM job). A
multi-process launch without such an id (torchrun's default ``--rdzv-id=none``, or
``NODE_RANK``/``WORLD_SIZE`` set by hand) must be given ``hydra.run.dir``; it fails with one line
saying so instead of scattering the ranks over several directories.

**A requeued SLURM job resumes by itself**. After a requeue (``SLURM_RESTART_COUNT`` > 0) the
job runs the same command again, in a new directory (``...-requeue<N>``: an earlier run's
directory is only read). With ``ckpt_path=null``, :func:`requeued_checkpoint` finds the newest
checkpoint of the same command in this job's earlier directories (``interrupted.ckpt`` from the
stop, or the last periodic one) and the run continues from it. A job id is not an identity (a
controller whose state was reset starts again at 1, ids wrap around), and SLURM keeps nothing
that tells a requeued attempt from a new job with the same id, so the job keeps its own: the
start of its first attempt (:func:`slurm_first_start`), in the name of a multi-task step's
directory and in every run's ``slurm_job`` file; only runs with this job's token are resumed from.
A sweep job of ``hydra/launcher=slurm`` (submitit) is requeued into its own job folder and
resumes from that folder's checkpoint.

Imports stay light (no torch, no Lightning at module level): ``cli`` registers the resolvers
before Hydra starts, and ``--help`` must stay instant.
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

# What Lightning's subprocess launcher puts into os.environ for its children (and itself).
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")
SWEEP_JOB_ENV = "RUNKIT_SWEEP_JOB"
"""Set by rank 0 for the length of a sweep job: the job's number, inherited by its DDP children."""
CHILD_GRACE_S = 60.0
"""How long rank 0 waits, at the end of a job, for the job's children to exit by themselves."""

_active: list[_Job] = []


class _Job:
    def __init__(self) -> None:
        self.launchers: list[Any] = []


# ------------------------------------------------------------------------------------------------
# One job per child


@contextmanager
def job_scope() -> Iterator[None]:
    """Run one Hydra job so that the DDP children started inside it run this job and no other.

    Does nothing outside a sweep, and in processes whose ranks were started by someone else
    (torchrun, SLURM, a DDP child): there is nothing to launch, hence nothing to rewrite.
    """
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
            # A child launched for one job of a sweep: say which, in its own log file.
            log.info(
                "Rank %s runs sweep job #%s: %s",
                os.environ["LOCAL_RANK"],
                os.environ[SWEEP_JOB_ENV],
                " ".join(hydra_cfg.overrides.task),
            )
        yield
        return
    saved_argv = list(sys.argv)
    saved_env = {key: os.environ.get(key) for key in (*LAUNCH_ENV, SWEEP_JOB_ENV)}
    saved_run_dir = hydra_cfg.run.dir
    job = _Job()
    sys.argv = single_job_argv(
        sys.argv[0], hydra_cfg.overrides.task, hydra_cfg.overrides.hydra, sys.argv[1:]
    )
    _set_run_dir(hydra_cfg, str(hydra_cfg.runtime.output_dir))
    os.environ[SWEEP_JOB_ENV] = str(hydra_cfg.job.num)
    _active.append(job)
    try:
        yield
    finally:
        _active.remove(job)
        _finish_children(job)
        sys.argv = saved_argv
        _set_run_dir(hydra_cfg, saved_run_dir)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _submitit_job() -> Iterator[None]:
    """A sweep job that submitit runs on SLURM (``hydra/launcher=slurm``) stops as a run does.

    Submitit's own SIGUSR2 handler (the notice before the time limit) would requeue the job from
    wherever Python is, unsaved. Here SIGUSR2 is a stop like SLURM's SIGUSR1: every rank stops at
    the same batch and saves; then submitit's handler, called as it would have been, requeues the
    job (``checkpoint()``: the same job again, in the same folder, up to ``max_num_timeout``
    times) and exits. The requeued job resumes from that folder (:func:`requeued_checkpoint`).
    """
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
    """The command line (after the interpreter) that runs one job of a sweep as a single run.

    ``task`` are the job's overrides (already one value each); ``hydra`` the command line's
    ``hydra.*`` overrides, minus the run mode, which becomes ``hydra.mode=RUN``; ``argv`` the
    sweep's own arguments, whose config options (``--config-dir``...) the job keeps.
    """
    kept = [str(o) for o in hydra if not str(o).lstrip("~+").startswith("hydra.mode=")]
    return [program, *config_options(argv), *map(str, task), *kept, "hydra.mode=RUN"]


def track(trainer: Any) -> None:
    """Remember ``trainer``'s launcher, so the current job can collect the children it starts."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if _active and launcher is not None and hasattr(launcher, "procs"):
        _active[-1].launchers.append(launcher)


def launched_externally(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the ranks of this run are started by something else than Lightning in this process:
    a DDP child (``LOCAL_RANK``), torchrun, SLURM (several tasks), LSF."""
    env = os.environ if environ is None else environ
    if "LOCAL_RANK" in env or "TORCHELASTIC_RUN_ID" in env or "LSB_JOBID" in env:
        return True
    return _slurm_tasks(env) > 1


def join_restarted_group(trainer: Any, environ: Mapping[str, str] | None = None) -> None:
    """In a group torchrun restarted, set up the process group before Lightning does.

    torchrun's c10d rendezvous keeps one store for the whole launch, and torch connects a
    restarted group's ranks through it without a per-attempt prefix ("a new TCPStore for every
    retry"): gloo then reads the dead attempt's addresses and fails (``connectFullMesh ...
    Connection refused``) or hangs. Here the ranks meet under ``runkit/attempt_<N>/`` in that store,
    and Lightning, finding the group set up, uses it. Does nothing in a first attempt.
    """
    env = os.environ if environ is None else environ
    restart = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if restart == 0 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from datetime import timedelta

    import torch.distributed as dist

    from runkit import compat

    if dist.is_initialized():
        return
    backend = compat.process_group_backend(trainer.strategy)
    if backend is None:
        return  # not a distributed strategy
    world = _int(env.get("WORLD_SIZE"))
    store = dist.TCPStore(
        env["MASTER_ADDR"], _int(env.get("MASTER_PORT")), world, is_master=False,
        timeout=timedelta(minutes=30),
    )  # fmt: skip
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"runkit/attempt_{restart}/", store),
        rank=_int(env.get("RANK")),
        world_size=world,
    )


def ranks_start_together(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every rank was started at once by a launcher (torchrun, SLURM tasks), rather
    than by rank 0's Lightning once rank 0 had made the run directory."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or _slurm_tasks(env) > 1


def _set_run_dir(hydra_cfg: Any, value: str | None) -> None:
    from omegaconf import read_write

    with read_write(hydra_cfg):
        hydra_cfg.run.dir = value


def _finish_children(job: _Job) -> None:
    """Collect the children of a job: first the process group goes (a child blocked in a collective
    then fails instead of hanging), then each child gets a grace period before it is killed."""
    procs: list[subprocess.Popen] = []
    for launcher in job.launchers:
        procs += launcher.procs
        # Lightning's watchdog thread holds this very list and kills this process (the whole
        # sweep) when a child exits non-zero; the job is over, so the job's children are ours.
        launcher.procs.clear()
    _destroy_process_group()
    for proc in procs:
        try:
            code = proc.wait(timeout=CHILD_GRACE_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "DDP child %d did not exit %.0f s after its job; killing it",
                proc.pid,
                CHILD_GRACE_S,
            )
            proc.kill()
            code = proc.wait()
        if code != 0:
            log.warning("DDP child %d of this job exited with code %s", proc.pid, code)


def _destroy_process_group() -> None:
    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def sweep_objective(cfg: Any, result: Any) -> Any:
    """What the entry point returns to Hydra: with ``optimized_metric`` set (``hparams_search``
    presets), that one metric as a float, which sweepers such as Optuna minimise or maximise;
    otherwise the task's own result."""
    key = cfg.get("optimized_metric") if hasattr(cfg, "get") else None
    if not key:
        return result
    if not isinstance(result, Mapping) or key not in result:
        known = ", ".join(sorted(result)) if isinstance(result, Mapping) else "none"
        raise RunError(f"optimized_metric={key!r} is not a metric of this run; it has: {known}")
    return float(result[key])


# ------------------------------------------------------------------------------------------------
# One directory per launch


def run_id(pattern: str, environ: Mapping[str, str] | None = None) -> str:
    """The name of this run's directory, the same in every process of one launch (module doc)."""
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
    """After a SLURM requeue or a torchrun restart: the newest complete checkpoint that an earlier
    run of this job (or of this torchrun launch), with the same ``overrides`` (by default this
    run's), left beside ``run_dir``; else ``None``.

    A torchrun launch whose earlier run finished (``metrics.json``) is a rerun of a used
    ``--rdzv-id``, not a restart: one line says so (:class:`RunError`).
    """
    env = os.environ if environ is None else environ
    current = Path(run_dir).resolve()
    token = _slurm_token(env)
    if token and rank_zero(env):
        (current / JOB_TOKEN_FILE).write_text(token + "\n", encoding="utf-8")
    earlier_runs = _earlier_runs(env)
    if earlier_runs is None:
        return None
    what, name = earlier_runs
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    found: list[Path] = []
    finished: list[Path] = []
    others: list[str] = []
    resuming = _restarted(env) or "TORCHELASTIC_RUN_ID" in env
    submitit = env.get("SUBMITIT_EXECUTOR") == "slurm"  # a sweep job: requeued into its folder
    for earlier in [current] if submitit else current.parent.iterdir():
        if not submitit and (earlier == current or not name.search(earlier.name)):
            continue
        if token and _read(earlier / JOB_TOKEN_FILE) != token:
            others.append(earlier.name)  # an earlier job that had the same id
            continue
        if not resuming:
            continue
        if _overrides(earlier) != [str(o) for o in overrides]:
            continue  # another command of the same job script
        if (earlier / "metrics.json").is_file():
            finished.append(earlier)
        found += [p for p in (earlier / "checkpoints").glob("*.ckpt") if complete_checkpoint(p)]
    if finished and "TORCHELASTIC_RUN_ID" in env:
        raise RunError(
            f"torchrun --rdzv-id={env['TORCHELASTIC_RUN_ID']} has run to its end already, in "
            f"{finished[0]}; give torchrun a new --rdzv-id to train again"
        )
    if others and rank_zero(env):
        log.info(
            "SLURM job %s: %d run(s) in %s (%s...) are of an earlier job with this id; "
            "this job does not resume from them",
            slurm_job_id(env), len(others), current.parent, max(others),
        )  # fmt: skip
    if not resuming:
        return None
    if not found:
        if rank_zero(env):
            log.info("%s; no checkpoint of this command to resume", what)
        return None
    newest = max(found, key=lambda p: p.stat().st_mtime).resolve()
    if rank_zero(env):
        log.info("%s: resuming from %s", what, newest)
    return newest


def _earlier_runs(env: Mapping[str, str]) -> tuple[str, re.Pattern[str]] | None:
    """For a SLURM job or a restarted torchrun group: what happened, in words, and the pattern of
    the run directories its earlier attempts made (:func:`run_id`); else ``None``."""
    job = slurm_job_id(env)
    if job:
        return (
            f"SLURM job {job} was requeued",
            re.compile(rf"(^|_)slurm-{re.escape(job)}(\.\d+)?(-requeue\d+)?$"),
        )
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    restart = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if elastic and elastic != "none" and restart > 0:
        limit = env.get("TORCHELASTIC_MAX_RESTARTS")
        of = f" of {limit}" if limit else ""
        return (
            f"torchrun restarted the group (restart {restart}{of})",
            re.compile(rf"^torchrun-{re.escape(elastic)}(-restart\d+)?$"),
        )
    return None


def complete_checkpoint(checkpoint: Path) -> bool:
    """A whole checkpoint file, or a sharded checkpoint directory (``trainer=fsdp``); what a
    requeued job or a resumed sweep job may continue from."""
    if checkpoint.is_dir():
        from runkit.safety.checkpoints import is_sharded_checkpoint  # torch: only when needed

        return is_sharded_checkpoint(checkpoint)
    return zipfile.is_zipfile(checkpoint)


def _overrides(run_dir: Path) -> list[str] | None:
    """The command-line overrides a run recorded (``.hydra/overrides.yaml``); None if unreadable."""
    import yaml

    try:
        data = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError):
        return None
    return [str(o) for o in data] if isinstance(data, list) else None


JOB_TOKEN_FILE = "slurm_job"
"""In the run directory of a SLURM job: ``<cluster>:<job id>:<first start>`` (:func:`_slurm_token`)."""
_first_starts: dict[str, str | None] = {}


def slurm_first_start(environ: Mapping[str, str] | None = None) -> str | None:
    """When this SLURM job's first attempt started (``2026-01-31T12:00:00``): the same in every
    task and in every requeued attempt, and another for a new job that got the same id.

    SLURM keeps no such time across a requeue (its start and submit times are the requeue's), so
    the first attempt's rank 0 writes it into the job's comment (``runkit-start=...``), which the
    job keeps. ``None`` where ``squeue`` cannot say (no SLURM client, not a job of this cluster).
    """
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


def _slurm_token(env: Mapping[str, str]) -> str | None:
    start = slurm_first_start(env)
    return f"{env.get('SLURM_CLUSTER_NAME', '')}:{slurm_job_id(env)}:{start}" if start else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def _restarted(env: Mapping[str, str]) -> bool:
    return _int(env.get("SLURM_RESTART_COUNT")) > 0


def rank_suffix(environ: Mapping[str, str] | None = None) -> str:
    """``""`` for rank 0; ``_rank<N>`` for other ranks started by torchrun or SLURM, which share
    the run directory and would otherwise write into one log file."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK") or (env.get("SLURM_PROCID") if _slurm_tasks(env) > 1 else None)
    return f"_rank{rank}" if rank not in (None, "", "0") else ""


def env_or(name: str, default: str) -> str:
    """``${env_or:VAR,default}``: the variable's value, or ``default`` when it is unset *or
    empty* (as a shell's ``${VAR:-default}``; OmegaConf's ``oc.env`` keeps an empty value, and
    ``LOG_DIR= python ...`` would then write runs under ``/``)."""
    return os.environ.get(name) or default


def register_resolvers() -> None:
    """Make ``${run_id:...}``, ``${rank_suffix:}`` and ``${env_or:...}`` available to the
    configs (idempotent)."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("env_or"):
        OmegaConf.register_new_resolver("env_or", env_or)
    if not OmegaConf.has_resolver("run_id"):
        OmegaConf.register_new_resolver("run_id", run_id, use_cache=True)
    if not OmegaConf.has_resolver("rank_suffix"):
        OmegaConf.register_new_resolver("rank_suffix", rank_suffix, use_cache=True)


def _slurm_tasks(env: Mapping[str, str]) -> int:
    return _int(env.get("SLURM_NTASKS")) if slurm_job_id(env) else 0


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0
