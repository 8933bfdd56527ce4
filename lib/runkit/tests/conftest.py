"""Shared test helpers: run tinyapp (the tests' app) in a subprocess, find its run directories."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import prewarmed

# Two pytest workers share two cores: one torch thread each (before torch is imported; the workers
# and every child inherit it) instead of four threads spinning for two cores. A user's value wins.
# Nothing heavy is imported here: pytest's main process loads this file before it starts workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# What a parent test process (or an earlier DDP test) may leave behind for a child run.
_LEAKY_ENV = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
              "PL_GLOBAL_SEED", "PL_SEED_WORKERS", "RUNKIT_GPU_SELECTION", "RUNKIT_NVML_BACKEND",
              "RUNKIT_FAKE_NVML", "PROJECT_LOG_DIR", "HYDRA_FULL_ERROR")  # fmt: skip

# Small, quiet budgets for CLI tests: the real pipeline, a fraction of the work.
FAST = ("trainer.max_epochs=2", "data.batch_size=256", "callbacks.progress_bar.refresh_rate=0")

CliRunner = Callable[..., subprocess.CompletedProcess]
TESTS = Path(__file__).resolve().parent

# What tinyapp's eval.yaml trusts (as the template's does its own packages): its modules, torch.
TEMPLATE_TARGETS = ("tinyapp.", "torch.nn.", "torch.optim.")

# The longest files first (by recorded durations), so that the last files two workers take whole
# (--no-loadscope-reorder) are short ones and neither worker waits long for the other at the end;
# the SLURM files after test_template's own SLURM job (they take turns on one cluster).
LONGEST = ("template", "readme", "slurm", "sweep", "zoo", "crash_safety", "signals",
           "slurm_cluster", "multinode", "pasted_commands", "fsdp", "performance_switches",
           "conformance", "damaged_files", "bad_inputs", "notebooks", "gpu_check", "resume",
           "train_cli", "plot", "smoke")  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = Path(item.nodeid.partition("::")[0]).stem.removeprefix("test_")
        return LONGEST.index(name) if name in LONGEST else len(LONGEST)

    items.sort(key=rank)


@pytest.fixture(autouse=True)
def _root_log_level_as_found() -> Iterator[None]:
    """An in-process Hydra run sets the root logger's level for the process: undo it per test."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


def user_config_dir(folder: Path) -> Path:
    """A ``--config-dir`` of a user's own: ``model=mine`` (tinyapp's MLP) is only there."""
    (folder / "model").mkdir(parents=True)
    shutil.copyfile(TESTS / "tinyapp/configs/model/mlp.yaml", folder / "model" / "mine.yaml")
    return folder


def clean_env(**extra: str) -> dict[str, str]:
    """This environment less what a parent run leaves; ``tinyapp``'s folder on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in _LEAKY_ENV}
    env.update(extra)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths if str(TESTS) in paths else [*paths, str(TESTS)])
    return env


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path / "logs"


def run_entry(cwd: Path, task: str, *args: str, env: dict[str, str] | None = None,
              timeout: float = 300) -> subprocess.CompletedProcess:  # fmt: skip
    """``python -m tinyapp.<task>`` (``runkit.<task>`` for plot, devices) in ``cwd``, prewarmed."""
    package = "runkit" if task in ("plot", "devices") else "tinyapp"
    command, env = [sys.executable, "-m", f"{package}.{task}", *args], clean_env(**(env or {}))
    return prewarmed.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def cli(tmp_path: Path, log_dir: Path) -> CliRunner:
    """``cli("train", "trainer.max_epochs=1", env={...})``: in ``tmp_path``, logs in ``log_dir``."""

    def run(task: str, *overrides: str, env: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:  # fmt: skip
        if task in ("train", "eval", "predict") and not any(o.startswith("--") for o in overrides):
            overrides = (*overrides, f"paths.log_dir={log_dir}")
        return run_entry(tmp_path, task, *overrides, env=env, timeout=timeout)

    return run


def run_python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -c <code> <args>`` in a fresh interpreter with a clean environment."""
    command = [sys.executable, "-c", code, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=clean_env())


def free_port() -> int:
    """A TCP port free now (a fixed one may be held by the other pytest worker)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def train_on_two_torchrun_nodes(
    cwd: Path, rdzv_id: str, *overrides: str, timeout: float = 300
) -> list[str]:
    """``python -m tinyapp.train`` as two torchrun nodes of one process each (run directory
    ``torchrun-<rdzv_id>``); both must exit 0. Returns each node's output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", f"--rdzv-id={rdzv_id}",
        "-m", "tinyapp.train", *overrides,
    ]  # fmt: skip
    env = clean_env(OMP_NUM_THREADS="1")
    nodes = [
        subprocess.Popen([*command[:5], f"--node-rank={rank}", *command[5:]], cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    try:
        outputs = [node.communicate(timeout=timeout)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(outputs)[-4000:]
    return outputs


def run_dirs(log_dir: Path, task: str = "train") -> list[Path]:
    """Every run directory of ``task`` under ``log_dir`` (sweep jobs too), oldest first."""
    return sorted(p.parent for p in (log_dir / task).glob("**/.hydra") if p.is_dir())


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture
def use_fake() -> Iterator[Callable[[Any], Any]]:
    """``use_fake(FakeNvml([...]))``: the process's NVML for one test."""
    from runkit.gpus import nvml

    yield lambda fake: (nvml.use_library(fake), fake)[1]
    nvml.use_library(None)


def compose_train(*overrides: str, name: str = "train") -> Any:
    """tinyapp's config as the CLI composes it (hydra config included)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import open_dict

    from tinyapp import config_dir

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(config_dir()), version_base="1.3"):
        cfg = compose(name, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.paths.output_dir = "/tmp/never-used"  # normally set by Hydra at run time
    return cfg


def stand_in(*devices: Any, world_size: int = 1, num_nodes: int = 1, local_rank: int = 0,
             node_rank: int = 0) -> Any:  # fmt: skip
    """``stand_in("cuda", "cuda", local_rank=1)``: what callbacks read of a Trainer, no Trainer."""
    import torch

    parallel = [torch.device(d) for d in devices or ("cpu",)]
    return SimpleNamespace(
        strategy=SimpleNamespace(parallel_devices=parallel, root_device=parallel[local_rank]),
        world_size=world_size, num_nodes=num_nodes, local_rank=local_rank, node_rank=node_rank,
        global_rank=node_rank * len(parallel) + local_rank,
        is_global_zero=node_rank == 0 and local_rank == 0, sanity_checking=False,
    )  # fmt: skip


@pytest.fixture
def stand_in_trainer() -> Callable[..., Any]:
    return stand_in
