"""GPU inventory, CUDA_VISIBLE_DEVICES rules, device resolution and selection by load.

Everything runs on the CPU: NVML is :mod:`project.machinery.testing.fake_nvml`, and what torch would say
about CUDA is the explicit :class:`project.machinery.gpus.devices.TorchCuda` argument.
"""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from project.errors import ProjectError
from project.machinery.gpus import devices as d
from project.machinery.gpus import nvml
from project.machinery.testing.fake_nvml import GIB, FakeGpu, FakeNvml, FakeProcess

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
    gpus, _driver, _notes = d.read_nvml()
    return gpus


def uuids(gpus):
    return [g.uuid for g in gpus]


# ------------------------------------------------------------------------- reading NVML


def test_read_nvml_reads_every_gpu_and_mig_slice(fake):
    gpus, driver, notes = d.read_nvml()
    assert driver == "560.35.03" and notes == []
    assert uuids(gpus) == [UUID0, UUID1, UUID2, UUID3]
    g0 = gpus[0]
    assert (g0.memory_total_mib, g0.memory_used_mib, g0.memory_free_mib) == (81920, 0, 81920)
    assert g0.temperature_c == 35 and g0.power_w == 70.0 and g0.power_limit_w == 700.0
    assert g0.processes == (d.GpuProcess(4242, 3072, None),)
    assert gpus[3].mig_enabled and uuids(gpus[3].mig_devices) == [MIG30, MIG31]
    mig = gpus[3].mig_devices[1]
    assert mig.is_mig and mig.parent_uuid == UUID3 and mig.mig_index == 1
    assert mig.utilization_percent is None  # MIG handles do not report utilisation
    assert fake.balanced


def test_unsupported_metric_becomes_none_not_an_error(fake):
    fake.gpus[1].fail("power", "not_supported")
    fake.gpus[1].fail("temperature", "no_permission")
    gpus, _, _ = d.read_nvml()
    assert gpus[1].power_w is None and gpus[1].temperature_c is None
    assert gpus[1].memory_total_mib == 81920


def test_a_gpu_nvml_cannot_open_keeps_its_place(fake):
    fake.gpus[1].lose(0.0)
    gpus, _, notes = d.read_nvml()
    assert [g.nvml_index for g in gpus] == [0, 1, 2, 3]
    assert gpus[1].error is not None and gpus[1].uuid == ""
    assert notes and "GPU 1" in notes[0]


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
        (f"1,{MIG30}", [UUID1, MIG30]),
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
        (f"2,{UUID2}", []),
    ],
)
def test_cuda_visible_devices(physical, value, expected):
    visible, _notes = d.apply_visible_devices(physical, value, "PCI_BUS_ID")
    assert uuids(visible) == expected


def test_truncation_and_empty_value_are_explained(physical):
    _, notes = d.apply_visible_devices(physical, "0,2,-1,1", "PCI_BUS_ID")
    assert notes == [
        "CUDA_VISIBLE_DEVICES entry '-1' names no GPU here; CUDA stops at the first invalid "
        "entry, so '-1,1' is ignored."
    ]
    _, notes = d.apply_visible_devices(physical, "1,GPU-aaaa", "PCI_BUS_ID")
    assert "matches more than one GPU" in notes[0]
    _, notes = d.apply_visible_devices(physical, "", "PCI_BUS_ID")
    assert notes == ["CUDA_VISIBLE_DEVICES is empty, which hides every GPU."]


def test_old_style_mig_identifier_is_matched_by_instance_ids():
    child = d.Gpu(
        uuid=MIG30, name="slice", parent_uuid=UUID3, gpu_instance_id=7, compute_instance_id=0
    )
    parent = d.Gpu(uuid=UUID3, name="A100", nvml_index=0, mig_enabled=True, mig_devices=(child,))
    visible, _ = d.apply_visible_devices([parent], f"MIG-{UUID3}/7/0", "PCI_BUS_ID")
    assert visible == [child]
    visible, _ = d.apply_visible_devices([parent], f"MIG-{UUID3}/7/1", "PCI_BUS_ID")
    assert visible == []


