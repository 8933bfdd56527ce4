"""GPU inventory, CUDA_VISIBLE_DEVICES rules, device resolution, least_used; fake NVML, TorchCuda."""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf, open_dict

from conftest import compose_train
from runkit.errors import RunError
from runkit.gpus import claims, nvml
from runkit.gpus import inventory as inventory_module
from runkit.gpus.claims import SelectionPolicy
from runkit.gpus.inventory import (
    Gpu,
    GpuProcess,
    Inventory,
    TorchCuda,
    apply_visible_devices,
    build_inventory,
    cached_inventory,
    collect_inventory,
    first_entry_problem,
    no_gpu_reason,
    read_nvml,
)
from runkit.gpus.reader import DeviceReader
from runkit.gpus.resolve import (
    SELECTION_ENV,
    DeviceError,
    parse_devices,
    resolve_devices,
    resolve_for_run,
)
from runkit.testing.fake_nvml import GIB, FakeGpu, FakeNvml, FakeProcess

# Four physical GPUs in NVML (PCI) order: three H100s and an A100 in MIG mode with two slices.
UUID0 = "GPU-aaaa1111-1111-1111-1111-111111111111"
UUID1 = "GPU-aaaa2222-2222-2222-2222-222222222222"
UUID2 = "GPU-cccc3333-3333-3333-3333-333333333333"
UUID3 = "GPU-dddd4444-4444-4444-4444-444444444444"
MIG30 = "MIG-eeee0000-5555-5555-5555-555555555555"
MIG31 = "MIG-ffff1111-6666-6666-6666-666666666666"
H100 = "NVIDIA H100 80GB HBM3"


def make_fake(loads: dict[int, tuple[int, int]] | None = None) -> FakeNvml:
    """The standard fake; ``loads`` maps GPU index -> (memory used in GiB, utilisation %)."""
    loads = loads or {}

    def gpu(i: int, uuid: str, **kw: object) -> FakeGpu:
        used, util = loads.get(i, (0, 0))
        return FakeGpu(uuid=uuid, memory_used=used * GIB, util_gpu=util, **kw)

    mig = [FakeGpu(uuid=MIG30, memory_total=10 * GIB), FakeGpu(uuid=MIG31, memory_total=20 * GIB)]
    gpus = [gpu(0, UUID0, processes=[FakeProcess(4242, 3 * GIB)]), gpu(1, UUID1), gpu(2, UUID2),
            FakeGpu(name="NVIDIA A100-SXM4-80GB", uuid=UUID3, mig=mig)]  # fmt: skip
    return FakeNvml(gpus, clock=lambda: 0.0)


@pytest.fixture
def fake(use_fake):
    return use_fake(make_fake())


@pytest.fixture
def physical(fake):
    return read_nvml()[0]


def uuids(gpus):
    return [g.uuid for g in gpus]


def board(i: int, name: str = "H100", **kw: Any) -> Gpu:
    return Gpu(f"GPU-{i:04d}", name, nvml_index=i, pci_bus_id=f"00000000:{i + 16:02X}:00.0", **kw)


def machine(gpus: int, torch_count: int | None = None, **env: str) -> Inventory:
    """``gpus`` physical H100s; torch counts ``torch_count`` of them (default: all)."""
    count = gpus if torch_count is None else torch_count
    return build_inventory([board(i) for i in range(gpus)], TorchCuda(count > 0, count), env=env)


def error(call, *args, **kwargs) -> str:
    with pytest.raises(DeviceError) as info:
        call(*args, **kwargs)
    err = info.value  # a RunError (one line) and a ValueError
    assert "\n" not in str(err) and isinstance(err, RunError) and isinstance(err, ValueError)
    return str(err)


# ------------------------------------------------------------------------- reading NVML
def test_read_nvml_reads_every_gpu_and_mig_slice(fake):
    fake.gpus[0].memory_total, fake.gpus[0].memory_used = 80 * GIB + 3, GIB + 1024 * 1024 + 1
    gpus, driver, notes = read_nvml()
    assert driver == "570.133.20" and notes == []
    assert uuids(gpus) == [UUID0, UUID1, UUID2, UUID3]
    g0 = gpus[0]  # whole MiB, rounded down
    assert (g0.memory_total_mib, g0.memory_used_mib, g0.memory_free_mib) == (81920, 1025, 80895)
    assert g0.temperature_c == 35 and g0.power_w == 70.0 and g0.power_limit_w == 700.0
    assert g0.processes == (GpuProcess(4242, 3072, None),)
    parent, (slice0, slice1) = gpus[3], gpus[3].mig_devices
    assert parent.mig_enabled and uuids(parent.mig_devices) == [MIG30, MIG31]
    assert slice1.is_mig and slice1.parent_uuid == UUID3 and slice1.mig_index == 1
    assert (slice1.nvml_index, slice1.gpu_instance_id, slice1.compute_instance_id) == (3, 2, 0)
    assert slice1.utilization_percent is None  # MIG handles do not report utilisation
    # a slice has no temperature or power of its own: its GPU has
    assert (slice0.temperature_c, slice0.power_w, slice0.power_limit_w) == (None, None, None)
    assert slice0.memory_total_mib == 10 * 1024
    assert slice0.pci_bus_id == parent.pci_bus_id == "00000000:47:00.0"
    assert fake.balanced


def test_what_nvml_will_not_say_stays_unknown(fake):
    fake.gpus[1].fail("power", "not_supported").fail("temperature", "no_permission")
    fake.gpus[1].fail("power_limit", "not_supported")
    fake.gpus[2].fail("name", "unknown")
    fake.gpus[3].mig[0].fail("nvmlDeviceGetGpuInstanceId", "not_supported")
    fake.gpus[3].mig[1].fail("nvmlDeviceGetComputeInstanceId", "not_supported")
    fake.gpus[0].lose(0.0)
    gpus, _, notes = read_nvml()
    assert (gpus[1].power_w, gpus[1].power_limit_w, gpus[1].temperature_c) == (None, None, None)
    assert gpus[1].memory_total_mib == 81920 and gpus[2].name == "unknown GPU"
    ids = [(s.gpu_instance_id, s.compute_instance_id) for s in gpus[3].mig_devices]
    assert ids == [(None, 0), (2, None)]
    # a GPU NVML cannot open keeps its place
    assert gpus[0] == Gpu(uuid="", name="unreadable GPU", nvml_index=0, error="GPU is lost")
    assert [g.nvml_index for g in gpus] == [0, 1, 2, 3]
    assert notes == ["NVML cannot open GPU 0 (GPU is lost); it is listed without details."]


