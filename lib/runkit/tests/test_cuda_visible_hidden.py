"""A ``CUDA_VISIBLE_DEVICES`` that hides every GPU is named, on both paths: the log line of the
CPU fallback (``accelerator=auto``) and the one-line error of ``accelerator=gpu``.

CUDA reads the list up to its first invalid entry, so ``banana,,7`` hides every GPU on any
machine; without NVML (this machine) the value alone says so, with NVML the GPUs decide."""

from __future__ import annotations

import json

import pytest

from conftest import FAST, CliRunner, last_line, run_dirs
from runkit.gpus.inventory import build_inventory
from runkit.gpus.records import DeviceError, TorchCuda
from runkit.gpus.resolve import hidden_by_variable, resolve_devices
from runkit.gpus.visible import first_entry_problem

FAKE_NVML = "runkit.testing.fake_nvml:create"
BANANA = (
    "CUDA_VISIBLE_DEVICES='banana,,7' hides every GPU: its first entry 'banana' is not a GPU "
    "index or UUID, and CUDA ignores the list from its first invalid entry on"
)


@pytest.mark.parametrize(
    ("value", "hides"),
    [
        ("banana,,7", True),
        ("-1", True),
        (",0", True),
        (" x1", True),
        ("0", False),
        ("1gpu", False),  # strtoul: leading digits count
        ("+1", False),
        ("GPU-abc", False),  # a UUID list: the GPUs decide
        ("MIG-abc", False),
        ("", False),  # empty: its own message
        (None, False),
    ],
)
def test_a_first_entry_that_names_no_device_hides_every_gpu(value: str | None, hides: bool) -> None:
    assert (first_entry_problem(value) is not None) == hides


def no_nvml(value: str):
    return build_inventory(None, TorchCuda(), env={"CUDA_VISIBLE_DEVICES": value}, nvml_reason="x")


def test_without_nvml_the_fallback_line_names_the_variable() -> None:
    plan = resolve_devices("auto", "auto", inventory=no_nvml("banana,,7"))
    assert plan.accelerator == "cpu"
    assert plan.message == f"No usable GPU: {BANANA}; this run uses the CPU."


def test_without_nvml_the_gpu_error_names_the_variable_and_the_fix() -> None:
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 1, inventory=no_nvml("banana,,7"))
    assert str(info.value) == (
        f"accelerator=gpu asks for a GPU, but this machine has no usable GPU ({BANANA}); "
        "set CUDA_VISIBLE_DEVICES to GPU indices or UUIDs (e.g. 0,1) or unset it"
    )


def test_the_variable_is_named_before_torch_reporting_no_cuda() -> None:
    """A CUDA torch reports no CUDA when the variable hides every GPU: the cause is the variable,
    not a CPU-only build."""
    from runkit.gpus import nvml
    from runkit.gpus.inventory import collect_inventory
    from runkit.testing.fake_nvml import FakeGpu, FakeNvml

    nvml.use_library(FakeNvml([FakeGpu(), FakeGpu()]))
    try:
        inv = collect_inventory(torch_info=TorchCuda(), env={"CUDA_VISIBLE_DEVICES": "GPU-nope"})
        assert hidden_by_variable(inv) == "CUDA_VISIBLE_DEVICES='GPU-nope' hides every GPU"
        plan = resolve_devices("auto", "auto", inventory=inv)
        assert plan.message == (
            "No usable GPU: CUDA_VISIBLE_DEVICES='GPU-nope' hides every GPU; this run uses the CPU."
        )
        inv = collect_inventory(torch_info=TorchCuda(), env={})
        assert hidden_by_variable(inv) is None  # no variable: torch's own reason stands
        assert "torch has no CUDA" in resolve_devices("auto", "auto", inventory=inv).message
    finally:
        nvml.use_library(None)


@pytest.mark.slow
def test_auto_trains_on_the_cpu_and_logs_the_variable(cli: CliRunner, log_dir) -> None:
    result = cli("train", *FAST, "trainer.max_epochs=1", env={"CUDA_VISIBLE_DEVICES": "banana,,7"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"No usable GPU: {BANANA}; this run uses the CPU." in result.stdout.splitlines()
    (run,) = run_dirs(log_dir)
    assert BANANA in (run / "train.log").read_text()
    assert json.loads((run / "metrics.json").read_text())["accelerator"] == "CPUAccelerator"


@pytest.mark.slow
@pytest.mark.parametrize("nvml", ["absent", "fake"])
def test_gpu_is_one_line_naming_the_variable(cli: CliRunner, log_dir, nvml: str) -> None:
    env = {"CUDA_VISIBLE_DEVICES": "banana,,7"}
    if nvml == "fake":
        env |= {"RUNKIT_NVML_BACKEND": FAKE_NVML, "RUNKIT_FAKE_NVML": '{"gpus": 2}'}
    result = cli("train", "trainer.accelerator=gpu", env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert last_line(result.stderr) == (
        f"error: accelerator=gpu asks for a GPU, but this machine has no usable GPU ({BANANA}); "
        "set CUDA_VISIBLE_DEVICES to GPU indices or UUIDs (e.g. 0,1) or unset it"
    )
    assert not log_dir.exists()
