"""How every process of a launch finds its run: one job per DDP child, one directory per launch.
Lightning re-runs ``sys.argv`` for ranks > 0, in a sweep every job's (Lightning #11300)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from runkit.errors import RunError
from runkit.quoting import config_options, hydra_value
from runkit.safety.signals import rank_zero, slurm_job_id
from runkit.safety.writes import atomic_write

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
    """Run one Hydra job so that the DDP children started inside it run this job and no other."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from runkit.safety.signals import stop_on_signal

    if not HydraConfig.initialized():
        yield
        return
    hydra_cfg = HydraConfig.get()
    if os.environ.get("SUBMITIT_EXECUTOR") == "slurm":
        try:
            with stop_on_signal():
                yield
        except SystemExit as stop:
            handler = signal.getsignal(signal.SIGUSR2)  # submitit's again, after the block
            if stop.code == 128 + signal.SIGUSR2 and callable(handler):
                handler(signal.SIGUSR2, None)
            raise
        return
    if hydra_cfg.mode != RunMode.MULTIRUN or launched_externally():
        if SWEEP_JOB_ENV in os.environ and "LOCAL_RANK" in os.environ:
            rank, num = os.environ["LOCAL_RANK"], os.environ[SWEEP_JOB_ENV]
            log.info(
                "Rank %s runs sweep job #%s: %s", rank, num, " ".join(hydra_cfg.overrides.task)
            )
        yield
        return
    saved_argv, saved_run_dir = list(sys.argv), hydra_cfg.run.dir
    saved_env = {key: os.environ.get(key) for key in SAVED_ENV}
    task, hydra = hydra_cfg.overrides.task, hydra_cfg.overrides.hydra
    sys.argv = job_command([sys.argv[0], *config_options(sys.argv[1:])], task, hydra)
    _set_run_dir(hydra_cfg, str(hydra_cfg.runtime.output_dir))
    os.environ[SWEEP_JOB_ENV] = str(hydra_cfg.job.num)
    launchers: list[Any] = []
    _launchers.append(launchers)
    try:
        yield
    finally:
        _launchers.remove(launchers)
        procs = [proc for launcher in launchers for proc in launcher.procs]
        for launcher in launchers:
            launcher.procs.clear()  # Lightning's watchdog would kill the sweep on a child's exit
        _finish_children(procs)
        sys.argv = saved_argv
        _set_run_dir(hydra_cfg, saved_run_dir)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def job_command(
    entry: Sequence[str],
    overrides: Sequence[Any],
    hydra_overrides: Sequence[Any],
    extra: Mapping[str, Any] | None = None,
    run_dir: Path | None = None,
    num: int = 0,
) -> list[str]:
    """The command line that runs one job of a sweep as a single run (in ``run_dir``, as job
    ``num``, when given): ``extra`` adds the keys that the job's own ``overrides`` do not set."""
    own = {_key(o) for o in overrides}
    added = [
        f"{key}={hydra_value(value)}" for key, value in (extra or {}).items() if key not in own
    ]
    mine = ("hydra.mode", "hydra.run.dir", "hydra.job.num", "hydra.job.id")
    kept = [str(o) for o in hydra_overrides if _key(o) not in mine]
    if run_dir is not None:
        kept += [f"hydra.run.dir={hydra_value(str(run_dir))}", f"hydra.job.num={num}"]
        kept += [f"hydra.job.id={num}"]
    return [*entry, *map(str, overrides), *added, *kept, "hydra.mode=RUN"]


def _key(override: Any) -> str:
    return str(override).split("=", 1)[0].lstrip("+~")


def track(trainer: Any) -> None:
    """Remember ``trainer``'s launcher, so the current job can collect the children it starts."""
    launcher = getattr(trainer.strategy, "launcher", None)
    if _launchers and launcher is not None and hasattr(launcher, "procs"):
        _launchers[-1].append(launcher)


