"""Every ``logger`` option keeps exactly one run record (``csv/metrics.csv``; the CLI runs:
test_train_cli.py); the debug presets are as README says (CPU, anomaly detection)."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from omegaconf import OmegaConf

from conftest import compose_train
from runkit.run import builders


def loggers_of(*overrides: str, out: Path) -> list:
    cfg = compose_train(*overrides)
    cfg.paths.output_dir = str(out)
    return builders.build_loggers(cfg.get("logger"), builders.run_record(cfg.paths.output_dir))


@pytest.mark.parametrize(
    ("option", "extra"),
    [
        ("csv", []),
        ("none", []),
        ("tensorboard", [TensorBoardLogger]),
        ("many_loggers", [TensorBoardLogger]),
    ],
)
def test_every_logger_option_keeps_exactly_one_csv_record(
    tmp_path: Path, option: str, extra: list[type]
) -> None:
    loggers = loggers_of(f"logger={option}", out=tmp_path)
    records = [logger for logger in loggers if isinstance(logger, CSVLogger)]
    assert len(records) == 1  # one writer of csv/metrics.csv, never two
    assert Path(records[0].log_dir) == tmp_path / "csv"
    assert [type(logger) for logger in loggers if logger is not records[0]] == extra


def test_the_record_follows_the_csv_node_and_needs_an_output_dir(tmp_path: Path) -> None:
    (logger,) = loggers_of("logger=csv", "+logger.csv.flush_logs_every_n_steps=7", out=tmp_path)
    assert logger._flush_logs_every_n_steps == 7  # the configured node, not a second default one
    assert builders.run_record(None) is None
    assert builders.build_loggers(OmegaConf.create({}), None) == []


def test_debug_overfit_runs_with_anomaly_detection_like_every_debug_preset() -> None:
    for preset in ("default", "fdr", "overfit", "limit", "profiler"):
        cfg = compose_train(f"debug={preset}")
        assert cfg.trainer.detect_anomaly is True, preset
        assert cfg.trainer.accelerator == "cpu", preset
        assert cfg.hydra.job_logging.root.level == "DEBUG", preset
    assert compose_train("debug=overfit").trainer.overfit_batches == 3
