"""GPU inventory, CUDA_VISIBLE_DEVICES rules, device resolution and selection by load.

Everything runs on the CPU: NVML is :mod:`runkit.testing.fake_nvml`, and what torch
would say about CUDA is the explicit :class:`runkit.gpus.records.TorchCuda` argument.
"""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from runkit.errors import RunError
from runkit.gpus import claims, nvml
from runkit.gpus import inventory as inventory_module
from runkit.gpus.claims import SelectionPolicy
from runkit.gpus.inventory import build_inventory, collect_inventory, read_nvml
from runkit.gpus.records import Gpu, GpuProcess, Inventory, TorchCuda
from runkit.gpus.resolve import (
    SELECTION_ENV,
    DeviceError,
    parse_devices,
    rank_by_load,
    resolve_devices,
    resolve_for_run,
    select_least_used,
)
from runkit.gpus.visible import apply_visible_devices
from runkit.testing.fake_nvml import GIB, FakeGpu, FakeNvml, FakeProcess

# Four physical GPUs in NVML (PCI) order: three H100s and an A100 in MIG mode with two slices.
UUID0 = "GPU-aaaa1111-1111-1111-1111-111111111111"
UUID1 = "GPU-aaaa2222-2222-2222-2222-222222222222"
UUID2 = "GPU-cccc3333-3333-3333-3333-333333333333"
UUID3 = "GPU-dddd4444-4444-4444-4444-444444444444"
MIG30 = "MIG-eeee0000-5555-5555-5555-555555555555"
MIG31 = "MIG-ffff1111-6666-6666-6666-666666666666"


def make_fake(loads: dict[int, tuple[int, int]] | None = None) -> FakeNvml:
    """The standard fake; ``loads`` maps GPU index -> (memory used in GiB, utilisation %)."""
    loads = loads or {}

    def gpu(i: int, uuid: str, **kw: object) -> FakeGpu:
        used, util = loads.get(i, (0, 0))
        return FakeGpu(uuid=uuid, memory_used=used * GIB, util_gpu=util, **kw)

    return FakeNvml(
        [
            gpu(0, UUID0, processes=[FakeProcess(4242, 3 * GIB)]),
            gpu(1, UUID1),
            gpu(2, UUID2),
            FakeGpu(
                name="NVIDIA A100-SXM4-80GB",
                uuid=UUID3,
                mig=[
                    FakeGpu(uuid=MIG30, memory_total=10 * GIB),
                    FakeGpu(uuid=MIG31, memory_total=20 * GIB),
                ],
            ),
        ],
        clock=lambda: 0.0,
    )


@pytest.fixture
def fake():
    lib = make_fake()
    nvml.use_library(lib)
    yield lib
    nvml.use_library(None)


@pytest.fixture
def physical(fake):
    gpus, _driver, _notes = read_nvml()
    return gpus


def uuids(gpus):
    return [g.uuid for g in gpus]


# ------------------------------------------------------------------------- reading NVML


def test_read_nvml_reads_every_gpu_and_mig_slice(fake):
    gpus, driver, notes = read_nvml()
    assert driver == "570.133.20" and notes == []
    assert uuids(gpus) == [UUID0, UUID1, UUID2, UUID3]
    g0 = gpus[0]
    assert (g0.memory_total_mib, g0.memory_used_mib, g0.memory_free_mib) == (81920, 0, 81920)
    assert g0.temperature_c == 35 and g0.power_w == 70.0 and g0.power_limit_w == 700.0
    assert g0.processes == (GpuProcess(4242, 3072, None),)
    assert gpus[3].mig_enabled and uuids(gpus[3].mig_devices) == [MIG30, MIG31]
    mig = gpus[3].mig_devices[1]
    assert mig.is_mig and mig.parent_uuid == UUID3 and mig.mig_index == 1
    assert mig.utilization_percent is None  # MIG handles do not report utilisation
    assert fake.balanced


def test_unsupported_metric_becomes_none_not_an_error(fake):
    fake.gpus[1].fail("power", "not_supported")
    fake.gpus[1].fail("temperature", "no_permission")
    gpus, _, _ = read_nvml()
    assert gpus[1].power_w is None and gpus[1].temperature_c is None
    assert gpus[1].memory_total_mib == 81920


def test_a_gpu_nvml_cannot_open_keeps_its_place(fake):
    fake.gpus[1].lose(0.0)
    gpus, _, notes = read_nvml()
    assert [g.nvml_index for g in gpus] == [0, 1, 2, 3]
    assert gpus[1].error is not None and gpus[1].uuid == ""
    assert notes and "GPU 1" in notes[0]


