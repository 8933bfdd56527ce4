"""The GPU inventory in detail: figures NVML gives in odd units or not at all, GPUs it cannot open,
MIG slices, and the reading :func:`cached_inventory` keeps, each pinned by a test that a plausible
bug in ``machinery/gpus/inventory.py`` fails (issue #16: mutation testing).
"""

from __future__ import annotations

import pytest

from runkit.gpus import nvml
from runkit.gpus.inventory import (
    build_inventory,
    cached_inventory,
    forget_readings,
    read_nvml,
)
from runkit.gpus.records import Gpu, TorchCuda
from runkit.gpus.visible import DEVICE_ORDERS
from runkit.testing.fake_nvml import GIB, FakeClock, FakeGpu, FakeNvml

MIB = 1024 * 1024
LOST = "NVML cannot open GPU 0 (GPU is lost); it is listed without details."


@pytest.fixture(autouse=True)
def fresh_readings(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv(nvml.BACKEND_ENV, raising=False)
    forget_readings()
    yield
    forget_readings()
    nvml.use_library(None)


@pytest.fixture
def torch_counts_two(monkeypatch):
    """torch counts two CUDA devices without initialising CUDA; initialising it fails the test
    (device resolution must leave CUDA alone, for the DDP workers it forks later)."""
    import torch

    def initialises_cuda(*args):
        raise AssertionError("CUDA was initialised")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", initialises_cuda)
    monkeypatch.setattr(torch.cuda, "get_device_properties", initialises_cuda)


def use(*gpus: FakeGpu, **kwargs) -> FakeNvml:
    fake = FakeNvml(list(gpus), clock=FakeClock(), **kwargs)
    nvml.use_library(fake)
    return fake


# ------------------------------------------------------------------------- reading NVML


def test_memory_figures_are_whole_mib_rounded_down():
    use(FakeGpu(memory_total=80 * GIB + 3, memory_used=GIB + MIB + 1))
    ((gpu,), _driver, _notes) = read_nvml("load")
    assert (gpu.memory_total_mib, gpu.memory_used_mib, gpu.memory_free_mib) == (
        80 * 1024,
        1024 + 1,
        79 * 1024 - 1,
    )
    assert all(type(v) is int for v in (gpu.memory_total_mib, gpu.memory_free_mib))


def test_what_nvml_will_not_say_stays_unknown():
    use(FakeGpu().fail("power_limit", "not_supported").fail("name", "unknown"))
    ((gpu,), _driver, _notes) = read_nvml("full")
    assert gpu.power_limit_w is None and gpu.power_w == 70.0
    assert gpu.name == "unknown GPU"


def test_a_gpu_nvml_cannot_open_is_listed_without_details():
    use(FakeGpu().lose(at=0), FakeGpu())
    gpus, _driver, notes = read_nvml("full")
    assert gpus[0] == Gpu(uuid="", name="unreadable GPU", nvml_index=0, error="GPU is lost")
    assert gpus[1].nvml_index == 1 and gpus[1].error is None
    assert notes == [LOST]


def test_a_mig_slice_has_its_gpus_index_and_no_instance_ids_nvml_will_not_give():
    first = FakeGpu(uuid="MIG-11110000-1111-2222-3333-444455556666")
    second = FakeGpu(uuid="MIG-22220000-1111-2222-3333-444455556666")
    first.fail("nvmlDeviceGetGpuInstanceId", "not_supported")
    second.fail("nvmlDeviceGetComputeInstanceId", "not_supported")
    use(FakeGpu(), FakeGpu(name="NVIDIA A100-SXM4-80GB", mig=[first, second]))
    gpus, _driver, _notes = read_nvml("identity")
    slices = gpus[1].mig_devices
    assert [s.nvml_index for s in slices] == [1, 1]
    assert [(s.gpu_instance_id, s.compute_instance_id) for s in slices] == [(None, 0), (2, None)]


# ------------------------------------------------------------------------- building the inventory


def test_notes_are_kept_when_nvml_is_unavailable():
    inv = build_inventory(
        None, TorchCuda(True, 1), env={"CUDA_DEVICE_ORDER": "slowest"}, nvml_reason="no driver"
    )
    assert inv.notes == (
        f"CUDA_DEVICE_ORDER='SLOWEST' is not one of {', '.join(DEVICE_ORDERS)}; "
        "CUDA uses FASTEST_FIRST.",
    )
    assert inv.mapping == "torch-only" and len(inv.visible) == 1


def test_hiding_every_gpu_maps_nothing():
    use(FakeGpu(), FakeGpu())
    physical, _driver, _notes = read_nvml("identity")
    inv = build_inventory(physical, TorchCuda(), env={"CUDA_VISIBLE_DEVICES": ""})
    assert inv.visible == () and inv.mapping == "none"


# ------------------------------------------------------------------------- the kept reading


def test_without_nvml_bindings_the_reason_is_kept_with_torchs_count(torch_counts_two, monkeypatch):
    monkeypatch.setenv(nvml.BACKEND_ENV, "no_such_nvml_module:create")
    inv = cached_inventory()
    assert not inv.nvml_available and inv.torch.device_count == 2
    assert inv.nvml_reason == (
        f"{nvml.BACKEND_ENV}='no_such_nvml_module:create' does not name an importable "
        "'module:factory'"
    )
    assert inv.mapping == "torch-only" and len(inv.visible) == 2


def test_nvml_failing_to_start_is_kept_as_the_reason(torch_counts_two):
    fake = use(FakeGpu(), init_error="driver_not_loaded")
    for _ in range(2):  # the second answer comes from the kept reading
        inv = cached_inventory()
        assert not inv.nvml_available and inv.torch.device_count == 2
        assert inv.nvml_reason == "NVML is not available (Driver Not Loaded)"
        assert inv.mapping == "torch-only"
    assert fake.calls["nvmlInit"] == 1


def test_the_kept_reading_has_the_driver_version_and_notes(torch_counts_two):
    fake = use(FakeGpu().lose(at=0), FakeGpu())
    for _ in range(2):
        inv = cached_inventory()
        assert inv.driver_version == "570.133.20" and LOST in inv.notes
        assert inv.torch.device_count == 2 and len(inv.physical) == 2
    assert fake.init_count == 1


def test_another_nvml_library_is_read_afresh(torch_counts_two):
    use(FakeGpu(), FakeGpu())
    assert len(cached_inventory().physical) == 2
    use(FakeGpu(), FakeGpu(), FakeGpu(), driver_version="580.1")
    inv = cached_inventory()
    assert len(inv.physical) == 3 and inv.driver_version == "580.1"
