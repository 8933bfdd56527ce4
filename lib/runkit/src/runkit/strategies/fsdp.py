"""``trainer=fsdp``: FSDP2 (``fully_shard``) through Lightning's ``ModelParallelStrategy``, with
no code in the module; checkpoints are directories of shards with a manifest checked on load."""

from __future__ import annotations

import importlib
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
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from runkit.errors import RunError
from runkit.safety import checkpoints, writes

log = logging.getLogger(__name__)

_BF16 = ("bf16-mixed", "bf16-true", "bf16")
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


class FSDPStrategy(ModelParallelStrategy):
    """Shards the user's module from config: ``shard_modules`` (classes) become FSDP units."""

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
        self.reduce_dtype = getattr(torch, str(reduce_dtype), None)
        if not isinstance(self.reduce_dtype, torch.dtype):
            raise RunError(
                f"trainer.strategy.reduce_dtype={reduce_dtype!r} is not a torch dtype; "
                "accepted: float32, bfloat16, float16"
            )
        classes = []  # dotted import paths, or bare torch.nn names
        for name in self.shard_modules:
            module_name, _, attr = name.rpartition(".")
            try:
                obj = getattr(importlib.import_module(module_name or "torch.nn"), attr)
            except (ImportError, AttributeError, ValueError):
                obj = None
            if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
                raise RunError(
                    f"trainer.strategy.shard_modules has {name!r}, which is not an nn.Module "
                    "class; accepted: import paths of module classes "
                    "(torch.nn.Linear, my_project.Block)"
                )
            classes.append(obj)
        self._classes = tuple(classes)

    def connect(self, model: Any) -> None:
        if isinstance(model, LightningModule) and not is_overridden("configure_model", model):
            model.configure_model = types.MethodType(lambda module: self.shard(module), model)
        super().connect(model)

    def setup(self, trainer: Any) -> None:
        # Shard what a module's own configure_model built unsharded: else unsynchronised copies.
        if self.lightning_module is not None:
            self.shard(self.lightning_module)
        super().setup(trainer)

    def model_to_device(self) -> None:
        if not self.cpu_offload or self.root_device.type == "cpu":  # offload: CPU on purpose
            super().model_to_device()

    def setup_environment(self) -> None:
        # One mesh dimension over every process ('auto' would mean num_nodes); private: compat.
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def shard(self, module: LightningModule) -> None:
        """``fully_shard`` the units, then each child with loose parameters; once."""
        name = type(module).__name__
        if any(isinstance(m, FSDPModule) for m in module.modules()):
            return  # sharded already
        if not self._classes:
            raise RunError(
                f"trainer=fsdp needs trainer.strategy.shard_modules (the submodule classes that "
                f"become FSDP units, e.g. [torch.nn.Linear]) or a configure_model in {name} "
                "that applies fully_shard; neither is set"
            )
        units = {m for m in module.modules() if isinstance(m, self._classes)}
        if not units:
            present = sorted({type(m).__name__ for m in module.modules()} - {"Sequential"})
            raise RunError(
                f"trainer.strategy.shard_modules={self.shard_modules} matches no submodule of "
                f"{name}; its submodule classes: {', '.join(present[:12])}"
            )
        kwargs: dict[str, Any] = {"mesh": self.device_mesh["data_parallel"]}
        bf16 = str(getattr(self.precision_plugin, "precision", "32-true")) in _BF16
        if bf16:
            kwargs["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, self.reduce_dtype)
        if self.cpu_offload and self.root_device.type != "cpu":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        elif self.cpu_offload and self.global_rank == 0:
            log.info("trainer.strategy.cpu_offload: the run is on the CPU already; ignored")
        # A batch norm's running statistics are float32 buffers, refused beside bf16 weights.
        norms = {m for m in module.modules() if isinstance(m, _BATCH_NORMS)} if bf16 else set()
        float32 = {**kwargs, "mp_policy": MixedPrecisionPolicy(torch.float32, torch.float32)}
        for unit in reversed([m for m in module.modules() if m in units | norms]):  # leaves first
            fully_shard(unit, **(float32 if unit in norms else kwargs))
        for child in module.children():
            if any(not isinstance(p, DTensor) for p in child.parameters()):
                fully_shard(child, **kwargs)
        loose = next((n for n, p in module.named_parameters() if not isinstance(p, DTensor)), None)
        if loose is not None:
            raise RunError(
                f"{name}.{loose} is a parameter of the LightningModule itself; trainer=fsdp "
                "shards submodules: move it into one (or write configure_model)"
            )

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Lightning's sharded save into a directory swapped in once complete."""
        if storage_options is not None or get_protocol(str(filepath)) != "file":
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        target = Path(self.broadcast(str(filepath).removeprefix("file://")))
        staging = writes.new_staging_dir(target) if self.is_global_zero else None
        staging_dir = Path(self.broadcast(str(staging) if staging else None))
        try:
            super().save_checkpoint(checkpoint, staging_dir)
            self.barrier()
            names = checkpoints.checkpoint_files(staging_dir)[self.global_rank :: self.world_size]
            entries = _gather(checkpoints.describe_files(staging_dir, names))
            if self.is_global_zero:
                checkpoints.write_manifest(staging_dir, entries)
                writes.swap_in(staging_dir, target)
        except OSError as err:
            if self.is_global_zero:
                shutil.rmtree(staging_dir, ignore_errors=True)
            problem, _ = writes.write_failure(target, err, target.exists())
            raise checkpoints.save_failure(target, problem) from err
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        """Check the manifest (each rank its share of the files), then Lightning's load."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir():
            names = checkpoints.manifest_names(path)
            problem = checkpoints.damaged_files(path, names[self.global_rank :: self.world_size])
            problems = [p for p in _gather([problem] if problem else []) if p]
            if problems:
                raise RunError(problems[0])
        return super().load_checkpoint(path, weights_only=weights_only)


def _gather(items: list[Any]) -> list[Any]:
    if not dist.is_initialized():
        return list(items)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [item for part in gathered for item in part]