@pytest.mark.parametrize(
    ("detail", "read", "not_read"),
    [
        (
            "identity",
            {"nvmlDeviceGetUUID", "nvmlDeviceGetPciInfo", "nvmlDeviceGetMigMode"},
            {"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates", "nvmlDeviceGetPowerUsage"},
        ),
        (
            "load",
            {"nvmlDeviceGetMemoryInfo", "nvmlDeviceGetUtilizationRates"},
            {"nvmlDeviceGetTemperature", "nvmlDeviceGetComputeRunningProcesses"},
        ),
        (
            "full",
            {"nvmlDeviceGetTemperature", "nvmlDeviceGetComputeRunningProcesses"},
            set(),
        ),
    ],
)
def test_nvml_is_read_at_the_detail_asked_and_no_more(fake, detail, read, not_read):
    gpus, _, _ = read_nvml(detail)
    assert uuids(gpus) == [UUID0, UUID1, UUID2, UUID3]
    assert uuids(gpus[3].mig_devices) == [MIG30, MIG31]  # enough to number cuda:N
    assert read <= set(fake.calls) and not not_read & set(fake.calls)
    assert (gpus[0].memory_free_mib is None) == (detail == "identity")
    assert (gpus[0].processes == ()) == (detail != "full")
    with pytest.raises(ValueError, match="detail='some'; use one of identity, load, full"):
        read_nvml("some")


def test_one_uuid_spelling_finds_gpus_and_mig_slices(fake):
    spellings = [
        (UUID1, UUID1),
        (UUID1[4:], UUID1),  # torch reports the bare UUID
        (UUID1.upper(), UUID1),
        (MIG31[4:], MIG31),
        (f"  {MIG31.upper()} ", MIG31),
    ]
    with nvml.nvml_session() as lib:
        for given, expected in spellings:
            handle, nvml_uuid = nvml.find_handle(lib, given)
            assert nvml_uuid == expected == lib.nvmlDeviceGetUUID(handle), given
        assert nvml.find_handle(lib, "GPU-0000") is None
    assert nvml.bare_uuid(" MIG-ABC ") == nvml.bare_uuid("abc") == "abc"


def test_a_mig_slice_lists_no_power_or_temperature_of_its_own(fake):
    gpus, _, _ = read_nvml()
    parent, (slice0, _) = gpus[3], gpus[3].mig_devices
    assert parent.temperature_c == 35 and parent.power_w == 70.0
    assert (slice0.temperature_c, slice0.power_w, slice0.power_limit_w) == (None, None, None)
    assert slice0.memory_total_mib == 10 * 1024 and slice0.pci_bus_id == parent.pci_bus_id


# ------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [UUID0, UUID1, UUID2, MIG30, MIG31]),  # a MIG-mode GPU shows its slices
        ("0,1", [UUID0, UUID1]),
        ("2,0", [UUID2, UUID0]),  # reordering: cuda:0 is physical GPU 2
        ("3", [MIG30, MIG31]),
        (UUID2, [UUID2]),
        (f"{UUID1},{UUID0}", [UUID1, UUID0]),
        ("GPU-cccc", [UUID2]),  # a unique UUID prefix
        (MIG31, [MIG31]),
        ("MIG-eeee", [MIG30]),
        (f"1,{MIG30}", [UUID1]),  # the first entry sets the list's kind (torch): MIG- ends it
        (f"{MIG30},{MIG31}", [MIG30, MIG31]),  # two GPU instances: one MIG device each (R570+)
        ("0,2,-1,1", [UUID0, UUID2]),  # CUDA's documented example
        ("1,9,0", [UUID1]),  # out of range ends the list
        ("1,GPU-aaaa,2", [UUID1]),  # ambiguous prefix ends the list
        ("GPU-nope,0", []),
        ("2,x,0", [UUID2]),
        ("1gpu,0", [UUID1, UUID0]),  # parsed like strtoul: leading digits count
        (" 1, 2", [UUID1, UUID2]),
        ("0,", [UUID0]),
        ("", []),
        ("0,1,0", []),  # a device named twice hides every device
        (f"2,{UUID2}", [UUID2]),  # a UUID in a list of indices ends it, as in torch
        (f"{UUID2},0", [UUID2]),  # and an index in a list of UUIDs
        (f"{UUID1}, {UUID0}", [UUID1]),  # torch compares UUID entries unstripped
        (f" {UUID1}", []),  # ... and a blank first makes it a list of indices
        ("+1", [UUID1]),  # strtoul takes a sign
    ],
)
def test_cuda_visible_devices(physical, value, expected):
    visible, _notes = apply_visible_devices(physical, value, "PCI_BUS_ID")
    assert uuids(visible) == expected


