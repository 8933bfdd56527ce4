"""Resuming continues a run exactly, in a new directory, with the logs carried on."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import CliRunner, run_dirs, run_entry, run_python

EXACT = (
    "trainer.accelerator=cpu", "trainer.deterministic=true", "data.batch_size=128",
    "callbacks.progress_bar.refresh_rate=0", "test=false", "export_weights=false",
    "model.scheduler.T_max=4",  # the same schedule whether a run stops at epoch 2 or 3
    "model.net.channels=[8,16]",  # a smaller ConvNet: its batch-norm buffers, less to compute
)  # fmt: skip
# An extra checkpoint every 13 steps (mid-epoch: steps 13 and 26), all kept.
STEP_CKPTS = (
    "+callbacks.steps._target_=lightning.pytorch.callbacks.ModelCheckpoint",
    "+callbacks.steps.dirpath=${paths.output_dir}/steps", "+callbacks.steps.filename='step_{step}'",
    "+callbacks.steps.every_n_train_steps=13", "+callbacks.steps.save_top_k=-1",
    "+callbacks.steps.auto_insert_metric_name=false",
)  # fmt: skip
ZOO = Path(__file__).resolve().parent / "resume_zoo.py"
# A user's DataModule: a shuffled DataLoader, augmentation from torch's global generator, workers.
USER_DATA = (
    "data._target_=resume_zoo.UserDigits", "~data.val_fraction", "~data.test_fraction",
    "~data.split_seed", "~data.pin_memory", "data.num_workers=2",
)  # fmt: skip


def stop_in(phase: str, epoch: int, batch: int = 1) -> tuple[str, ...]:
    return (
        "+callbacks.stop._target_=resume_zoo.StopIn", f"+callbacks.stop.phase={phase}",
        f"+callbacks.stop.epoch={epoch}", f"+callbacks.stop.batch={batch}",
    )  # fmt: skip


@pytest.fixture
def zoo(tmp_path: Path) -> None:
    shutil.copy(ZOO, tmp_path)  # the runs' working directory: importable as a user's module


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cwd = tmp_path_factory.mktemp("straight")
    logs = f"paths.log_dir={cwd / 'logs'}"
    done = run_entry(cwd, "train", *EXACT, *STEP_CKPTS, "trainer.max_epochs=3", logs, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = run_dirs(cwd / "logs")
    return run


def assert_same_run(expected: Path, actual: Path) -> None:
    assert_equal_weights(*(run / "checkpoints" / "last.ckpt" for run in (expected, actual)))
    assert logged(actual) == logged(expected)
    best = [
        Path(json.loads((r / "metrics.json").read_text())["best_checkpoint"])
        for r in (expected, actual)
    ]
    assert best[0].name == best[1].name
    assert_equal_weights(*best)


def logged(run: Path) -> list[dict[str, str]]:
    # the loop's timings (samples per second) differ from run to run
    rows = [{k: v for k, v in r.items() if v and not k.startswith("loop/")} for r in csv_rows(run)]
    return sorted((r for r in rows if set(r) - {"epoch", "step"}), key=lambda r: sorted(r.items()))


def tree_hash(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def assert_equal_weights(a: Path, b: Path) -> None:
    wa, wb = (torch.load(c, map_location="cpu", weights_only=True)["state_dict"] for c in (a, b))
    assert wa.keys() == wb.keys()
    different = [key for key in wa if not torch.equal(wa[key], wb[key])]
    assert not different, f"{a} and {b} differ in {different}"


def csv_rows(run: Path) -> list[dict[str, str]]:
    with (run / "csv" / "metrics.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_resume_is_bit_identical_at_epoch_end_and_mid_epoch(
    cli: CliRunner, log_dir: Path, straight: Path
) -> None:
    # Two epochs, then resume to three from the run directory (its last.ckpt).
    first = cli("train", *EXACT, "trainer.max_epochs=2")
    assert first.returncode == 0, first.stderr[-2000:]
    (half,) = run_dirs(log_dir)
    before = tree_hash(half)
    second = cli("train", *EXACT, "trainer.max_epochs=3", f"ckpt_path={half}")
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = next(d for d in run_dirs(log_dir) if d != half)

    assert tree_hash(half) == before, "the earlier run's directory changed"
    assert_same_run(straight, resumed)
    record = json.loads((resumed / "metrics.json").read_text())
    assert record["resumed_from"] == str((half / "checkpoints" / "last.ckpt").resolve())
    assert record["epochs"] == 3 and record["global_step"] == 30
    assert "Resuming from" in (resumed / "train.log").read_text()
    # The curves read as one: epochs 0-2 and steps rising, nothing repeated.
    rows = [r for r in csv_rows(resumed) if r.get("val/acc")]
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2]
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps) and len(set(steps)) == 3

    # Mid-epoch: step 26 is 6 batches into epoch 2; the batches before it are read and dropped.
    mid = straight / "steps" / "step_26.ckpt"
    third = cli("train", *EXACT, "trainer.max_epochs=3", f"ckpt_path={mid}")
    assert third.returncode == 0, third.stderr[-2000:]
    assert "not resumable" not in third.stdout + third.stderr
    from_mid = next(d for d in run_dirs(log_dir) if d not in (half, resumed))
    assert_equal_weights(*(run / "checkpoints" / "last.ckpt" for run in (straight, from_mid)))


@pytest.mark.slow
def test_a_stop_resumes_as_if_never_stopped(
    cli: CliRunner, log_dir: Path, straight: Path, zoo: None
) -> None:
    # SIGTERM in epoch 1's validation: the same rows (no NaN or zero epoch), weights, best
    stopped = cli("train", *EXACT, "trainer.max_epochs=3", *stop_in("validation", 1))
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (run,) = run_dirs(log_dir)
    saved = run / "checkpoints" / "interrupted.ckpt"
    assert saved.is_file(), stopped.stderr[-2000:]
    again = cli("train", *EXACT, "trainer.max_epochs=3", f"ckpt_path={saved}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "before the ``update``" not in again.stderr  # torchmetrics: an epoch without data
    (resumed,) = [d for d in run_dirs(log_dir) if d != run]
    assert_same_run(straight, resumed)


@pytest.mark.slow
def test_a_users_datamodule_resumes_bit_identically(
    cli: CliRunner, log_dir: Path, zoo: None
) -> None:
    # shuffling, augmentation from torch's global generator, two workers; SIGTERM mid-epoch 0
    done = cli("train", *EXACT, *USER_DATA, "trainer.max_epochs=2")
    assert done.returncode == 0, done.stderr[-2000:]
    (full,) = run_dirs(log_dir)
    stopped = cli(
        "train", *EXACT, *USER_DATA, "trainer.max_epochs=2", *stop_in("train", 0, batch=6)
    )
    assert stopped.returncode == 143, stopped.stderr[-2000:]
    (run,) = [d for d in run_dirs(log_dir) if d != full]
    saved = run / "checkpoints" / "interrupted.ckpt"
    again = cli("train", *EXACT, *USER_DATA, "trainer.max_epochs=2", f"ckpt_path={saved}")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "not resumable" not in again.stdout + again.stderr
    (resumed,) = [d for d in run_dirs(log_dir) if d not in (full, run)]
    assert_equal_weights(full / "checkpoints" / "last.ckpt", resumed / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_resuming_from_a_run_whose_csv_log_is_damaged(
    cli: CliRunner, log_dir: Path, straight: Path
) -> None:
    from test_damaged_files import damage, one_error_line, snapshot

    earlier_run = log_dir / "train" / "runs" / straight.name
    shutil.copytree(straight, earlier_run)
    damage(earlier_run / "csv" / "metrics.csv", "directory")
    before = snapshot(earlier_run)
    result = cli("train", *EXACT, "trainer.max_epochs=4", f"ckpt_path={earlier_run}")
    assert snapshot(earlier_run) == before  # the earlier run is never changed
    line = one_error_line(result)
    assert line.startswith(f"error: {str(earlier_run / 'csv' / 'metrics.csv')!r} "), line
    assert run_dirs(log_dir) == [earlier_run]  # nothing created


@pytest.mark.slow
def test_resume_with_another_model_fails_in_one_line(cli: CliRunner, straight: Path) -> None:
    before = tree_hash(straight)
    exact = [a for a in EXACT if not a.startswith("model.net.")]  # not the MLP's
    wrong = cli("train", *exact, "trainer.max_epochs=5", "model=mlp", f"ckpt_path={straight}")
    assert wrong.returncode == 2
    lines = wrong.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ckpt_path=") and "another model" in lines[-1]
    assert tree_hash(straight) == before


CHECK_FITS = r"""
import resource, sys
from pathlib import Path
import torch, lightning.pytorch as pl
from runkit.safety.resume import check_fits

