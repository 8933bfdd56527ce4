"""Bad input through the real CLI: one clear line on stderr, a non-zero exit, nothing lost.

Every case runs next to an earlier, finished run; its whole directory (checkpoints, logs,
model.pth) is hashed before and after each case and must not change by a byte.

Two situations are simulated, because the tests run as root:

* an output directory that cannot be created: ``paths.log_dir`` below a regular *file* (root
  ignores ``chmod``, but nobody can make a directory inside a file: ``ENOTDIR``);
* a full disk during a save: ``PROJECT_FAIL_CHECKPOINT_WRITES=ENOSPC`` makes the checkpoint
  writer fail half-way through each write with the same ``OSError`` a full disk raises, after
  bytes reached the temporary file (a real small tmpfs needs a mount, which CI lacks).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from conftest import FAST, clean_env, run_dirs

FAKE_NVML = "project.machinery.testing.fake_nvml:create"


@dataclass
class Case:
    id: str
    task: str
    args: Callable[[dict[str, Path]], list[str]]
    expect: str  # a piece of the one error line
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)


CASES = [
    Case("unknown-key", "train", lambda p: ["trainer.devicez=2"], "is not a key of the config"),
    Case("unknown-group", "train", lambda p: ["model=nosuch"], "nosuch"),
    Case("wrong-type", "train", lambda p: ["trainer.max_epochs=abc"], "wrong type"),
    Case("zero-epochs", "train", lambda p: ["trainer.max_epochs=0"], "max_epochs=0 is invalid"),
    Case("negative-epochs", "train", lambda p: ["trainer.max_epochs=-3"], "max_epochs=-3"),
    Case("zero-batch", "train", lambda p: ["data.batch_size=0"], "data.batch_size"),
    Case("no-such-strategy", "train", lambda p: ["trainer.strategy=warp"], "does not exist"),
    Case(
        "gpus-beyond-what-exists",
        "train",
        lambda p: ["trainer.accelerator=gpu", "trainer.devices=4"],
        "GPU",
        env={"PROJECT_NVML_BACKEND": FAKE_NVML, "PROJECT_FAKE_NVML": '{"gpus": 2}'},
    ),
    Case("ckpt-missing", "train", lambda p: [f"ckpt_path={p['in']}/nope.ckpt"], "does not exist"),
    Case("ckpt-empty", "train", lambda p: [f"ckpt_path={p['in']}/empty.ckpt"], "empty"),
    Case("ckpt-truncated", "train", lambda p: [f"ckpt_path={p['in']}/half.ckpt"], "truncated"),
    Case(
        "ckpt-not-a-ckpt", "train", lambda p: [f"ckpt_path={p['in']}/notes.txt"], "not a complete"
    ),
    Case(
        "ckpt-last-none",
        "train",
        lambda p: [f"paths.log_dir={p['in']}/empty_logs", "ckpt_path=last"],
        "found no",
    ),
    Case(
        "eval-other-architecture",
        "eval",
        lambda p: [f"ckpt_path={p['in']}/other_arch/model.pth"],
        "does not fit MLP: missing keys",
    ),
    Case("eval-truncated-pth", "eval", lambda p: [f"ckpt_path={p['in']}/half.pth"], "half.pth"),
    Case(
        "output-dir-not-writable",
        "train",
        lambda p: [f"paths.log_dir={p['in']}/a_file/logs"],
        "cannot create or write",
    ),
    Case(
        "disk-full-during-save",
        "train",
        lambda p: ["trainer.max_epochs=1"],
        "No space left on device",
        code=1,
        env={"PROJECT_FAIL_CHECKPOINT_WRITES": "ENOSPC"},
    ),
    Case(
        "cuda-visible-devices-garbage",
        "train",
        lambda p: ["trainer.accelerator=gpu"],
        "no usable GPU",  # a CPU-only torch is reported first; on CUDA torch devices.py reports it
        env={
            "CUDA_VISIBLE_DEVICES": "banana,,7",
            "PROJECT_NVML_BACKEND": FAKE_NVML,
            "PROJECT_FAKE_NVML": '{"gpus": 2}',
        },
    ),
    Case(
        "nvml-init-fails",
        "train",
        lambda p: ["trainer.accelerator=gpu"],
        "NVML",
        env={
            "PROJECT_NVML_BACKEND": FAKE_NVML,
            "PROJECT_FAKE_NVML": '{"gpus": 2, "init_error": "driver_not_loaded"}',
        },
    ),
]


def tree_hash(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An earlier finished run, and a folder of bad files made from it."""
    root = tmp_path_factory.mktemp("bad_inputs")
    logs = root / "logs"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "project.train",
            *FAST,
            "trainer.max_epochs=1",
            f"paths.log_dir={logs}",
        ],
        cwd=root,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = run_dirs(logs)
    bad = root / "inputs"
    bad.mkdir()
    (bad / "empty.ckpt").write_bytes(b"")
    data = (run / "checkpoints" / "last.ckpt").read_bytes()
    (bad / "half.ckpt").write_bytes(data[: len(data) // 2])
    weights = (run / "model.pth").read_bytes()
    (bad / "half.pth").write_bytes(weights[: len(weights) // 2])
    (bad / "notes.txt").write_text("not a checkpoint\n")
    (bad / "a_file").write_text("a regular file, not a directory\n")
    (bad / "empty_logs").mkdir()
    other = bad / "other_arch"
    other.mkdir()
    shutil.copy(run / "model.pth", other / "model.pth")
    config = (run / "config.yaml").read_text()
    mlp = "  net:\n    _target_: project.models.nets.MLP\n    in_features: 64\n    hidden: [16]\n    num_classes: 10\n    dropout: 0.0\n"
    head, _, _ = config.partition("  net:\n")
    (other / "config.yaml").write_text(head + mlp)
    return {"root": root, "logs": logs, "run": run, "in": bad}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_loses_nothing(world: dict[str, Path], case: Case) -> None:
    before = tree_hash(world["run"])
    args = case.args(world)
    budget = FAST if case.task == "train" else ()  # eval has no callbacks or epochs
    command = [sys.executable, "-m", f"project.{case.task}", *budget, *args]
    if not any(a.startswith("paths.log_dir=") for a in args):
        command.append(f"paths.log_dir={world['logs']}")
    done = subprocess.run(
        command,
        cwd=world["root"],
        env=clean_env(**case.env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert done.returncode == case.code, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines and lines[-1].startswith("error: "), done.stderr[-2000:]
    assert case.expect in lines[-1], lines[-1]
    assert tree_hash(world["run"]) == before, "the earlier run's files changed"
    json.loads((world["run"] / "metrics.json").read_text())  # still whole
