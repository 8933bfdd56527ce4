"""Run ``runkit.devices`` and nvitop on the same faked GPUs and print where they differ.

Issue #10, item 10 asks whether the GPU code (now ``runkit.gpus``) should give way to nvitop (which re-exports
``parse_cuda_visible_devices``, ``Device``/``CudaDevice`` and ``select_devices``). This script is
the evidence: both implementations read the *same* :class:`runkit.testing.fake_nvml.FakeNvml`, so
every difference in the tables is a difference in rules, not in data. ``docs/design/notes.md``
records the decisions; ``nvitop_comparison.txt`` beside this file is its output.

How to run (nvitop must not go into the project's own venv; it needs no torch)::

    python3 -m venv /tmp/nvitop-venv
    /tmp/nvitop-venv/bin/pip install nvitop==1.7.2       # pulls nvidia-ml-py and psutil only
    TORCH_PYTHON=.venv/bin/python PYTHONPATH=src /tmp/nvitop-venv/bin/python \
        docs/design/nvitop_comparison.py > docs/design/nvitop_comparison.txt

(from the repository root; leave out ``TORCH_PYTHON=...`` to skip the torch column). It takes
10-40 s and needs no GPU. One selection row ("GPU0 memory NotSupported") depends on the host's
RAM, because nvitop then reads host memory as the GPU's.

Optional third opinion: ``TORCH_PYTHON=.venv/bin/python`` (any interpreter with torch) adds a
column with torch's own NVML-based parser (``torch.cuda._parse_visible_devices`` and
``_transform_uuid_to_ordinals``, private API, checked with torch 2.13), which encodes CUDA's
undocumented rules (duplicates, ``strtoul``-style ordinals, ambiguous prefixes).

How nvitop is pointed at the fake (least invasive way found):

* ``nvitop.api.libnvml`` copies pynvml's functions into its own module at import time and every
  ``Device`` query goes through ``libnvml.nvmlQuery('nvmlDeviceGet...')``, which looks the name
  up on ``libnvml``; so each ``nvml*`` function is replaced *on libnvml* with the fake's bound
  method, and ``pynvml.nvmlInitWithFlags``/``nvmlShutdown`` (which libnvml calls directly) with the
  fake's. nvitop's own wrappers (``nvmlQuery``, ``nvmlCheckReturn`` ...) stay untouched.
* ``parse_cuda_visible_devices`` first asks the CUDA driver in a child interpreter
  (``subprocess.check_output([sys.executable, '-c', ...])`` which ``cuInit``s in a spawned
  process, so the caller's CUDA stays uninitialised). The fake cannot live in that child, so the
  script replaces ``nvitop.api.device.subprocess`` with a stub: by default it fails as it does on
  a machine without a CUDA driver (nvitop then applies its own NVML-based rules, the code
  comparable to ours); section 2 makes it answer like a driver would, to show what nvitop does
  with the driver's answer.
* nvitop caches the physical-device list and the parse results; both caches and libnvml's
  "initialised" flag are reset for each fake machine.

The MIG slices carry GPU/compute instance ids (the fake's ``gpu_instance_id``/
``compute_instance_id``), which the legacy ``MIG-GPU-<uuid>/<gi>/<ci>`` form needs. Our MIG rule
follows NVML's driver version, so the MIG section runs twice: an R570 driver and an R535 one.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import nvitop
import pynvml
from nvitop.api import device as nv_device
from nvitop.api import libnvml
from nvitop.select import select_devices


def _first_module(*names: str) -> Any:
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} is importable; is PYTHONPATH the project's src?")


def _merged(*names: str) -> SimpleNamespace:
    """The names defined in every importable module in ``names`` (earlier ones win), so the script
    keeps working while the GPU code moves between modules (``runkit.devices`` before the
    "two zones" restructure, ``runkit.gpus.*`` after it)."""
    merged: dict[str, Any] = {}
    for name in reversed(names):
        try:
            merged.update(vars(importlib.import_module(name)))
        except ImportError:
            continue
    return SimpleNamespace(**merged)


nvml = _first_module("runkit.gpus.nvml", "project.nvml")
fake_nvml = _first_module("runkit.testing.fake_nvml", "project.testing.fake_nvml")
devices = _merged(
    "runkit.gpus.inventory",
    "runkit.gpus.resolve",
    "runkit.gpus.claims",
    "runkit.gpus.visible",
    "runkit.devices",
)

GIB, FakeGpu, FakeNvml = fake_nvml.GIB, fake_nvml.FakeGpu, fake_nvml.FakeNvml

# The fake lacks some queries nvitop's snapshots make (encoder use, BAR1 ...); nvitop logs each
# FunctionNotFound with a traceback. Quiet, since the values involved are not compared here.
libnvml.LOGGER.setLevel(logging.CRITICAL)


# --------------------------------------------------------------------------------------------
# The fake, and pointing both implementations at it


_OWN = {
    "nvmlInit",
    "nvmlInitWithFlags",
    "nvmlShutdown",
    "nvmlQuery",
    "nvmlQueryFieldValues",
    "nvmlCheckReturn",
}
_REAL_SUBPROCESS = nv_device.subprocess
# What the stubbed "CUDA driver" child prints (UUIDs); None: no driver, the child fails.
_cuda_answer: list[str] | None = None


def _fake_check_output(*args: Any, **kwargs: Any) -> str:
    if _cuda_answer is None:
        raise subprocess.CalledProcessError(1, "python -c cuInit", "no CUDA driver (stub)")
    return ",".join(u.split("-", 1)[1] for u in _cuda_answer) + "\n"


def use_machine(fake: FakeNvml) -> None:
    """Point ours (``nvml.use_library``) and nvitop (libnvml attributes) at ``fake``."""
    nvml.use_library(fake)
    pynvml.nvmlInitWithFlags = fake.nvmlInitWithFlags
    pynvml.nvmlShutdown = fake.nvmlShutdown
    for name in dir(pynvml):
        if name.startswith("nvml") and name not in _OWN and callable(getattr(pynvml, name)):
            setattr(libnvml, name, getattr(fake, name))
    state = vars(libnvml)
    state["__flags"], state["__initialized"] = [], False  # forget the previous fake's init
    nv_device._PHYSICAL_DEVICE_ATTRS = None
    nv_device._parse_cuda_visible_devices.cache_clear()
    nv_device.subprocess = SimpleNamespace(
        check_output=_fake_check_output,
        SubprocessError=_REAL_SUBPROCESS.SubprocessError,
        DEVNULL=_REAL_SUBPROCESS.DEVNULL,
    )


def set_env(cvd: str | None, order: str | None) -> None:
    for key, value in (("CUDA_VISIBLE_DEVICES", cvd), ("CUDA_DEVICE_ORDER", order)):
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    nv_device._parse_cuda_visible_devices.cache_clear()


# --------------------------------------------------------------------------------------------
# The fake machines

UUIDS = [
    "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6",  # shares "GPU-8932f93" with the next one
    "GPU-8932f93a-0b1c-4d2e-8f30-415263748596",
    "GPU-1b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d",
    "GPU-c08d91cb-e324-655c-71ba-7570956445bc",
]


def four_gpus(**per_gpu: list[Any]) -> FakeNvml:
    gpus = []
    for i, uuid in enumerate(UUIDS):
        extra = {k: v[i] for k, v in per_gpu.items()}
        gpus.append(FakeGpu(uuid=uuid, pci_bus_id=f"00000000:{0x17 + 0x10 * i:02X}:00.0", **extra))
    return FakeNvml(gpus)


def mig(gi: int, ci: int, uuid: str) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA A100-SXM4-80GB MIG 1g.10gb",
        uuid=uuid,
        memory_total=10 * GIB,
        gpu_instance_id=gi,
        compute_instance_id=ci,
    )


MIG_UUIDS = [
    "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f",  # GPU 0, GI 1 CI 0
    "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb",  # GPU 0, GI 2 CI 0
    "MIG-0c757cd7-e942-5726-a0b8-0e8fb7067135",  # GPU 2, GI 3 CI 0
    "MIG-703fb6ed-3fa0-5e48-8e65-1c5bdcfe2202",  # GPU 2, GI 3 CI 1 (same GI: two CIs)
]


def mig_machine(driver: str = "570.133.20") -> FakeNvml:
    """``driver`` decides our MIG rule (R570+: one CI per GI; before: one MIG device in all)."""
    a100 = "NVIDIA A100-SXM4-80GB"
    return FakeNvml(
        [
            FakeGpu(
                name=a100, uuid=UUIDS[0], mig=[mig(1, 0, MIG_UUIDS[0]), mig(2, 0, MIG_UUIDS[1])]
            ),
            FakeGpu(name=a100, uuid=UUIDS[2], mig_capable=True),  # MIG-capable, MIG off
            FakeGpu(
                name=a100, uuid=UUIDS[3], mig=[mig(3, 0, MIG_UUIDS[2]), mig(3, 1, MIG_UUIDS[3])]
            ),
        ],
        driver_version=driver,
    )


def mixed_machine(swap_bus: bool = False) -> FakeNvml:
    """NVML GPU 0 is a T4, GPU 1 an H100 (the faster one); ``swap_bus`` puts GPU 1 first on PCI."""
    buses = (
        ["00000000:27:00.0", "00000000:17:00.0"]
        if swap_bus
        else ["00000000:17:00.0", "00000000:27:00.0"]
    )
    return FakeNvml(
        [
            FakeGpu(name="Tesla T4", uuid=UUIDS[0], pci_bus_id=buses[0], memory_total=16 * GIB),
            FakeGpu(name="NVIDIA H100 80GB HBM3", uuid=UUIDS[2], pci_bus_id=buses[1]),
        ]
    )


# --------------------------------------------------------------------------------------------
# Running both sides


def nvml_key(gpu: devices.Gpu) -> int | tuple[int, int]:
    return (gpu.nvml_index, gpu.mig_index) if gpu.is_mig else gpu.nvml_index  # type: ignore[return-value]


def ours_parse(cvd: str | None, order: str | None) -> tuple[list[Any], list[str]]:
    physical, driver, _notes = devices.read_nvml()
    visible, notes = devices.apply_visible_devices(physical, cvd, order, driver)
    return [nvml_key(g) for g in visible], notes


def nvitop_parse(cvd: str | None, order: str | None) -> list[Any]:
    set_env(cvd, order)
    try:
        return list(nv_device.parse_cuda_visible_devices(cvd))
    except Exception as err:  # report, don't die: a crash is a result too
        return [f"raised {type(err).__name__}"]


def torch_parse(cases: list[tuple[str | None, list[str]]]) -> list[Any] | None:
    """torch's NVML-based parser in another interpreter (TORCH_PYTHON); None when not asked."""
    python = os.environ.get("TORCH_PYTHON")
    if not python:
        return None
    code = r"""
import json, os, sys
import torch.cuda as c
out = []
for cvd, uuids in json.load(sys.stdin):
    if cvd is None: os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else: os.environ["CUDA_VISIBLE_DEVICES"] = cvd
    v = c._parse_visible_devices()
    if v and isinstance(v[0], str):
        out.append("asks CUDA" if v[0].startswith("MIG-") else c._transform_uuid_to_ordinals(v, uuids))
    else:
        cut = next((i for i, x in enumerate(v) if x >= len(uuids)), len(v))
        out.append(v[:cut])
print(json.dumps(out))
"""
    done = subprocess.run(
        [python, "-c", code], input=json.dumps(cases), text=True, capture_output=True, check=True
    )
    return json.loads(done.stdout)


