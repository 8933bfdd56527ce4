"""Damaged or foreign files a tool reads back (CSV log, overrides, GPU locks): one line, exit 2."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from runkit import plots
from runkit.gpus import claims, nvml
from runkit.gpus.claims import SelectionPolicy
from runkit.gpus.inventory import DeviceError, TorchCuda, collect_inventory
from runkit.testing.fake_nvml import FakeGpu, FakeNvml

PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x01"
GOOD_CSV = (
    "epoch,step,train/loss,val/loss,val/acc\r\n"
    "0,9,,1.2,0.5\r\n"
    "0,9,1.5,,\r\n"
    "1,19,,0.8,0.7\r\n"
    "1,19,1.0,,\r\n"
)


def damage(path: Path, kind: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    if kind == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("not a CSV log\n")
        return
    data = {
        "empty": b"",
        "truncated": GOOD_CSV.encode()[:-9],  # cut in the middle of the last row
        "binary": bytes(range(256)) * 4,
        "png": PNG,
        "latin-1": "epoch,step,précision\n0,1,0.5\n".encode("latin-1"),
        "foreign-csv": b"name,age\nada,36\n",
        "ragged": b"epoch,step,train/loss\n0,1,0.5,0.7,0.9\n",
    }[kind]
    path.write_bytes(data)


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }


def one_error_line(result) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: ")
    return lines[0]


# ------------------------------------------------------------------------- plot: csv/metrics.csv

CSV_CASES = {
    "empty": "is empty: it has no rows yet",
    "truncated": "is cut short: its last line ends without a newline",
    "binary": "it holds binary data (a NUL byte at offset 0)",
    "png": "it holds a PNG image",
    "latin-1": "it holds binary data (byte 0xe9 at offset 13 is not UTF-8)",
    "directory": "is a directory; expected a CSV log",
    "foreign-csv": "its header 'name,age' has no epoch and step columns",
    "ragged": "is damaged: row 2 has 5 fields, its header 3",
}


def a_run(root: Path) -> Path:
    run = root / "logs" / "train" / "runs" / "run é"
    (run / "csv").mkdir(parents=True)
    (run / "csv" / "metrics.csv").write_text(GOOD_CSV)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").write_text("- model.optimizer.lr=0.01\n")
    return run


@pytest.mark.parametrize("kind", sorted(CSV_CASES))
def test_plot_reading_a_damaged_csv_log_raises_one_line(tmp_path: Path, kind: str) -> None:
    run = a_run(tmp_path)
    damage(run / plots.METRICS_CSV, kind)
    with pytest.raises(plots.PlotError) as info:
        plots.read_metrics(run)
    message = str(info.value)
    assert "\n" not in message and CSV_CASES[kind] in message, message
    assert message.startswith(repr(str(run / plots.METRICS_CSV)))


def test_the_intact_csv_log_still_reads(tmp_path: Path) -> None:
    metrics = plots.read_metrics(a_run(tmp_path))
    assert metrics.curve("val/loss") == ([0, 1], [1.2, 0.8])
    assert metrics.curve("train/loss") == ([0, 1], [1.5, 1.0])
    assert metrics.label.endswith("model.optimizer.lr=0.01")


@pytest.mark.parametrize("kind", ["binary", "png", "directory"])
def test_after_run_never_fails_a_run_over_a_damaged_csv_log(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("matplotlib", reason="after_run draws only with matplotlib installed")
    run = a_run(tmp_path)
    damage(run / plots.METRICS_CSV, kind)
    assert plots.after_run(run) is None
    assert CSV_CASES[kind] in caplog.text
    assert not (run / plots.PLOT_FILE).exists()


def plot_cli_case(root: Path, case: str) -> tuple[list[str], str]:
    if case == "sweep":
        sweep = root / "sweep"
        for job in ("0", "1"):
            (sweep / job / "csv").mkdir(parents=True)
            (sweep / job / "csv" / "metrics.csv").write_text(GOOD_CSV)
        damage(sweep / "1" / plots.METRICS_CSV, "png")
        expected = (
            f"error: {str(sweep / '1' / plots.METRICS_CSV)!r} is not a CSV log (the text file "
            "Lightning's CSVLogger writes): it holds a PNG image; the file is damaged or foreign"
        )
        return [str(sweep), "--out", str(root / "compare.png")], expected
    if case == "overrides":
        run = a_run(root)
        damage(run / ".hydra" / "overrides.yaml", "binary")
        return [str(run)], f"error: {str(run / '.hydra' / 'overrides.yaml')!r} "
    (root / "curves.png").write_bytes(PNG)
    return ["curves.png"], "error: 'curves.png' is a file; expected a run or sweep directory"


@pytest.mark.parametrize("case", ["sweep", "overrides", "png-as-run"])
def test_plot_cli_on_damaged_files_is_one_line_naming_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, case: str
) -> None:
    args, expected = plot_cli_case(tmp_path, case)
    before = snapshot(tmp_path)
    monkeypatch.chdir(tmp_path)  # python -m runkit.plot's main, in-process
    returncode = plots.main(args)
    line = one_error_line(SimpleNamespace(returncode=returncode, stderr=capsys.readouterr().err))
    assert line.startswith(expected) and (case == "overrides" or line == expected), line
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------- GPU claims: lock files

LOCK_UUID = "GPU-11110000-1111-2222-3333-444455556666"


def quick_policy(lock_dir: Path) -> SelectionPolicy:
    return SelectionPolicy(lock_dir=str(lock_dir), util_window_s=0.05)


@pytest.fixture
def one_fake_gpu() -> Callable[[], object]:
    nvml.use_library(FakeNvml([FakeGpu(uuid=LOCK_UUID)]))
    claims.finish_job()
    yield lambda: collect_inventory(torch_info=TorchCuda(True, 1), env={})
    claims.finish_job()
    nvml.use_library(None)


@pytest.mark.parametrize("kind", ["empty", "truncated", "binary", "png", "latin-1"])
def test_a_damaged_lock_file_nobody_holds_is_claimed_and_rewritten(
    tmp_path: Path, one_fake_gpu: Callable[[], object], kind: str
) -> None:
    # the note (a pid) of a run that died is no claim, the kernel's lock is
    lock = claims.lock_path(tmp_path, LOCK_UUID)
    damage(lock, kind)
    chosen, message = claims.wait_and_claim(one_fake_gpu(), 1, quick_policy(tmp_path))
    assert chosen == [0] and claims.claimed_uuids() == (LOCK_UUID,)
    assert "picked cuda:0" in message
    assert lock.read_bytes() == f"{os.getpid()}\n".encode()


@pytest.mark.parametrize("kind", ["binary", "png", "empty"])
def test_a_held_lock_file_with_damaged_content_still_keeps_others_off(
    tmp_path: Path, one_fake_gpu: Callable[[], object], kind: str
) -> None:
    lock = claims.lock_path(tmp_path, LOCK_UUID)
    holder = claims.try_lock(lock)  # another open file: flock keeps this process off it too
    assert isinstance(holder, int)
    os.ftruncate(holder, 0)
    os.pwrite(holder, {"binary": bytes(range(256)), "png": PNG, "empty": b""}[kind], 0)
    with pytest.raises(DeviceError) as info:
        claims.wait_and_claim(one_fake_gpu(), 1, quick_policy(tmp_path))
    assert str(info.value) == (
        "select_gpus=least_used found 0 of the 1 GPU(s) wanted with gpu_wait_s=0: "
        "cuda:0 claimed by another run"
    )
    os.close(holder)


def test_a_directory_where_a_lock_file_belongs_is_one_line_naming_it(
    tmp_path: Path, one_fake_gpu: Callable[[], object]
) -> None:
    lock = claims.lock_path(tmp_path, LOCK_UUID)
    damage(lock, "directory")
    before = snapshot(tmp_path)
    with pytest.raises(DeviceError) as info:
        claims.wait_and_claim(one_fake_gpu(), 1, quick_policy(tmp_path))
    assert str(info.value) == (
        "select_gpus=least_used found 0 of the 1 GPU(s) wanted with gpu_wait_s=0: "
        f"cuda:0 its lock file {str(lock)!r} cannot be opened (Is a directory)"
    )
    assert snapshot(tmp_path) == before and claims.claimed_uuids() == ()