def test_pci_bus_order_follows_bus_ids_and_mixed_models_get_a_note():
    a = d.Gpu(uuid="GPU-a", name="RTX 4090", nvml_index=0, pci_bus_id="00000000:41:00.0")
    b = d.Gpu(uuid="GPU-b", name="RTX 3060", nvml_index=1, pci_bus_id="00000000:0A:00.0")
    visible, notes = d.apply_visible_devices([a, b], None, "PCI_BUS_ID")
    assert uuids(visible) == ["GPU-b", "GPU-a"] and notes == []
    _, notes = d.apply_visible_devices([a, b], "0", "FASTEST_FIRST")
    assert len(notes) == 1 and "CUDA_DEVICE_ORDER=PCI_BUS_ID" in notes[0]


def test_same_model_gpus_need_no_order_note(physical):
    _, notes = d.apply_visible_devices(physical[:3], None, None)
    assert notes == []


# ------------------------------------------------------------------------- inventory


def test_inventory_maps_cuda_indices_by_torch_uuid(physical):
    # torch reports UUIDs without the GPU-/MIG- prefix; cuda:0 is GPU 2, cuda:1 a MIG slice
    torch_info = d.TorchCuda(True, 2, uuids=(UUID2[4:], MIG31[4:]), names=("H100", "A100 MIG"))
    inv = d.build_inventory(physical, torch_info, env={"CUDA_VISIBLE_DEVICES": "whatever"})
    assert inv.mapping == "torch-uuid"
    assert uuids(inv.visible) == [UUID2, MIG31]
    assert uuids(inv.hidden) == [UUID0, UUID1]
    assert inv.usable_gpu_count == 2


