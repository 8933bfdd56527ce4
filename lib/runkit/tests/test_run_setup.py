"""Setting up a run: safety parts, the run directory claimed and discarded, eval's settings,
the collector at start-up, trainer presets, one CSV record whatever the loggers, debug presets."""

from __future__ import annotations

import gc
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import DictConfig, OmegaConf

from conftest import CliRunner, compose_train, run_dirs
from tinyapp import config_dir
import runkit
from runkit import speed
from runkit.errors import RunError
from runkit.run import builders, collector, preflight, run_files
from runkit.run.launch import register_resolvers
from runkit.run.preflight import check_config
from runkit.safety.checkpoints import AtomicCheckpointIO, save_weights
from runkit.safety.interrupts import GracefulInterrupt
from runkit.safety.resume import ResumeState

LAUNCH_ENV = ("LOCAL_RANK", "RANK", "NODE_RANK", "SLURM_PROCID", "SLURM_JOB_ID",
              "SLURM_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "LSB_JOBID")  # fmt: skip


def composed(*overrides: str, name: str = "train") -> DictConfig:
    register_resolvers()
    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(name, overrides=list(overrides))


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(preflight, "_claimed", None)


@pytest.mark.parametrize(
    ("overrides", "line", "loggers"),
    [
        (["~callbacks.graceful_interrupt", "logger=none"],
         "callbacks.graceful_interrupt removed: Ctrl-C/SIGTERM", [CSVLogger]),
        (["~callbacks.resume_state", "logger=tensorboard"],
         "callbacks.resume_state removed: a resumed run", [CSVLogger, TensorBoardLogger]),
        (["trainer.plugins=[]", "logger=many_loggers"],
         "trainer.plugins has no AtomicCheckpointIO: checkpoint", [CSVLogger, TensorBoardLogger]),
        # a complete run (the csv node is the record: its setting kept), and a test-only run
        # (which needs no safety part) without an output directory (no record): silent
        (["+logger.csv.flush_logs_every_n_steps=7"], None, [CSVLogger]),
        (["train=false", "callbacks=none", "trainer.plugins=[]", "logger=none",
          "paths.output_dir=null"], None, []),
    ],
)  # fmt: skip
def test_safety_parts_and_one_csv_record_reach_the_trainer_and_a_removed_part_says_what_is_lost(
    tmp_path, caplog, overrides: list[str], line: str | None, loggers: list[type]
) -> None:
    out = f"paths.output_dir={tmp_path}"
    cfg = composed(out, "trainer.accelerator=cpu", "seed=7", *overrides)
    with caplog.at_level(logging.WARNING, logger=builders.__name__):
        trainer = builders.build_trainer(cfg)
    said = [r.getMessage() for r in caplog.records if r.name == builders.__name__]
    assert said == [] if line is None else len(said) == 1 and said[0].startswith(line), said
    assert trainer.max_epochs == cfg.trainer.max_epochs  # the run is built all the same
    assert [type(logger) for logger in trainer.loggers] == loggers  # one CSV record, never two
    assert not loggers or Path(trainer.loggers[0].log_dir) == tmp_path / "csv"
    if line is None and loggers:  # the complete run: each part from its config node, once
        assert isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO)
        (resume,) = [c for c in trainer.callbacks if isinstance(c, ResumeState)]
        assert resume.seed == 7
        assert sum(isinstance(c, GracefulInterrupt) for c in trainer.callbacks) == 1
        assert trainer.loggers[0]._flush_logs_every_n_steps == 7


def _run_cfg(directory: Path) -> DictConfig:
    return OmegaConf.create(
        {"hydra": {"run": {"dir": str(directory)}, "sweep": {"dir": str(directory)}}}
    )


def test_two_racing_claims_for_one_directory_give_one_winner(
    tmp_path: Path, single_process: None
) -> None:
    cfg, start = _run_cfg(tmp_path / "logs" / "run é"), threading.Barrier(8)

    def claim(_: int) -> str:
        start.wait()
        try:
            preflight.claim_run_dir(cfg, "hydra.run.dir")
        except RunError as err:
            return str(err)
        return "won"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(claim, range(8)))
    assert outcomes.count("won") == 1, outcomes
    assert all("is taken: it already has .hydra" in o for o in outcomes if o != "won")
    # a sweep directory is claimed once too
    preflight.claim_run_dir(cfg := _run_cfg(tmp_path / "sweep"), "hydra.sweep.dir")
    assert (tmp_path / "sweep" / "multirun.yaml").is_file()
    with pytest.raises(RunError, match=r"hydra.sweep.dir=.* is taken: .*multirun.yaml"):
        preflight.claim_run_dir(cfg, "hydra.sweep.dir")
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(RunError, match=r"cannot create or write .*a_file.*Not a directory"):
        preflight.claim_run_dir(_run_cfg(tmp_path / "a_file" / "run"), "hydra.run.dir")
    assert (tmp_path / "a_file").read_text() == "x"


