"""``trainer.strategy=dp``: one process drives several GPUs through ``nn.DataParallel`` (dropped
by Lightning 2); ``pl_module.net`` answers with the wrapper, which is no submodule."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch import nn

from runkit.errors import RunError

CPU_HINT = "on the CPU use trainer=ddp_sim (N processes over gloo)"
NEEDS_GPU = "trainer.strategy=dp asks for a GPU (DataParallel splits each batch over CUDA GPUs)"


def check_dp_request(accelerator: Any, devices: Any, num_nodes: Any = 1) -> None:
    """Refuse ``strategy=dp`` without a CUDA GPU or on several nodes (preflight)."""
    from runkit.gpus.resolve import resolve_devices

    if isinstance(num_nodes, int) and num_nodes > 1:
        raise RunError(
            f"trainer.strategy=dp runs in one process on one machine, but trainer.num_nodes="
            f"{num_nodes}; use trainer=multi_node (DDP) for several machines"
        )
    if str(accelerator).lower() not in ("auto", "gpu", "cuda", "none"):
        raise RunError(f"{NEEDS_GPU}, but trainer.accelerator={accelerator}; {CPU_HINT}")
    plan = resolve_devices("auto", "auto" if devices is None else devices)
    if not plan.gpus:
        reason = (plan.message or "no usable GPU").split(";")[0]  # drop "this run uses the CPU"
        raise RunError(f"{NEEDS_GPU}, but: {reason}; {CPU_HINT}")


class AutocastDataParallel(nn.DataParallel):
    """Copies compute in the caller's autocast dtype (torch's threads would use float16)."""

    def parallel_apply(self, replicas: Any, inputs: Any, kwargs: Any) -> list[Any]:
        device = self.src_device_obj.type
        if torch.is_autocast_enabled(device):  # one autocast a copy: its state is per instance
            dtype = torch.get_autocast_dtype(device)
            replicas = [torch.autocast(device, dtype=dtype)(replica) for replica in replicas]
        return super().parallel_apply(replicas, inputs, kwargs)


class DataParallelStrategy(ParallelStrategy):
    strategy_name = "dp"
    # One process: rank 0 of 1 whatever the environment says; DataParallel splits the batches.
    global_rank = local_rank = node_rank = 0  # type: ignore[assignment]
    world_size = 1  # type: ignore[assignment]
    is_distributed = False  # type: ignore[assignment]
    distributed_sampler_kwargs = None  # type: ignore[assignment]

    def __init__(
        self,
        network: str = "net",
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(accelerator, parallel_devices, None, checkpoint_io, precision_plugin)
        self.network = network
        self._parallel_net: nn.Module | None = None  # what pl_module.<network> answers with

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices  # Lightning's accelerator connector sets them
        return self.parallel_devices[0]

    def setup_environment(self) -> None:
        if self.root_device.type != "cuda":
            raise RunError(
                f"{NEEDS_GPU}, but the Trainer's devices are {self.root_device.type}; {CPU_HINT}"
            )
        super().setup_environment()

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _setup_model(self, model: nn.Module) -> nn.Module:
        net, name = getattr(model, self.network, None), type(model).__name__
        if not isinstance(net, nn.Module):
            raise RunError(
                f"trainer.strategy=dp parallelises the network in {name}.{self.network}, but "
                f"{name} has no nn.Module attribute {self.network!r}; set "
                "trainer.strategy.network to the attribute that holds the network (trainer=dp)"
            )
        if getattr(net, "compiled_by_runkit", False):  # runkit.speed marks what it compiled
            raise RunError(
                "a compiled network (callbacks.speed.compile=true) does not work with "
                "trainer.strategy=dp: the copies DataParallel makes of it cannot run compiled; "
                "use DDP (trainer.devices=N) or callbacks.speed.compile=false"
            )
        # The instance dict comes before nn.Module.__getattr__: the wrapper shadows the network
        # without being registered (its keys and parameters stay the network's).
        wrapper = AutocastDataParallel(net, device_ids=self.parallel_devices)
        self._parallel_net = vars(model)[self.network] = wrapper
        return model

    def _same(self, value: Any, *args: Any, **kwargs: Any) -> Any:  # one process: as it is
        return value

    reduce = all_gather = broadcast = reduce_boolean_decision = _same  # type: ignore[assignment]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        return None

    def teardown(self) -> None:
        module, wrapper, self._parallel_net = self.lightning_module, self._parallel_net, None
        if wrapper is not None and module is not None and vars(module).get(self.network) is wrapper:
            del vars(module)[self.network]  # pl_module.net is the plain network again
        super().teardown()
        if self.parallel_devices and self.root_device.type == "cuda":
            torch.cuda.empty_cache()