def test_inventory_without_torch_uuids_follows_the_env_rules(physical):
    env = {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    inv = d.build_inventory(physical, d.TorchCuda(True, 2), env=env)
    assert inv.mapping == "env-rules" and uuids(inv.visible) == [UUID2, UUID0]
    assert inv.cuda_visible_devices == "2,0" and inv.cuda_device_order == "PCI_BUS_ID"
    assert inv.notes == ()


def test_inventory_flags_a_count_mismatch_with_torch(physical):
    inv = d.build_inventory(physical, d.TorchCuda(True, 1), env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert any("torch sees 1 CUDA device(s)" in n for n in inv.notes)
    assert inv.usable_gpu_count == 1


def test_torch_without_cuda_means_no_usable_gpu(physical):
    inv = d.build_inventory(physical, d.TorchCuda(False, 0), env={})
    assert inv.usable_gpu_count == 0 and len(inv.visible) == 5
    assert inv.summary() == (
        "No usable GPU: NVML sees 4 GPUs but torch has no CUDA (CPU-only build?); "
        "training will use the CPU."
    )


def test_inventory_without_nvml_uses_torch_names():
    inv = d.build_inventory(
        None, d.TorchCuda(True, 1, ("abc",), ("NVIDIA L4",)), env={}, nvml_reason="no driver"
    )
    assert inv.mapping == "torch-only" and inv.visible[0].name == "NVIDIA L4"
    assert inv.visible[0].memory_total_mib is None


def test_collect_inventory_reports_nvml_failure_in_one_line():
    nvml.use_library(FakeNvml(2, init_error="library_not_found"))
    try:
        inv = d.collect_inventory(torch_info=d.TorchCuda(), env={})
    finally:
        nvml.use_library(None)
    assert not inv.nvml_available and inv.visible == ()
    assert inv.summary() == (
        "No usable GPU: NVML is not available (NVML Shared Library Not Found); "
        "training will use the CPU."
    )


def test_unknown_device_order_is_noted(physical):
    inv = d.build_inventory(physical, d.TorchCuda(), env={"CUDA_DEVICE_ORDER": "SLOWEST"})
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
    assert d.parse_devices(value) == expected


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
    with pytest.raises(d.DeviceError) as info:
        d.parse_devices(value)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_device_error_is_a_project_error_and_a_value_error():
    assert issubclass(d.DeviceError, ProjectError) and issubclass(d.DeviceError, ValueError)


# ------------------------------------------------------------------------- resolve_devices


def inventory(physical, gpus: int, env: dict[str, str] | None = None) -> d.Inventory:
    return d.build_inventory(physical, d.TorchCuda(gpus > 0, gpus), env=env or {})


CPU_ONLY = d.build_inventory(None, d.TorchCuda(), env={}, nvml_reason="NVML is not available (x)")


def test_auto_without_gpu_falls_back_to_cpu_with_one_message():
    plan = d.resolve_devices("auto", "auto", inventory=CPU_ONLY)
    assert plan.trainer_kwargs() == {"accelerator": "cpu", "devices": "auto"}
    assert plan.message == "No usable GPU: NVML is not available (x); training runs on the CPU."


def test_auto_without_gpu_keeps_a_process_count_and_maps_all_to_auto():
    assert d.resolve_devices("auto", 3, inventory=CPU_ONLY).devices == 3
    assert d.resolve_devices("auto", -1, inventory=CPU_ONLY).devices == "auto"


def test_auto_without_gpu_rejects_gpu_indices():
    with pytest.raises(d.DeviceError, match=r"^devices=\[0, 1\] lists GPU indices, but training"):
        d.resolve_devices("auto", "0,1", inventory=CPU_ONLY)


@pytest.mark.parametrize("accelerator", ["gpu", "cuda", "GPU"])
def test_gpu_on_a_cpu_machine_is_one_line(accelerator):
    with pytest.raises(d.DeviceError) as info:
        d.resolve_devices(accelerator, 1, inventory=CPU_ONLY)
    assert str(info.value) == (
        f"accelerator={accelerator} asks for a GPU, but this machine has no usable GPU "
        "(NVML is not available (x)); use accelerator=cpu or accelerator=auto"
    )


def test_more_gpus_than_exist_is_one_line(physical):
    with pytest.raises(d.DeviceError) as info:
        d.resolve_devices(
            "gpu", 4, inventory=inventory(physical, 2, {"CUDA_VISIBLE_DEVICES": "0,1"})
        )
    assert str(info.value) == (
        "devices=4 asks for 4 GPUs, but only 2 GPUs are visible "
        "(cuda:0 NVIDIA H100 80GB HBM3, cuda:1 NVIDIA H100 80GB HBM3)"
    )


def test_missing_index_is_one_line(physical):
    inv = inventory(physical, 1, {"CUDA_VISIBLE_DEVICES": "2"})
    with pytest.raises(d.DeviceError) as info:
        d.resolve_devices("auto", [0, 3], inventory=inv)
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
        plan = d.resolve_devices(accelerator, devices, inventory=inv)
        assert plan.trainer_kwargs() == {"accelerator": accelerator, "devices": expected}
        assert plan.message is None and plan.selected is None
    assert uuids(d.resolve_devices("gpu", [3, 1], inventory=inv).gpus) == [MIG30, UUID1]


def test_cpu_takes_a_process_count():
    assert d.resolve_devices("cpu", 4).trainer_kwargs() == {"accelerator": "cpu", "devices": 4}
    with pytest.raises(d.DeviceError, match=r"^devices=-1 means 'every GPU'"):
        d.resolve_devices("cpu", -1)


def test_other_accelerators_pass_through():
    plan = d.resolve_devices("mps", 1, inventory=CPU_ONLY)
    assert (plan.accelerator, plan.devices, plan.message) == ("mps", 1, None)
    on_mac = d.build_inventory(None, d.TorchCuda(mps_available=True), env={})
    assert d.resolve_devices("auto", 1, inventory=on_mac).accelerator == "auto"


def test_bad_select_is_one_line():
    with pytest.raises(d.DeviceError) as info:
        d.resolve_devices("cpu", 1, select="emptiest")
    assert str(info.value) == "select_gpus='emptiest' is not valid; use one of first, least_used"


# ------------------------------------------------------------------------- selection by load


def gpu(free: int | None, util: int | None) -> d.Gpu:
    return d.Gpu(uuid="", name="x", memory_free_mib=free, utilization_percent=util)


def test_rank_by_load_free_memory_then_utilisation_then_index():
    gpus = [gpu(100, 50), gpu(200, 90), gpu(100, 10), gpu(200, 90), gpu(None, 0), gpu(100, None)]
    assert d.rank_by_load(gpus) == [1, 3, 2, 0, 5, 4]
    assert d.select_least_used(gpus, 3) == [1, 2, 3]


def loaded_inventory(loads: dict[int, tuple[int, int]], gpus: int = 3) -> d.Inventory:
    lib = make_fake(loads)
    nvml.use_library(lib)
    try:
        return d.collect_inventory(
            torch_info=d.TorchCuda(True, gpus), env={"CUDA_VISIBLE_DEVICES": "0,1,2"}
        )
    finally:
        nvml.use_library(None)


def test_least_used_picks_most_free_memory_then_lowest_utilisation():
    inv = loaded_inventory({0: (40, 10), 1: (5, 90), 2: (5, 30)})
    environ: dict[str, str] = {}
    plan = d.resolve_devices("gpu", 2, select="least_used", inventory=inv, environ=environ)
    assert plan.devices == [1, 2] and plan.selected == (1, 2)
    assert plan.message == (
        "select_gpus=least_used picked cuda:1, cuda:2 of 3 (most free memory, then lowest "
        "utilisation)"
    )
    record = json.loads(environ[d.SELECTION_ENV])
    assert record == {
        "pid": os.getpid(),
        "request": "devices=2 CUDA_VISIBLE_DEVICES=0,1,2",
        "gpus": [1, 2],
    }
    one = d.resolve_devices("gpu", 1, select="least_used", inventory=inv, environ={})
    assert one.devices == [2]  # same free memory as GPU 1, lower utilisation


def test_least_used_ties_go_to_the_lowest_index():
    inv = loaded_inventory({})
    assert d.resolve_devices("gpu", 2, select="least_used", inventory=inv, environ={}).devices == [
        0,
        1,
    ]


def test_least_used_is_moot_when_all_gpus_are_wanted():
    inv = loaded_inventory({0: (40, 10)})
    environ: dict[str, str] = {}
    for devices in (3, -1, "auto"):
        plan = d.resolve_devices(
            "gpu", devices, select="least_used", inventory=inv, environ=environ
        )
        assert plan.devices == devices and plan.selected is None
    assert environ == {}


def test_ddp_child_reuses_rank_zero_choice_despite_different_load():
    rank0_env: dict[str, str] = {}
    rank0 = d.resolve_devices(
        "gpu", 2, select="least_used", inventory=loaded_inventory({0: (40, 10)}), environ=rank0_env
    )
    assert rank0.devices == [1, 2]
    # The child re-runs the command: LOCAL_RANK is set, the record comes from another pid (rank 0),
    # and meanwhile the load moved so that a fresh choice would be [0, 1].
    record = json.loads(rank0_env[d.SELECTION_ENV])
    record["pid"] = os.getpid() + 1
    child_env = {d.SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}
    moved = loaded_inventory({2: (70, 100)})
    assert d.resolve_devices(
        "gpu", 2, select="least_used", inventory=moved, environ={}
    ).devices == [0, 1]
    child = d.resolve_devices("gpu", 2, select="least_used", inventory=moved, environ=child_env)
    assert child.devices == [1, 2]
    assert child.message == "GPUs chosen by rank 0 (least used): [1, 2]"


def test_a_record_written_by_this_process_is_a_stale_one_and_is_redone():
    # Sequential runs in one process (Hydra multirun): Lightning left LOCAL_RANK=0 behind.
    environ = {"LOCAL_RANK": "0"}
    environ[d.SELECTION_ENV] = json.dumps(
        {"pid": os.getpid(), "request": "devices=2 CUDA_VISIBLE_DEVICES=0,1,2", "gpus": [0, 1]}
    )
    inv = loaded_inventory({0: (40, 10)})
    assert d.resolve_devices(
        "gpu", 2, select="least_used", inventory=inv, environ=environ
    ).devices == [1, 2]


def test_child_with_a_different_request_fails_in_one_line():
    record = {
        "pid": os.getpid() + 1,
        "request": "devices=1 CUDA_VISIBLE_DEVICES=0,1,2",
        "gpus": [2],
    }
    environ = {d.SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}
    with pytest.raises(d.DeviceError) as info:
        d.resolve_devices(
            "gpu", 2, select="least_used", inventory=loaded_inventory({}), environ=environ
        )
    assert str(info.value) == (
        "PROJECT_GPU_SELECTION holds rank 0's GPU choice for "
        "'devices=1 CUDA_VISIBLE_DEVICES=0,1,2', but this process asks "
        "'devices=2 CUDA_VISIBLE_DEVICES=0,1,2'; unset PROJECT_GPU_SELECTION and start again"
    )


def test_external_launcher_without_a_record_cannot_coordinate():
    with pytest.raises(d.DeviceError, match=r"^select_gpus=least_used cannot coordinate"):
        d.resolve_devices(
            "gpu",
            2,
            select="least_used",
            inventory=loaded_inventory({}),
            environ={"LOCAL_RANK": "3"},
        )


def test_garbage_record_is_one_line():
    environ = {d.SELECTION_ENV: "[1, 2]", "LOCAL_RANK": "1"}
    with pytest.raises(
        d.DeviceError, match=r"^PROJECT_GPU_SELECTION='\[1, 2\]' is not a GPU choice"
    ):
        d.resolve_devices(
            "gpu", 2, select="least_used", inventory=loaded_inventory({}), environ=environ
        )


def test_least_used_without_nvml_takes_the_first_gpus():
    inv = d.build_inventory(
        None, d.TorchCuda(True, 3), env={}, nvml_reason="NVML is not available (x)"
    )
    plan = d.resolve_devices("gpu", 2, select="least_used", inventory=inv, environ={})
    assert plan.devices == [0, 1]
    assert plan.message == (
        "select_gpus=least_used: no GPU load readings (NVML is not available (x)); "
        "using the first 2: [0, 1]"
    )


def test_first_is_the_default_and_ignores_load():
    inv = loaded_inventory({0: (40, 10)})
    plan = d.resolve_devices("gpu", 2, inventory=inv, environ={})
    assert plan.devices == 2 and plan.selected is None
    assert uuids(plan.gpus) == [UUID0, UUID1]


def test_child_whose_rank_zero_choice_is_out_of_range_fails_in_one_line():
    record = {
        "pid": os.getpid() + 1,
        "request": "devices=2 CUDA_VISIBLE_DEVICES=0,1,2",
        "gpus": [1, 7],
    }
    environ = {d.SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}
    with pytest.raises(d.DeviceError) as info:
        d.resolve_devices(
            "gpu", 2, select="least_used", inventory=loaded_inventory({}), environ=environ
        )
    assert str(info.value).startswith(
        "rank 0 chose GPUs [1, 7] (PROJECT_GPU_SELECTION), but only 3 GPUs are visible"
    )


def test_torch_without_uuids_falls_back_to_the_env_rules(physical):
    inv = d.build_inventory(
        physical, d.TorchCuda(True, 2, uuids=("", "")), env={"CUDA_VISIBLE_DEVICES": "1,0"}
    )
    assert inv.mapping == "env-rules" and uuids(inv.visible) == [UUID1, UUID0]