def test_truncation_and_empty_value_are_explained(physical):
    _, notes = apply_visible_devices(physical, "0,2,-1,1", "PCI_BUS_ID")
    assert notes == [
        "CUDA_VISIBLE_DEVICES entry '-1' names no GPU here; CUDA stops at the first invalid "
        "entry, so '-1,1' is ignored."
    ]
    _, notes = apply_visible_devices(physical, f"{UUID2},GPU-aaaa", "PCI_BUS_ID")
    assert "matches more than one GPU" in notes[0]
    _, notes = apply_visible_devices(physical, "1,GPU-aaaa", "PCI_BUS_ID")
    assert notes == [
        "CUDA_VISIBLE_DEVICES entry 'GPU-aaaa' is not of the list's kind (indices, set by its "
        "first entry); CUDA stops at the first invalid entry, so 'GPU-aaaa' is ignored."
    ]
    _, notes = apply_visible_devices(physical, "", "PCI_BUS_ID")
    assert notes == ["CUDA_VISIBLE_DEVICES is empty, which hides every GPU."]


def test_old_style_mig_identifier_is_matched_by_instance_ids():
    child = Gpu(
        uuid=MIG30, name="slice", parent_uuid=UUID3, gpu_instance_id=7, compute_instance_id=0
    )
    parent = Gpu(uuid=UUID3, name="A100", nvml_index=0, mig_enabled=True, mig_devices=(child,))
    visible, _ = apply_visible_devices([parent], f"MIG-{UUID3}/7/0", "PCI_BUS_ID")
    assert visible == [child]
    visible, _ = apply_visible_devices([parent], f"MIG-{UUID3}/7/1", "PCI_BUS_ID")
    assert visible == []


def test_the_pre_r470_mig_form_is_matched_through_nvml(physical):
    assert (
        physical[3].mig_devices[1].gpu_instance_id,
        physical[3].mig_devices[1].compute_instance_id,
    ) == (2, 0)
    visible, _ = apply_visible_devices(physical, f"MIG-{UUID3}/2/0", "PCI_BUS_ID")
    assert uuids(visible) == [MIG31]


def mig_slice(uuid: str, parent: str, gi: int, ci: int = 0) -> Gpu:
    return Gpu(
        uuid=uuid, name="slice", parent_uuid=parent, gpu_instance_id=gi, compute_instance_id=ci
    )


# NVML 0: a plain GPU; NVML 1: MIG mode, GPU instance 1 with two compute instances and GPU
# instance 2; NVML 2: MIG mode, one GPU instance.
MIG_MACHINE = [
    Gpu(uuid="GPU-p", name="A100", nvml_index=0, pci_bus_id="00000000:17:00.0"),
    Gpu(
        uuid="GPU-a",
        name="A100",
        nvml_index=1,
        pci_bus_id="00000000:27:00.0",
        mig_enabled=True,
        mig_devices=(
            mig_slice("MIG-a1x", "GPU-a", 1),
            mig_slice("MIG-a1y", "GPU-a", 1, 1),
            mig_slice("MIG-a2", "GPU-a", 2),
        ),
    ),
    Gpu(
        uuid="GPU-b",
        name="A100",
        nvml_index=2,
        pci_bus_id="00000000:37:00.0",
        mig_enabled=True,
        mig_devices=(mig_slice("MIG-b1", "GPU-b", 1),),
    ),
]


@pytest.mark.parametrize(
    ("driver", "value", "expected"),
    [
        # R570+: one compute instance per GPU instance, across GPUs; plain GPUs stay visible
        ("570.133.20", None, ["GPU-p", "MIG-a1x", "MIG-a2", "MIG-b1"]),
        (None, None, ["GPU-p", "MIG-a1x", "MIG-a2", "MIG-b1"]),  # unknown: today's rule
        ("580.65.06", "MIG-a1y,MIG-a1x,MIG-b1", ["MIG-a1y", "MIG-b1"]),  # one CI of GI 1 of GPU a
        ("570.133.20", "1,0", ["MIG-a1x", "MIG-a2", "GPU-p"]),
        # before R570: one MIG device in all, and no plain GPU once a MIG device is shown
        ("535.104.05", None, ["MIG-a1x"]),
        ("535.104.05", "0,2", ["MIG-b1"]),
        ("535.104.05", "MIG-b1,MIG-a2", ["MIG-b1"]),
        ("535.104.05", "0", ["GPU-p"]),
    ],
)
def test_mig_devices_follow_the_drivers_enumeration_rule(driver, value, expected):
    visible, _ = apply_visible_devices(MIG_MACHINE, value, "PCI_BUS_ID", driver)
    assert uuids(visible) == expected


def test_a_mig_device_cuda_does_not_enumerate_is_explained():
    _, notes = apply_visible_devices(MIG_MACHINE, None, "PCI_BUS_ID", "535.104.05")
    assert notes == [
        "driver 535.104.05 (before R570): CUDA enumerates one MIG device and no other GPU; "
        "shown: MIG-a1x (the first in CUDA order; which one CUDA takes is not documented)."
    ]
    _, notes = apply_visible_devices(MIG_MACHINE, None, "PCI_BUS_ID", "570.133.20")
    assert len(notes) == 1 and "not shown: MIG-a1y" in notes[0]


