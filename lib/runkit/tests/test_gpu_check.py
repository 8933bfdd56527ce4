"""scripts/gpu_check.py: wheels, time limits, GPU figures on run-shaped files, a real dry run."""

from __future__ import annotations

import csv
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
assert spec and spec.loader
gc = sys.modules["gpu_check"] = importlib.util.module_from_spec(spec)  # dataclasses look there
spec.loader.exec_module(gc)


def requires(name: str) -> list[str]:  # what the real wheel requires, markers and extras included
    return importlib.metadata.requires(name) or []


def make_wheel(folder: Path, name: str, version: str, requires: list[str], tag="py3-none-any"):
    """A tiny real wheel (METADATA, WHEEL, RECORD) that pip installs, with no code in it."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = folder / f"{dist}-{version}-{tag}.whl"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n")
        archive.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


@pytest.fixture
def versions() -> dict[str, str]:
    return gc.local_versions()


@pytest.fixture
def wheels(tmp_path: Path, versions: dict[str, str]) -> Path:  # for this environment's versions
    folder = tmp_path / "wheels"
    folder.mkdir()
    for name, version in versions.items():
        make_wheel(folder, name, version, requires(name))
    (folder / gc.MANIFEST).write_text("".join(f"{n}=={v}\n" for n, v in versions.items()))
    return folder


def test_the_wheel_check_passes_a_full_folder_and_names_each_problem(wheels, versions, tmp_path):
    assert gc.check_wheels(wheels, versions, project_requires=gc.project_requirements()) == []
    (error,) = gc.check_wheels(tmp_path / "nowhere", versions)
    assert "does not exist" in error and "--fetch-wheels" in error
    timeout = next(wheels.glob("pytest_timeout-*.whl"))
    timeout.rename(tmp_path / timeout.name)
    (error,) = gc.check_wheels(wheels, versions)
    assert f"pytest-timeout=={versions['pytest-timeout']}" in error and "--fetch-wheels" in error
    assert "\n" not in error
    (tmp_path / timeout.name).rename(timeout)
    manifest = (wheels / gc.MANIFEST).read_text()
    (wheels / gc.MANIFEST).write_text(manifest.replace(versions["omegaconf"], "0.0.1"))
    (error,) = gc.check_wheels(wheels, versions)
    assert "omegaconf==0.0.1" in error and versions["omegaconf"] in error
    (wheels / gc.MANIFEST).write_text(manifest)
    next(wheels.glob("omegaconf-*.whl")).unlink()  # a wheel for another python and platform
    wrong = make_wheel(wheels, "omegaconf", versions["omegaconf"], [], tag="cp311-cp311-win_amd64")
    (error,) = gc.check_wheels(wheels, versions)
    assert wrong.name in error and "does not install" in error
    wrong.unlink()
    make_wheel(wheels, "omegaconf", versions["omegaconf"], requires("omegaconf"))
    next(wheels.glob("hydra_core-*.whl")).unlink()  # a dependency neither there nor brought
    make_wheel(wheels, "hydra-core", versions["hydra-core"], ["omegaconf", "einops>=0.7"])
    assert gc.check_wheels(wheels, versions) == [
        f"hydra-core needs einops, which is neither on the GPU machine nor in {wheels}"
    ]
    next(wheels.glob("hydra_core-*.whl")).unlink()
    make_wheel(wheels, "hydra-core", versions["hydra-core"], requires("hydra-core"))
    (error,) = gc.check_wheels(wheels, versions, project_requires=["torch", "hydra-core", "wandb"])
    assert error.startswith("the project needs wandb")


def test_a_test_module_importing_what_the_gpu_machine_lacks_is_named(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "helpers.py").write_text("")
    (tmp_path / "src" / "mylib").mkdir(parents=True)
    (tests / "test_fine.py").write_text(
        "import json\nimport helpers\nimport torch\nfrom mylib import x\n"
        "try:\n    import importlinter\nexcept ImportError:\n    pass\n"
        "def test():\n    import importlinter\n"
    )
    (tests / "test_lint.py").write_text("import yaml\nfrom importlinter.cli import lint_imports\n")
    machine = gc.GPU_MACHINE_HAS + gc.GPU_MACHINE_BRINGS
    (error,) = gc.check_test_imports(tests, machine, root=tmp_path)
    assert error.startswith("test_lint.py imports importlinter (import-linter) at module level")
    assert gc.check_test_imports(tests, [*machine, "import-linter"], root=tmp_path) == []


def test_a_hang_is_cut_at_its_limit_and_the_budget_stops_what_it_cannot_fit(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    # The step starts a grandchild that ignores SIGTERM, then hangs: both must go.
    code = (
        "import subprocess, sys, time;"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)']);"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True);"
        "time.sleep(60)"
    )
    steps = [
        gc.Step("hang", "sleeps", ["-c", code], 1.0),
        gc.Step("after", "runs once the hang is cut", ["-c", "print('ok')"], 10.0),
    ]
    ctx = gc.Context(ROOT, tmp_path, dict(os.environ))
    start = time.monotonic()
    hang, after = gc.run_steps(steps, ctx, budget_s=60)
    assert time.monotonic() - start < 12
    assert hang.status == "timeout" and "limit of 1 s" in hang.message
    assert hang.output_tail == ["started"]
    status = Path(f"/proc/{pid_file.read_text()}/status")  # the grandchild: gone or a zombie
    assert not status.exists() or "State:\tZ" in status.read_text()
    assert (after.status, after.output_tail) == ("pass", ["ok"])
    # the overall budget stops the steps it cannot fit
    sleep = ["-c", "import time; time.sleep(30)"]
    steps = [gc.Step("long", "", sleep, 20.0), gc.Step("next", "", ["-c", "pass"], 5.0)]
    first, second = gc.run_steps(steps, gc.Context(ROOT, tmp_path, dict(os.environ)), budget_s=1.0)
    assert first.status == "timeout" and first.seconds < 8
    assert second.status == "timeout" and "not started" in second.message
    assert not gc.overall([first, second])[0]


def fake_run(run: Path, columns: dict[str, str], accelerator: str = "CUDAAccelerator") -> Path:
    """A run directory as a GPU training leaves it: metrics.json, csv/metrics.csv, config.yaml."""
    (run / "csv").mkdir(parents=True)
    summary = {"metrics": {"test/acc": 0.9}, "accelerator": accelerator, "wall_seconds": 9.0}
    (run / "metrics.json").write_text(json.dumps(summary))
    strategy = "  strategy:\n    _target_: runkit.strategies.dp.DataParallelStrategy\n"
    (run / "config.yaml").write_text(f"trainer:\n{strategy}")
    with (run / "csv" / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["epoch", *columns])
        writer.writeheader()
        writer.writerow({"epoch": "0", **columns})
        writer.writerow({"epoch": "0"})  # a row from another logging call: empty GPU columns
    return run


GPU_ROW = {"gpu/node0/cuda0/util_mean": "37.5", "gpu/node0/cuda0/mem_used_gib_max": "1.25",
           "gpu/node0/cuda0/power_w_mean": "180", "gpu/node0/cuda0/energy_j": "900",
           "gpu/all/util_mean_max": "0"}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "accelerator", "message"),
    [
        ({"gpu/host7/cuda0/util_mean": "37.5"}, "CUDAAccelerator", None),  # passes (train_dp)
        ({"gpu/node0/cuda0/util_mean": "0"}, "CUDAAccelerator", "util_mean = 0.0"),
        ({"gpu/node0/cuda0/power_w_mean": ""}, "CUDAAccelerator", "power_w_mean"),
        ({"gpu/node0/cuda0/energy_j": "-3"}, "CUDAAccelerator", "energy_j = -3.0"),
        ({}, "CPUAccelerator", "CPUAccelerator"),  # a run on the CPU
    ],
)
def test_a_gpu_run_passes_with_its_figures_or_fails_on_implausible_ones(
    tmp_path, change, accelerator, message
) -> None:
    run = fake_run(tmp_path / "run", {**GPU_ROW, **change}, accelerator)
    (step,) = [s for s in gc.default_steps() if s.name == ("train_gpu" if message else "train_dp")]
    step.argv = ["-c", f"print('Run directory: {run}')"]  # the real step, printing the run's path
    result = gc.run_step(step, gc.Context(ROOT, tmp_path, dict(os.environ)))
    assert result.figures["accelerator"] == accelerator  # what was read stays in the report
    if message:
        assert result.status == "fail" and message in result.message
        return
    assert result.status == "pass", result.message
    assert result.figures["gpu/node0/cuda0/power_w_mean"] == 180
    matched = result.figures["matched /strategies\\.dp\\.DataParallelStrategy/"]
    assert matched == "strategies.dp.DataParallelStrategy"


def test_gpm_figures_are_a_skip_until_they_exist(tmp_path: Path) -> None:
    ctx = gc.Context(ROOT, tmp_path, dict(os.environ))
    (gpm,) = [s for s in gc.default_steps() if s.name == "gpm_figures"]
    ctx.run_dirs["train_gpu"] = fake_run(tmp_path / "a", GPU_ROW)
    result = gc.run_step(gpm, ctx)
    assert result.status == "skip" and "not present" in result.message
    row = {**GPU_ROW, "gpu/node0/cuda0/sm_active_mean": "42"}
    ctx.run_dirs["train_gpu"] = fake_run(tmp_path / "b", row)
    result = gc.run_step(gpm, ctx)
    assert (result.status, result.figures) == ("pass", {"gpu/node0/cuda0/sm_active_mean": 42.0})


@pytest.mark.slow
def test_dry_run_writes_its_report_under_out(tmp_path: Path, wheels: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PROJECT_LOG_DIR")}
    command = [sys.executable, str(SCRIPT), "--dry-run", "--wheels", str(wheels)]
    result = subprocess.run([*command, "--steps", "train_dp,gpm_figures,benchmark"], capture_output=True,
                            env={**env, "OUT": str(tmp_path / "out")}, text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == ["wheels", "setup", "gpm_figures", "train_dp", "benchmark"]
    assert {s["status"] for s in doc["steps"]} == {"dry-run"}
    assert doc["mode"] == "dry-run" and doc["ok"] is True
    # The fake wheels really went through pip, and the training command really composed.
    assert steps["setup"]["figures"]["installed"] == gc.local_versions()
    assert "trainer=dp" in steps["train_dp"]["command"]
    assert steps["train_dp"]["command"].endswith("--cfg job --package trainer")
    tail = steps["train_dp"]["output_tail"]
    assert any(line.strip().endswith("strategies.dp.DataParallelStrategy") for line in tail)
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (dry-run): PASS")
    # the benchmark takes every arm on the CPU
    assert steps["benchmark"]["command"].endswith("--allow-cpu")
    figures = steps["benchmark"]["figures"]
    assert all(figures[f"{arm} samples/s"] > 0 for arm in gc.BENCHMARK_ARMS)
    assert {"template / plain Lightning", "template / hand loop"} <= figures.keys()


@pytest.mark.slow
def test_dry_run_catches_an_override_that_does_not_compose(tmp_path: Path) -> None:
    step = gc.Step("bad", "", ["-m", "project.train", "trainer.devicez=1"], 60, dry="compose")
    env = gc.step_env(ROOT, tmp_path / "site", dry_run=True)
    result = gc.run_step(step, gc.Context(ROOT, tmp_path, env, dry_run=True))
    assert result.status == "fail" and "exit code 2" in result.message
    assert "trainer.devicez" in result.message


BENCHMARK_OUTPUT = """\
mlp: batch 4096, precision bf16-mixed, float32 matmul high, channels_last False, compile False
  mlp / plain Lightning, samples/s   1.032   [1.032 .. 1.032]
  mlp / hand loop, samples/s         0.981   [0.981 .. 0.981]
  template        812345 samples/s     512.40 TFLOP/s   MFU 51.8 %
  lightning       787002 samples/s     496.41 TFLOP/s   MFU 50.2 %
  plain           828100 samples/s     522.34 TFLOP/s   MFU 52.8 %
"""


def test_the_benchmark_check_reads_every_arm_and_both_ratios(tmp_path: Path) -> None:
    (step,) = [s for s in gc.default_steps() if s.name == "benchmark"]
    ctx = gc.Context(ROOT, tmp_path, dict(os.environ))
    figures = gc.check_benchmark(step, ctx, BENCHMARK_OUTPUT, tmp_path / "log")
    assert figures["lightning samples/s"] == 787002 and figures["template MFU"] == "51.8 %"
    assert figures["template / plain Lightning"] == 1.032
    assert figures["template / hand loop"] == 0.981
    without = BENCHMARK_OUTPUT.replace("  lightning", "  (lost)")
    with pytest.raises(gc.CheckFailed, match="no 'samples/s' figure for lightning"):
        gc.check_benchmark(step, ctx, without, tmp_path / "log")