class ProcessNames(FakeNvml):  # process names and graphics processes, not in the fake
    def nvmlSystemGetProcessName(self, pid: int) -> bytes:
        if pid == 4242:
            return b"train.py"  # old bindings give bytes
        if pid == 5:
            return b""  # a name NVML could not read
        raise self.NVMLError(3)  # NOT_FOUND: a process gone meanwhile

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        return [SimpleNamespace(pid=4242, usedGpuMemory=GIB), SimpleNamespace(pid=77)]


def test_processes_are_listed_once_with_their_names(use_fake):
    use_fake(ProcessNames([FakeGpu(processes=[FakeProcess(4242, 2 * GIB), FakeProcess(5, GIB)])]))
    assert read_nvml("full")[0][0].processes == (
        GpuProcess(4242, 2048, "train.py"),  # the compute entry wins over the graphics one
        GpuProcess(5, 1024, None),
        GpuProcess(77, None, None),
    )


def test_one_uuid_spelling_finds_gpus_and_mig_slices(fake):
    spellings = [(UUID1, UUID1), (UUID1[4:], UUID1), (UUID1.upper(), UUID1),  # torch: bare
                 ("MIG-" + UUID1[4:], UUID1), (MIG31[4:], MIG31), (f"  {MIG31.upper()} ", MIG31)]  # fmt: skip
    with nvml.nvml_session() as lib:
        for given, expected in spellings:
            handle, nvml_uuid = nvml.find_handle(lib, given)
            assert nvml_uuid == expected == lib.nvmlDeviceGetUUID(handle), given
        assert nvml.find_handle(lib, "GPU-0000") is None
        assert nvml.optional(lib, "no_such_query") is None  # not even in these bindings
    twins = FakeNvml([FakeGpu(uuid="GPU-abc", mig=[FakeGpu(uuid="MIG-abc")])])  # one bare UUID
    twins.nvmlInit()
    found = [nvml.find_handle(twins, u)[1] for u in ("abc", " mig-ABC", "GPU-abc", "MIG-abc")]
    assert found == ["GPU-abc", "MIG-abc", "GPU-abc", "MIG-abc"]
    assert nvml.bare_uuid(" MIG-ABC ") == nvml.bare_uuid("abc") == "abc"


def test_a_backend_spec_loads_its_factory_or_says_it_cannot(monkeypatch):
    nvml._from_spec.cache_clear()  # a fresh process: nothing loaded yet
    monkeypatch.setenv(nvml.BACKEND_ENV, "runkit.testing.fake_nvml")  # no factory: create
    monkeypatch.setenv("RUNKIT_FAKE_NVML", json.dumps({"gpus": [{}, {}]}))
    lib = nvml.load_library()
    assert isinstance(lib, FakeNvml) and len(lib.gpus) == 2
    assert nvml.error_classes(
        lib, ["NVMLError_NotSupported", "NVMLError_NoSuch", "NVML_SUCCESS"]
    ) == (lib.NVMLError_NotSupported,)
    monkeypatch.setenv(nvml.BACKEND_ENV, "runkit.testing.fake_nvml:create")
    assert isinstance(nvml.load_library(), FakeNvml)
    monkeypatch.setenv(nvml.BACKEND_ENV, "runkit.testing.fake_nvml:no_such_factory")
    with pytest.raises(nvml.NvmlUnavailable) as info:
        nvml.load_library()
    assert str(info.value) == (
        "RUNKIT_NVML_BACKEND='runkit.testing.fake_nvml:no_such_factory' does not "
        "name an importable 'module:factory'"
    )
    monkeypatch.delenv(nvml.BACKEND_ENV)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # a trimmed environment
    with pytest.raises(nvml.NvmlUnavailable) as info:
        nvml.load_library()
    assert str(info.value) == "the NVML bindings are not installed (pip install nvidia-ml-py)"


# ------------------------------------------------------------------------- one device's figures
class OddDriver(FakeNvml):  # an old driver's clock name, a checked ECC query, typed fields
    value_type, result = 0, 0

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any) -> int:
        raise AttributeError("not in these bindings")

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int) -> int:
        wanted = (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        if (error_type, counter) != wanted:
            raise self.NVMLError(self.NVML_ERROR_INVALID_ARGUMENT)
        return 2

    def nvmlDeviceGetFieldValues(self, handle: Any, field_ids: Any) -> list[Any]:
        value = SimpleNamespace(dVal=1.5, uiVal=2, ulVal=3, ullVal=4, sllVal=5, siVal=6)
        return [SimpleNamespace(nvmlReturn=self.result, valueType=self.value_type, value=value)]


def test_the_reader_reads_every_board_figure_in_nvml_units_from_the_board_of_a_slice():
    figures = dict(clock_sm_mhz=1410, clocks_event_reasons=4, energy_mj=123_456, fan_pct=55, pcie_tx_kbs=10,
                   pcie_rx_kbs=20, ecc_uncorrected=3, memory_temperature=71)  # fmt: skip
    board0 = FakeGpu(**figures, mig=[FakeGpu(memory_total=10 * GIB)])
    lib = FakeNvml([board0, FakeGpu()], clock=lambda: 0.0)
    lib.nvmlInit()
    gpu = lib.nvmlDeviceGetHandleByIndex(0)
    for handle in (gpu, lib.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)):
        reader = DeviceReader.open(lib, handle)
        got = (reader.index(), reader.sm_clock_mhz(), reader.clock_event_reasons(), reader.energy_mj(),
               reader.fan_pct(), reader.pcie_kbs(), reader.ecc_uncorrected(), reader.memory_temperature_c())  # fmt: skip
        assert got == (0, 1410.0, 4, 123_456, 55, (10.0, 20.0), 3.0, 71.0)
        assert isinstance(got[1], float)
    assert reader.is_mig and reader.memory()[0] == 10 * GIB
    other = DeviceReader.open(lib, lib.nvmlDeviceGetHandleByIndex(1))
    assert not other.is_mig and other.index() == 1
    with pytest.raises(lib.NVMLError):
        other.memory_temperature_c()  # not reported by that board


