"""``trainer.strategy=dp``: one process drives several GPUs through ``torch.nn.DataParallel``.

Lightning 2 dropped DataParallel from the Trainer (Fabric kept it); this brings it back for the
Trainer, with the behaviour Lightning 1.x had and one correction for torchmetrics:

* The LightningModule moves to the first chosen GPU and is wrapped in ``nn.DataParallel`` over all
  of them. Each step, DataParallel copies the module to every GPU (the *replicas*), splits the
  batch along its first dimension, runs the step on every slice in parallel threads and gathers
  the outputs on the first GPU: tensors are concatenated, so a scalar per replica becomes a vector
  with one entry per GPU.
* The training loss reaching Lightning is the mean of what the replicas returned.
* Checkpoints hold the unwrapped module: ``state_dict`` keys carry no ``module.`` prefix, and a
  checkpoint trained with DP loads into any other strategy unchanged.

What a LightningModule must do under DP (and why): replicas are throw-away copies made anew each
step. Anything a step *changes* on ``self`` is lost (a torchmetrics ``update()``, a counter) or
unsafe (``self.log`` from several threads with tensors on several GPUs). So a module that updates
metrics or logs per step splits its step in two:

1. ``training_step``/``validation_step``/``test_step`` compute and *return* what the rest needs
   (per-sample losses, predictions, targets) when :func:`steps_run_in_replicas` is true;
2. ``training_step_end(outputs)``/``validation_step_end``/``test_step_end``/``predict_step_end``
   (the Lightning 1.x names) receive the gathered outputs on the real module, update the metrics,
   log, and return the step's result (for training: the loss, or a dict with ``"loss"``).

:class:`~project.models.classifier.ClassifierModule` does exactly this, and returns per-sample
losses so that the loss averaged after the gather equals the single-GPU loss even when a batch
splits unevenly. A module without ``*_step_end`` hooks still trains: the strategy averages its
``loss`` (a tensor, or the ``"loss"`` entry of a dict); only its in-step metric updates are lost.

DP is for one machine with a few GPUs and code that must stay single-process; DDP
(``trainer.devices=N``) is faster almost everywhere. Without a CUDA GPU there is nothing for DP to
split over, so the strategy refuses to run instead of silently training on one CPU.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.nn import DataParallel

from project.errors import ProjectError

STRATEGY_NAME = "dp"
CPU_HINT = "on the CPU use trainer=ddp_sim (N processes over gloo)"
NEEDS_GPU = "trainer.strategy=dp asks for a GPU (DataParallel splits each batch over CUDA GPUs)"

# Each step and the hook that receives its gathered outputs on the real module.
_STEP_END_HOOKS = {
    "training_step": "training_step_end",
    "validation_step": "validation_step_end",
    "test_step": "test_step_end",
    "predict_step": "predict_step_end",
}


def steps_run_in_replicas(module: LightningModule) -> bool:
    """Whether ``module``'s steps currently run inside DataParallel replicas (``strategy=dp``).

    When true, a step should return its outputs and leave metric updates and logging to the
    matching ``*_step_end`` hook, which the strategy calls on the real module after the gather.
    False for a module not attached to a Trainer (a unit test calling ``training_step``).
    """
    trainer = getattr(module, "_trainer", None)  # the public property raises when unattached
    return trainer is not None and isinstance(trainer.strategy, DataParallelStrategy)


def check_dp_request(accelerator: Any, devices: Any, num_nodes: Any = 1) -> None:
    """Refuse ``strategy=dp`` where it cannot run: no CUDA GPU, or more than one node.

    Called by preflight before anything is created; the strategy checks again at setup for code
    that builds a Trainer directly.
    """
    from project.machinery.gpus.devices import resolve_devices

    if isinstance(num_nodes, int) and num_nodes > 1:
        raise ProjectError(
            f"trainer.strategy=dp runs in one process on one machine, but trainer.num_nodes="
            f"{num_nodes}; use trainer=multi_node (DDP) for several machines"
        )
    if str(accelerator).lower() not in ("auto", "gpu", "cuda", "none"):
        raise ProjectError(f"{NEEDS_GPU}, but trainer.accelerator={accelerator}; {CPU_HINT}")
    # Whether there are GPUs at all ("auto" answers instead of raising); too many asked for, or
    # a missing index, still fails here with resolve_devices' own line.
    plan = resolve_devices("auto", "auto" if devices is None else devices)
    if not plan.gpus:
        reason = (plan.message or "no usable GPU").split(";")[0]  # drop "training runs on the CPU"
        raise ProjectError(f"{NEEDS_GPU}, but: {reason}; {CPU_HINT}")


class _ReplicaStep(nn.Module):
    """What DataParallel wraps: ``forward(step_name, *args)`` runs that step on the replica.

    DataParallel only ever calls ``forward``; passing the step's name as the first argument
    (copied, not split, to every replica) routes each call to ``training_step`` & co. without
    patching the LightningModule's ``forward`` (which replicas would copy mid-call).
    """

    def __init__(self, module: LightningModule) -> None:
        super().__init__()
        self.module = module

    def forward(self, step: str, *args: Any, **kwargs: Any) -> Any:
        device = _first_device(args)
        if device is not None:
            # A replica is a shallow copy still believing it lives on the first GPU; correct it so
            # that `self.device` inside the step names this replica's GPU.
            for sub in self.module.modules():
                if isinstance(sub, _DeviceDtypeModuleMixin):
                    sub._device = device
        output = getattr(self.module, step)(*args, **kwargs)
        return apply_to_collection(output, (Tensor, numbers.Number), _as_vector, device=device)


def _first_device(args: Any) -> torch.device | None:
    found: list[torch.device] = []
    apply_to_collection(args, Tensor, lambda t: found.append(t.device))
    return found[0] if found else None


def _as_vector(value: Tensor | numbers.Number, device: torch.device | None) -> Tensor:
    """Numbers and 0-dim tensors become 1-element vectors, so the gather yields one per GPU."""
    tensor = value if isinstance(value, Tensor) else torch.tensor(value, device=device)
    return tensor.unsqueeze(0) if tensor.ndim == 0 else tensor


def mean_loss(output: Any) -> Any:
    """Reduce the gathered training output to one scalar loss (the mean over its entries)."""
    if isinstance(output, Tensor):
        return output if output.ndim == 0 else output.float().mean().to(output.dtype)
    if isinstance(output, Mapping) and isinstance(output.get("loss"), Tensor):
        return {**output, "loss": mean_loss(output["loss"])}
    return output


class DataParallelStrategy(ParallelStrategy):
    """Single-process data parallelism over the GPUs in ``trainer.devices`` (see the module doc)."""

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

    # One process: rank 0 of 1 whatever the environment says (torchrun, SLURM).
    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        return False  # no DistributedSampler: DataParallel splits each batch itself

    @property
    def root_device(self) -> torch.device:
        if not self.parallel_devices:
            raise ProjectError("trainer.strategy=dp was given no devices; set trainer.devices")
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        return None

    def setup_environment(self) -> None:
        self._require_cuda()
        super().setup_environment()

    def _require_cuda(self) -> None:
        if self.root_device.type != "cuda":
            raise ProjectError(
                f"{NEEDS_GPU}, but the Trainer's devices are {self.root_device.type}; {CPU_HINT}"
            )

    def setup(self, trainer: Trainer) -> None:
        # DataParallel gathers the per-GPU outputs itself; 0-dim outputs are unsqueezed by
        # _ReplicaStep, so its "all input tensors were scalars" warning would only be noise.
        warnings.filterwarnings("ignore", message="Was asked to gather along dimension 0")
        super().setup(trainer)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        return self._data_parallel(_ReplicaStep(model))

    def _data_parallel(self, module: nn.Module) -> nn.Module:
        """The wrapper that replicates, scatters and gathers (tests substitute a CPU stand-in)."""
        return DataParallel(module, device_ids=self.parallel_devices)

    def batch_to_device(self, batch: Any, device: Any = None, dataloader_idx: int = 0) -> Any:
        return batch  # DataParallel scatters each slice straight to its GPU

    # The four steps: run on the replicas, gather, then the module's *_step_end on the real module.
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return mean_loss(self._run_step("training_step", *args, **kwargs))

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._run_step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._run_step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._run_step("predict_step", *args, **kwargs)

    def _run_step(self, step: str, *args: Any, **kwargs: Any) -> Any:
        assert self.model is not None and self.lightning_module is not None
        outputs = self.model(step, *args, **kwargs)
        step_end = getattr(self.lightning_module, _STEP_END_HOOKS[step], None)
        return step_end(outputs) if callable(step_end) else outputs

    # One process: nothing to synchronise.
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor

    def all_gather(self, tensor: Tensor, group: Any = None, sync_grads: bool = False) -> Tensor:
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        return None

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decision

    def teardown(self) -> None:
        super().teardown()
        if self.parallel_devices and self.root_device.type == "cuda":
            torch.cuda.empty_cache()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="DataParallel: one process, several GPUs"
            )