def test_at_most_64_mig_devices_are_enumerated():
    gpus = [
        Gpu(
            uuid=f"GPU-{i}",
            name="A100",
            nvml_index=i,
            pci_bus_id=f"00000000:{i + 16:02X}:00.0",
            mig_enabled=True,
            mig_devices=tuple(mig_slice(f"MIG-{i}-{g}", f"GPU-{i}", g) for g in range(7)),
        )
        for i in range(10)
    ]
    visible, notes = apply_visible_devices(gpus, None, "PCI_BUS_ID", "570.133.20")
    assert len(visible) == 64 and visible[-1].uuid == "MIG-9-0"
    assert "at most 64 MIG devices" in notes[0]


def test_inventory_applies_the_mig_rule_of_nvmls_driver(physical):
    inv = build_inventory(physical, TorchCuda(), env={}, driver_version="535.104.05")
    assert uuids(inv.visible) == [MIG30]
    assert uuids(inv.hidden) == [UUID0, UUID1, UUID2]


def test_pci_bus_order_follows_bus_ids_and_mixed_models_get_a_note():
    a = Gpu(uuid="GPU-a", name="RTX 4090", nvml_index=0, pci_bus_id="00000000:41:00.0")
    b = Gpu(uuid="GPU-b", name="RTX 3060", nvml_index=1, pci_bus_id="00000000:0A:00.0")
    visible, notes = apply_visible_devices([a, b], None, "PCI_BUS_ID")
    assert uuids(visible) == ["GPU-b", "GPU-a"] and notes == []
    _, notes = apply_visible_devices([a, b], "0", "FASTEST_FIRST")
    assert len(notes) == 1 and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in notes[0]


def test_same_model_gpus_need_no_order_note(physical):
    _, notes = apply_visible_devices(physical[:3], None, None)
    assert notes == []


# ------------------------------------------------------------------------- inventory


def test_inventory_maps_cuda_indices_by_torch_uuid(physical):
    # torch reports UUIDs without the GPU-/MIG- prefix; cuda:0 is GPU 2, cuda:1 a MIG slice
    torch_info = TorchCuda(True, 2, uuids=(UUID2[4:], MIG31[4:]), names=("H100", "A100 MIG"))
    inv = build_inventory(physical, torch_info, env={"CUDA_VISIBLE_DEVICES": "whatever"})
    assert inv.mapping == "torch-uuid"
    assert uuids(inv.visible) == [UUID2, MIG31]
    assert uuids(inv.hidden) == [UUID0, UUID1]
    assert inv.usable_gpu_count == 2


def test_inventory_without_torch_uuids_follows_the_env_rules(physical):
    env = {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    inv = build_inventory(physical, TorchCuda(True, 2), env=env)
    assert inv.mapping == "env-rules" and uuids(inv.visible) == [UUID2, UUID0]
    assert inv.cuda_visible_devices == "2,0" and inv.cuda_device_order == "PCI_BUS_ID"
    assert inv.notes == ()


def test_inventory_flags_a_count_mismatch_with_torch(physical):
    inv = build_inventory(physical, TorchCuda(True, 1), env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert any("torch sees 1 CUDA device(s)" in n for n in inv.notes)
    assert inv.usable_gpu_count == 1


def test_torch_without_cuda_means_no_usable_gpu(physical):
    inv = build_inventory(physical, TorchCuda(False, 0), env={})
    assert inv.usable_gpu_count == 0 and len(inv.visible) == 5
    assert inv.summary() == (
        "No usable GPU: NVML sees 4 GPUs but torch has no CUDA (CPU-only build?); "
        "training will use the CPU."
    )


def test_inventory_without_nvml_uses_torch_names():
    inv = build_inventory(
        None, TorchCuda(True, 1, ("abc",), ("NVIDIA L4",)), env={}, nvml_reason="no driver"
    )
    assert inv.mapping == "torch-only" and inv.visible[0].name == "NVIDIA L4"
    assert inv.visible[0].memory_total_mib is None


def test_collect_inventory_reports_nvml_failure_in_one_line():
    nvml.use_library(FakeNvml(2, init_error="library_not_found"))
    try:
        inv = collect_inventory(torch_info=TorchCuda(), env={})
    finally:
        nvml.use_library(None)
    assert not inv.nvml_available and inv.visible == ()
    assert inv.summary() == (
        "No usable GPU: NVML is not available (NVML Shared Library Not Found); "
        "training will use the CPU."
    )


def test_unknown_device_order_is_noted(physical):
    inv = build_inventory(physical, TorchCuda(), env={"CUDA_DEVICE_ORDER": "SLOWEST"})
    assert inv.cuda_device_order == "FASTEST_FIRST"
    assert inv.notes[0].startswith("CUDA_DEVICE_ORDER='SLOWEST' is not one of")


# ------------------------------------------------------------------------- parse_devices


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", "auto"),
        ("AUTO", "auto"),
        (2, 2),
        ("2", 2),
        (-1, -1),
        ("-1", -1),
        ([0, 2], [0, 2]),
        ((1,), [1]),
        ("0,1", [0, 1]),
        ("[0,1]", [0, 1]),
        ("[ 3 ]", [3]),
        ("1,", [1]),
        (OmegaConf.create([2, 0]), [2, 0]),
    ],
)
def test_parse_devices_accepts_what_users_type(value, expected):
    assert parse_devices(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            0,
            "devices=0 is not valid; use a count ≥ 1, -1 (all), 'auto', or GPU indices such as "
            "[0,1] or '0,1'",
        ),
        (-2, "devices=-2 is not valid"),
        (True, "devices=True is not valid"),
        ("two", "devices='two' is not valid"),
        ("0,a", "devices='0,a' is not valid"),
        ([0, -1], "devices=[0, -1] is not valid"),
        ([], "devices=[] lists no GPU; use a count or at least one index"),
        ("[]", "devices='[]' is not valid"),
        ([1, 1], "devices=[1, 1] names a GPU twice; each index may appear once"),
        (1.5, "devices=1.5 is not valid"),
    ],
)
def test_parse_devices_rejects_bad_values_in_one_line(value, message):
    with pytest.raises(DeviceError) as info:
        parse_devices(value)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_device_error_is_a_project_error_and_a_value_error():
    assert issubclass(DeviceError, RunError) and issubclass(DeviceError, ValueError)