@pytest.mark.parametrize(
    ("value_type", "expected"), [(0, 1.5), (1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (9, 6)]
)
def test_old_drivers_and_typed_fields_read_as_the_same_figures(value_type, expected):
    lib = OddDriver([FakeGpu(clocks_event_reasons=8)], clock=lambda: 0.0)
    lib.value_type = value_type
    lib.nvmlInit()
    reader = DeviceReader.open(lib, lib.nvmlDeviceGetHandleByIndex(0))
    assert reader.clock_event_reasons() == reader.clock_event_reasons() == 8
    assert reader.ecc_uncorrected() == 2.0  # volatile uncorrected errors
    assert reader.memory_temperature_c() == expected
    lib.result = lib.NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(lib.NVMLError_NotSupported):
        reader.memory_temperature_c()


# ------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES
def invalid(entry: str, why: str, ignored: str) -> str:
    return f"CUDA_VISIBLE_DEVICES entry {entry!r} {why}; CUDA stops at the first invalid entry, so {ignored!r} is ignored."  # fmt: skip


NOT_INDICES = "is not of the list's kind (indices, set by its first entry)"
NOT_GPU = "is not of the list's kind (GPU- UUIDs, set by its first entry)"
VISIBLE = [
        (None, [UUID0, UUID1, UUID2, MIG30, MIG31]),  # a MIG-mode GPU shows its slices
        ("2,0", [UUID2, UUID0]), ("3", [MIG30, MIG31]),  # reordering: cuda:0 is physical GPU 2
        (UUID2, [UUID2]), (f"{UUID1},{UUID0}", [UUID1, UUID0]),
        ("GPU-cccc", [UUID2]), (MIG31, [MIG31]), ("MIG-eeee", [MIG30]),  # unique UUID prefixes
        (f"MIG-{UUID3}/2/0", [MIG31]), (f"MIG-{UUID3}/2/1", []),  # the pre-R470 form, by ids
        (f"1,{MIG30}", [UUID1]),  # the first entry sets the list's kind (torch): MIG- ends it
        (f"{MIG30},{MIG31}", [MIG30, MIG31]),  # two GPU instances: one MIG device each (R570+)
        ("1,9,0", [UUID1]), ("2,4,0", [UUID2]),  # out of range (the count too) ends the list
        ("1,GPU-aaaa,2", [UUID1]), ("GPU-nope,0", []), ("2,x,0", [UUID2]),  # so does ambiguity
        ("1gpu,0", [UUID1, UUID0]), (" 1, 2", [UUID1, UUID2]), ("+0, 1", [UUID0, UUID1]),  # strtoul
        ("0,", [UUID0]), ("0,1,0", []),  # a device named twice hides every device
        (f"2,{UUID2}", [UUID2]), (f"{UUID2},0", [UUID2]),  # another kind ends the list, as in torch
        (f"{UUID1}, {UUID0}", [UUID1]),  # torch compares UUID entries unstripped
        (f" {UUID1}", []),  # ... and a blank first makes it a list of indices
]  # fmt: skip


@pytest.mark.parametrize(
    ("value", "expected", "notes"),
    [
        *[(value, expected, None) for value, expected in VISIBLE],
        ("0,2,-1,1", [UUID0, UUID2], [invalid("-1", "names no GPU here", "-1,1")]),  # CUDA's example
        ("GPU-nope", [], [invalid("GPU-nope", "names no GPU here", "GPU-nope")]),
        (f"{UUID2},GPU-aaaa", [UUID2], [invalid("GPU-aaaa", "matches more than one GPU", "GPU-aaaa")]),
        ("1,GPU-aaaa", [UUID1], [invalid("GPU-aaaa", NOT_INDICES, "GPU-aaaa")]),
        (f"0,{MIG30}", [UUID0], [invalid(MIG30, NOT_INDICES, MIG30)]),
        (f"{UUID0},1", [UUID0], [invalid("1", NOT_GPU, "1")]),
        (f"{UUID0}, {UUID1}", [UUID0], [invalid(f" {UUID1}", NOT_GPU, f" {UUID1}")]),
        (f"{MIG30},0", [MIG30], [invalid("0", "is not of the list's kind (MIG- UUIDs, set by its first entry)", "0")]),
        ("", [], ["CUDA_VISIBLE_DEVICES is empty, which hides every GPU."]),
        ("1,1", [], ["CUDA_VISIBLE_DEVICES names '1' twice; CUDA then shows no GPU at all."]),
        ("0,1", [UUID0, UUID1], []),
    ],
)  # fmt: skip
def test_cuda_visible_devices_and_what_cuda_ignores(physical, value, expected, notes):
    visible, said = apply_visible_devices(physical, value, "PCI_BUS_ID")
    assert uuids(visible) == expected and notes in (None, said)


def mig_slice(uuid: str, parent: str, gi: int | None, ci: int = 0) -> Gpu:
    return Gpu(uuid, "slice", parent_uuid=parent, gpu_instance_id=gi, compute_instance_id=ci)


# NVML 0: a plain GPU; NVML 1: MIG mode, GPU instance 1 with two compute instances and GPU
# instance 2; NVML 2: MIG mode, one GPU instance.
MIG_MACHINE = [
    Gpu(uuid="GPU-p", name="A100", nvml_index=0, pci_bus_id="00000000:17:00.0"),
    Gpu(
        uuid="GPU-a", name="A100", nvml_index=1, pci_bus_id="00000000:27:00.0", mig_enabled=True,
        mig_devices=(mig_slice("MIG-a1x", "GPU-a", 1), mig_slice("MIG-a1y", "GPU-a", 1, 1), mig_slice("MIG-a2", "GPU-a", 2)),
    ),
    Gpu(
        uuid="GPU-b", name="A100", nvml_index=2, pci_bus_id="00000000:37:00.0", mig_enabled=True,
        mig_devices=(mig_slice("MIG-b1", "GPU-b", 1),),
    ),
]  # fmt: skip
PRE_R570 = (
    "driver 535.104.05 (before R570): CUDA enumerates one MIG device and no other GPU; shown: "
    "MIG-a1x (the first in CUDA order; which one CUDA takes is not documented)."
)


@pytest.mark.parametrize(
    ("driver", "value", "expected", "notes"),
    [
        # R570+: one compute instance per GPU instance, across GPUs; plain GPUs stay visible
        ("570.133.20", None, ["GPU-p", "MIG-a1x", "MIG-a2", "MIG-b1"], ["not shown: MIG-a1y"]),
        (None, None, ["GPU-p", "MIG-a1x", "MIG-a2", "MIG-b1"], ["not shown: MIG-a1y"]),  # unknown
        ("580.65.06", "MIG-a1y,MIG-a1x,MIG-b1", ["MIG-a1y", "MIG-b1"], ["not shown: MIG-a1x"]),
        ("570.133.20", "1,0", ["MIG-a1x", "MIG-a2", "GPU-p"], ["not shown: MIG-a1y"]),
        ("570.133.20", "2,0", ["MIG-b1", "GPU-p"], []),
        # before R570: one MIG device in all, and no plain GPU once a MIG device is shown
        ("535.104.05", None, ["MIG-a1x"], [PRE_R570]),
        ("535.104.05", "0,2", ["MIG-b1"], ["shown: MIG-b1 (the first"]),
        ("535.104.05", "MIG-b1,MIG-a2", ["MIG-b1"], ["shown: MIG-b1 (the first"]),
        ("535.104.05", "MIG-a2", ["MIG-a2"], []),
        ("535.104.05", "0", ["GPU-p"], []),
    ],
)
def test_mig_devices_follow_the_drivers_enumeration_rule(driver, value, expected, notes):
    visible, said = apply_visible_devices(MIG_MACHINE, value, "PCI_BUS_ID", driver)
    assert uuids(visible) == expected
    assert len(said) == len(notes) and all(n in s for n, s in zip(notes, said, strict=True))


def test_at_most_64_mig_devices_are_enumerated_beside_plain_gpus():
    gpus = [Gpu(uuid="GPU-p", name="A100", nvml_index=10, pci_bus_id="00000000:01:00.0")] + [
        board(i, name="A100", mig_enabled=True,
              mig_devices=tuple(mig_slice(f"MIG-{i}-{g}", f"GPU-{i:04d}", g) for g in range(7)))
        for i in range(10)
    ]  # fmt: skip
    visible, notes = apply_visible_devices(gpus, None, "PCI_BUS_ID", "570.133.20")
    assert len(visible) == 65 and uuids(visible)[::64] == ["GPU-p", "MIG-9-0"]
    assert notes == [
        "CUDA enumerates one compute instance per GPU instance and at most 64 MIG devices; not "
        "shown: MIG-9-1, MIG-9-2, MIG-9-3, MIG-9-4, MIG-9-5, MIG-9-6 (which compute instance "
        "CUDA takes is not documented; the first in CUDA order is assumed)."
    ]
    # slices whose GPU instance NVML does not give are told apart by their UUIDs
    unknown = (mig_slice("MIG-x", "GPU-0000", None), mig_slice("MIG-y", "GPU-0000", None))
    gpus = [board(0, name="A100", mig_enabled=True, mig_devices=unknown)]
    assert uuids(apply_visible_devices(gpus, None, "PCI_BUS_ID")[0]) == ["MIG-x", "MIG-y"]


ORDER_NOTE = (
    "CUDA_DEVICE_ORDER is FASTEST_FIRST (CUDA's default) and the GPUs are different models, so "
    "CUDA may number them differently from PCI bus order; the indices shown assume PCI order. "
    "Set CUDA_DEVICE_ORDER=PCI_BUS_ID to make them exact."
)


@pytest.mark.parametrize(
    ("gpus", "order", "expected", "notes"),
    [
        # (name, nvml index, PCI bus): PCI bus order, then NVML's to break ties
        ([("4090", 0, "41"), ("3060", 1, "0A")], "PCI_BUS_ID", ["GPU-b", "GPU-a"], []),
        ([("4090", 0, "41"), ("3060", 1, "0A")], " pci_bus_id ", ["GPU-b", "GPU-a"], []),
        ([("4090", 0, "01"), ("3060", 1, "02")], None, ["GPU-a", "GPU-b"], [ORDER_NOTE]),
        ([("A", 0, "01"), ("A", 1, "02")], None, ["GPU-a", "GPU-b"], []),
        ([("A", 2, "01"), ("A", 0, "01"), ("A", None, "01"), ("A", 1, "01")], "PCI_BUS_ID",
         ["GPU-b", "GPU-c", "GPU-d", "GPU-a"], []),
        ([("A", 1, None), ("A", 0, "99")], "PCI_BUS_ID", ["GPU-b", "GPU-a"], []),  # no bus id: NVML's
    ],
)  # fmt: skip
def test_cuda_numbers_gpus_in_pci_bus_order_and_says_when_that_may_be_wrong(
    gpus, order, expected, notes
):
    physical = [
        Gpu(uuid=f"GPU-{'abcd'[i]}", name=name, nvml_index=index,
            pci_bus_id=None if bus is None else f"00000000:{bus}:00.0")
        for i, (name, index, bus) in enumerate(gpus)
    ]  # fmt: skip
    visible, said = apply_visible_devices(physical, None, order)
    assert uuids(visible) == expected and said == notes


# strtoul: a sign and leading digits count; a UUID list: the GPUs decide; a blank first makes a
# list of indices (torch); empty: its own message
@pytest.mark.parametrize("value", ["banana,,7", "-1", ",0", " x1", " GPU-abc", "0", "1gpu", "+1", "GPU-abc", "MIG-abc", "", None])  # fmt: skip
def test_a_first_entry_that_names_no_device_hides_every_gpu(value):
    assert (first_entry_problem(value) is not None) == (value in ("banana,,7", "-1", ",0", " x1", " GPU-abc"))  # fmt: skip


# ------------------------------------------------------------------------- the inventory
def test_inventory_maps_cuda_indices_by_torch_uuid(physical):
    # torch reports UUIDs without the GPU-/MIG- prefix; cuda:0 is GPU 2, cuda:1 a MIG slice
    torch_info = TorchCuda(True, 3, uuids=(UUID2[4:], MIG31[4:], "beef"), names=("H100", "A100 MIG"))  # fmt: skip
    inv = build_inventory(physical, torch_info, env={"CUDA_VISIBLE_DEVICES": "whatever"})
    assert inv.mapping == "torch-uuid" and inv.usable_gpu_count == 3
    names = [(g.uuid, g.name) for g in inv.visible]
    assert names == [(UUID2, H100), (MIG31, "NVIDIA A100-SXM4-80GB MIG 1g.10gb"), ("beef", "unknown GPU")]  # fmt: skip
    assert inv.notes == ("cuda:2 (beef) is not in NVML's list; shown without metrics.",)
    assert uuids(inv.hidden) == [UUID0, UUID1]


def test_inventory_without_torch_uuids_follows_the_env_rules(physical):
    env = {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    inv = build_inventory(physical, TorchCuda(True, 2, uuids=("", "")), env=env)
    assert inv.mapping == "env-rules" and uuids(inv.visible) == [UUID2, UUID0]
    assert inv.cuda_visible_devices == "2,0" and inv.cuda_device_order == "PCI_BUS_ID"
    assert inv.notes == ()
    inv = build_inventory(physical, TorchCuda(True, 1), env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert inv.usable_gpu_count == 1 and inv.notes[1:] == (
        "torch sees 1 CUDA device(s) but the CUDA_VISIBLE_DEVICES rules give 2; trust torch's "
        "count, the GPU details may be misplaced.",
    )
    inv = build_inventory(physical, TorchCuda(), env={}, driver_version="535.104.05")
    assert uuids(inv.visible) == [MIG30] and uuids(inv.hidden) == [UUID0, UUID1, UUID2]
    hidden = build_inventory(physical, TorchCuda(), env={"CUDA_VISIBLE_DEVICES": ""})
    assert hidden.visible == () and hidden.mapping == "none"


def test_inventory_without_nvml_names_what_torch_names():
    inv = build_inventory(
        None, TorchCuda(True, 2, uuids=("u0",), names=("L4",)), env={"CUDA_DEVICE_ORDER": "slowest"}, nvml_reason="no driver"
    )  # fmt: skip
    assert [(g.uuid, g.name) for g in inv.visible] == [("u0", "L4"), ("", "cuda:1")]
    assert inv.mapping == "torch-only" and not inv.nvml_available
    assert inv.visible[0].memory_total_mib is None and inv.cuda_device_order == "FASTEST_FIRST"
    assert inv.notes == (
        "CUDA_DEVICE_ORDER='SLOWEST' is not one of FASTEST_FIRST, PCI_BUS_ID; CUDA uses "
        "FASTEST_FIRST.",
    )
    none = build_inventory(None, TorchCuda(False, 0), env={})
    assert none.mapping == "none" and none.visible == ()


@pytest.mark.parametrize(
    ("inv", "reason"),
    [
        (machine(2, 0, CUDA_VISIBLE_DEVICES=" "), "CUDA_VISIBLE_DEVICES is set to an empty string"),
        (machine(1, 0), "NVML sees 1 GPU but torch has no CUDA (CPU-only build?)"),
        (machine(2, 0), "NVML sees 2 GPUs but torch has no CUDA (CPU-only build?)"),
        (machine(1, 0, CUDA_VISIBLE_DEVICES="5"), "CUDA_VISIBLE_DEVICES='5' hides every GPU"),
        # named before torch's lack of CUDA, which a hiding variable causes
        (machine(2, 0, CUDA_VISIBLE_DEVICES="GPU-nope"), "CUDA_VISIBLE_DEVICES='GPU-nope' hides every GPU"),
        (
            build_inventory(None, TorchCuda(), env={"CUDA_VISIBLE_DEVICES": "banana,,7"}),
            "CUDA_VISIBLE_DEVICES='banana,,7' hides every GPU: its first entry 'banana' is not a "
            "GPU index or UUID, and CUDA ignores the list from its first invalid entry on",
        ),
        (build_inventory(None, TorchCuda(), env={}, nvml_reason="no driver"), "no driver"),
        (build_inventory(None, TorchCuda(), env={}), "no NVIDIA GPU found"),
        (build_inventory([], TorchCuda(), env={}, nvml_reason="ignored"), "no NVIDIA GPU found"),
        (machine(1), "1 CUDA GPU visible; training can use cuda:0..cuda:0."),
        (machine(3), "3 CUDA GPUs visible; training can use cuda:0..cuda:2."),
    ],
)  # fmt: skip
def test_the_summary_counts_the_gpus_or_names_why_there_is_none(inv, reason):
    if inv.usable_gpu_count:
        assert inv.summary() == reason
    else:
        assert no_gpu_reason(inv) == reason
        assert inv.summary() == f"No usable GPU: {reason}; training will use the CPU."


def test_probe_torch_counts_without_initialising_cuda_unless_asked_for_uuids(monkeypatch, use_fake):
    import torch

    probe, calls = inventory_module.probe_torch, []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.append("count") or 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append("available") or True)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    props = lambda i: calls.append(f"props {i}") or SimpleNamespace(uuid=f"u{i}", name=f"G{i}")  # noqa: E731
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    use_fake(FakeNvml(1, clock=lambda: 0.0))
    inventory_module.forget_readings()
    cached_inventory()  # device resolution
    inv = collect_inventory(env={"CUDA_VISIBLE_DEVICES": "0"}, probe_uuids=False)  # the sweep's
    assert calls == ["count", "count"] and inv.cuda_visible_devices == "0"
    assert inv.torch == probe(uuids=False) == TorchCuda(True, 1, version="12.4", mps_available=True)
    assert collect_inventory(env={}).torch == TorchCuda(True, 1, ("u0",), ("G0",), "12.4", True)
    assert calls[3:] == ["available", "count", "props 0"]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(name="L4"))
    assert probe().uuids == ("",)  # no uuid in old torch's properties
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe() == TorchCuda(version="12.4", mps_available=True)  # a Mac
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert probe() == probe(uuids=False) == TorchCuda(version="12.4")
    inventory_module.forget_readings()


# ------------------------------------------------------------------------- parse_devices
ACCEPTED = "use a count ≥ 1, -1 (all), 'auto', or GPU indices such as [0,1] or '0,1'"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", "auto"), ("AUTO", "auto"), (1, 1), (2, 2), ("2", 2), (-1, -1), (" -1 ", -1),
        ([0, 2], [0, 2]), ((1,), [1]), ((0, 2), [0, 2]), ("0,1", [0, 1]), ("[0,1]", [0, 1]),
        ("[ 3 ]", [3]), ("[2]", [2]), ("1,", [1]), ("0,1,", [0, 1]), (OmegaConf.create([2, 0]), [2, 0]),
        *[(v, DeviceError(f"devices={v!r} is not valid; {ACCEPTED}"))
          for v in (0, -2, True, False, 1.0, 1.5, None, "two", "0,a", "[1,-1]", "1,,2",
                    "[]", "0,1]", "[0,1")],
        *[(v, DeviceError(f"devices={list(v)!r} is not valid; {ACCEPTED}")) for v in ([0, -1], [1, True], [-1])],
        *[(v, DeviceError(f"devices={int(v)} is not valid; {ACCEPTED}")) for v in ("0", "-2")],
        ([], DeviceError("devices=[] lists no GPU; use a count or at least one index")),
        ([1, 1], DeviceError("devices=[1, 1] names a GPU twice; each index may appear once")),
        ("[1,1]", DeviceError("devices='[1,1]' names a GPU twice; each index may appear once")),
    ],
)  # fmt: skip
def test_parse_devices_takes_what_users_type_and_refuses_the_rest_in_one_line(value, expected):
    if isinstance(expected, DeviceError):
        assert error(parse_devices, value) == str(expected)
    else:
        assert parse_devices(value) == expected


