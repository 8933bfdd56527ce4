"""``trainer=fsdp`` on 2 CPU processes over gloo, through the real CLI: fit, test, export, eval,
SIGTERM, exact resume, kill -9 during a sharded save, a damaged shard, another model's checkpoint.

The runs are few and each checks many things; signals are sent once files show the run is where
the test needs it, never after a fixed time.
"""

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

from conftest import CliRunner, clean_env, run_dirs, train_on_two_torchrun_nodes
from runkit.errors import RunError
from runkit.safety import checkpoints
from runkit.safety.resume import check_fits

ZOO = Path(__file__).resolve().parent / "zoo"

TWO_PROCESSES = (
    "trainer=fsdp",
    "trainer.devices=2",
    "trainer.accelerator=cpu",
    "trainer.deterministic=true",
    "callbacks.progress_bar.refresh_rate=0",
)
# batch_size is per process: each sees half of the 1258 training samples, 2 steps of 320 an epoch.
# T_max: one schedule whatever epoch a run stops at.
FSDP = (*TWO_PROCESSES, "data.batch_size=320", "model.scheduler.T_max=8")


def start(tmp_path: Path, log_dir: Path, *overrides: str) -> subprocess.Popen:
    """A training run of its own process group (a kill reaches every rank at once)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tinyapp.train", *FSDP, *overrides, f"paths.log_dir={log_dir}"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for(process: subprocess.Popen, found: object, what: str, timeout: float = 300) -> Path:
    """Poll (1 ms) until ``found()`` returns a path; fail if the run ends first."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        path = found()  # type: ignore[operator]
        if path is not None:
            return path
        if process.poll() is not None:
            raise AssertionError(
                f"exited {process.returncode} before {what}: {process.stderr.read()[-3000:]}"
            )
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
    """eval on one process of the sharded best checkpoint: the test figures; its path."""
    best = json.loads((run / "metrics.json").read_text())["best_checkpoint"]
    evaluated = cli("eval", f"ckpt_path={best}", *overrides)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (eval_run,) = run_dirs(log_dir, "eval")[-1:]
    assert figures_of(eval_run) == pytest.approx(figures_of(run), rel=1e-6)
    return Path(best)


