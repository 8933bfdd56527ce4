"""Bad input: one line on stderr, a non-zero exit, an earlier run's files unchanged, nothing left
(bad files in a folder with a space and an é). lib/runkit/docs/reliability.md lists every case."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from lightning.pytorch.demos.boring_classes import DemoModel
from omegaconf import OmegaConf

from conftest import FAST, compose_train, run_dirs, run_entry
from runkit.run.preflight import PreflightCallback

FAKE_NVML = "runkit.testing.fake_nvml:create"
ROOT = Path(__file__).resolve().parents[3]
PAYLOAD_FILE = "payload_ran"  # what the malicious checkpoint's pickle would create


class Case(NamedTuple):
    id: str
    task: str
    args: tuple[str, ...]  # formatted with the world's paths: {in}, {run}, {demo}, {in_name}
    expect: str  # a piece of the one error line
    code: int = 2
    env: dict[str, str] | None = None
    cli: bool = True  # False: refused by the preflight, checked in-process


# Lightning's own demo modules and data, through the CLI (model._target_, data._target_).
BORING = (
    "~model",
    "~data",
    "+data._target_=lightning.pytorch.demos.boring_classes.BoringDataModule",
)


class Evil:  # unpickling it runs ``touch <PAYLOAD_FILE>``: what weights_only must refuse
    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch '{self.target}'",))


def fake_gpus(**spec: object) -> dict[str, str]:
    return {"RUNKIT_NVML_BACKEND": FAKE_NVML, "RUNKIT_FAKE_NVML": json.dumps({"gpus": 2, **spec})}


CASES = [
    Case("unknown-key", "train", ("trainer.devicez=2",),
         "trainer.devicez is not a key of the config (did you mean trainer.devices?)"),
    Case("unknown-group", "train", ("model=nosuch",), "Could not find 'model/nosuch'"),
    Case("wrong-type", "train", ("trainer.max_epochs=abc",),
         "trainer.max_epochs='abc' has the wrong type", cli=False),
    Case("zero-epochs", "train", ("trainer.max_epochs=0",), "trainer.max_epochs=0 is invalid", cli=False),
    Case("negative-epochs", "train", ("trainer.max_epochs=-3",), "max_epochs=-3", cli=False),
    Case("zero-batch", "train", ("data.batch_size=0",), "data.batch_size"),
    Case("negative-lr", "train", ("model.optimizer.lr=-1",), "model.optimizer.lr=-1", cli=False),
    Case("nan-lr", "train", ("model.optimizer.lr=nan",), "lr=nan is not a finite", cli=False),
    Case("betas-out-of-range", "train", ("+model.optimizer.betas=[0.9,1.5]",),
         "model.optimizer.betas=[0.9, 1.5] is invalid", cli=False),
    Case("negative-seed", "train", ("seed=-1",), "seed=-1 is invalid", cli=False),
    Case("seed-not-a-number", "train", ("seed=abc",), "seed='abc' is invalid", cli=False),
    Case("experiment-yaml-broken", "train", ("--config-dir={in}/configs", "experiment=broken"),
         "broken.yaml is not valid YAML (line "),
    Case("experiment-not-utf8", "train", ("--config-dir={in}/configs", "experiment=latin1"),
         "latin1.yaml is not UTF-8 text (byte 0xe9 at position"),
    Case("config-with-conflict-markers", "train",
         ("--config-dir={in}/conflicted", "experiment=updated"),
         "updated.yaml:3 has merge-conflict markers"),
    Case("no-such-strategy", "train", ("trainer.strategy=warp",), "does not exist", cli=False),
    Case("accelerator-not-here", "train", ("trainer.accelerator=tpu",),
         "trainer.accelerator=tpu is not available", cli=False),
    Case("gpus-beyond-what-exists", "train", ("trainer.accelerator=gpu", "trainer.devices=4"),
         "GPU", env=fake_gpus()),
    Case("ckpt-missing", "train", ('ckpt_path="{in}/nope.ckpt"',), "nope.ckpt' does not exist", cli=False),
    Case("ckpt-empty", "train", ('ckpt_path="{in}/empty.ckpt"',), "empty", cli=False),
    Case("ckpt-truncated", "train", ('ckpt_path="{in}/half.ckpt"',), "truncated", cli=False),
    Case("ckpt-not-a-ckpt", "train", ('ckpt_path="{in}/notes.txt"',), "not a complete", cli=False),
    Case("ckpt-malicious", "train", ('ckpt_path="{in}/evil.ckpt"',), "was refused"),
    Case("resume-from-model-pth", "train", ('ckpt_path="{run}/model.pth"',),
         "training cannot resume from it", cli=False),
    Case("resume-other-model", "train", ("model=mlp", 'ckpt_path="{run}"'),
         "was trained with another model"),
    Case("ckpt-last-none", "train", ('paths.log_dir="{in}/empty_logs"', "ckpt_path=last"),
         "found no", cli=False),
    # The file judged is named as resolved, and the value typed beside it when that is another.
    Case("ckpt-last-empty", "train", ('paths.log_dir="{in}/empty_last"', "ckpt_path=last"),
         "checkpoints/last.ckpt' (typed 'last') is an empty file", cli=False),
    Case("ckpt-run-dir-empty-last", "train", ('ckpt_path="{in}/empty_last/train/runs/r"',),
         "runs/r/checkpoints/last.ckpt' (typed '", cli=False),
    Case("ckpt-dir-typed-relative", "train", ('ckpt_path="{in_name}/empty_logs"',),
         "empty_logs' (typed 'bad inputs é/empty_logs') is a directory without", cli=False),
    Case("ckpt-device", "train", ("ckpt_path=/dev/zero",),
         "'/dev/zero' is a character device, not a regular file", cli=False),
    Case("ckpt-fifo", "train", ('ckpt_path="{in}/pipe.ckpt"',),
         "pipe.ckpt' is a FIFO (named pipe), not a regular file"),
    Case("eval-without-ckpt", "eval", (), "ckpt_path is required", cli=False),
    Case("eval-without-test-step", "eval",
         ('ckpt_path="{demo}/model.pth"', "trusted_targets=[lightning.pytorch.demos.,torch.]"),
         "DemoModel has no test_step, so there is nothing to evaluate"),
    Case("monitor-of-a-module-that-logs-nothing", "train",
         (*BORING, "+model._target_=lightning.pytorch.demos.boring_classes.BoringModel"),
         "it logs nothing (no self.log call). Log 'val/acc' with self.log, or set "
         "callbacks.model_checkpoint.monitor=null to keep the latest checkpoint only"),
    Case("eval-other-architecture", "eval", ('ckpt_path="{in}/other_arch/model.pth"',),
         "does not fit MLP: missing keys"),
    Case("eval-truncated-pth", "eval", ('ckpt_path="{in}/half.pth"',), "half.pth", cli=False),
    Case("eval-config-yaml-broken", "eval", ('ckpt_path="{in}/broken_config/model.pth"',),
         "config.yaml"),
    Case("output-dir-not-writable", "train", ('paths.log_dir="{in}/a_file/logs"',),
         "cannot create or write"),
    Case("log-dir-empty", "train", ("paths.log_dir=",), "paths.log_dir is empty", cli=False),
    Case("path-not-quoted", "train", ("paths.log_dir={in}/logs",),
         "quote a value with spaces, non-ASCII or special characters"),
    Case("run-dir-holds-a-run", "train", ('hydra.run.dir="{run}"',), "already holds a run"),
    Case("run-dir-taken", "train", ('hydra.run.dir="{in}/starting"',), "is taken"),
    # a CPU-only torch is reported first; on CUDA torch devices.py reports it
    Case("cuda-visible-devices-garbage", "train", ("trainer.accelerator=gpu",), "no usable GPU",
         env={"CUDA_VISIBLE_DEVICES": "banana,,7", **fake_gpus()}),
    Case("nvml-init-fails", "train", ("trainer.accelerator=gpu",), "NVML",
         env=fake_gpus(init_error="driver_not_loaded")),
]  # fmt: skip


def tree_hash(directory: Path) -> dict[str, str]:
    return {
        str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad_inputs")
    logs = root / "logs"
    done = run_entry(root, "train", *FAST, f"paths.log_dir={logs}", "trainer.max_epochs=1")
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = run_dirs(logs)
    bad = root / "bad inputs é"
    ckpt = (run / "checkpoints" / "last.ckpt").read_bytes()
    weights = (run / "model.pth").read_bytes()
    config = (run / "config.yaml").read_text()
    crafted = OmegaConf.create(config)  # the same run, with an MLP for the ConvNet
    crafted.model.net = {"_target_": "tinyapp.models.MLP", "in_features": 64,
                         "hidden": [16], "num_classes": 10, "dropout": 0.0}  # fmt: skip
    files = {
        "empty.ckpt": b"", "half.ckpt": ckpt[: len(ckpt) // 2],
        "half.pth": weights[: len(weights) // 2], "notes.txt": b"not a checkpoint\n",
        "a_file": b"a regular file, not a directory\n",
        "empty_last/train/runs/r/checkpoints/last.ckpt": b"",
        "other_arch/model.pth": weights, "other_arch/config.yaml": OmegaConf.to_yaml(crafted),
        "broken_config/model.pth": weights,
        "broken_config/config.yaml": config[: len(config) // 3] + "\n  net: [unclosed\n",
        "configs/experiment/broken.yaml": "# @package _global_\ntrainer:\n  max_epochs: [1\n",
        # saved by a Latin-1 editor
        "configs/experiment/latin1.yaml":
            "# @package _global_\n# réglages\ntrainer:\n  max_epochs: 2\n".encode("latin-1"),
        # as copier update leaves it
        "conflicted/experiment/updated.yaml": "# @package _global_\ntrainer:\n<<<<<<< before "
            "updating\n  max_epochs: 2\n=======\n  max_epochs: 3\n>>>>>>> after updating\n",
    }  # fmt: skip
    for name, content in files.items():
        (bad / name).parent.mkdir(parents=True, exist_ok=True)
        data = content.encode() if isinstance(content, str) else content
        (bad / name).write_bytes(data)
    (bad / "empty_logs").mkdir()
    (bad / "starting" / ".hydra").mkdir(parents=True)  # another run has just claimed it
    os.mkfifo(bad / "pipe.ckpt")
    torch.save({"state_dict": {}, "trap": Evil(bad / PAYLOAD_FILE)}, bad / "evil.ckpt")
    demo_run = root / "demo_run"  # a run of a module without test_step (Lightning's DemoModel)
    demo_run.mkdir()
    torch.save(DemoModel().state_dict(), demo_run / "model.pth")
    boring = "lightning.pytorch.demos.boring_classes."
    OmegaConf.save({"model": {"_target_": f"{boring}DemoModel"},
                    "data": {"_target_": f"{boring}BoringDataModule"}}, demo_run / "config.yaml")  # fmt: skip
    return {"root": root, "logs": logs, "run": run, "in": bad, "demo": demo_run}


def command_for(case: Case, world: dict[str, Path]) -> list[str]:
    args = [arg.format(**world, in_name=world["in"].name) for arg in case.args]
    options = [a for a in args if a.startswith("--")]  # Hydra's own flags go first
    overrides = [a for a in args if not a.startswith("--")]
    # eval has no callbacks or epochs; a command replacing the data node takes no data.* key
    budget = [a for a in FAST if "~data" not in args or not a.startswith("data.")]
    budget = budget if case.task == "train" else []
    command = [*options, *budget, *overrides]
    if not any(a.startswith("paths.log_dir=") for a in args):
        command.append(f'paths.log_dir="{world["logs"]}"')
    return command


@pytest.mark.slow  # the world: a training run
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bad_input_is_one_line_and_loses_nothing(world, case, capsys, monkeypatch) -> None:
    before, everything = tree_hash(world["run"]), set(world["root"].rglob("*"))
    if case.cli:
        done = run_entry(world["root"], case.task, *command_for(case, world), env=case.env)
        code, err = done.returncode, done.stderr
        assert "Traceback" not in err and "Error executing job" not in err, err
    else:  # what the preflight refuses, through its Hydra callback in this process
        monkeypatch.chdir(world["root"])
        with pytest.raises(SystemExit) as stop:
            PreflightCallback._check(compose_train(*command_for(case, world), name=case.task),
                                     "hydra.run.dir")  # fmt: skip
        code, err = stop.value.code, capsys.readouterr().err
        assert err.count("\n") == 1, err
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert code == case.code, err[-2000:]
    assert lines and lines[-1].startswith("error: ") and case.expect in lines[-1], err[-2000:]
    assert tree_hash(world["run"]) == before, "the earlier run's files changed"
    assert not (world["in"] / PAYLOAD_FILE).exists(), "the malicious checkpoint's code ran"
    created = sorted(str(p) for p in set(world["root"].rglob("*")) - everything)
    assert not created, f"a run that never started left {created}"


def test_reliability_table_lists_every_case() -> None:
    # rows ``| `<id>` | <what> | <line> (exit <code>) | `<file>` |``; another file names its test
    text = (ROOT / "lib" / "runkit" / "docs" / "reliability.md").read_text()
    rows = [
        [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for line in text.split("\n## ")[0].splitlines()
        if line.startswith("| `")
    ]
    cases, listed = {case.id: case for case in CASES}, set()
    for row in rows:
        assert len(row) == 4, f"a reliability row needs 4 cells: {row}"
        case_id, _, shown, test_file = row
        path = ROOT / "lib" / "runkit" / test_file  # the library's own paths
        assert path.is_file(), f"reliability row {case_id!r} names {test_file}: no such file"
        if path.name != Path(__file__).name:
            defined = rf"def {re.escape(case_id)}\(|[\"']{re.escape(case_id)}[\"']"
            assert re.search(defined, path.read_text()), f"{case_id!r}: no such test in {test_file}"
            continue
        assert case_id in cases, f"reliability row {case_id!r} is not a case here"
        assert cases[case_id].expect in shown, f"row {case_id!r} should show the line"
        assert f"(exit {cases[case_id].code})" in shown, f"row {case_id!r}: exit code"
        listed.add(case_id)
    assert listed == set(cases), f"cases without a row: {sorted(set(cases) - listed)}"