# ------------------------------------------------------------------------- resolve_devices
CPU_ONLY = build_inventory(None, TorchCuda(), env={}, nvml_reason="NVML is not available (x)")
MAC = build_inventory(None, TorchCuda(mps_available=True), env={})
BANANA = build_inventory(None, TorchCuda(), env={"CUDA_VISIBLE_DEVICES": "banana,,7"}, nvml_reason="x")  # fmt: skip
BANANA_WHY = (
    "CUDA_VISIBLE_DEVICES='banana,,7' hides every GPU: its first entry 'banana' is not a GPU "
    "index or UUID, and CUDA ignores the list from its first invalid entry on"
)
ACCELERATOR = object()  # an Accelerator instance passes through


def visible(n: int) -> str:
    return f"only {n} GPU{'s are' if n != 1 else ' is'} visible"


CANNOT = [
    ("gpu", 4, machine(2), f"devices=4 asks for 4 GPUs, but {visible(2)} (cuda:0 H100, cuda:1 H100)"),
    ("gpu", 2, machine(1), f"devices=2 asks for 2 GPUs, but {visible(1)} (cuda:0 H100)"),
    ("Cuda", 5, machine(4), f"devices=5 asks for 5 GPUs, but {visible(4)} (cuda:0 H100, cuda:1 H100, cuda:2 H100, cuda:3 H100)"),
    ("gpu", 6, machine(5), f"devices=6 asks for 6 GPUs, but {visible(5)} (cuda:0..cuda:4)"),
    ("gpu", 6, machine(1, 5), f"devices=6 asks for 6 GPUs, but {visible(5)} (cuda:0..cuda:4)"),  # names known for one
    ("gpu", 2, machine(0, 1), f"devices=2 asks for 2 GPUs, but {visible(1)} (cuda:0..cuda:0)"),
    ("auto", [0, 2], machine(2), f"devices=[0, 2] names GPU 2, but {visible(2)} (cuda:0 H100, cuda:1 H100)"),
    ("gpu", [0, 2, 3], machine(2), f"devices=[0, 2, 3] names GPU 2, 3, but {visible(2)} (cuda:0 H100, cuda:1 H100)"),
    *[(acc, 1, CPU_ONLY,
       f"accelerator={acc} asks for a GPU, but this machine has no usable GPU (NVML is not "
       "available (x)); use accelerator=cpu or accelerator=auto") for acc in ("gpu", "cuda", "GPU")],
    ("gpu", 1, MAC, "accelerator=gpu asks for a GPU, but this machine has no usable GPU (no NVIDIA GPU found); use accelerator=cpu or accelerator=auto"),
    ("gpu", 1, BANANA,
     f"accelerator=gpu asks for a GPU, but this machine has no usable GPU ({BANANA_WHY}); "
     "set CUDA_VISIBLE_DEVICES to GPU indices or UUIDs (e.g. 0,1) or unset it"),
    ("auto", "0,1", CPU_ONLY, "devices=[0, 1] lists GPU indices, but this run uses the CPU, where devices is a process count (an integer ≥ 1 or 'auto')"),
    ("cpu", [0], None, "devices=[0] lists GPU indices, but this run uses the CPU, where devices is a process count (an integer ≥ 1 or 'auto')"),
    ("cpu", -1, None, "devices=-1 means 'every GPU' and has no meaning with accelerator=cpu; use a process count ≥ 1 or 'auto'"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("accelerator", "devices", "inv", "expected"),
    [
        ("auto", "auto", CPU_ONLY, (("cpu", "auto"), [], "No usable GPU: NVML is not available (x); this run uses the CPU.")),
        ("auto", 3, CPU_ONLY, (("cpu", 3), [], "No usable GPU: NVML is not available (x); this run uses the CPU.")),
        ("auto", -1, CPU_ONLY, (("cpu", "auto"), [], "No usable GPU: NVML is not available (x); this run uses the CPU.")),
        ("auto", 2, machine(0), (("cpu", 2), [], "No usable GPU: no NVIDIA GPU found; this run uses the CPU.")),
        ("auto", "auto", BANANA, (("cpu", "auto"), [], f"No usable GPU: {BANANA_WHY}; this run uses the CPU.")),
        ("auto", 1, MAC, (("auto", 1), [], None)),
        ("mps", 1, CPU_ONLY, (("mps", 1), [], None)),
        (ACCELERATOR, 2, machine(2), ((ACCELERATOR, 2), [], None)),
        ("cpu", 4, None, (("cpu", 4), [], None)),
        (" CPU ", 2, None, ((" CPU ", 2), [], None)),
        ("auto", "auto", machine(2), (("auto", "auto"), ["GPU-0000", "GPU-0001"], None)),
        ("Auto", 1, machine(1), (("Auto", 1), ["GPU-0000"], None)),
        ("gpu", -1, machine(2), (("gpu", -1), ["GPU-0000", "GPU-0001"], None)),
        ("cuda", 2, machine(2), (("cuda", 2), ["GPU-0000", "GPU-0001"], None)),
        ("gpu", "[1,0]", machine(2), (("gpu", [1, 0]), ["GPU-0001", "GPU-0000"], None)),
        ("gpu", [1], machine(2), (("gpu", [1]), ["GPU-0001"], None)),
        # torch sees one more device than the rules place: the plan names those it knows
        ("gpu", [0, 2], machine(2, 3), (("gpu", [0, 2]), ["GPU-0000"], None)),
        *[(acc, devices, inv, DeviceError(message)) for acc, devices, inv, message in CANNOT],
    ],
)  # fmt: skip
def test_what_the_trainer_gets_or_why_it_cannot_in_one_line(accelerator, devices, inv, expected):
    if isinstance(expected, DeviceError):
        assert error(resolve_devices, accelerator, devices, inventory=inv) == str(expected)
        return
    kwargs, gpus, message = expected
    plan = resolve_devices(accelerator, devices, inventory=inv)
    assert plan.trainer_kwargs() == dict(zip(("accelerator", "devices"), kwargs, strict=True))
    assert uuids(plan.gpus) == gpus and plan.message == message


def test_resolve_devices_defaults_to_auto_and_hands_out_fresh_lists():
    defaults = [resolve_devices(inventory=machine(n)).trainer_kwargs() for n in (0, 2)]
    assert defaults == [{"accelerator": a, "devices": "auto"} for a in ("cpu", "auto")]
    plan = resolve_devices("gpu", [0, 1], inventory=machine(2))
    plan.trainer_kwargs()["devices"].append(5)
    assert plan.devices == [0, 1] and plan.trainer_kwargs()["devices"] == [0, 1]
    assert error(resolve_devices, "cpu", 1, select="emptiest") == (
        "select_gpus='emptiest' is not valid; use one of first, least_used"
    )


# ------------------------------------------------------------------------- select_gpus=least_used
@pytest.mark.parametrize(("devices", "chosen"), [(2, [0, 1]), (-1, [0, 1, 2]), ("auto", [0, 1, 2])])
def test_least_used_is_left_to_the_run_which_measures_and_claims(devices, chosen):
    environ: dict[str, str] = {}  # the measured choice: test_gpu_claims (wait_and_claim)
    plan = resolve_devices("gpu", devices, select="least_used", inventory=machine(3), environ=environ)  # fmt: skip
    assert plan.trainer_kwargs() == {"accelerator": "gpu", "devices": chosen}
    assert uuids(plan.gpus) == [f"GPU-{i:04d}" for i in chosen]
    assert environ == {}  # deciding changes nothing; the run hands its choice on
    assert plan.claim == len(chosen)
    assert error(resolve_devices, "gpu", 4, select="least_used", inventory=machine(3), environ={}) == (
        f"devices=4 asks for 4 GPUs, but {visible(3)} (cuda:0 H100, cuda:1 H100, cuda:2 H100)"
    )  # fmt: skip


def rank0(gpus: list[int], request: str = "devices=2 CUDA_VISIBLE_DEVICES=None", **kw) -> dict:
    record = {"pid": os.getpid() + 1, "request": request, "gpus": gpus, **kw}
    return {SELECTION_ENV: json.dumps(record), "LOCAL_RANK": "1"}


def test_a_ddp_child_reuses_rank_zero_choice_despite_different_load():
    # a child (LOCAL_RANK set, the record from rank 0's pid) keeps [1, 2]; a fresh choice: [0, 1]
    moved = machine(3)
    assert resolve_devices("gpu", 2, select="least_used", inventory=moved, environ={}).devices == [0, 1]  # fmt: skip
    for accelerator in ("gpu", "cuda"):
        child = resolve_devices(accelerator, 2, select="least_used", inventory=moved, environ=rank0([1, 2]))  # fmt: skip
        assert child.trainer_kwargs() == {"accelerator": accelerator, "devices": [1, 2]}
        assert uuids(child.gpus) == ["GPU-0001", "GPU-0002"]
        assert child.message == "GPUs chosen by rank 0 (least used): [1, 2]"
        assert child.claim == 0  # a child claims nothing
    # Sequential runs in one process (Hydra multirun) leave LOCAL_RANK=0 and their own record.
    environ = {**rank0([1, 2]), "LOCAL_RANK": "0"}
    environ[SELECTION_ENV] = environ[SELECTION_ENV].replace(str(os.getpid() + 1), str(os.getpid()))
    assert resolve_devices("gpu", 2, select="least_used", inventory=moved, environ=environ).devices == [0, 1]  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        (rank0([2], "devices=1 CUDA_VISIBLE_DEVICES=None"),
         f"{SELECTION_ENV} holds rank 0's GPU choice for 'devices=1 CUDA_VISIBLE_DEVICES=None', but "
         f"this process asks 'devices=2 CUDA_VISIBLE_DEVICES=None'; unset {SELECTION_ENV} and start again"),
        (rank0([0, 3]), f"rank 0 chose GPUs [0, 3] ({SELECTION_ENV}), but {visible(3)} (cuda:0 H100, cuda:1 H100, cuda:2 H100) in this process"),
        ({"LOCAL_RANK": "2"},
         f"select_gpus=least_used cannot coordinate processes started by an external launcher "
         f"(LOCAL_RANK=2 is set but {SELECTION_ENV} is not); pin GPUs with CUDA_VISIBLE_DEVICES or use select_gpus=first"),
        *[({SELECTION_ENV: text, "LOCAL_RANK": "1"},
           f"{SELECTION_ENV}={text!r} is not a GPU choice written by this template; unset it")
          for text in ['{"pid": "1", "request": "r", "gpus": [0]}', '{"pid": 1, "request": 5, "gpus": [0]}',
                       '{"pid": 1, "request": "r", "gpus": "0"}', '{"pid": 1, "request": "r", "gpus": []}',
                       '{"pid": 1, "request": "r", "gpus": [0, 0]}', '{"pid": 1, "request": "r", "gpus": [-1]}',
                       '{"pid": 1, "request": "r", "gpus": [true]}', "[1, 2]", "not json"]],
    ],
)  # fmt: skip
def test_a_child_that_cannot_use_rank_zero_choice_stops_in_one_line(environ, message):
    got = error(
        resolve_devices, "gpu", 2, select="least_used", inventory=machine(3), environ=environ
    )
    assert got == message