class Big(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4000, 4000, bias=False)  # 64 MB of weights

model = Big()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
check_fits(model, Path(sys.argv[1]))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_the_resume_check_does_not_read_the_weights_lightning_reads_next(tmp_path: Path) -> None:
    path = tmp_path / "big.ckpt"
    state = {"net.weight": torch.zeros(4000, 4000)}
    torch.save({"state_dict": state, "pytorch-lightning_version": "2.6.0"}, path)
    del state
    done = run_python(CHECK_FITS, str(path), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    grown_mb = int(done.stdout.split()[-1])
    assert grown_mb < 32, f"the check raised the peak memory by {grown_mb} MB"


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from range(10)


def test_resuming_a_stateless_iterable_dataset_says_what_will_differ(caplog) -> None:
    from runkit.safety.resume import _say_what_differs

    mapped = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10)))
    with caplog.at_level("WARNING", logger="runkit.safety.resume"):
        _say_what_differs([mapped], epoch=2, done=3)
        assert not caplog.records  # map-style data resumes exactly: nothing to say
        _say_what_differs([torch.utils.data.DataLoader(Stream(), batch_size=2)], epoch=2, done=3)
    (record,) = caplog.records
    line = record.getMessage()
    assert "\n" not in line and line.startswith("Resuming epoch 2: the training data (Stream)")
    assert "its first 3 batches are read again and dropped" in line