Expect = Any  # a list, a {driver: list} dict for MIG, or None (unknown)


def fmt(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(fmt(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ",".join(map(str, value)) + ")"
    return str(value)


def judge(ours: list[Any], theirs: list[Any], expect: Expect) -> str:
    if expect is None:
        return "unconfirmed"
    if isinstance(expect, dict):
        parts = []
        for label, exp in expect.items():
            who = [n for n, v in (("ours", ours), ("nvitop", theirs)) if v == exp]
            parts.append(f"{label}: {'+'.join(who) or 'neither'}")
        return "; ".join(parts)
    who = [n for n, v in (("ours", ours), ("nvitop", theirs)) if v == expect]
    return " + ".join(who) if who else "neither"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(header), "-+-".join("-" * w for w in widths), *map(line, rows)])


PARSE_HEADER = [
    "case",
    "CUDA_VISIBLE_DEVICES",
    "ours",
    "nvitop",
    "agree?",
    "torch",
    "CUDA says (source)",
    "right",
]


def run_parse_cases(
    title: str,
    make: Callable[[], FakeNvml],
    cases: Sequence[tuple[str, str | None, str | None, Expect, str]],
) -> str:
    fake = make()
    use_machine(fake)
    physical_uuids = [g.uuid for g in fake.gpus]
    rows, notes = [], []
    for name, cvd, order, expect, source in cases:
        ours, our_notes = ours_parse(cvd, order)
        theirs = nvitop_parse(cvd, order)
        rows.append(
            [
                name,
                "(unset)" if cvd is None else repr(cvd),
                fmt(ours),
                fmt(theirs),
                "yes" if ours == theirs else "NO",
                "",
                source,
                judge(ours, theirs, expect),
            ]
        )
        notes += [f"  {name}: ours notes: {n}" for n in our_notes if "FASTEST_FIRST" in n][:1]
    torch_out = torch_parse([(cvd, physical_uuids) for _, cvd, *_ in cases])
    for row, value in zip(rows, torch_out or [None] * len(rows), strict=True):
        row[5] = "n/a" if value is None else fmt(value)
    out = f"{title}\n{table(rows, PARSE_HEADER)}"
    return out + ("\n" + "\n".join(notes) if notes else "")


# --------------------------------------------------------------------------------------------
# The cases

PG = "[PG]"  # CUDA Programming Guide, appendix "CUDA Environment Variables"
MIGG = "[MIG]"  # MIG User Guide, "MIG Device Names > CUDA Device Enumeration"
TORCH = "[torch]"  # not in NVIDIA's docs; torch's NVML-based parser encodes it
NONE = "[?]"  # undocumented; no independent source found

PLAIN_CASES = [
    ("unset", None, "PCI_BUS_ID", [0, 1, 2, 3], f"all GPUs {PG}"),
    ("empty", "", "PCI_BUS_ID", [], f"no GPU {PG}"),
    ("in order", "0,1", "PCI_BUS_ID", [0, 1], PG),
    ("reordered", "1,0", "PCI_BUS_ID", [1, 0], f"listed order {PG}"),
    ("stop at invalid", "0,2,-1,1", "PCI_BUS_ID", [0, 2], f"stop at -1 {PG}"),
    ("strtoul digits", "1gpu", "PCI_BUS_ID", [1], f"leading digits {TORCH}"),
    ("plus sign", "+1", "PCI_BUS_ID", [1], f"strtoul takes '+' {TORCH}"),
    ("spaces", " 1, 2", "PCI_BUS_ID", [1, 2], f"strtoul skips blanks {TORCH}"),
    ("duplicate", "0,0", "PCI_BUS_ID", [], f"no GPU {TORCH}"),
    ("late duplicate", "2,1,2", "PCI_BUS_ID", [], f"no GPU {TORCH}"),
    ("out of range", "4", "PCI_BUS_ID", [], f"invalid index {PG}"),
    ("out of range mid", "1,7,2", "PCI_BUS_ID", [1], f"stop at 7 {PG}"),
    ("full GPU UUID", UUIDS[2], "PCI_BUS_ID", [2], PG),
    ("UUID prefix", "GPU-8932f937", "PCI_BUS_ID", [0], f"unique prefix ok {PG}"),
    ("UUID prefix, ambiguous", "GPU-8932f93", "PCI_BUS_ID", [], f"must be unique {PG}"),
    ("UUID then ambiguous", f"{UUIDS[2]},GPU-8932f93", "PCI_BUS_ID", [2], f"stop {PG}{TORCH}"),
    ("UUIDs reordered", f"{UUIDS[3]},{UUIDS[1]}", "PCI_BUS_ID", [3, 1], PG),
    ("unknown UUID", "GPU-deadbeef", "PCI_BUS_ID", [], f"invalid {PG}"),
    ("index then UUID", f"0,{UUIDS[2]}", "PCI_BUS_ID", [0], f"stop at kind switch {TORCH}"),
    ("UUID then index", f"{UUIDS[2]},0", "PCI_BUS_ID", [2], f"stop at kind switch {TORCH}"),
]

MIG_EXPECT_UNSET = {
    "<R570": [(0, 0)],
    ">=R570": [(0, 0), (0, 1), 1, (2, 0)],
}
MIG_CASES = [
    (
        "MIG on, unset",
        None,
        "PCI_BUS_ID",
        MIG_EXPECT_UNSET,
        f"<R570: 1st CI only, no plain GPU; >=R570: 1 CI per GI + plain GPUs, order {NONE} {MIGG}",
    ),
    (
        "MIG GPU by index",
        "0",
        "PCI_BUS_ID",
        {"<R570": [(0, 0)], ">=R570": [(0, 0), (0, 1)]},
        f"index of a MIG-mode GPU: {NONE} (expected shown is a guess)",
    ),
    ("plain GPU by index", "1", "PCI_BUS_ID", [1], PG),
    (
        "plain + MIG GPU",
        "1,0",
        "PCI_BUS_ID",
        {"<R570": [(0, 0)], ">=R570": [1, (0, 0), (0, 1)]},
        f"<R570 hides plain GPUs {MIGG}; >=R570 {NONE}",
    ),
    ("MIG UUID", MIG_UUIDS[1], "PCI_BUS_ID", [(0, 1)], MIGG),
    (
        "two MIG UUIDs, 2 GPUs",
        f"{MIG_UUIDS[1]},{MIG_UUIDS[2]}",
        "PCI_BUS_ID",
        {"<R570": [(0, 1)], ">=R570": [(0, 1), (2, 0)]},
        f"one MIG device before R570 {MIGG}",
    ),
    (
        "two CIs of one GI",
        f"{MIG_UUIDS[2]},{MIG_UUIDS[3]}",
        "PCI_BUS_ID",
        {"<R570": [(2, 0)], ">=R570": [(2, 0)]},
        f"one CI per GI, CUDA 'picks one' {MIGG}",
    ),
    (
        "legacy MIG-GPU-/gi/ci",
        f"MIG-{UUIDS[0]}/2/0",
        "PCI_BUS_ID",
        [(0, 1)],
        f"form for drivers <R470 {PG}{MIGG}",
    ),
    (
        "MIG UUID prefix",
        "MIG-cba663e8",
        "PCI_BUS_ID",
        None,
        f"prefixes documented for GPU- only {NONE}",
    ),
    (
        "GPU UUID of MIG GPU",
        UUIDS[0],
        "PCI_BUS_ID",
        {"<R570": [(0, 0)], ">=R570": [(0, 0), (0, 1)]},
        f"{NONE} (like 'MIG GPU by index')",
    ),
]

MIXED_CASES = [
    ("PCI order, unset", None, "PCI_BUS_ID", [0, 1], f"PCI bus order {PG}"),
    (
        "fastest first, unset",
        None,
        "FASTEST_FIRST",
        None,
        f"H100 likely first: [1,0]; heuristic unpublished {PG}",
    ),
    ("fastest first, '0'", "0", "FASTEST_FIRST", None, f"likely the H100: [1] {PG}"),
    ("PCI order, '0'", "0", "PCI_BUS_ID", [0], PG),
]

SWAPPED_CASES = [
    ("PCI order, unset", None, "PCI_BUS_ID", [1, 0], f"NVML GPU 1 has the lower bus id {PG}"),
    ("PCI order, '0'", "0", "PCI_BUS_ID", [1], PG),
]


# --------------------------------------------------------------------------------------------
# Section 2: nvitop when the (stubbed) CUDA driver answers


def with_driver_answer() -> str:
    global _cuda_answer
    rows = []
    checks = [
        (
            "mixed models, FASTEST_FIRST",
            mixed_machine,
            None,
            "FASTEST_FIRST",
            [UUIDS[2], UUIDS[0]],
            "driver's order is returned as is (exact, no guessing)",
        ),
        (
            "MIG, R570+ driver shows 3 MIG devices",
            mig_machine,
            None,
            "PCI_BUS_ID",
            [MIG_UUIDS[0], MIG_UUIDS[1], MIG_UUIDS[2]],
            "nvitop keeps only the first: it overrides the driver with the pre-R570 rule",
        ),
        (
            "MIG-capable GPUs, MIG off",
            lambda: mig_machine(),
            "1",
            "PCI_BUS_ID",
            [UUIDS[2]],
            "MIG-capable GPU: nvitop re-checks the driver's UUIDs with its own rules",
        ),
    ]
    for name, make, cvd, order, answer, remark in checks:
        use_machine(make())
        _cuda_answer = answer
        got = nvitop_parse(cvd, order)
        rows.append([name, fmt([a[:12] for a in answer]), fmt(got), remark])
    _cuda_answer = None
    return (
        "2. nvitop with a stubbed CUDA driver answer (its normal path on a GPU machine)\n"
        + table(rows, ["case", "driver says (UUIDs)", "nvitop returns", "remark"])
    )


# --------------------------------------------------------------------------------------------
# Section 3: selection by load


def selection() -> str:
    rows = []

    def ours_select(fake: FakeNvml, cvd: str | None, count: int) -> list[int]:
        set_env(cvd, "PCI_BUS_ID")
        inv = devices.collect_inventory(torch_info=devices.TorchCuda(True, 0), env=os.environ)
        return sorted(
            devices.rank_by_load(
                [devices.Load(g.memory_free_mib, g.utilization_percent) for g in inv.visible]
            )[:count]
        )

    def nvitop_select(cvd: str | None, **kwargs: Any) -> tuple[list[Any], list[Any]]:
        set_env(cvd, "PCI_BUS_ID")
        physical = select_devices(format="index", **kwargs)  # default: every GPU, NVML index
        cuda = [
            d.cuda_index
            for d in select_devices(nv_device.CudaDevice.all(), format="device", **kwargs)
        ]
        return physical, cuda

    scenarios = [
        (
            "free memory differs",
            dict(memory_used=[30 * GIB, 5 * GIB, 60 * GIB, 10 * GIB]),
            None,
            2,
            {},
            "[1,3]",
        ),
        ("same free, util differs", dict(util_gpu=[90, 10, 50, 5]), None, 2, {}, "[1,3]"),
        ("all idle (tie)", {}, None, 2, {}, "any 2: policy"),
        (
            "CVD=2,3,0; free differs",
            dict(memory_used=[0, 0, 70 * GIB, 1 * GIB]),
            "2,3,0",
            2,
            {},
            "cuda [1,2]",
        ),
        (
            "threshold: 2 asked, 1 fits",
            dict(memory_used=[70 * GIB, 5 * GIB, 75 * GIB, 79 * GIB]),
            None,
            2,
            {"min_free_memory": "20GiB"},
            "ours has no threshold",
        ),
        (
            "util threshold",
            dict(util_gpu=[95, 10, 50, 99]),
            None,
            2,
            {"max_gpu_utilization": 60},
            "ours has no threshold",
        ),
        (
            "GPU0 memory read fails",
            dict(
                memory_used=[0, 40 * GIB, 50 * GIB, 60 * GIB],
                failures=[{"memory": "unknown"}, {}, {}, {}],
            ),
            None,
            1,
            {},
            "[1]: unknown free memory is no reason to pick",
        ),
        (
            "GPU0 memory NotSupported",
            dict(
                memory_used=[0, 40 * GIB, 50 * GIB, 60 * GIB],
                failures=[{"memory": "not_supported"}, {}, {}, {}],
            ),
            None,
            1,
            {},
            "[1]; nvitop takes host RAM as GPU0 memory: host-dependent",
        ),
    ]
    for name, per_gpu, cvd, count, extra, remark in scenarios:
        fake = four_gpus(**per_gpu)
        use_machine(fake)
        ours = ours_select(fake, cvd, count)
        physical, cuda = nvitop_select(cvd, min_count=count, max_count=count, **extra)
        rows.append(
            [
                name,
                "(unset)" if cvd is None else cvd,
                str(count),
                fmt(extra) if extra else "-",
                fmt(ours),
                fmt(physical),
                fmt(cuda),
                remark,
            ]
        )

    fake = mig_machine()
    use_machine(fake)
    inv = devices.collect_inventory(torch_info=devices.TorchCuda(True, 0), env={})
    ours = sorted(
        devices.rank_by_load(
            [devices.Load(g.memory_free_mib, g.utilization_percent) for g in inv.visible]
        )[:2]
    )
    set_env(None, "PCI_BUS_ID")
    physical = select_devices(format="index", min_count=2, max_count=2)
    rows.append(
        [
            "MIG machine",
            "(unset)",
            "2",
            "-",
            f"{fmt(ours)} (of our {len(inv.visible)}-entry listing)",
            fmt(physical),
            "-",
            "nvitop: 1 < min_count, no error",
        ]
    )
    return (
        "3. Selection by load: ours select_least_used (cuda:N) vs nvitop select_devices\n"
        + table(
            rows,
            [
                "scenario",
                "CVD",
                "n",
                "nvitop filters",
                "ours",
                "nvitop (NVML idx)",
                "nvitop (cuda idx)",
                "expected / remark",
            ],
        )
    )


def main() -> int:
    started = time.monotonic()
    print(
        f"nvitop {nvitop.__version__}, nvidia-ml-py {_pkg_version('nvidia-ml-py')}, "
        f"python {sys.version.split()[0]}; NVML is "
        f"{fake_nvml.__name__}; nvitop's CUDA-driver child process is stubbed to fail "
        "(no driver) except in section 2."
    )
    print(
        "Sources: [PG] CUDA Programming Guide, 'CUDA Environment Variables'; [MIG] MIG User "
        "Guide, 'MIG Device Names > CUDA Device Enumeration'; [torch] torch.cuda."
        "_parse_visible_devices/_transform_uuid_to_ordinals; [?] undocumented."
    )
    print("Indices are NVML indices: N for a GPU, (N,M) for MIG device M of GPU N.\n")
    print(run_parse_cases("1a. Four plain GPUs of one model", four_gpus, PLAIN_CASES), "\n")
    for driver in ("570.133.20", "535.104.05"):
        print(
            run_parse_cases(
                "1b. MIG: GPU0 MIG on (GI1, GI2), GPU1 MIG off, GPU2 MIG on (GI3 with CI0 and "
                f"CI1); NVML driver {driver}",
                lambda driver=driver: mig_machine(driver),
                MIG_CASES,
            ),
            "\n",
        )
    print(
        run_parse_cases(
            "1c. Mixed models: NVML GPU0 = T4 (bus 17), GPU1 = H100 (bus 27)",
            mixed_machine,
            MIXED_CASES,
        ),
        "\n",
    )
    print(
        run_parse_cases(
            "1d. Synthetic: NVML order differs from PCI bus order (GPU0 bus 27, GPU1 bus 17)",
            lambda: mixed_machine(swap_bus=True),
            SWAPPED_CASES,
        ),
        "\n",
    )
    print(with_driver_answer(), "\n")
    print(selection())
    print(f"\n(ran in {time.monotonic() - started:.1f} s)")
    return 0


def _pkg_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    sys.exit(main())