@pytest.mark.parametrize(
    ("existing", "extra", "removed", "left"),
    [
        ("", "", True, []),  # logs/ did not exist before: gone too
        ("logs/train", "", True, ["logs", "logs/train"]),  # parents that existed stay
        ("mine", "mine/notes.log", False, None),  # a given directory that had files: kept
        ("", "logs/train/runs/1/checkpoints/last.ckpt", False, None),  # anything else: kept
        ("", "logs/train/runs/1/notes.txt", False, None),
        ("", "logs/train/runs/1/.hydra/mine.yaml", False, None),
    ],
)
def test_an_unused_run_directory_goes_with_the_parents_its_claim_made(
    tmp_path: Path, single_process: None, existing: str, extra: str, removed: bool, left: Any
) -> None:
    run = tmp_path / ("mine" if existing == "mine" else "logs/train/runs/1")
    if existing:
        (tmp_path / existing).mkdir(parents=True)
    if existing == "mine":
        (tmp_path / extra).write_text("the user's own")
    preflight.claim_run_dir(_run_cfg(run), "hydra.run.dir")
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):  # what Hydra writes first
        (run / ".hydra" / name).write_text("x: 1\n")
    (run / "train.log").write_text("[INFO] Seed set to 42\n")
    (run / "config.yaml").write_text("seed: 42\n")
    if extra and existing != "mine":
        (tmp_path / extra).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / extra).write_text("keep me")
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert preflight.discard_unused(run) is removed
    after = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert after == (before if left is None else left)


_Built = type("_Built", (Exception,), {})  # the build_trainer spy's: its arguments are known


def test_eval_tests_at_the_precision_training_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tinyapp.eval import evaluate
    from tinyapp.train import train

    seen: dict[str, Any] = {}

    def spy(cfg: DictConfig, **kwargs: Any) -> Any:
        seen[cfg.task_name] = kwargs
        raise _Built

    monkeypatch.setattr(runkit, "build_trainer", spy)  # first: undone to the real one
    monkeypatch.setattr(builders, "build_trainer", spy)
    # A bf16 GPU (Ampere), faked: nothing is built on it.
    monkeypatch.setattr(speed, "cuda_indices", lambda accelerator, devices: [0])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (8, 0))
    matmul = torch.get_float32_matmul_precision()
    try:
        cfg = composed(f"paths.output_dir={tmp_path / 'train'}", "model=mlp")
        with pytest.raises(_Built):
            train(cfg)
        weights = tmp_path / "trained" / "model.pth"
        save_weights(instantiate(cfg.model).net, weights)
        run_files.save_config(cfg, weights.parent)
        with pytest.raises(_Built):
            evaluate(composed(f"paths.output_dir={tmp_path / 'eval'}", f"ckpt_path={weights}",
                              name="eval"))  # fmt: skip
    finally:
        torch.set_float32_matmul_precision(matmul)
    assert {task: kw["precision"] for task, kw in seen.items()} == {
        "train": "bf16-mixed", "eval": "bf16-mixed"
    }  # fmt: skip
    assert isinstance(seen["train"]["profiler"], speed.NoProfiler)