# ------------------------------------------------------------------------- resolve_devices


def inventory(physical, gpus: int, env: dict[str, str] | None = None) -> Inventory:
    return build_inventory(physical, TorchCuda(gpus > 0, gpus), env=env or {})


CPU_ONLY = build_inventory(None, TorchCuda(), env={}, nvml_reason="NVML is not available (x)")


def test_auto_without_gpu_falls_back_to_cpu_with_one_message():
    plan = resolve_devices("auto", "auto", inventory=CPU_ONLY)
    assert plan.trainer_kwargs() == {"accelerator": "cpu", "devices": "auto"}
    assert plan.message == "No usable GPU: NVML is not available (x); this run uses the CPU."


def test_auto_without_gpu_keeps_a_process_count_and_maps_all_to_auto():
    assert resolve_devices("auto", 3, inventory=CPU_ONLY).devices == 3
    assert resolve_devices("auto", -1, inventory=CPU_ONLY).devices == "auto"


def test_auto_without_gpu_rejects_gpu_indices():
    with pytest.raises(
        DeviceError, match=r"^devices=\[0, 1\] lists GPU indices, but this run uses"
    ):
        resolve_devices("auto", "0,1", inventory=CPU_ONLY)


@pytest.mark.parametrize("accelerator", ["gpu", "cuda", "GPU"])
def test_gpu_on_a_cpu_machine_is_one_line(accelerator):
    with pytest.raises(DeviceError) as info:
        resolve_devices(accelerator, 1, inventory=CPU_ONLY)
    assert str(info.value) == (
        f"accelerator={accelerator} asks for a GPU, but this machine has no usable GPU "
        "(NVML is not available (x)); use accelerator=cpu or accelerator=auto"
    )


def test_more_gpus_than_exist_is_one_line(physical):
    with pytest.raises(DeviceError) as info:
        resolve_devices("gpu", 4, inventory=inventory(physical, 2, {"CUDA_VISIBLE_DEVICES": "0,1"}))
    assert str(info.value) == (
        "devices=4 asks for 4 GPUs, but only 2 GPUs are visible "
        "(cuda:0 NVIDIA H100 80GB HBM3, cuda:1 NVIDIA H100 80GB HBM3)"
    )


def test_missing_index_is_one_line(physical):
    inv = inventory(physical, 1, {"CUDA_VISIBLE_DEVICES": "2"})
    with pytest.raises(DeviceError) as info:
        resolve_devices("auto", [0, 3], inventory=inv)
    assert str(info.value) == (
        "devices=[0, 3] names GPU 3, but only 1 GPU is visible (cuda:0 NVIDIA H100 80GB HBM3)"
    )