# ------------------------------------------------------------------------- once per job
QUICK = SelectionPolicy(util_window_s=0.01)


@pytest.fixture
def gpu_box(monkeypatch, tmp_path, use_fake):
    """Three GPUs (GPU 0 busy) that torch pretends to see; claims in a lock dir of the test's own."""
    lib = use_fake(make_fake({0: (40, 10)}))
    claims.finish_job()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setattr(inventory_module, "probe_torch", lambda uuids=True: TorchCuda(True, 3))
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LOCAL_RANK", SELECTION_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(nvml.BACKEND_ENV, raising=False)
    yield lib
    claims.finish_job()


@pytest.mark.parametrize("select", ["first", "least_used"])
def test_checks_change_nothing_and_only_the_run_claims_and_hands_over(gpu_box, select):
    from runkit.run.preflight import check_devices

    cfg = OmegaConf.create({"trainer": {"accelerator": "gpu", "devices": 2}, "select_gpus": select})
    before = dict(os.environ)
    check_devices(cfg)  # the preflight Hydra callback, then again in the job
    check_devices(cfg)
    assert dict(os.environ) == before and claims.claimed_uuids() == ()
    assert gpu_box.calls["nvmlInit"] == 1  # NVML read once per job
    environ: dict[str, str] = {}
    plan = resolve_for_run("gpu", 2, select=select, policy=QUICK, environ=environ)
    # a plain request reads no load; neither reads temperatures or process names
    assert ("nvmlDeviceGetMemoryInfo" in gpu_box.calls) == (select == "least_used")
    assert not {"nvmlDeviceGetTemperature", "nvmlDeviceGetComputeRunningProcesses"} & set(gpu_box.calls)  # fmt: skip
    if select == "least_used":
        assert plan.devices == [1, 2] and json.loads(environ[SELECTION_ENV]) == {
            "pid": os.getpid(), "request": "devices=2 CUDA_VISIBLE_DEVICES=None", "gpus": [1, 2]
        }  # fmt: skip
        assert set(claims.claimed_uuids()) == {UUID1, UUID2}
        quiet: dict[str, str] = {}
        resolve_for_run("gpu", 1, environ=quiet)  # gives the claims back, claims nothing
        assert quiet == {} and claims.claimed_uuids() == ()
    else:
        assert plan.devices == 2 and environ == {} and claims.claimed_uuids() == ()
    assert gpu_box.balanced


