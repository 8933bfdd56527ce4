"""``python -m runkit.devices``: the listing, ``--json``, the no-GPU line, and (on a machine with
a GPU) agreement with what CUDA itself reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import prewarmed
from runkit.gpus import inventory, nvml
from runkit.gpus.inventory import build_inventory, collect_inventory, read_nvml
from runkit.gpus.listing import main
from runkit.gpus.records import TorchCuda
from runkit.gpus.resolve import SELECTION_ENV, resolve_devices
from runkit.gpus.visible import apply_visible_devices
from runkit.testing.fake_nvml import GIB, FakeGpu, FakeNvml, FakeProcess

UUID0 = "GPU-aaaa1111-1111-1111-1111-111111111111"
UUID1 = "GPU-bbbb2222-2222-2222-2222-222222222222"
UUID2 = "GPU-cccc3333-3333-3333-3333-333333333333"
MIG = "MIG-dddd4444-4444-4444-4444-444444444444"

JSON_KEYS = {
    "schema_version",
    "cuda_available",
    "device_count",
    "training_device",
    "message",
    "nvml",
    "cuda_visible_devices",
    "cuda_device_order",
    "index_mapping",
    "gpus",
    "hidden_gpus",
    "notes",
}
GPU_KEYS = {
    "index",
    "nvml_index",
    "name",
    "uuid",
    "mig",
    "parent_uuid",
    "memory_used_mib",
    "memory_total_mib",
    "memory_free_mib",
    "utilization_percent",
    "temperature_c",
    "power_w",
    "power_limit_w",
    "processes",
}

# The same machine as JSON for subprocesses: three GPUs and an A100 split into one MIG slice.
SCENARIO = {
    "gpus": [
        {
            "uuid": UUID0,
            "memory_used": 30 * GIB,
            "util_gpu": 80,
            "processes": [{"pid": 777, "used_memory": 30 * GIB}],
        },
        {"uuid": UUID1, "memory_used": 1 * GIB, "util_gpu": 5},
        {"uuid": UUID2, "memory_used": 1 * GIB, "util_gpu": 50},
        {"name": "NVIDIA A100-SXM4-80GB", "mig": [{"uuid": MIG, "memory_total": 10 * GIB}]},
    ]
}


def fake_env(scenario: dict | None = SCENARIO, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LOCAL_RANK")}
    env.pop(SELECTION_ENV, None)
    env["RUNKIT_NVML_BACKEND"] = "runkit.testing.fake_nvml:create"
    env["RUNKIT_FAKE_NVML"] = json.dumps(scenario)
    env.update(extra)
    return env


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return prewarmed.run(
        [sys.executable, "-m", "runkit.devices", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
def machine(monkeypatch):
    """The fake NVML in-process, torch pretending to see the GPUs CUDA_VISIBLE_DEVICES leaves."""
    lib = FakeNvml(
        [
            FakeGpu(uuid=UUID0, memory_used=10 * GIB, processes=[FakeProcess(4242, 3 * GIB)]),
            FakeGpu(uuid=UUID1),
            FakeGpu(uuid=UUID2, util_gpu=37),
        ],
        clock=lambda: 0.0,
    )
    nvml.use_library(lib)
    monkeypatch.setenv("COLUMNS", "250")  # keep Rich from folding UUIDs in the captured table
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.setattr(inventory, "probe_torch", lambda uuids=True: TorchCuda(True, 2))
    yield lib
    nvml.use_library(None)


def test_json_output_has_the_documented_keys_and_indices(machine, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert main(["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == JSON_KEYS and doc["schema_version"] == 1
    assert (doc["cuda_available"], doc["device_count"], doc["training_device"]) == (True, 2, "cuda")
    assert doc["index_mapping"] == "env-rules" and doc["cuda_visible_devices"] == "2,0"
    assert [(g["index"], g["nvml_index"], g["uuid"]) for g in doc["gpus"]] == [
        (0, 2, UUID2),
        (1, 0, UUID0),
    ]
    assert all(set(g) == GPU_KEYS for g in doc["gpus"] + doc["hidden_gpus"])
    assert doc["gpus"][0]["utilization_percent"] == 37
    assert doc["gpus"][1]["memory_used_mib"] == 10240
    assert doc["gpus"][1]["processes"] == [{"pid": 4242, "used_memory_mib": 3072, "name": None}]
    assert [(g["index"], g["uuid"]) for g in doc["hidden_gpus"]] == [(None, UUID1)]
    assert doc["nvml"] == {"available": True, "reason": None, "driver_version": "570.133.20"}
    assert machine.balanced


def test_human_listing_shows_cuda_indices_and_processes(machine, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc,GPU-aaaa")
    assert main([]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│ cuda:")]
    assert len(rows) == 2
    assert "cuda:0" in rows[0] and UUID2 in rows[0] and "37%" in rows[0]
    assert "cuda:1" in rows[1] and UUID0 in rows[1] and "4242 (3072 MiB)" in rows[1]
    assert "CUDA available: yes (2 device(s))" in out
    assert f"not visible to CUDA here: NVML GPU 1 NVIDIA H100 80GB HBM3 {UUID1}" in out


@pytest.mark.parametrize(
    ("fake", "reason"),
    [
        (
            lambda: FakeNvml(2, init_error="library_not_found"),
            "NVML is not available (NVML Shared Library Not Found)",
        ),
        (lambda: FakeNvml(0), "no NVIDIA GPU found"),
    ],
    ids=["no-nvml", "no-gpu"],
)
def test_no_usable_gpu_is_one_line_and_exit_zero(monkeypatch, capsys, fake, reason):
    nvml.use_library(fake())
    monkeypatch.setenv("COLUMNS", "40")  # the line must not be wrapped even on a narrow terminal
    monkeypatch.setattr(inventory, "probe_torch", lambda uuids=True: TorchCuda())
    try:
        assert main([]) == 0
    finally:
        nvml.use_library(None)
    assert capsys.readouterr().out == (f"No usable GPU: {reason}; training will use the CPU.\n")


def test_empty_cuda_visible_devices_is_one_line(machine, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setattr(inventory, "probe_torch", lambda uuids=True: TorchCuda())
    assert main([]) == 0
    assert capsys.readouterr().out == (
        "No usable GPU: CUDA_VISIBLE_DEVICES is set to an empty string; "
        "training will use the CPU.\n"
    )


def test_module_import_stays_light():
    code = (
        "import sys, runkit.devices, runkit.gpus.resolve; "
        "print(sorted({'torch', 'lightning', 'rich'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _skip_if_torch_sees_a_real_gpu() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a real GPU, so its UUIDs (not the fake NVML) decide cuda:N")


@pytest.mark.slow
def test_cli_subprocess_json_with_the_fake_follows_cuda_visible_devices():
    _skip_if_torch_sees_a_real_gpu()
    result = run_cli("--json", env=fake_env(CUDA_VISIBLE_DEVICES="3,2,0,-1,1"))
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert [(g["index"], g["nvml_index"], g["uuid"], g["mig"]) for g in doc["gpus"]] == [
        (0, 3, MIG, True),
        (1, 2, UUID2, False),
        (2, 0, UUID0, False),
    ]
    assert doc["gpus"][2]["processes"] == [{"pid": 777, "used_memory_mib": 30720, "name": None}]
    assert [g["uuid"] for g in doc["hidden_gpus"]] == [UUID1]
    assert any("'-1,1' is ignored" in note for note in doc["notes"])
    assert doc["cuda_available"] is False and doc["training_device"] == "cpu"
    assert doc["index_mapping"] == "env-rules"


@pytest.mark.slow
def test_cli_subprocess_human_table_with_the_fake():
    _skip_if_torch_sees_a_real_gpu()
    result = run_cli(env=fake_env(CUDA_VISIBLE_DEVICES="1,2", COLUMNS="250"))
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ cuda:")]
    assert [row.split()[1] for row in rows] == ["cuda:0", "cuda:1"]
    assert UUID1 in rows[0] and UUID2 in rows[1]


@pytest.mark.slow
def test_cli_subprocess_without_nvml_prints_one_line():
    env = fake_env({"init_error": "driver_not_loaded"})
    result = run_cli(env=env)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    if lines[0].startswith("No usable GPU"):  # torch without CUDA too
        assert lines == [
            "No usable GPU: NVML is not available (Driver Not Loaded); training will use the CPU."
        ]
    doc = json.loads(run_cli("--json", env=env).stdout)
    assert doc["nvml"]["available"] is False and doc["nvml"]["reason"].endswith(
        "(Driver Not Loaded)"
    )


@pytest.mark.slow
def test_ddp_child_process_reuses_rank_zero_choice():
    # Rank 0 measures the fake machine and chooses the two least used GPUs (1 and 2) ...
    nvml.use_library(FakeNvml.from_dict(SCENARIO, clock=lambda: 0.0))
    try:
        inv = collect_inventory(
            torch_info=TorchCuda(True, 3), env={"CUDA_VISIBLE_DEVICES": "0,1,2"}
        )
        plan = resolve_devices("gpu", 2, select="least_used", inventory=inv, environ={})
    finally:
        nvml.use_library(None)
    assert plan.devices == [1, 2] and plan.handoff is not None
    # ... then a child (another pid, LOCAL_RANK=1, as Lightning's launcher starts it) sees a machine
    # where GPU 0 has become the emptiest, and still gets rank 0's choice.
    moved = {"gpus": [{"uuid": UUID0}, {"uuid": UUID1, "memory_used": 50 * GIB}, {"uuid": UUID2}]}
    code = (
        "import json\n"
        "from runkit.gpus.inventory import collect_inventory\n"
        "from runkit.gpus.records import TorchCuda\n"
        "from runkit.gpus.resolve import resolve_devices, select_least_used\n"
        "inv = collect_inventory(torch_info=TorchCuda(True, 3))\n"
        "fresh = select_least_used(inv.visible, 2)\n"
        "plan = resolve_devices('gpu', 2, select='least_used', inventory=inv)\n"
        "print(json.dumps([fresh, plan.devices]))\n"
    )
    env = fake_env(moved, CUDA_VISIBLE_DEVICES="0,1,2", LOCAL_RANK="1")
    env[SELECTION_ENV] = plan.handoff  # what resolve_for_run hands to the ranks it launches
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    fresh, chosen = json.loads(result.stdout)
    assert fresh == [0, 2]  # what the child would have picked on its own
    assert chosen == [1, 2]


# ------------------------------------------------------------------------- real GPU


def _cuda_or_skip():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False")
    return torch


@pytest.mark.gpu
def test_listing_matches_torch_on_a_real_gpu():
    torch = _cuda_or_skip()
    inv = collect_inventory()
    assert inv.nvml_available, inv.nvml_reason
    assert inv.mapping == "torch-uuid"
    assert inv.usable_gpu_count == torch.cuda.device_count() == len(inv.visible)
    for i, gpu in enumerate(inv.visible):
        props = torch.cuda.get_device_properties(i)
        assert gpu.name == props.name
        assert nvml.bare_uuid(gpu.uuid) == nvml.bare_uuid(str(props.uuid))
        assert gpu.memory_total_mib is not None
        assert abs(gpu.memory_total_mib * 2**20 - props.total_memory) < 0.05 * props.total_memory
    # Without torch's UUIDs, CUDA's rules applied to NVML give the same cuda:N order.
    by_rules = build_inventory(list(inv.physical), TorchCuda(True, len(inv.visible)))
    if not any("FASTEST_FIRST" in note for note in by_rules.notes):
        assert [g.uuid for g in by_rules.visible] == [g.uuid for g in inv.visible]


@pytest.mark.gpu
@pytest.mark.slow
def test_cuda_visible_devices_rules_match_real_cuda():
    _cuda_or_skip()
    physical, _, _ = read_nvml()
    if any(g.mig_enabled for g in physical):
        pytest.skip("MIG mode: CUDA's MIG enumeration differs between driver releases")
    first = physical[0].uuid
    n = len(physical)
    values = ["0", "", "-1", "0,-1", f"{n}", f"{n},0", "0,0", "0x", first, first[:12], "GPU-zz"]
    if n > 1:
        values += ["1,0", f"1,{first[:12]}", f"0,{n},1"]
    code = "import torch; print(torch.cuda.device_count())"
    for value in values:
        env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
        env.update(CUDA_VISIBLE_DEVICES=value, CUDA_DEVICE_ORDER="PCI_BUS_ID")
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
        )
        predicted, _ = apply_visible_devices(physical, value, "PCI_BUS_ID")
        assert int(out.stdout.strip()) == len(predicted), f"CUDA_VISIBLE_DEVICES={value!r}"


@pytest.mark.gpu
@pytest.mark.slow
def test_cli_json_on_a_real_gpu_names_the_gpu_torch_sees():
    torch = _cuda_or_skip()
    env = {k: v for k, v in os.environ.items() if k not in ("RUNKIT_NVML_BACKEND",)}
    env["CUDA_VISIBLE_DEVICES"] = str(torch.cuda.device_count() - 1)
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    result = run_cli("--json", env=env)
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["device_count"] == 1 and doc["index_mapping"] == "torch-uuid"
    physical, _, _ = read_nvml()
    assert doc["gpus"][0]["uuid"] == physical[-1].uuid