def test_plain_requests_pass_through_unchanged(physical):
    inv = inventory(physical, 5)
    for accelerator, devices, expected in [
        ("auto", "auto", "auto"),
        ("gpu", -1, -1),
        ("cuda", 2, 2),
        ("auto", "[3,1]", [3, 1]),
    ]:
        plan = resolve_devices(accelerator, devices, inventory=inv)
        assert plan.trainer_kwargs() == {"accelerator": accelerator, "devices": expected}
        assert plan.message is None and plan.selected is None
    assert uuids(resolve_devices("gpu", [3, 1], inventory=inv).gpus) == [MIG30, UUID1]


def test_cpu_takes_a_process_count():
    assert resolve_devices("cpu", 4).trainer_kwargs() == {"accelerator": "cpu", "devices": 4}
    with pytest.raises(DeviceError, match=r"^devices=-1 means 'every GPU'"):
        resolve_devices("cpu", -1)


def test_other_accelerators_pass_through():
    plan = resolve_devices("mps", 1, inventory=CPU_ONLY)
    assert (plan.accelerator, plan.devices, plan.message) == ("mps", 1, None)
    on_mac = build_inventory(None, TorchCuda(mps_available=True), env={})
    assert resolve_devices("auto", 1, inventory=on_mac).accelerator == "auto"


def test_bad_select_is_one_line():
    with pytest.raises(DeviceError) as info:
        resolve_devices("cpu", 1, select="emptiest")
    assert str(info.value) == "select_gpus='emptiest' is not valid; use one of first, least_used"


# ------------------------------------------------------------------------- selection by load


def gpu(free: int | None, util: int | None) -> Gpu:
    return Gpu(uuid="", name="x", memory_free_mib=free, utilization_percent=util)


def test_rank_by_load_free_memory_then_utilisation_then_index():
    gpus = [gpu(100, 50), gpu(200, 90), gpu(100, 10), gpu(200, 90), gpu(None, 0), gpu(100, None)]
    assert rank_by_load(gpus) == [1, 3, 2, 0, 5, 4]
    assert select_least_used(gpus, 3) == [1, 2, 3]


def loaded_inventory(loads: dict[int, tuple[int, int]], gpus: int = 3) -> Inventory:
    lib = make_fake(loads)
    nvml.use_library(lib)
    try:
        return collect_inventory(
            torch_info=TorchCuda(True, gpus), env={"CUDA_VISIBLE_DEVICES": "0,1,2"}
        )
    finally:
        nvml.use_library(None)


def test_least_used_picks_most_free_memory_then_lowest_utilisation():
    inv = loaded_inventory({0: (40, 10), 1: (5, 90), 2: (5, 30)})
    environ: dict[str, str] = {}
    plan = resolve_devices("gpu", 2, select="least_used", inventory=inv, environ=environ)
    assert plan.devices == [1, 2] and plan.selected == (1, 2)
    assert plan.message == (
        "select_gpus=least_used picked cuda:1, cuda:2 of 3 (most free memory, then lowest "
        "utilisation)"
    )
    assert environ == {}  # deciding changes nothing; the run hands the choice on (resolve_for_run)
    record = json.loads(plan.handoff)
    assert record == {
        "pid": os.getpid(),
        "request": "devices=2 CUDA_VISIBLE_DEVICES=0,1,2",
        "gpus": [1, 2],
    }
    one = resolve_devices("gpu", 1, select="least_used", inventory=inv, environ={})
    assert one.devices == [2]  # same free memory as GPU 1, lower utilisation


def test_least_used_ties_go_to_the_lowest_index():
    inv = loaded_inventory({})
    assert resolve_devices("gpu", 2, select="least_used", inventory=inv, environ={}).devices == [
        0,
        1,
    ]


def test_least_used_with_every_gpu_wanted_chooses_them_all_so_the_run_can_claim_them():
    inv = loaded_inventory({0: (40, 10)})
    environ: dict[str, str] = {}
    for devices in (3, -1, "auto"):
        plan = resolve_devices("gpu", devices, select="least_used", inventory=inv, environ=environ)
        assert plan.devices == [0, 1, 2] and plan.selected == (0, 1, 2)
        assert json.loads(plan.handoff)["request"] == "devices=3 CUDA_VISIBLE_DEVICES=0,1,2"
    assert environ == {}


def test_ddp_child_reuses_rank_zero_choice_despite_different_load():
    rank0 = resolve_devices(
        "gpu", 2, select="least_used", inventory=loaded_inventory({0: (40, 10)}), environ={}
    )
    assert rank0.devices == [1, 2]
    # The child re-runs the command: LOCAL_RANK is set, the record comes from another pid (rank 0),
    # and meanwhile the load moved so that a fresh choice would be [0, 1].
    record = json.loads(rank0.handoff)
    record["pid"] = os.getpid() + 1
    child_env = {SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}
    moved = loaded_inventory({2: (70, 100)})
    assert resolve_devices("gpu", 2, select="least_used", inventory=moved, environ={}).devices == [
        0,
        1,
    ]
    child = resolve_devices("gpu", 2, select="least_used", inventory=moved, environ=child_env)
    assert child.devices == [1, 2]
    assert child.message == "GPUs chosen by rank 0 (least used): [1, 2]"