def launched_externally(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the ranks were started by something else than Lightning in this process."""
    env = os.environ if environ is None else environ
    return any(k in env for k in ("LOCAL_RANK", "LSB_JOBID")) or ranks_start_together(env)


def ranks_start_together(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every rank was started at once by a launcher (torchrun, SLURM tasks)."""
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env or _slurm_tasks(env) > 1


def join_restarted_group(trainer: Any, environ: Mapping[str, str] | None = None) -> None:
    """In a group torchrun restarted, set up the process group under ``runkit/attempt_<N>/``
    before Lightning does: torch's own would read the dead attempt's addresses and hang."""
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
    world, port = _int(env.get("WORLD_SIZE")), _int(env.get("MASTER_PORT"))
    store = dist.TCPStore(env["MASTER_ADDR"], port, world, False, timedelta(minutes=30))
    prefixed = dist.PrefixStore(f"runkit/attempt_{restart}/", store)
    dist.init_process_group(backend, store=prefixed, rank=_int(env.get("RANK")), world_size=world)


def _set_run_dir(hydra_cfg: Any, value: str | None) -> None:
    from omegaconf import read_write

    with read_write(hydra_cfg):
        hydra_cfg.run.dir = value


def destroy_process_group() -> None:
    """As torch asks: a gloo group left to the interpreter's exit may abort the process."""
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _finish_children(procs: list[subprocess.Popen]) -> None:
    destroy_process_group()  # first: a child blocked in a collective then fails
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
    """What the entry point returns to Hydra: the ``optimized_metric`` when set, else ``result``."""
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
    restarts = _int(env.get("SLURM_RESTART_COUNT"))
    requeue = f"-requeue{restarts}" if restarts else ""
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
    run of this job with the same ``overrides`` (by default this run's) left beside ``run_dir``."""
    env = os.environ if environ is None else environ
    current, job = Path(run_dir).resolve(), slurm_job_id(env)
    start = slurm_first_start(env)
    token = f"{env.get('SLURM_CLUSTER_NAME', '')}:{job}:{start}" if start else None
    if token and rank_zero(env):
        atomic_write(current / JOB_TOKEN_FILE, token + "\n")
    elastic = env.get("TORCHELASTIC_RUN_ID", "")
    restart = _int(env.get("TORCHELASTIC_RESTART_COUNT"))
    if job:
        what, name = f"SLURM job {job} was requeued", rf"(^|_)slurm-{job}(\.\d+)?(-requeue\d+)?$"
    elif elastic not in ("", "none") and restart > 0:
        limit = env.get("TORCHELASTIC_MAX_RESTARTS")
        what = f"torchrun restarted the group (restart {restart}{f' of {limit}' if limit else ''})"
        name = rf"^torchrun-{re.escape(elastic)}(-restart\d+)?$"
    else:
        return None
    if overrides is None:
        from hydra.core.hydra_config import HydraConfig

        overrides = list(HydraConfig.get().overrides.task)
    resuming = _int(env.get("SLURM_RESTART_COUNT")) > 0 or bool(elastic)
    submitit = env.get("SUBMITIT_EXECUTOR") == "slurm"  # a sweep job: requeued into its folder
    same, others = [], []
    for earlier in [current] if submitit else current.parent.iterdir():
        if not submitit and (earlier == current or not re.search(name, earlier.name)):
            continue
        if token and _read(earlier / JOB_TOKEN_FILE) != token:
            others.append(earlier.name)
        elif resuming and _overrides(earlier) == [str(o) for o in overrides]:
            same.append(earlier)
    if others and rank_zero(env):
        log.info(
            "SLURM job %s: %d run(s) in %s (%s...) are of an earlier job with this id; "
            "this job does not resume from them", job, len(others), current.parent, max(others),
        )  # fmt: skip
    if elastic and (finished := [d for d in same if (d / "metrics.json").is_file()]):
        raise RunError(
            f"torchrun --rdzv-id={elastic} has run to its end already, in {finished[0]}; give "
            "torchrun a new --rdzv-id to train again"
        )
    if not resuming:
        return None
    newest = newest_checkpoint(same)
    if rank_zero(env):
        said = (
            f": resuming from {newest}" if newest else "; no checkpoint of this command to resume"
        )
        log.info("%s%s", what, said)
    return newest


def newest_checkpoint(run_dirs: Iterable[str | Path]) -> Path | None:
    """The newest whole checkpoint (a file, or a sharded directory) in ``run_dirs``' checkpoints."""

    def whole(path: Path) -> bool:
        if path.is_dir():
            from runkit.safety.checkpoints import is_sharded_checkpoint  # torch: only when needed

            return is_sharded_checkpoint(path)
        return zipfile.is_zipfile(path)

    found = [p for d in run_dirs for p in (Path(d) / "checkpoints").glob("*.ckpt") if whole(p)]
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name)).resolve() if found else None


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
    """When this SLURM job's first attempt started, kept in the job's comment across requeues."""
    env = os.environ if environ is None else environ
    job = slurm_job_id(env)
    if job is None:
        return None
    if job not in _first_starts:
        out = _command("squeue", "-h", "-j", job, "-o", "%S|%k").strip()
        start, _, comment = out.partition("|")
        comment = "" if comment == "(null)" else comment
        kept = re.search(r"runkit-start=(\S+)", comment)
        valid = re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", start)
        _first_starts[job] = kept.group(1) if kept else start if valid else None
        if not kept and valid and rank_zero(env):  # the first attempt (or one requeued before)
            new = f"comment={comment} runkit-start={start}".replace("= ", "=")
            _command("scontrol", "update", f"job={job}", new)
    return _first_starts[job]


def _command(*command: str) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        return None


def rank_suffix(environ: Mapping[str, str] | None = None) -> str:
    """``_rank<N>`` for ranks > 0 started by torchrun or SLURM (they share the run directory)."""
    env = os.environ if environ is None else environ
    rank = env.get("RANK") or (env.get("SLURM_PROCID") if _slurm_tasks(env) > 1 else None)
    return f"_rank{rank}" if rank not in (None, "", "0") else ""


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, resolver, cache in (
        ("env_or", lambda var, default: os.environ.get(var) or default, False),  # unset or empty
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