@pytest.mark.parametrize(
    ("argv", "caller_on", "job_sees_on"),
    [
        ((), True, True),  # the job runs with the collector on, the imports frozen
        (("no_such_key=2",), True, None),  # no job runs (a mistake): on again, nothing frozen
        ((), False, False),  # a caller that holds the collector off keeps it off
    ],
)
def test_the_collector_is_off_for_the_imports_and_back_as_the_caller_had_it(
    tmp_path, monkeypatch, single_process, argv, caller_on, job_sees_on
) -> None:
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "app.yaml").write_text("value: 1\n")
    seen: list[tuple[bool, int]] = []
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["app", f"hydra.run.dir={tmp_path / 'run'}", *argv])
    monkeypatch.setattr(collector, "_collector_paused", False)
    main = runkit.hydra_entry(
        lambda cfg: seen.append((gc.isenabled(), gc.get_freeze_count())),
        "app",
        tmp_path / "configs",
    )
    before = gc.get_freeze_count()
    if not caller_on:
        gc.disable()
    try:
        if job_sees_on is None:
            with pytest.raises(SystemExit) as stop:
                main()
            assert stop.value.code == 2 and seen == [] and gc.get_freeze_count() == before
        else:
            main()
            (state,) = seen
            assert state[0] is job_sees_on
            assert state[1] > before if job_sees_on else state[1] == before
        assert gc.isenabled() is caller_on
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_preflight_turns_the_collector_back_on_for_a_sweeps_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, single_process: None
) -> None:  # a sweep's parent runs no job in-process: the preflight turns it on
    monkeypatch.setattr(collector, "_collector_paused", False)
    before = gc.get_freeze_count()
    try:
        assert collector.pause_collector() and not gc.isenabled()
        preflight.PreflightCallback().on_multirun_start(_run_cfg(tmp_path / "sweep"))
        assert gc.isenabled() and gc.get_freeze_count() > before
        assert (tmp_path / "sweep" / "multirun.yaml").is_file()
    finally:
        gc.enable()
        gc.unfreeze()


EXPECTED = {"default": ("auto", 1, 1), "cpu": ("auto", 1, 1), "gpu": ("auto", 1, 1),
            "ddp": ("ddp", 2, 1), "ddp_sim": ("ddp", 2, 1), "ddp_spawn": ("ddp_spawn", 2, 1),
            "dp": ("dp", 2, 1), "fsdp": ("fsdp", 2, 1), "multi_node": ("ddp", "auto", 2)}  # fmt: skip


@pytest.mark.parametrize("preset", EXPECTED)
def test_preset_composes_with_the_expected_strategy(preset: str) -> None:
    trainer = compose_train(f"trainer={preset}").trainer
    # trainer=dp and fsdp name the strategy by its class (dp: with the network it parallelises).
    strategy = trainer.strategy if isinstance(trainer.strategy, str) else preset
    classes = {"dp": "strategies.dp.DataParallelStrategy", "fsdp": "strategies.fsdp.FSDPStrategy"}
    if preset in classes:
        assert trainer.strategy._target_.endswith(classes[preset])
    assert (strategy, trainer.devices, trainer.num_nodes) == EXPECTED[preset]
    assert trainer._target_ == "lightning.pytorch.Trainer"


def test_cpu_presets_pass_preflight_and_ddp_on_cpu_equals_ddp_sim() -> None:
    on_disk = {p.stem for p in (config_dir() / "trainer").glob("*.yaml")}
    assert on_disk == {*EXPECTED, "lightning"}  # lightning.yaml: the node the presets build on
    for preset in ("cpu", "ddp_sim", "ddp_spawn", "fsdp", "multi_node"):
        check_config(compose_train(f"trainer={preset}", "trainer.accelerator=cpu"))
    ddp_cpu = compose_train("trainer=ddp", "trainer.accelerator=cpu").trainer
    ddp_sim = compose_train("trainer=ddp_sim").trainer
    assert OmegaConf.to_container(ddp_cpu) == OmegaConf.to_container(ddp_sim)  # every key


@pytest.mark.slow
def test_ddp_spawn_preset_runs_on_the_cpu(cli: CliRunner, log_dir: Path) -> None:
    # test=false: each fit or test spawns its processes anew (fresh interpreters), the same way
    tiny = ("trainer.max_epochs=1", "data.batch_size=256", "+trainer.limit_train_batches=2",
            "+trainer.limit_val_batches=1", "test=false", "callbacks.progress_bar.refresh_rate=0")  # fmt: skip
    result = cli("train", "trainer=ddp_spawn", "trainer.accelerator=cpu", *tiny, timeout=400)
    # A worker's own traceback comes first on stderr, the launcher's last: both are shown.
    assert result.returncode == 0, result.stderr[:4000] + "\n...\n" + result.stderr[-2000:]
    (run,) = run_dirs(log_dir)
    summary = json.loads((run / "metrics.json").read_text())
    assert summary["devices"] == 2 and "val/acc" in summary["metrics"]
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_debug_overfit_runs_with_anomaly_detection_like_every_debug_preset() -> None:
    for preset in ("default", "fdr", "overfit", "limit", "profiler"):
        cfg = compose_train(f"debug={preset}")
        assert cfg.trainer.detect_anomaly is True, preset
        assert cfg.trainer.accelerator == "cpu", preset
        assert cfg.hydra.job_logging.root.level == "DEBUG", preset
    assert compose_train("debug=overfit").trainer.overfit_batches == 3