def test_a_record_written_by_this_process_is_a_stale_one_and_is_redone():
    # Sequential runs in one process (Hydra multirun): Lightning left LOCAL_RANK=0 behind.
    environ = {"LOCAL_RANK": "0"}
    environ[SELECTION_ENV] = json.dumps(
        {"pid": os.getpid(), "request": "devices=2 CUDA_VISIBLE_DEVICES=0,1,2", "gpus": [0, 1]}
    )
    inv = loaded_inventory({0: (40, 10)})
    assert resolve_devices(
        "gpu", 2, select="least_used", inventory=inv, environ=environ
    ).devices == [1, 2]


def test_child_with_a_different_request_fails_in_one_line():
    record = {
        "pid": os.getpid() + 1,
        "request": "devices=1 CUDA_VISIBLE_DEVICES=0,1,2",
        "gpus": [2],
    }
    environ = {SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}
    with pytest.raises(DeviceError) as info:
        resolve_devices(
            "gpu", 2, select="least_used", inventory=loaded_inventory({}), environ=environ
        )
    assert str(info.value) == (
        "RUNKIT_GPU_SELECTION holds rank 0's GPU choice for "
        "'devices=1 CUDA_VISIBLE_DEVICES=0,1,2', but this process asks "
        "'devices=2 CUDA_VISIBLE_DEVICES=0,1,2'; unset RUNKIT_GPU_SELECTION and start again"
    )


def test_external_launcher_without_a_record_cannot_coordinate():
    with pytest.raises(DeviceError, match=r"^select_gpus=least_used cannot coordinate"):
        resolve_devices(
            "gpu",
            2,
            select="least_used",
            inventory=loaded_inventory({}),
            environ={"LOCAL_RANK": "3"},
        )


def test_garbage_record_is_one_line():
    environ = {SELECTION_ENV: "[1, 2]", "LOCAL_RANK": "1"}
    with pytest.raises(DeviceError, match=r"^RUNKIT_GPU_SELECTION='\[1, 2\]' is not a GPU choice"):
        resolve_devices(
            "gpu", 2, select="least_used", inventory=loaded_inventory({}), environ=environ
        )


def test_least_used_without_nvml_takes_the_first_gpus():
    inv = build_inventory(None, TorchCuda(True, 3), env={}, nvml_reason="NVML is not available (x)")
    plan = resolve_devices("gpu", 2, select="least_used", inventory=inv, environ={})
    assert plan.devices == [0, 1]
    assert plan.message == (
        "select_gpus=least_used: no GPU load readings (NVML is not available (x)); "
        "using the first 2: [0, 1]"
    )


def test_first_is_the_default_and_ignores_load():
    inv = loaded_inventory({0: (40, 10)})
    plan = resolve_devices("gpu", 2, inventory=inv, environ={})
    assert plan.devices == 2 and plan.selected is None
    assert uuids(plan.gpus) == [UUID0, UUID1]


def test_child_whose_rank_zero_choice_is_out_of_range_fails_in_one_line():
    record = {
        "pid": os.getpid() + 1,
        "request": "devices=2 CUDA_VISIBLE_DEVICES=0,1,2",
        "gpus": [1, 7],
    }
    environ = {SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}
    with pytest.raises(DeviceError) as info:
        resolve_devices(
            "gpu", 2, select="least_used", inventory=loaded_inventory({}), environ=environ
        )
    assert str(info.value).startswith(
        "rank 0 chose GPUs [1, 7] (RUNKIT_GPU_SELECTION), but only 3 GPUs are visible"
    )


def test_torch_without_uuids_falls_back_to_the_env_rules(physical):
    inv = build_inventory(
        physical, TorchCuda(True, 2, uuids=("", "")), env={"CUDA_VISIBLE_DEVICES": "1,0"}
    )
    assert inv.mapping == "env-rules" and uuids(inv.visible) == [UUID1, UUID0]


# ------------------------------------------------------------------------- once per process


FAST = SelectionPolicy(util_window_s=0.01)


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fresh fake NVML with three idle GPUs and torch pretending to see them all; GPU claims
    in a lock directory of the test's own."""
    lib = make_fake({0: (40, 10)})
    nvml.use_library(lib)
    claims.finish_job()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(inventory_module, "probe_torch", lambda uuids=True: TorchCuda(True, 3))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK", SELECTION_ENV):
        monkeypatch.delenv(name, raising=False)
    yield lib
    claims.finish_job()
    nvml.use_library(None)


