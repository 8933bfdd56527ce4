"""``trainer=fsdp``: FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``,
for models that no longer fit one GPU, with no code in the module.

Submodules whose class ``shard_modules`` names become FSDP units, then each top-level child with
parameters of its own; a module whose ``configure_model`` applies ``fully_shard`` itself is
honoured. ``bf16-*`` precision keeps bf16 parameters and reduces in float32 (batch norms in
float32); ``cpu_offload`` keeps state in CPU memory. Checkpoints are directories of shards
(``torch.distributed.checkpoint``) written crash-safe with a manifest of sizes and CRC-32s that
loading checks first (:mod:`runkit.safety.checkpoints`).
"""

from __future__ import annotations

import logging
import shutil
import types
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from fsspec.utils import get_protocol
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from runkit import compat
from runkit.errors import RunError
from runkit.safety import checkpoints

log = logging.getLogger(__name__)

_BF16 = ("bf16-mixed", "bf16-true", "bf16")
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class FSDPStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2) that shards the user's module from config.

    Args:
        shard_modules: classes (import paths, ``torch.nn.Conv2d``, or bare class names) whose
            instances become FSDP units. Needed unless the module's own ``configure_model``
            applies ``fully_shard``.
        cpu_offload: keep parameters, gradients and optimiser state in CPU memory (GPUs only;
            ignored with a log line on the CPU).
        reduce_dtype: the dtype gradients are reduced in under bf16 mixed precision.
        process_group_backend: ``nccl``/``gloo``; ``None`` picks the device's default.
        timeout: how long a collective waits for the other ranks.
    """

    def __init__(
        self,
        shard_modules: Sequence[str] = (),
        cpu_offload: bool = False,
        reduce_dtype: str = "float32",
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
    ) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.shard_modules = [str(name) for name in shard_modules]
        self.cpu_offload = bool(cpu_offload)
        dtype = getattr(torch, str(reduce_dtype), None)
        if not isinstance(dtype, torch.dtype):
            raise RunError(
                f"trainer.strategy.reduce_dtype={reduce_dtype!r} is not a torch dtype; "
                "accepted: float32, bfloat16, float16"
            )
        self.reduce_dtype = dtype
        self._classes = resolve_classes(self.shard_modules)

    # ------------------------------------------------------------------ sharding
    def connect(self, model: Any) -> None:
        """Give a module without its own ``configure_model`` this strategy's sharding as that
        hook: Lightning then calls it where it calls the user's (in its init contexts, in fit
        and again in test: idempotent), and ModelParallelStrategy's check finds the hook."""
        if isinstance(model, LightningModule) and not is_overridden("configure_model", model):
            if not self._classes:
                raise RunError(
                    f"trainer=fsdp needs trainer.strategy.shard_modules (the submodule classes "
                    f"that become FSDP units, e.g. [torch.nn.Linear]) or a configure_model in "
                    f"{type(model).__name__}; neither is set"
                )
            strategy = self

            def configure_model(module: LightningModule) -> None:
                strategy.shard(module)

            model.configure_model = types.MethodType(configure_model, model)
        super().connect(model)

    def setup(self, trainer: Any) -> None:
        """A module's own ``configure_model`` that built layers without sharding them (layers
        made lazily, say): shard them now, as for a module without one; else FSDP would train
        an unsynchronised copy on every rank."""
        from torch.distributed.fsdp import FSDPModule

        module = self.lightning_module
        if module is not None and not any(isinstance(m, FSDPModule) for m in module.modules()):
            if not self._classes:
                raise RunError(
                    f"{type(module).__name__}.configure_model shards nothing; under trainer=fsdp "
                    "it must apply fully_shard, or set trainer.strategy.shard_modules"
                )
            self.shard(module)
        super().setup(trainer)

    def model_to_device(self) -> None:
        """Lightning's ``model.to(device)``, except under ``cpu_offload``: there FSDP has put
        the buffers on the GPU and keeps the parameter shards in CPU memory on purpose."""
        if self.cpu_offload and self.root_device.type != "cpu":
            return
        super().model_to_device()

    def setup_environment(self) -> None:
        # One mesh dimension over every process: FSDP over all of them, no tensor parallelism.
        compat.set_data_parallel_size(self, self.num_nodes * self.num_processes)
        super().setup_environment()

    def mixed_precision(self) -> Any:
        """The ``MixedPrecisionPolicy`` for the run's precision (``None``: float32 throughout)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        precision = str(getattr(self.precision_plugin, "precision", "32-true"))
        if precision in _BF16:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=self.reduce_dtype)
        return None

    def shard(self, module: LightningModule) -> None:
        """Apply ``fully_shard`` to the configured units, then to each top-level child that still
        holds parameters outside them. A second call (``test`` after ``fit``) finds it done."""
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            fully_shard,
        )

        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return
        units = [m for m in module.modules() if isinstance(m, self._classes)]
        if not units:
            present = sorted({type(m).__name__ for m in module.modules()} - {"Sequential"})
            raise RunError(
                f"trainer.strategy.shard_modules={self.shard_modules} matches no submodule of "
                f"{type(module).__name__}; its submodule classes: {', '.join(present[:12])}"
            )
        kwargs: dict[str, Any] = {"mesh": self.device_mesh["data_parallel"]}
        policy = self.mixed_precision()
        if policy is not None:
            kwargs["mp_policy"] = policy
        if self.cpu_offload:
            if self.root_device.type == "cpu":
                if self.global_rank == 0:  # one line per run, not one per process
                    log.info("trainer.strategy.cpu_offload: the run is on the CPU already; ignored")
            else:
                kwargs["offload_policy"] = CPUOffloadPolicy()
        # Under bf16 a batch norm is a unit of its own in float32 (its input cast up): its
        # running statistics are float32 buffers, which batch_norm refuses beside bf16 weights.
        norms = [m for m in module.modules() if isinstance(m, _BATCH_NORMS)] if policy else []
        chosen = {*units, *norms}
        ordered = [m for m in module.modules() if m in chosen]
        for unit in reversed(ordered):  # reversed pre-order: every unit before its parents
            if unit in norms:
                float32 = MixedPrecisionPolicy(
                    param_dtype=torch.float32, reduce_dtype=torch.float32
                )
                fully_shard(unit, **{**kwargs, "mp_policy": float32})
            else:
                fully_shard(unit, **kwargs)
        for child in module.children():
            if _owns_parameters(child):
                fully_shard(child, **kwargs)
        loose = next((n for n, p in module.named_parameters() if not _is_dtensor(p)), None)
        if loose is not None:
            raise RunError(
                f"{type(module).__name__}.{loose} is a parameter of the LightningModule itself; "
                "trainer=fsdp shards submodules: move it into one (or write configure_model)"
            )

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Lightning's sharded save, into a temporary directory swapped in once complete."""
        if storage_options is not None or get_protocol(str(filepath)) != "file":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        target = Path(self.broadcast(str(filepath).removeprefix("file://")))
        staging: str | None = None
        if self.is_global_zero:
            staging = str(checkpoints.new_staging_dir(target))
        staging_dir = Path(self.broadcast(staging))
        try:
            super().save_checkpoint(checkpoint, staging_dir)
            self.barrier()
            names = checkpoints.checkpoint_files(staging_dir)
            share = checkpoints.describe_files(
                staging_dir, names[self.global_rank :: self.world_size]
            )
            entries = _gather(share)
            if self.is_global_zero:
                checkpoints.write_manifest(staging_dir, entries)
                checkpoints.swap_in(staging_dir, target)
        except OSError as err:
            if self.is_global_zero:
                shutil.rmtree(staging_dir, ignore_errors=True)
            problem, _ = checkpoints.write_failure(target, err, target.exists())
            raise checkpoints.CheckpointSaveError(
                problem.replace("write ", "write checkpoint ", 1),
                checkpoints.last_good_checkpoint(target.parent, prefer=target),
            ) from err
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Check the checkpoint directory's manifest (each rank its share of the files), then
        Lightning's sharded load."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            names = checkpoints.manifest_names(path)
            problem = checkpoints.damaged_files(path, names[self.global_rank :: self.world_size])
            problems = [p for p in _gather([problem] if problem else []) if p]
            if problems:
                raise RunError(problems[0])
        return super().load_checkpoint(path, weights_only=weights_only)


def _gather(items: list[Any]) -> list[Any]:
    """Every rank's ``items``, concatenated in rank order, on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(items)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]


def _owns_parameters(module: nn.Module) -> bool:
    """Whether ``module`` has parameters that no FSDP unit inside it holds."""
    return any(not _is_dtensor(p) for p in module.parameters())


def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def resolve_classes(names: Sequence[str]) -> tuple[type, ...]:
    """The classes ``shard_modules`` names: dotted import paths, or bare ``torch.nn`` names."""
    import importlib

    classes = []
    for name in names:
        module_name, _, attr = name.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name or "torch.nn"), attr)
        except (ImportError, AttributeError, ValueError):
            obj = None
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            raise RunError(
                f"trainer.strategy.shard_modules has {name!r}, which is not an nn.Module class; "
                "accepted: import paths of module classes (torch.nn.Linear, my_project.Block)"
            )
        classes.append(obj)
    return tuple(classes)
