"""GPU statistics per epoch from NVML: what the GPUs of *this run* did, not a snapshot.

Why not Lightning's ``DeviceStatsMonitor``: it reads ``torch.cuda.memory_stats`` on the training
thread at every step and knows nothing of utilisation, power or throttling. This callback samples
NVML in a background thread (default every second), keeps running statistics per GPU and logs,
once per epoch, the mean/max/min over the epoch. The training thread makes no NVML call per step;
it only takes one boundary sample at epoch start/end and when validation starts/ends, so that the
training and validation figures (and the energy counter) are split exactly.

Which GPU: every torch device this process trains on is mapped to its NVML device by UUID
(``torch.cuda.get_device_properties(i).uuid`` → ``nvmlDeviceGetHandleByUUID("GPU-…"|"MIG-…")``),
so ``CUDA_VISIBLE_DEVICES=2,3``, ``GPU-…``/``MIG-…`` UUIDs and ``CUDA_DEVICE_ORDER`` all land on
the right physical GPU. Without a GPU (tests, demos with
:mod:`project.machinery.testing.fake_nvml`), pass ``device_uuids``: entry *i* is the NVML UUID of
``trainer.strategy.parallel_devices[i]`` (a constructor argument only: the user's
``configs/callbacks/gpu_stats.yaml`` does not show it; ``+callbacks.gpu_stats.device_uuids=[...]``
adds it from the command line).

Which process: under DDP every rank samples its own device and, at epoch end, all ranks gather
their figures (a collective called on every rank, whatever state its NVML is in); rank 0's logger
writes them. A process that drives several devices (one process per node) samples them all.

Logged keys (training epoch; validation uses ``gpu_val/`` instead of ``gpu/``)::

    gpu/node{N}/cuda{i}/util_mean       GPU busy %: mean, max, min over the epoch's samples
    gpu/node{N}/cuda{i}/mem_util_mean   memory-bandwidth busy %: mean, max
    gpu/node{N}/cuda{i}/mem_used_gib_*  device memory in use (all processes): mean, max
    gpu/node{N}/cuda{i}/mem_total_gib   device memory size
    gpu/node{N}/cuda{i}/proc_mem_gib_*  this process's memory on the GPU: mean, max
    gpu/node{N}/cuda{i}/torch_peak_alloc_gib, torch_peak_reserved_gib   PyTorch's peaks this epoch
    gpu/node{N}/cuda{i}/temp_c_*        temperature: mean, max
    gpu/node{N}/cuda{i}/power_w_*       power draw: mean, max; power_ratio_* = draw / power limit
    gpu/node{N}/cuda{i}/sm_clock_mhz_*  SM clock: mean, min
    gpu/node{N}/cuda{i}/throttle_*_frac share of samples with clocks held back: power, thermal,
                                        hw (slowdown) or any of them
    gpu/node{N}/cuda{i}/energy_j        energy used during the epoch (total-energy counter)
    gpu/node{N}/cuda{i}/samples         number of samples behind the figures
    optional: fan_pct_*, pcie_{tx,rx}_mbs_*, ecc_uncorrected, mem_temp_c_*, sample_ms (NVML time
    per sample: the sampler's own cost)
    gpu/all/{key}_{min,mean,max}        across every GPU of the run, for the headline keys in
                                        AGGREGATED (plus gpu/all/energy_j_sum), so a straggler shows

``N`` is ``trainer.node_rank``; ``i`` is the CUDA index in the process (or the position in
``parallel_devices`` when ``device_uuids`` stands in for CUDA). A metric a GPU does not support
(fan on datacenter cards, utilisation on MIG slices, ...) is probed once, listed once in the log
and left out: never logged as 0. On a MIG slice, temperature, power, clocks, throttling and
energy are those of the whole physical GPU (NVML reports them only there).

Identity (name, UUID, NVML index, PCI bus) is written once per GPU as an INFO log line on rank 0
(not as logger hyperparameters, which belong to the experiment config). At the end of ``fit``
rank 0 prints one Rich table summarising each GPU over the run.

Never breaks training: no NVML library, no driver or no GPU gives one log line and the callback
does nothing; a GPU lost or NVML failing mid-run gives one warning and that GPU stops being
sampled. Messages go through :mod:`logging`, never :mod:`warnings`, so ``python -W error`` runs.
NVML is opened with :func:`project.machinery.gpus.nvml.nvml_session` and closed on every path,
exceptions included (``teardown`` and ``on_exception``).

The parts, one job per module: :mod:`.statistics` (running statistics, the key scheme),
:mod:`.sampler` (which metrics a GPU supports, the background thread), this callback (the
Lightning lifecycle, the gathers across ranks) and :mod:`.report` (the end-of-run table).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import lightning.pytorch as pl
import torch

from project.machinery.gpu_stats import report
from project.machinery.gpu_stats.sampler import (
    DEFAULT_GROUPS,
    OPTIONAL_GROUPS,
    TRAIN,
    VAL,
    GpuReader,
    GpuSampler,
    TorchPeakMemory,
)
from project.machinery.gpu_stats.statistics import flatten_epoch
from project.machinery.gpus import nvml

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- device mapping
def cuda_device_uuid(index: int) -> str | None:
    """The UUID CUDA reports for ``cuda:index`` (this already reflects CUDA_VISIBLE_DEVICES)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return None if uuid is None else str(uuid)