def compose_train(*overrides: str):
    from hydra import compose, initialize_config_dir

    from project import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.parametrize("select", ["first", "least_used"])
def test_preflight_reads_nvml_once_and_only_the_run_measures_claims_and_hands_over(machine, select):
    from runkit.run.preflight import check_config

    cfg = compose_train("trainer.accelerator=gpu", "trainer.devices=2", f"select_gpus={select}")
    ours = lambda: {k: v for k, v in os.environ.items() if k.startswith("PROJECT_")}  # noqa: E731
    before = ours()
    check_config(cfg)  # the preflight Hydra callback
    check_config(cfg)  # again in the job
    assert ours() == before  # a check changes nothing (importing Lightning sets its own vars)
    assert machine.calls["nvmlInit"] == machine.calls["nvmlDeviceGetCount"] == 1
    assert claims.claimed_uuids() == ()
    environ: dict[str, str] = {}
    plan = resolve_for_run("gpu", 2, select=select, policy=FAST, environ=environ)
    # a plain request reads no load; neither reads temperatures or process names
    assert ("nvmlDeviceGetMemoryInfo" in machine.calls) == (select == "least_used")
    assert not {"nvmlDeviceGetTemperature", "nvmlDeviceGetComputeRunningProcesses"} & set(
        machine.calls
    )
    if select == "least_used":
        assert machine.calls["nvmlInit"] == 2  # the run measures afresh, over a window
        assert plan.devices == [1, 2] and json.loads(environ[SELECTION_ENV])["gpus"] == [1, 2]
        assert set(claims.claimed_uuids()) == {UUID1, UUID2}
    else:
        assert machine.calls["nvmlInit"] == 1
        assert plan.devices == 2 and environ == {} and claims.claimed_uuids() == ()
    assert machine.balanced


def test_the_end_of_a_job_gives_back_its_gpus_and_the_next_job_measures_anew(machine):
    assert resolve_for_run("gpu", 1, select="least_used", policy=FAST, environ={}).devices == [1]
    assert claims.claimed_uuids() == (UUID1,)
    # Between two jobs of a sweep the load moves: GPU 1 fills up.
    machine.gpus[1].memory_used = 70 * GIB
    assert resolve_devices("gpu", 1, select="least_used", environ={}).devices == [1]  # cached
    claims.finish_job()  # what the Hydra entry point does after every job
    assert claims.claimed_uuids() == ()
    assert resolve_devices("gpu", 1, select="least_used", environ={}).devices == [2]
    assert resolve_for_run("gpu", 1, select="least_used", policy=FAST, environ={}).devices == [2]
    assert claims.claimed_uuids() == (UUID2,)


def test_the_cached_reading_follows_cuda_visible_devices_and_upgrades_its_detail(
    machine, monkeypatch
):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert uuids(resolve_devices("gpu", 2).gpus) == [UUID2, UUID0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert uuids(resolve_devices("gpu", 1).gpus) == [UUID1]
    assert machine.calls["nvmlInit"] == 1  # NVML's GPU list does not depend on the variable
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert resolve_devices("gpu", 2, select="least_used", environ={}).devices == [1, 2]
    assert resolve_devices("gpu", 1, select="least_used", environ={}).devices == [1]
    assert resolve_devices("gpu", 1).devices == 1
    assert machine.calls["nvmlInit"] == 2  # the load readings needed one more read, kept


def test_cpu_and_other_accelerators_never_touch_nvml(machine):
    assert resolve_for_run("cpu", 2).devices == 2
    assert resolve_devices("mps", 1).accelerator == "mps"
    assert machine.total_calls() == 0


@pytest.mark.slow
def test_an_in_process_run_reads_nvml_once(machine, monkeypatch, tmp_path):
    """The whole ``train`` flow in-process, preflight included: one NVML reading, no more."""
    from project import train as train_module
    from runkit.run.preflight import check_config

    monkeypatch.setattr(inventory_module, "probe_torch", lambda uuids=True: TorchCuda())
    monkeypatch.setattr("runkit.plots.after_run", lambda out: None)
    cfg = compose_train(
        f"paths.output_dir='{tmp_path / 'run with spaces é'}'",
        "model=mlp",
        "trainer.max_epochs=1",
        "+trainer.limit_train_batches=2",
        "+trainer.limit_val_batches=1",
        "test=false",
        "export_weights=false",
        "logger=none",
        "callbacks.progress_bar.refresh_rate=0",
    )
    check_config(cfg)
    metrics = train_module.train(cfg)
    assert "val/loss" in metrics  # it trained (on the CPU: torch has no CUDA here)
    assert machine.calls["nvmlInit"] == machine.calls["nvmlDeviceGetCount"] == 1
    assert machine.balanced and SELECTION_ENV not in os.environ
