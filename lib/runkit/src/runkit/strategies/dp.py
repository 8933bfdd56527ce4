"""``trainer.strategy=dp``: one process drives several GPUs through ``torch.nn.DataParallel``.

Lightning 2 dropped DataParallel from the Trainer; this brings it back as plain PyTorch uses it:
while the Trainer runs, the module's network attribute (``net`` by default) answers with
``nn.DataParallel(net)``, and the step, loss, metrics and logging run once on the first GPU over
the gathered outputs, so a module needs no DP-specific code. The wrapper is never registered as
a submodule, so ``state_dict`` keys, checkpoints and ``model.pth`` are a single device's. Without
a CUDA GPU there is nothing to split over: the strategy refuses to run.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor, nn
from torch.nn import DataParallel

from runkit.errors import RunError

STRATEGY_NAME = "dp"
CPU_HINT = "on the CPU use trainer=ddp_sim (N processes over gloo)"
NEEDS_GPU = "trainer.strategy=dp asks for a GPU (DataParallel splits each batch over CUDA GPUs)"


def check_dp_request(accelerator: Any, devices: Any, num_nodes: Any = 1) -> None:
    """Refuse ``strategy=dp`` where it cannot run: no CUDA GPU, or more than one node.

    Called by preflight before anything is created; the strategy checks again at setup for code
    that builds a Trainer directly.
    """
    from runkit.gpus.resolve import resolve_devices

    if isinstance(num_nodes, int) and num_nodes > 1:
        raise RunError(
            f"trainer.strategy=dp runs in one process on one machine, but trainer.num_nodes="
            f"{num_nodes}; use trainer=multi_node (DDP) for several machines"
        )
    if str(accelerator).lower() not in ("auto", "gpu", "cuda", "none"):
        raise RunError(f"{NEEDS_GPU}, but trainer.accelerator={accelerator}; {CPU_HINT}")
    # Whether there are GPUs at all ("auto" answers instead of raising); too many asked for, or
    # a missing index, still fails here with resolve_devices' own line.
    plan = resolve_devices("auto", "auto" if devices is None else devices)
    if not plan.gpus:
        reason = (plan.message or "no usable GPU").split(";")[0]  # drop "this run uses the CPU"
        raise RunError(f"{NEEDS_GPU}, but: {reason}; {CPU_HINT}")


class _Autocast(nn.Module):
    """One copy of the network, run under a given autocast dtype."""

    def __init__(self, module: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


class AutocastDataParallel(DataParallel):
    """``nn.DataParallel`` whose copies compute in the caller's autocast dtype.

    torch's ``parallel_apply`` turns autocast on in its worker threads but leaves the dtype at the
    thread's default (float16 on CUDA): under ``precision=bf16-mixed`` the copies on the other
    GPUs would compute in float16, without the loss scaling float16 needs.
    """

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> list[Any]:
        device_type = self.src_device_obj.type
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [_Autocast(replica, device_type, dtype) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class DataParallelStrategy(ParallelStrategy):
    """Single-process data parallelism of ``pl_module.<network>`` over the GPUs in
    ``trainer.devices`` (see the module doc)."""

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        network: str = "net",
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
        self.network = network
        self._parallel_net: nn.Module | None = None  # what pl_module.<network> answers with

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
            raise RunError("trainer.strategy=dp was given no devices; set trainer.devices")
        return self.parallel_devices[0]

    @property
    def distributed_sampler_kwargs(self) -> None:  # type: ignore[override]
        return None

    def setup_environment(self) -> None:
        self._require_cuda()
        super().setup_environment()

    def _require_cuda(self) -> None:
        if self.root_device.type != "cuda":
            raise RunError(
                f"{NEEDS_GPU}, but the Trainer's devices are {self.root_device.type}; {CPU_HINT}"
            )

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        net = self._network(model)
        # private: nn.Module.compile's marker; a compiled network's copies would call the
        # original's compiled code, on the first GPU's weights.
        if getattr(net, "_compiled_call_impl", None) is not None:
            raise RunError(
                "a compiled network (callbacks.speed.compile=true) does not work with "
                "trainer.strategy=dp: the copies DataParallel makes of it cannot run compiled; "
                "use DDP (trainer.devices=N) or callbacks.speed.compile=false"
            )
        # private: nn.Module keeps submodules in `_modules` and looks there only when the
        # instance dict has no such name; shadowing the attribute there makes `pl_module.net`
        # the parallel wrapper without registering it, so parameters and state_dict keys stay.
        self._parallel_net = self._data_parallel(net)
        vars(model)[self.network] = self._parallel_net
        return model

    def _network(self, model: nn.Module) -> nn.Module:
        net = getattr(model, self.network, None)
        if not isinstance(net, nn.Module):
            name = type(model).__name__
            raise RunError(
                f"trainer.strategy=dp parallelises the network in {name}.{self.network}, but "
                f"{name} has no nn.Module attribute {self.network!r}; set "
                "trainer.strategy.network to the attribute that holds the network (trainer=dp)"
            )
        return net

    def _data_parallel(self, net: nn.Module) -> nn.Module:
        """The wrapper that replicates, scatters and gathers (tests substitute a CPU stand-in)."""
        return AutocastDataParallel(net, device_ids=self.parallel_devices)

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
        module = self.lightning_module
        wrapper, self._parallel_net = self._parallel_net, None
        if wrapper is not None and module is not None and vars(module).get(self.network) is wrapper:
            del vars(module)[self.network]  # pl_module.net is the plain network again
        super().teardown()
        if self.parallel_devices and self.root_device.type == "cuda":
            torch.cuda.empty_cache()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if STRATEGY_NAME not in strategy_registry:
            strategy_registry.register(
                STRATEGY_NAME, cls, description="DataParallel: one process, several GPUs"
            )
