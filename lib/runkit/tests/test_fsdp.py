"""``trainer=fsdp`` on 2 CPU processes through the real CLI; signals wait on files, not times."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint

from conftest import CliRunner, clean_env, run_dirs
from runkit.errors import RunError
from runkit.safety import checkpoints, writes
from runkit.safety.resume import check_fits

ZOO = Path(__file__).resolve().parent / "zoo"

# batch_size is per process: each sees half of the 1258 training samples, 2 steps of 320 an epoch.
FSDP = ("trainer=fsdp", "trainer.devices=2", "trainer.accelerator=cpu",
        "trainer.deterministic=true", "callbacks.progress_bar.refresh_rate=0",
        "data.batch_size=320", "model.scheduler.T_max=8")  # fmt: skip


def start(tmp_path: Path, log_dir: Path, *overrides: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tinyapp.train", *FSDP, *overrides, f"paths.log_dir={log_dir}"]
    return subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def wait_for(process: subprocess.Popen, found: object, what: str, timeout: float = 300) -> Path:
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = found()  # type: ignore[operator]
        if path is not None:
            return path
        if process.poll() is not None:
            err = process.stderr.read()[-3000:]
            raise AssertionError(f"exited {process.returncode} before {what}: {err}")
        time.sleep(0.001)
    os.killpg(process.pid, signal.SIGKILL)
    raise AssertionError(f"no {what} within {timeout} s")


def first(pattern: str, root: Path) -> object:
    return lambda: next(iter(root.glob(f"train/runs/*/checkpoints/{pattern}")), None)


def meta(checkpoint: Path) -> dict:
    return torch.load(checkpoint / "meta.pt", map_location="cpu", weights_only=True)


def figures_of(run: Path) -> dict[str, float]:
    record = json.loads((run / "metrics.json").read_text())
    return {k: v for k, v in record["metrics"].items() if k.startswith("test/")}


def evaluates_as_trained(cli: CliRunner, run: Path, log_dir: Path, *overrides: str) -> Path:
    best = json.loads((run / "metrics.json").read_text())["best_checkpoint"]
    evaluated = cli("eval", f"ckpt_path={best}", *overrides)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (eval_run,) = run_dirs(log_dir, "eval")[-1:]
    assert figures_of(eval_run) == pytest.approx(figures_of(run), rel=1e-6)
    return Path(best)


@pytest.mark.slow
def test_fsdp_sigterm_resume_exactly_export_and_eval(cli: CliRunner, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    process = start(tmp_path, log_dir, "trainer.max_epochs=100", "test=false")
    last = wait_for(process, first("last.ckpt/manifest.json", log_dir), "a checkpoint")
    os.killpg(process.pid, signal.SIGTERM)
    out, err = process.communicate(timeout=300)
    assert process.returncode == 128 + signal.SIGTERM, err[-3000:]
    interrupted_run = last.parent.parent.parent
    interrupted = interrupted_run / "checkpoints" / "interrupted.ckpt"
    assert checkpoints.damaged_files(interrupted) is None
    assert sorted(checkpoints.manifest_names(interrupted)) == sorted(
        [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    )
    epoch = meta(interrupted)["epoch"]
    assert meta(interrupted)["global_step"] > 0
    assert "ckpt_path=" in out + err  # the command that resumes
    assert not list(interrupted.parent.glob(".*.tmp"))  # no staging directory left behind

    # the same run in one go, to the epoch after the interrupted one; then the resumed run
    epochs = f"trainer.max_epochs={epoch + 2}"
    full = cli("train", *FSDP, epochs)
    assert full.returncode == 0, full.stderr[-3000:]
    (full_run,) = [r for r in run_dirs(log_dir) if r != interrupted_run]
    resumed = cli("train", *FSDP, epochs, f"ckpt_path={interrupted}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (resumed_run,) = [r for r in run_dirs(log_dir) if r not in (interrupted_run, full_run)]

    # Exact resume: the same final weights, the same test figures.
    a = checkpoints.load_sharded(full_run / "checkpoints" / "last.ckpt")
    b = checkpoints.load_sharded(resumed_run / "checkpoints" / "last.ckpt")
    assert a["global_step"] == b["global_step"] > meta(interrupted)["global_step"]
    for key, value in a["state_dict"].items():
        assert torch.equal(value, b["state_dict"][key]), key
    assert figures_of(resumed_run) == figures_of(full_run)

    record = json.loads((full_run / "metrics.json").read_text())
    assert a["global_step"] == record["global_step"]
    assert record["global_step"] == (epoch + 2) * 2  # half the data per process (FSDP above)

    # model.pth: the best checkpoint's full state, plain tensors, for the plain network
    from tinyapp.models import ConvNet

    exported = torch.load(full_run / "model.pth", map_location="cpu", weights_only=True)
    ConvNet().load_state_dict(exported)  # strict: every key, full shapes
    assert all(type(v) is torch.Tensor for v in exported.values())
    best = checkpoints.load_sharded(evaluates_as_trained(cli, full_run, log_dir))["state_dict"]
    assert all(torch.equal(value, best[f"net.{key}"]) for key, value in exported.items())


@pytest.mark.slow
def test_fsdp_kill_9_during_a_sharded_save_leaves_last_complete(
    cli: CliRunner, tmp_path: Path
) -> None:
    log_dir = tmp_path / "logs"
    # bf16 parameters, float32 batch norms (what a bf16 GPU runs), here on the CPU
    every_step = ("precision=bf16-mixed", "test=false", "export_weights=false",
                  "callbacks.model_checkpoint.monitor=null",
                  "callbacks.model_checkpoint.every_n_epochs=null",
                  "+callbacks.model_checkpoint.every_n_train_steps=1")  # fmt: skip
    process = start(tmp_path, log_dir, "trainer.max_epochs=100", *every_step)
    wait_for(process, first("last.ckpt/manifest.json", log_dir), "a checkpoint")
    # The next save's staging directory: kill -9 every rank in the middle of writing it.
    staging = wait_for(process, first(".last.ckpt.*.tmp", log_dir), "a save")
    os.killpg(process.pid, signal.SIGKILL)
    process.communicate(timeout=60)
    folder = staging.parent
    last = folder / "last.ckpt"
    assert checkpoints.damaged_files(last) is None  # the previous save, complete
    step = checkpoints.load_sharded(last)["global_step"]
    assert step >= 1

    # a damaged shard, a checkpoint of another model: one line before anything loads
    copy = tmp_path / "damaged.ckpt"
    shutil.copytree(last, copy)
    shard = copy / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(RunError, match=r"'__1_0\.distcp' does not match its recorded CRC-32"):
        checkpoints.resolve_ckpt_path(str(copy), tmp_path)
    from hydra.utils import instantiate
    from test_performance_switches import _compose

    other = instantiate(_compose("model.net.channels=[8,16]").model)
    with pytest.raises(RunError, match="was trained with another model"):
        check_fits(other, last)

    # the killed run's directory resumes from that save; the dead writer's staging goes
    assert checkpoints.resolve_ckpt_path(str(folder.parent), tmp_path) == last.resolve()
    assert writes.remove_stale_temporaries(folder) == [staging]
    assert checkpoints.damaged_files(last) is None


def fake_checkpoint(folder: Path, marker: bytes = b"a") -> Path:
    folder.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"):
        (folder / name).write_bytes(marker * 100 + name.encode())
    names = checkpoints.checkpoint_files(folder)
    checkpoints.write_manifest(folder, checkpoints.describe_files(folder, names[:2]))
    return folder


def test_a_damaged_missing_or_cut_shard_is_named_in_one_line(tmp_path: Path) -> None:
    folder = fake_checkpoint(tmp_path / "epoch_001.ckpt")
    assert checkpoints.damaged_files(folder) is None
    assert len(checkpoints.manifest_names(folder)) == 4  # the ranks' shares and the rest
    shard = folder / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))
    said = str(checkpoints.damaged_files(folder))
    assert "'__1_0.distcp' does not match its recorded CRC-32" in said
    assert checkpoints.damaged_files(folder, ["__0_0.distcp"]) is None  # another rank's share
    shard.write_bytes(bytes(data[:-1]))
    said = str(checkpoints.damaged_files(folder))
    assert "'__1_0.distcp' has 111 bytes, 112 were written" in said
    shard.unlink()
    with pytest.raises(Exception, match=r"shard file '__1_0\.distcp' is missing"):
        checkpoints.resolve_ckpt_path(str(folder), tmp_path)


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two renames"])
def test_swap_in_replaces_a_checkpoint_directory_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exchange: bool
) -> None:
    if not exchange:
        monkeypatch.setattr(writes, "_exchange", lambda a, b: False)
    target = fake_checkpoint(tmp_path / "last.ckpt", b"o")
    new = writes.new_staging_dir(target)
    new.rmdir()
    fake_checkpoint(new, b"n")
    writes.swap_in(new, target)
    assert (target / "meta.pt").read_bytes().startswith(b"n")
    assert checkpoints.damaged_files(target) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing left aside


def test_last_is_a_directory_of_links_and_a_run_directory_resolves_to_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    best = fake_checkpoint(run / "checkpoints" / "epoch_003.ckpt")
    last = fake_checkpoint(run / "checkpoints" / "last.ckpt", b"o")  # the previous one, replaced
    writes.atomic_link(best, last)
    for name in [*checkpoints.manifest_names(best), checkpoints.MANIFEST_FILE]:
        assert (last / name).stat().st_ino == (best / name).stat().st_ino
    assert checkpoints.resolve_ckpt_path(str(run), tmp_path) == last.resolve()
    assert checkpoints.resolve_ckpt_path(str(best), tmp_path) == best.resolve()
    assert checkpoints.last_good_checkpoint(last.parent, prefer=last).endswith(f"{str(last)!r}")
