"""Resuming continues a run exactly, in a new directory, with the logs carried on.

Bit-identical comparisons need ``trainer.deterministic=true`` and the CPU. The digits train split
has 1,257 samples: with ``data.batch_size=128`` an epoch is 10 steps.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import CliRunner, clean_env, run_dirs
from runkit.data import EpochShuffle, ResumableLoader

EXACT = (
    "trainer.accelerator=cpu",
    "trainer.deterministic=true",
    "data.batch_size=128",
    "callbacks.progress_bar.refresh_rate=0",
    "test=false",
    "export_weights=false",
    "model.scheduler.T_max=4",  # the same schedule whether a run stops at epoch 2 or 4
)
# An extra checkpoint every 13 steps (mid-epoch: steps 13, 26, 39), all kept.
STEP_CKPTS = (
    "+callbacks.steps._target_=lightning.pytorch.callbacks.ModelCheckpoint",
    "+callbacks.steps.dirpath=${paths.output_dir}/steps",
    "+callbacks.steps.filename='step_{step}'",
    "+callbacks.steps.every_n_train_steps=13",
    "+callbacks.steps.save_top_k=-1",
    "+callbacks.steps.auto_insert_metric_name=false",
)


def tree_hash(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def assert_equal_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    different = [key for key in wa if not torch.equal(wa[key], wb[key])]
    assert not different, f"{a} and {b} differ in {different}"


def csv_rows(run: Path) -> list[dict[str, str]]:
    with (run / "csv" / "metrics.csv").open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_resume_is_bit_identical_at_epoch_end_and_mid_epoch(cli: CliRunner, log_dir: Path) -> None:
    # One go: 4 epochs (40 steps), with mid-epoch checkpoints to resume from later.
    done = cli("train", *EXACT, *STEP_CKPTS, "trainer.max_epochs=4")
    assert done.returncode == 0, done.stderr[-2000:]
    (full,) = run_dirs(log_dir)

    # Two epochs, then resume to four from the run directory (its last.ckpt).
    first = cli("train", *EXACT, "trainer.max_epochs=2")
    assert first.returncode == 0, first.stderr[-2000:]
    half = next(d for d in run_dirs(log_dir) if d != full)
    before = tree_hash(half)
    second = cli("train", *EXACT, "trainer.max_epochs=4", f"ckpt_path={half}")
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = next(d for d in run_dirs(log_dir) if d not in (full, half))

    assert tree_hash(half) == before, "the earlier run's directory changed"
    assert_equal_weights(full / "checkpoints" / "last.ckpt", resumed / "checkpoints" / "last.ckpt")
    record = json.loads((resumed / "metrics.json").read_text())
    assert record["resumed_from"] == str((half / "checkpoints" / "last.ckpt").resolve())
    assert record["epochs"] == 4 and record["global_step"] == 40
    assert "Resuming from" in (resumed / "train.log").read_text()
    # The curves read as one: epochs 0-3 and steps rising, nothing repeated.
    rows = [r for r in csv_rows(resumed) if r.get("val/acc")]
    assert [int(r["epoch"]) for r in rows] == [0, 1, 2, 3]
    steps = [int(r["step"]) for r in rows]
    assert steps == sorted(steps) and len(set(steps)) == 4

    # Mid-epoch: step 26 is 6 batches into epoch 2; the loader must skip exactly those.
    mid = full / "steps" / "step_26.ckpt"
    third = cli("train", *EXACT, "trainer.max_epochs=4", f"ckpt_path={mid}")
    assert third.returncode == 0, third.stderr[-2000:]
    assert "not resumable" not in third.stdout + third.stderr
    from_mid = next(d for d in run_dirs(log_dir) if d not in (full, half, resumed))
    assert_equal_weights(full / "checkpoints" / "last.ckpt", from_mid / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_resume_with_another_model_fails_in_one_line(cli: CliRunner, log_dir: Path) -> None:
    first = cli("train", *EXACT, "trainer.max_epochs=1")
    assert first.returncode == 0, first.stderr[-2000:]
    (run,) = run_dirs(log_dir)
    before = tree_hash(run)
    wrong = cli("train", *EXACT, "trainer.max_epochs=2", "model=mlp", f"ckpt_path={run}")
    assert wrong.returncode == 2
    lines = wrong.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ckpt_path=") and "another model" in lines[-1]
    assert tree_hash(run) == before


def test_loader_skips_exactly_the_batches_a_checkpoint_used() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20))
    loader = ResumableLoader(data, batch_size=3, sampler=EpochShuffle(data, seed=7))
    loader.sampler.set_epoch(2)
    full = [batch[0].tolist() for batch in loader]
    it = iter(loader)
    seen = [next(it)[0].tolist() for _ in range(4)]
    state = loader.state_dict()
    assert state == {"epoch": 2, "batches": 4, "seed": 7}

    fresh = ResumableLoader(data, batch_size=3, sampler=EpochShuffle(data, seed=0))
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(2)
    rest = [batch[0].tolist() for batch in fresh]
    assert seen + rest == full
    # The next epoch is whole again, and in a different order.
    fresh.sampler.set_epoch(3)
    following = [batch[0].tolist() for batch in fresh]
    assert len(following) == len(full) and following != full


def test_loader_state_for_another_epoch_is_ignored() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(10))
    loader = ResumableLoader(data, batch_size=2, sampler=EpochShuffle(data, seed=1))
    loader.load_state_dict({"epoch": 0, "batches": 5, "seed": 1})
    loader.sampler.set_epoch(1)  # an end-of-epoch checkpoint of epoch 0: epoch 1 is whole
    assert len(list(loader)) == 5


@pytest.mark.slow
def test_a_moved_finished_run_resumes_and_its_best_checkpoint_is_its_own(
    cli: CliRunner, log_dir: Path, tmp_path: Path
) -> None:
    first = cli("train", *EXACT, "trainer.max_epochs=1")
    assert first.returncode == 0, first.stderr[-2000:]
    (run,) = run_dirs(log_dir)
    moved = tmp_path / "moved away" / "run é"
    moved.parent.mkdir()
    shutil.move(run, moved)
    before = tree_hash(moved)
    again = cli("train", *EXACT, "trainer.max_epochs=1", f'ckpt_path="{moved}"')
    assert again.returncode == 0, again.stderr[-2000:]
    (resumed,) = run_dirs(log_dir)
    best = Path(json.loads((resumed / "metrics.json").read_text())["best_checkpoint"])
    assert best.parent == resumed / "checkpoints" and best.is_file()
    assert best.read_bytes() == (moved / "checkpoints" / best.name).read_bytes()
    assert tree_hash(moved) == before


CHECK_FITS = r"""
import resource, sys
from pathlib import Path
import torch, lightning.pytorch as pl
from runkit.safety.resume import check_fits

class Big(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(6000, 6000, bias=False)  # 144 MB of weights

model = Big()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
check_fits(model, Path(sys.argv[1]))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
def test_the_resume_check_does_not_read_the_weights_lightning_reads_next(tmp_path: Path) -> None:
    """Checking shapes must not hold a second copy of a large model in memory."""
    path = tmp_path / "big.ckpt"
    state = {"net.weight": torch.zeros(6000, 6000)}
    torch.save({"state_dict": state, "pytorch-lightning_version": "2.6.0"}, path)
    del state
    done = subprocess.run(
        [sys.executable, "-c", CHECK_FITS, str(path)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    grown_mb = int(done.stdout.split()[-1])
    assert grown_mb < 40, f"the check raised the peak memory by {grown_mb} MB"