def process_devices(trainer: Any) -> list[tuple[int, torch.device]]:
    """The devices this process drives, each with its position in ``parallel_devices``.

    One process per device (DDP and friends): the root device only. One process for several
    devices on its node (``world_size == num_nodes`` with several ``parallel_devices``): all.
    """
    strategy = trainer.strategy
    devices = list(getattr(strategy, "parallel_devices", None) or [strategy.root_device])
    if len(devices) > 1 and trainer.world_size == trainer.num_nodes:
        return list(enumerate(devices))
    position = trainer.local_rank if trainer.local_rank < len(devices) else 0
    return [(position, torch.device(strategy.root_device))]


# --------------------------------------------------------------------------- helpers for ranks
def gather_objects(trainer: Any, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order: the real collective under DDP, ``[obj]`` otherwise."""
    dist = torch.distributed
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered
    return [obj]


# --------------------------------------------------------------------------- the callback
class GpuStatsMonitor(pl.Callback):
    """Log per-epoch GPU statistics from NVML for every GPU of the run (see the module docstring).

    Args:
        interval_s: seconds between background samples.
        report_validation: also log the validation runs, under ``gpu_val/``.
        fan, pcie, ecc, memory_temperature: log these too (off by default; often unsupported).
        log_sampler_cost: log ``sample_ms``, the NVML time per sample of each GPU.
        summary_table: print a Rich table of every GPU at the end of ``fit`` (rank 0).
        device_uuids: the NVML UUID of each entry of ``trainer.strategy.parallel_devices``, for
            runs whose devices are not CUDA devices (tests and demos on CPU with the fake NVML;
            not in the shipped YAML: ``+callbacks.gpu_stats.device_uuids=[...]`` adds it).
            Leave ``None`` on real GPUs: the UUIDs then come from CUDA.
        key_prefix: first part of every key (``gpu``); validation uses ``{key_prefix}_val``.
    """

    def __init__(
        self,
        interval_s: float = 1.0,
        report_validation: bool = True,
        fan: bool = False,
        pcie: bool = False,
        ecc: bool = False,
        memory_temperature: bool = False,
        log_sampler_cost: bool = False,
        summary_table: bool = True,
        device_uuids: Sequence[str] | None = None,
        key_prefix: str = "gpu",
    ) -> None:
        if not isinstance(interval_s, (int, float)) or not interval_s > 0:
            raise ValueError(f"GpuStatsMonitor: interval_s={interval_s!r}; give seconds > 0")
        if device_uuids is not None and (
            isinstance(device_uuids, str) or not all(isinstance(u, str) for u in device_uuids)
        ):
            raise ValueError(
                f"GpuStatsMonitor: device_uuids={device_uuids!r}; give a list of NVML UUID strings"
            )
        if not key_prefix or "/" in key_prefix:
            raise ValueError(f"GpuStatsMonitor: key_prefix={key_prefix!r}; give a word without '/'")
        self.interval_s = float(interval_s)
        self.report_validation = report_validation
        optional = {"fan": fan, "pcie": pcie, "ecc": ecc, "memory_temperature": memory_temperature}
        self.groups = [*DEFAULT_GROUPS, *(g for g in OPTIONAL_GROUPS if optional[g])]
        self.log_sampler_cost = log_sampler_cost
        self.summary_table = summary_table
        self.device_uuids = None if device_uuids is None else list(device_uuids)
        self.key_prefix = key_prefix
        self._reset_state()

    def _reset_state(self) -> None:
        self._stack = ExitStack()
        self._sampler: GpuSampler | None = None
        self._peaks: TorchPeakMemory | None = None
        self._active = False  # some rank samples a GPU: every rank joins the epoch gathers
        self._identities: list[dict[str, Any]] = []
        self._summary = report.RunSummary()
        self._phase_before_val: str | None = None

    @property
    def identities(self) -> list[dict[str, Any]]:
        """What every rank reported at setup: status, problems and, per GPU, its identity."""
        return list(self._identities)

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._close()
        self._reset_state()
        try:
            local = self._open(trainer)
        except ValueError as err:  # a configuration error: raised below, on every rank at once
            self._close()
            local = {"status": "misconfigured", "gpus": [], "config_error": str(err)}
        except Exception as err:  # never let statistics break a run
            self._close()
            local = {"status": f"failed to start ({type(err).__name__}: {err})", "gpus": []}
        local.update(node=trainer.node_rank, rank=trainer.global_rank)
        everyone = gather_objects(trainer, local)  # every rank, before anyone may raise
        errors = [p["config_error"] for p in everyone if p.get("config_error")]
        if errors:
            self._close()
            raise ValueError(errors[0])
        self._identities = everyone
        self._active = any(p["gpus"] for p in everyone)
        if trainer.is_global_zero:
            self._report_setup(everyone)
        if self._sampler is not None:
            self._sampler.start()

    def _open(self, trainer: pl.Trainer) -> dict[str, Any]:
        """Map this process's devices to NVML and probe them. Returns what rank 0 should hear."""
        devices = process_devices(trainer)
        wanted: list[tuple[str, torch.device, str | None]] = []
        for position, device in devices:
            if self.device_uuids is not None:
                if position >= len(self.device_uuids):
                    raise ValueError(
                        f"GpuStatsMonitor: device_uuids has {len(self.device_uuids)} entries but "
                        f"this process drives parallel_devices[{position}]; give one UUID a device"
                    )
                wanted.append((f"cuda{position}", device, self.device_uuids[position]))
            elif device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                wanted.append((f"cuda{index}", device, cuda_device_uuid(index)))
        if not wanted:
            return {"status": "off: this run uses no CUDA device", "gpus": [], "quiet": True}
        try:
            lib = self._stack.enter_context(nvml.nvml_session())
        except nvml.NvmlUnavailable as err:
            return {"status": f"off: {err}", "gpus": []}
        readers, problems = [], []
        for label, _device, uuid in wanted:
            found = nvml.find_handle(lib, uuid) if uuid else None
            if found is None:
                problems.append(f"{label}: no NVML device with UUID {uuid!r}")
                continue
            try:
                reader = GpuReader(lib, found[0], label, self.groups)
                reader.probe()
            except Exception as err:
                problems.append(f"{label}: {type(err).__name__}: {err}")
                continue
            readers.append(reader)
        if readers:
            self._sampler = GpuSampler(readers, self.interval_s)
            self._peaks = TorchPeakMemory({label: dev for label, dev, _ in wanted})
        else:
            self._close()
        status = "on" if readers else "off: no usable GPU"
        return {"status": status, "gpus": [r.identity() for r in readers], "problems": problems}

    def _report_setup(self, everyone: Sequence[dict[str, Any]]) -> None:
        idle: dict[tuple[str, bool], list[str]] = {}
        for payload in everyone:
            where = f"rank {payload['rank']} (node {payload['node']})"
            for problem in payload.get("problems", []):
                log.warning("gpu_stats: %s: %s", where, problem)
            if not payload["gpus"]:  # one line for all ranks in the same state
                key = (payload["status"], bool(payload.get("quiet")))
                idle.setdefault(key, []).append(str(payload["rank"]))
            for gpu in payload["gpus"]:
                log.info(
                    "gpu_stats: node%s/%s = %s, %s, NVML index %s, PCI %s%s; not supported: %s",
                    payload["node"],
                    gpu["label"],
                    gpu["name"],
                    gpu["uuid"],
                    gpu["nvml_index"],
                    gpu["pci_bus_id"],
                    " (MIG slice)" if gpu["mig"] else "",
                    ", ".join(gpu["unsupported"]) or "none",
                )
        for (status, quiet), ranks in idle.items():
            log.log(
                logging.INFO if quiet else logging.WARNING,
                "gpu_stats: rank %s: %s; training continues without GPU statistics",
                ",".join(ranks),
                status,
            )

    def _close(self) -> None:
        """Stop the thread and shut NVML down; safe to call any number of times."""
        sampler, self._sampler = getattr(self, "_sampler", None), None
        if sampler is not None:
            sampler.stop()
        stack = getattr(self, "_stack", None)
        if stack is not None:
            stack.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._close()  # Lightning does not call ``teardown`` on this path

    def _guarded(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run local bookkeeping; on a bug, stop sampling here but keep training (and gathers)."""
        try:
            return fn()
        except Exception as err:
            log.warning(
                "gpu_stats: %s failed (%s: %s); sampling stops", what, type(err).__name__, err
            )
            self._close()
            return None

    # ------------------------------------------------------------------ phases
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._sampler is not None:
            self._guarded("epoch start", lambda: self._sampler.set_phase(TRAIN, reset=True))
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.clear())

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or self._sampler is None:
            return
        self._phase_before_val = self._sampler.phase
        self._guarded("validation start", lambda: self._sampler.set_phase(VAL, reset=True))
        if self._peaks is not None:
            self._guarded("peak reset", lambda: self._peaks.stash())

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self._active:
            return
        local: dict[str, Any] = {}
        if self.report_validation:
            local = self._local_payload(trainer, VAL, include_carry=False)
        sampler, peaks, resume = self._sampler, self._peaks, self._phase_before_val
        if sampler is not None:
            self._guarded("validation end", lambda: sampler.set_phase(resume, reset=False))
        if peaks is not None:
            self._guarded("peak reset", lambda: peaks.restart())
        if self.report_validation:  # the same on every rank, so every rank joins the gather
            everyone = gather_objects(trainer, local)
            root = f"{self.key_prefix}_val"
            self._log(pl_module, flatten_epoch(everyone, root, self.log_sampler_cost))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._active:
            return
        local = self._local_payload(trainer, TRAIN, include_carry=True)
        if self._sampler is not None:
            self._guarded("epoch end", lambda: self._sampler.set_phase(None, sample=False))
        everyone = gather_objects(trainer, local)  # every rank, whatever its NVML did
        self._log(pl_module, flatten_epoch(everyone, self.key_prefix, self.log_sampler_cost))
        self._summary.add_epoch(everyone)

    def _local_payload(
        self, trainer: pl.Trainer, phase: str, include_carry: bool
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "node": trainer.node_rank,
            "rank": trainer.global_rank,
            "gpus": {},
        }
        sampler, peaks = self._sampler, self._peaks
        if sampler is None:
            return payload
        gpus = self._guarded(f"{phase} summary", lambda: sampler.collect(phase)) or {}
        if peaks is not None:
            for label, values in (
                self._guarded("peaks", lambda: peaks.peaks(include_carry)) or {}
            ).items():
                if label in gpus:
                    gpus[label].update(values)
        payload["gpus"] = gpus
        return payload

    def _log(self, pl_module: pl.LightningModule, metrics: dict[str, float]) -> None:
        # Every rank holds the same gathered figures and logs them all, in the same order. Under
        # DDP ``sync_dist=True`` then averages identical values (a no-op on the numbers) and keeps
        # Lightning from warning once per key that epoch-level metrics are not synchronised;
        # it also means monitors (EarlyStopping, ModelCheckpoint) see the keys on every rank.
        distributed = pl_module.trainer.world_size > 1
        for key, value in metrics.items():
            pl_module.log(key, float(value), on_step=False, on_epoch=True, sync_dist=distributed)

    # ------------------------------------------------------------------ end of run
    def run_summary(self) -> list[dict[str, Any]]:
        """One row per GPU over the whole ``fit`` (training epochs): what the table shows."""
        return self._summary.rows(self._identities)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.summary_table and trainer.is_global_zero and self._summary:
            report.print_table(self.run_summary())
