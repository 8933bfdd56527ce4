"""What the program prints to paste works pasted into a real bash and Hydra, whatever the value;
and the one-line endings of sweeps."""

from __future__ import annotations

import functools
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf
from test_readme import shell_env

from conftest import FAST, CliRunner, run_dirs, user_config_dir
from runkit import quoting, speed
from runkit.errors import RunError
from runkit.safety.interrupts import resume_command
from runkit.safety.trusted import check_trusted

TESTS = Path(__file__).resolve().parent
HOSTILE = [
    "/data/my runs/é.ckpt", "it's", 'say "hi"', "$HOME/x", "a=b", "a,b", "[1,2]", "{a: 1}", "x\\",
    'x\\"y', "${oc.env:HOME}", "\\${x}", "tab\there", "null", "True", "16", "-1", "", " ",
    "/plain/path-1.ckpt", "/data/it's $HOME=a,b [x] é/run (1).ckpt",
]  # fmt: skip
TINY = (*FAST, "trainer.max_epochs=1", "+trainer.limit_train_batches=2", "test=false")


def bash_words(line: str) -> list[str]:
    done = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {line}"], capture_output=True, check=True, timeout=30
    )
    return done.stdout.decode().split("\0")[:-1]


@functools.cache
def parser() -> OverridesParser:
    return OverridesParser.create()


def config_value(word: str) -> object:  # Hydra's parser, then OmegaConf
    (parsed,) = parser().parse_overrides([word])
    return OmegaConf.create({"k": parsed.value()}).k


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def test_override_survives_bash_and_hydra_for_hostile_and_random_values_keeping_type() -> None:
    plain = ["16-mixed", "32-true", "bf16-mixed", "/data/run-1.ckpt", "torch.nn."]
    assert [quoting.override("k", v) for v in plain] == [f"k={v}" for v in plain]  # as typed
    assert quoting.override("k", "1e-5") == "'k=\"1e-5\"'"  # a number: quoted to stay a string
    scalars = [*HOSTILE, *plain, "1e-5", 16, -1, 0.5, True, False, None]
    alphabet, rng = list(" é日'\"\\$={}[](),:;|&<>`~!?*#%@+-./_\t\nab01"), random.Random(24)
    randoms = [
        "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(1000)
    ]
    values = [*scalars, [*scalars, ["a b", 2]], (), *randoms]  # and lists of them
    words = bash_words(" ".join(quoting.override("ckpt_path", v) for v in values))
    assert len(words) == len(values), words  # one word each: nothing split, nothing expanded
    for word, value in zip(words, values, strict=True):
        assert word.startswith("ckpt_path="), word
        got = config_value(word)
        got = OmegaConf.to_container(got, resolve=True) if OmegaConf.is_list(got) else got  # type: ignore[arg-type]
        assert repr(got) == repr(list(value) if value == () else value), (value, word)


@pytest.mark.parametrize("value", ["16-mixed", "it's $HOME=a,b [x] é", 16, "null", "1e-5"])
def test_trainer_precision_line_of_a_built_run_pastes_back_the_value(value: object) -> None:
    cfg = OmegaConf.create({"trainer": {"precision": value}})
    with pytest.raises(RunError) as refused:
        speed.trainer_settings(cfg, None)
    hint = str(refused.value).rsplit("top-level key: ", 1)[1]
    (word,) = bash_words(hint)
    assert word.partition("=")[0] == "precision"
    got = config_value(word)
    assert got == value and type(got) is type(value), (hint, got)
    if value == "16-mixed":
        assert hint == "precision=16-mixed"


def test_trusted_targets_hint_pastes_back_the_list_that_lets_the_file_in() -> None:
    tree = {"model": {"_target_": "collections.OrderedDict"}}
    allowed = ["torch.nn.", "my pkg.", "it's $HOME=a,b [x] é.", "null", "${oc.env:HOME}."]
    with pytest.raises(RunError) as refused:
        check_trusted(tree, allowed, "given.ckpt")
    message = str(refused.value)
    hint = message.split(" allow it with ", 1)[1].split(" (eval, predict)", 1)[0]
    (word,) = bash_words(hint)
    assert word.startswith("trusted_targets=[")
    widened = OmegaConf.to_container(config_value(word), resolve=True)
    assert widened == [*allowed, "collections."]
    check_trusted(tree, widened, "given.ckpt")  # pasted, the list lets the file in
    with pytest.raises(RunError, match=r"with 'trusted_targets=\[torch\.nn\.,collections\.\]' "):
        check_trusted(tree, ["torch.nn."], "given.ckpt")


def test_resume_command_pastes_back_the_overrides_and_the_checkpoint(monkeypatch) -> None:
    typed = ['paths.log_dir="/data/it\'s $HOME=a,b [x] é"', "trainer.max_epochs=3", "ckpt_path=x"]
    options = ["-cd", "my configs é", "--config-name=exp", "-cp", "conf"]
    monkeypatch.setattr(sys, "argv", ["train.py", *options, *typed])
    monkeypatch.setenv("PYTHONPATH", "/my code/é:.")
    checkpoint = Path(HOSTILE[-1])
    words = bash_words(resume_command(checkpoint))
    assert words[:2] == ["PYTHONPATH=/my code/é:.", "python"]
    program = words.index(typed[0])
    assert words[program - 6 : program] == [
        *("--config-dir", "my configs é", "--config-name", "exp", "--config-path", "conf")
    ]
    assert words[program:-1] == typed[:2]  # the user's overrides as typed; no old ckpt_path
    assert words[-1].startswith("ckpt_path=")
    assert config_value(words[-1]) == str(checkpoint)
    assert config_value(words[program]) == "/data/it's $HOME=a,b [x] é"


