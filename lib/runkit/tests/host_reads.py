"""Count the host reads of tensor values made per training and validation step, at the operator.

A *host read* is an operator whose result the host needs before it can go on (``.item()``,
``bool()``, ``aten.equal``, value-dependent sizes such as ``nonzero``, a copy to host memory): on
a CUDA tensor it waits for every queued kernel. :class:`HostReadProbe` keeps a
``TorchDispatchMode`` active in a window around each batch but the first of an epoch or a
validation run, and records each read with its operator and Python line. On a GPU run, reads of
GPU tensors count; on a CPU run tensors are told apart as a GPU run would place them: optimiser
step counters (neither ``fused`` nor ``capturable``), tensors made from Python data and what is
computed from those alone stay on the host, everything else is on the accelerator.

In-process: ``trainer.callbacks.insert(0, HostReadProbe())``; from the command line (``tests/`` on
``PYTHONPATH``): ``+callbacks.host_reads._target_=host_reads.HostReadProbe
+callbacks.host_reads.report=FILE``, each rank writing ``FILE.<rank>.json`` at the end of fit.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Operators that read a value back to the host (their result's size or value is a host number).
VALUE_READS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero,
               aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
               aten.unique_consecutive, aten.bincount, aten.histc}  # fmt: skip
# A boolean mask as an index is a hidden nonzero.
_BOOL_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
# torch.tensor(python_data) and friends: made on the host.
_FROM_PYTHON = {aten.lift_fresh, aten.lift_fresh_copy}
# Python methods that read a CPU tensor without any operator.
PYTHON_READS = ("tolist", "numpy", "cpu")
_PLUMBING = ("torch/utils/_python_dispatch.py", "torch/_tensor.py", "torch/_dynamo/",
             "torch/_compile.py", "torch/overrides.py", "/host_reads.py")  # fmt: skip


def _storage(tensor: torch.Tensor) -> int:
    """Identity of the memory behind ``tensor``, shared by its views and in-place results."""
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # no plain storage (sparse, nested): keep apart
        return id(tensor)


@dataclass(frozen=True)
class HostRead:
    """One host read: the window it happened in, the operator, the Python line that made it."""

    stage: str
    op: str
    line: str
    code: str
    caller: str

    def __str__(self) -> str:
        via = f" (called from {self.caller})" if self.caller and self.caller != self.line else ""
        return f"{self.stage}: {self.op} at {self.line}: {self.code}{via}"


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


def _read_tensors(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], on_accelerator: Any
) -> list[torch.Tensor]:
    """The tensors whose values ``func`` brings to the host; [] when it brings none."""
    packet = func.overloadpacket
    if packet in VALUE_READS:
        return _tensors(args[:2])
    if packet in _BOOL_INDEX_OPS:
        return [t for t in _tensors(args[1:2]) if t.dtype in (torch.bool, torch.uint8)]
    if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
        return _tensors(args[:1])
    if kwargs.get("non_blocking", False):
        return []
    if packet is aten.copy_ and not on_accelerator(args[0]):
        return [args[1]]  # into host memory: a read when the source is on the accelerator
    if packet is aten._to_copy and str(kwargs.get("device", "")) == "cpu":
        return [args[0]]
    return []


def _where() -> tuple[str, str, str]:
    """(innermost line outside torch's plumbing, its code, the innermost test or tinyapp line)."""
    frames = [
        f
        for f in traceback.extract_stack()
        if not any(part in f.filename.replace("\\", "/") for part in _PLUMBING)
    ]
    inner = frames[-1] if frames else None
    ours = next(
        (f for f in reversed(frames) if "/tests/" in f.filename),
        None,
    )

    def short(frame: Any) -> str:
        if frame is None:
            return ""
        path = frame.filename.replace("\\", "/")
        for marker in ("site-packages/", "/src/", "/tests/"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        return f"{path}:{frame.lineno}"

    return short(inner), (inner.line or "") if inner else "", short(ours)


def host_side_storages(optimizers: list[torch.optim.Optimizer]) -> set[int]:
    """Storages of the optimiser step counters torch keeps on the host (neither fused nor capturable)."""
    found = set()
    for optimizer in optimizers:
        on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
        for state in optimizer.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and not on_device:
                found.add(_storage(step))
    return found


class ReadRecorder(TorchDispatchMode):
    """Hands every operator to ``probe``: its reads, and (on the CPU) where its outputs would live."""

    def __init__(self, probe: HostReadProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        probe = self.probe
        probe.check(str(func), _read_tensors(func, args, kwargs, probe.on_accelerator))
        out = func(*args, **kwargs)
        if probe.simulate:
            probe.place(func, [*_tensors(args), *_tensors(kwargs)], _tensors(out))
        return out


class HostReadProbe(pl.Callback):
    """Record the host reads of accelerator-resident tensors made inside each step window."""

    def __init__(self, report: str | None = None) -> None:
        self.report = report
        self.reads: list[HostRead] = []
        self.windows = 0
        self.stage: str | None = None
        self.simulate = True  # CPU run: classify tensors by what they are (see the module doc)
        self.host_side: set[int] = set()  # storages of tensors kept on the host by design
        self._mode: ReadRecorder | None = None
        self._python_reads: dict[str, Any] = {}

    def check(self, op: str, tensors: list[torch.Tensor]) -> None:
        if self.stage is None or not any(self.on_accelerator(t) for t in tensors):
            return
        line, code, caller = _where()
        self.reads.append(HostRead(self.stage, op, line, code, caller))

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether a GPU run would keep ``tensor`` on the GPU (see the module doc)."""
        if not self.simulate:
            return tensor.device.type != "cpu"
        return _storage(tensor) not in self.host_side

    def place(self, func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """On the CPU: outputs of host data alone stay on the host; anything else goes to the accelerator."""
        from_host = func.overloadpacket in _FROM_PYTHON or not any(
            self.on_accelerator(t) for t in inputs
        )
        for tensor in outputs:
            if from_host:
                self.host_side.add(_storage(tensor))
            else:
                self.host_side.discard(_storage(tensor))

    def _open(self, trainer: pl.Trainer, stage: str, batch_idx: int) -> None:
        self._close()
        if batch_idx < 1 or trainer.sanity_checking:
            return
        self.host_side = host_side_storages(trainer.optimizers)
        self.stage, self.windows = stage, self.windows + 1
        self._mode = ReadRecorder(self)
        self._mode.__enter__()

    def _close(self, *_: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.stage = None

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int
    ) -> None:
        self._open(trainer, "train", idx)

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: Any, batch: Any, idx: int, *_: Any
    ) -> None:
        self._open(trainer, "val", idx)

    # The last batch's window ends with the batch: what follows is once-per-epoch work.
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, out: Any, batch: Any, idx: int
    ) -> None:
        if idx == trainer.num_training_batches - 1:
            self._close()

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: Any, out: Any, batch: Any, idx: int, *_: Any
    ) -> None:
        if idx == trainer.num_val_batches[0] - 1:
            self._close()

    on_train_epoch_start = on_train_epoch_end = _close
    on_validation_start = on_validation_epoch_end = on_validation_end = _close

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.simulate = trainer.strategy.root_device.type == "cpu"
        for name in PYTHON_READS if not self._python_reads else ():
            original = getattr(torch.Tensor, name)
            self._python_reads[name] = original

            def read(
                tensor: torch.Tensor, *args: Any, _name: str = name, _orig: Any = original
            ) -> Any:
                if tensor.device.type == "cpu":  # elsewhere the copy dispatches an operator
                    self.check(f"Tensor.{_name}", [tensor])
                return _orig(tensor, *args)

            setattr(torch.Tensor, name, read)

    def teardown(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: Any, exception: BaseException) -> None:
        self._restore()

    def _restore(self) -> None:
        self._close()
        for name, original in self._python_reads.items():
            setattr(torch.Tensor, name, original)
        self._python_reads.clear()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.report:
            path = Path(f"{self.report}.{trainer.global_rank}.json")
            content = {"windows": self.windows, "reads": [asdict(r) for r in self.reads]}
            path.write_text(json.dumps(content, indent=1))

    def summary(self) -> str:
        """The reads, one per line, for a failure message."""
        counts: dict[str, int] = {}
        for read in self.reads:
            counts[str(read)] = counts.get(str(read), 0) + 1
        lines = [f"{n} x {text}" for text, n in counts.items()]
        return f"{len(self.reads)} host reads in {self.windows} step windows:\n" + "\n".join(lines)