def test_the_end_of_a_job_gives_back_its_gpus_and_the_next_job_measures_anew(gpu_box, monkeypatch):
    assert resolve_for_run("cpu", 2).devices == 2  # CPU and other accelerators never touch NVML
    assert resolve_devices("mps", 1).accelerator == "mps" and gpu_box.total_calls() == 0
    monkeypatch.setenv(SELECTION_ENV, "")  # by default the choice goes to os.environ
    assert resolve_for_run("gpu", 1, select="least_used", policy=QUICK).devices == [1]
    assert claims.claimed_uuids() == (UUID1,) and json.loads(os.environ[SELECTION_ENV])["gpus"] == [
        1
    ]
    gpu_box.gpus[1].memory_used = 70 * GIB  # between two jobs of a sweep the load moves
    claims.finish_job()  # what the Hydra entry point does after every job
    assert claims.claimed_uuids() == ()
    assert resolve_for_run("gpu", 1, select="least_used", policy=QUICK, environ={}).devices == [2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")  # the kept reading follows the variable
    assert uuids(resolve_devices("gpu", 2).gpus) == [UUID2, UUID0]
    gpu_box.gpus[0].lose(0.0)
    claims.finish_job()
    for _ in range(2):  # the kept reading keeps its driver version and notes too
        inv = cached_inventory()
        assert inv.driver_version == "570.133.20" and len(inv.physical) == 4
        assert "NVML cannot open GPU 0 (GPU is lost); it is listed without details." in inv.notes
    nvml.use_library(FakeNvml(3, driver_version="580.1"))  # another library is read afresh
    assert len(cached_inventory().physical) == 3 and cached_inventory().driver_version == "580.1"


@pytest.mark.slow
def test_a_variable_that_hides_every_gpu_sends_the_run_to_the_cpu(monkeypatch, tmp_path, caplog):
    # accelerator=gpu with it is refused in one line: test_bad_inputs (cuda-visible-devices-garbage)
    from runkit.run import builders

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "banana,,7")
    monkeypatch.delenv(nvml.BACKEND_ENV, raising=False)
    monkeypatch.setattr(builders.log, "disabled", False)
    nvml.use_library(None)
    inventory_module.forget_readings()
    cfg = compose_train()
    with open_dict(cfg):
        del cfg["hydra"]  # what a run's config.yaml holds
    with caplog.at_level(logging.INFO, logger=builders.__name__):
        trainer = builders.run_trainer(cfg, tmp_path)
    assert f"No usable GPU: {BANANA_WHY}; this run uses the CPU." in caplog.messages
    assert type(trainer.accelerator).__name__ == "CPUAccelerator"  # metrics.json's "accelerator"
    inventory_module.forget_readings()