@pytest.mark.slow
def test_resume_command_printed_after_ctrl_c_resumes_when_pasted_into_bash(tmp_path: Path) -> None:
    log_dir = tmp_path / "it's $HOME=a,b [x] é"
    marker = tmp_path / "paused"
    pause = ("_target_=user_callbacks.Pause", "at=train", f"marker={marker}")
    overrides = [*FAST, "trainer.accelerator=cpu", "test=false", f'paths.log_dir="{log_dir}"']
    overrides += [f"+callbacks.pause.{o}" for o in pause]
    user_config_dir(tmp_path / "my configs")
    env = shell_env()
    argv = [sys.executable, "-m", "tinyapp.train", "--config-dir", "my configs", "model=mine"]
    process = subprocess.Popen([*argv, *overrides], cwd=tmp_path, text=True,
                               env={**env, "PYTHONPATH": str(TESTS)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.time() + 240
    while not marker.exists():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline, "the run never reached its first batch"
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    Path(f"{marker}.release").touch()
    out, err = process.communicate(timeout=180)
    assert process.returncode == 130, err[-3000:]
    (run,) = run_dirs(log_dir)
    saved = run / "checkpoints" / "interrupted.ckpt"
    assert saved.is_file()
    lines = (out + err).splitlines()
    command = lines[next(i for i, line in enumerate(lines) if "resume with:" in line) + 1].strip()
    assert command.startswith(f"PYTHONPATH={TESTS} python -m tinyapp.train --config-dir ")
    assert config_value(bash_words(command)[-1]) == str(saved)

    resumed = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (new_run,) = [d for d in run_dirs(log_dir) if d != run]
    assert f"Resuming from {saved}" in (new_run / "train.log").read_text()
    assert "_target_: tinyapp.models.MLP" in (new_run / "config.yaml").read_text()


HOSTILE_DIR = "it's $HOME=a,b [x] é"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("typed", "before_hint", "key"),
    [
        ("paths.log_dir={tmp}/" + HOSTILE_DIR, "e.g. ", "paths.log_dir"),  # unquoted path
        (f'trainer.precision="{HOSTILE_DIR}"', "write ", "precision"),  # precision's new key
    ],
)
def test_a_hint_keeps_a_hostile_value_when_pasted(cli, tmp_path, typed, before_hint, key) -> None:
    failed = cli("train", typed.format(tmp=tmp_path), "--cfg", "job")
    assert failed.returncode == 2, failed.stderr[-2000:]
    (line,) = error_lines(failed.stderr)
    shown = cli("train", *bash_words(line.rsplit(before_hint, 1)[1]), "--cfg", "job")
    assert shown.returncode == 0, shown.stderr[-2000:]
    value = f"{tmp_path}/{HOSTILE_DIR}" if key == "paths.log_dir" else HOSTILE_DIR
    assert OmegaConf.select(OmegaConf.create(shown.stdout), key) == value


@pytest.mark.slow
def test_bad_value_in_a_sweep_is_one_line_and_exit_2_after_the_other_jobs(cli, log_dir) -> None:
    done = cli("train", "-m", "model.optimizer.lr=-1,0.01", *TINY)
    assert done.returncode == 2, done.stderr[-3000:]
    assert error_lines(done.stderr) == [
        "error: model.optimizer.lr=-1 is invalid: torch.optim.AdamW refuses it "
        "(Invalid learning rate: -1)"
    ]
    assert "Error executing job" not in done.stderr and "Traceback" not in done.stderr
    (sweep,) = (log_dir / "train" / "multiruns").iterdir()
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["1"]  # job 0 left nothing
    assert (sweep / "1" / "metrics.json").is_file()  # the good job still ran


@pytest.mark.slow
def test_cfg_job_with_an_interval_sweep_is_one_line(cli: CliRunner, tmp_path: Path) -> None:
    before = set(tmp_path.rglob("*"))  # with a list of values: each job's config
    done = cli("train", "-m", "--cfg", "job", "model.optimizer.lr=0.1,0.01", "seed=3")
    assert done.returncode == 0, done.stderr[-2000:]
    jobs = list(yaml.safe_load_all(done.stdout))
    assert [job["model"]["optimizer"]["lr"] for job in jobs] == [0.1, 0.01]
    assert {job["seed"] for job in jobs} == {3}
    assert "hydra" not in jobs[0]
    assert "# job #1: model.optimizer.lr=0.01 seed=3" in done.stdout
    assert set(tmp_path.rglob("*")) == before, "showing a config created files"
    done = cli("train", "--multirun", "--cfg", "job", "model.optimizer.lr=interval(0,1)")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        "error: model.optimizer.lr=interval(0,1) is an interval: it has no list of jobs for "
        "--cfg to show; give model.optimizer.lr a list of values (a,b,...) to see each job's config"
    ]