@pytest.mark.slow
def test_fsdp_sigterm_resume_exactly_export_and_eval(cli: CliRunner, tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    # SIGTERM once the first epoch's checkpoint exists: both ranks save one sharded
    # interrupted.ckpt and the run exits 128+15.
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

    # The same run in one go, to the epoch after the interrupted one; then the resumed run.
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

    # last.ckpt is the latest save point (links to the epoch file's shards or its own save).
    record = json.loads((full_run / "metrics.json").read_text())
    assert a["global_step"] == record["global_step"]
    assert record["global_step"] == (epoch + 2) * 2  # half the data per process (FSDP above)

    # model.pth: the full state gathered on rank 0, plain tensors, loads into the plain network;
    # the best checkpoint's weights, so its eval is that checkpoint's (evaluated on one process).
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
    every_step = (
        # bf16 parameters, float32 batch norms (what a bf16 GPU runs), here on the CPU
        "precision=bf16-mixed",
        "test=false",
        "export_weights=false",
        "callbacks.model_checkpoint.monitor=null",
        "callbacks.model_checkpoint.every_n_epochs=null",
        "+callbacks.model_checkpoint.every_n_train_steps=1",
    )
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

    # A damaged shard is named in one line before anything loads; a checkpoint of another
    # model is one line too (the CLI prints such lines as they are: test_bad_inputs.py).
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

    # The killed run's directory resumes from that save (a sharded resume runs in the first test);
    # the dead writer's staging directory goes with the next save in that directory.
    assert checkpoints.resolve_ckpt_path(str(folder.parent), tmp_path) == last.resolve()
    assert checkpoints.remove_stale_temporaries(folder) == [staging]
    assert checkpoints.damaged_files(last) is None


@pytest.mark.slow
def test_fsdp_shards_a_foreign_module_whose_configure_model_builds_its_layers(
    cli: CliRunner, tmp_path: Path
) -> None:
    # The zoo's LazyModule makes its layers in its own configure_model (honoured, not replaced)
    # and shards nothing there: its Linear layers become the FSDP units afterwards.
    shutil.copytree(ZOO, tmp_path / "zoo", ignore=shutil.ignore_patterns("__pycache__"))
    log_dir = tmp_path / "logs"
    done = cli(
        "train",
        "--config-dir",
        "zoo/configs",
        "experiment=zoo_lazy",
        *TWO_PROCESSES,
        "data.batch_size=128",
        "trainer.max_epochs=2",
        f"paths.log_dir={log_dir}",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = run_dirs(log_dir)
    index = torch.distributed.checkpoint.FileSystemReader(str(run / "checkpoints" / "last.ckpt"))
    keys = index.read_metadata().state_dict_metadata
    assert "state_dict.layers.0.weight" in keys  # the module's own layers, saved sharded
    exported = set(torch.load(run / "model.pth", weights_only=True))
    assert exported == {f"layers.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")}
    # model.pth's eval is the template's path (the first test); its keys are checked above
    evaluates_as_trained(cli, run, log_dir, "trusted_targets=[zoo.,torch.]")


@pytest.mark.slow
def test_fsdp_over_two_torchrun_nodes_shards_over_every_process(tmp_path: Path) -> None:
    # trainer.num_nodes as for DDP: 2 nodes x 1 process is one mesh of 2 shards; each rank sees
    # half the data (3 steps of 256 from 629 samples) and writes its own shard file.
    log_dir = tmp_path / "logs"
    train_on_two_torchrun_nodes(
        tmp_path,
        "fsdp-nodes",
        "trainer=fsdp",
        "trainer.num_nodes=2",
        "trainer.devices=1",
        "trainer.accelerator=cpu",
        "trainer.max_epochs=1",
        "data.batch_size=256",
        "callbacks.progress_bar.refresh_rate=0",
        f"paths.log_dir={log_dir}",
    )
    run = log_dir / "train" / "runs" / "torchrun-fsdp-nodes"
    summary = json.loads((run / "metrics.json").read_text())
    assert (summary["num_nodes"], summary["global_step"]) == (2, 3)
    last = run / "checkpoints" / "last.ckpt"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(checkpoints.manifest_names(last))
    assert checkpoints.damaged_files(last) is None
    assert (run / "model.pth").is_file()


# ---- the directory machinery, without processes -----------------------------------------------


def fake_checkpoint(folder: Path, marker: bytes = b"a") -> Path:
    """A checkpoint directory as a sharded save leaves it: shards, index, meta, manifest last."""
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
        monkeypatch.setattr(checkpoints, "_exchange", lambda a, b: False)
    target = fake_checkpoint(tmp_path / "last.ckpt", b"o")
    new = checkpoints.new_staging_dir(target)
    new.rmdir()
    fake_checkpoint(new, b"n")
    checkpoints.swap_in(new, target)
    assert (target / "meta.pt").read_bytes().startswith(b"n")
    assert checkpoints.damaged_files(target) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]  # nothing left aside


def test_last_is_a_directory_of_links_and_a_run_directory_resolves_to_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    best = fake_checkpoint(run / "checkpoints" / "epoch_003.ckpt")
    last = fake_checkpoint(run / "checkpoints" / "last.ckpt", b"o")  # the previous one, replaced
    checkpoints.atomic_link(best, last)
    for name in [*checkpoints.manifest_names(best), checkpoints.MANIFEST_FILE]:
        assert (last / name).stat().st_ino == (best / name).stat().st_ino
    assert checkpoints.resolve_ckpt_path(str(run), tmp_path) == last.resolve()
    assert checkpoints.resolve_ckpt_path(str(best), tmp_path) == best.resolve()
    assert checkpoints.last_good_checkpoint(last.parent, prefer=last).endswith(f"{str(last)!r}")
