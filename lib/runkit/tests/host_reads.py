"""Count the host reads of tensor values (``.item()``, a copy to the host: on a GPU each waits for
the queued kernels) in each step but an epoch's first; a CPU run places tensors as a GPU run would.
CLI: ``+callbacks.host_reads._target_=host_reads.HostReadProbe +callbacks.host_reads.report=FILE``.
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
VALUE_READS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero,
               aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
               aten.unique_consecutive, aten.bincount, aten.histc}  # fmt: skip
_BOOL_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}  # nonzero
_FROM_PYTHON = {aten.lift_fresh, aten.lift_fresh_copy}  # torch.tensor(python_data)
PYTHON_READS = ("tolist", "numpy", "cpu")  # read a CPU tensor without any operator
_PLUMBING = ("torch/utils/_python_dispatch.py", "torch/_tensor.py", "torch/_dynamo/",
             "torch/_compile.py", "torch/overrides.py", "/host_reads.py")  # fmt: skip


def _storage(tensor: torch.Tensor) -> int:
    try:  # shared by views and in-place results
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, nested: kept apart
        return id(tensor)


@dataclass(frozen=True)
class HostRead:
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
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [t for item in value for t in _tensors(item)]
    return []


def _read_tensors(func: Any, args: Any, kwargs: dict[str, Any], on_accelerator: Any) -> list[Any]:
    """The tensors whose values ``func`` brings to the host."""
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
        return [args[1]]  # into host memory
    if packet is aten._to_copy and str(kwargs.get("device", "")) == "cpu":
        return [args[0]]
    return []


def _where() -> tuple[str, str, str]:
    """(innermost line outside torch's plumbing, its code, the innermost test or tinyapp line)."""
    frames = [f for f in traceback.extract_stack()
              if not any(part in f.filename.replace("\\", "/") for part in _PLUMBING)]  # fmt: skip
    inner = frames[-1] if frames else None
    ours = next((f for f in reversed(frames) if "/tests/" in f.filename), None)

    def short(frame: Any) -> str:
        if frame is None:
            return ""
        path = frame.filename.replace("\\", "/")
        marker = next((m for m in ("site-packages/", "/src/", "/tests/") if m in path), None)
        return f"{path.split(marker, 1)[1] if marker else path}:{frame.lineno}"

    return short(inner), (inner.line or "") if inner else "", short(ours)


class ReadRecorder(TorchDispatchMode):
    """Hands every operator to ``probe``: its reads, and (on the CPU) where its outputs would live."""

    def __init__(self, probe: HostReadProbe) -> None:
        super().__init__()
        self.probe = probe

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs, probe = kwargs or {}, self.probe
        probe.check(str(func), _read_tensors(func, args, kwargs, probe.on_accelerator))
        out = func(*args, **kwargs)
        if probe.simulate:  # outputs of host data alone stay on the host
            inputs = [*_tensors(args), *_tensors(kwargs)]
            host = func.overloadpacket in _FROM_PYTHON or not any(map(probe.on_accelerator, inputs))
            for tensor in _tensors(out):
                (probe.host_side.add if host else probe.host_side.discard)(_storage(tensor))
        return out


class HostReadProbe(pl.Callback):
    """Record the host reads of accelerator-resident tensors made inside each step window."""

    def __init__(self, report: str | None = None) -> None:
        self.report = report
        self.reads: list[HostRead] = []
        self.windows = 0
        self.stage: str | None = None
        self.simulate = True  # a CPU run: place tensors as a GPU run would
        self.host_side: set[int] = set()  # storages of tensors kept on the host
        self._mode: ReadRecorder | None = None
        self._python_reads: dict[str, Any] = {}

    def check(self, op: str, tensors: list[torch.Tensor]) -> None:
        if self.stage is not None and any(self.on_accelerator(t) for t in tensors):
            self.reads.append(HostRead(self.stage, op, *_where()))

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        if not self.simulate:
            return tensor.device.type != "cpu"
        return _storage(tensor) not in self.host_side

    def _open(self, trainer: pl.Trainer, stage: str, batch_idx: int) -> None:
        self._close()
        if batch_idx < 1 or trainer.sanity_checking:
            return
        self.host_side = {  # optimiser step counters torch keeps on the host
            _storage(state["step"])
            for optimizer in trainer.optimizers
            if not any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
            for state in optimizer.state.values()
            if isinstance(state.get("step"), torch.Tensor)
        }
        self.stage, self.windows = stage, self.windows + 1
        self._mode = ReadRecorder(self)
        self._mode.__enter__()

    def _close(self, *_: Any) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self.stage = None

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any, i: int) -> None:
        self._open(trainer, "train", i)

    def on_validation_batch_start(self, trainer: pl.Trainer, module: Any, b: Any, i: int, *_: Any) -> None:  # fmt: skip
        self._open(trainer, "val", i)

    # The last batch's window ends with the batch: what follows is once-per-epoch work.
    def on_train_batch_end(self, trainer: pl.Trainer, m: Any, out: Any, b: Any, i: int) -> None:
        if i == trainer.num_training_batches - 1:
            self._close()

    def on_validation_batch_end(self, trainer: pl.Trainer, m: Any, o: Any, b: Any, i: int, *_: Any) -> None:  # fmt: skip
        if i == trainer.num_val_batches[0] - 1:
            self._close()

    on_train_epoch_start = on_train_epoch_end = _close
    on_validation_start = on_validation_epoch_end = on_validation_end = _close

    def setup(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        self.simulate = trainer.strategy.root_device.type == "cpu"
        for name in PYTHON_READS if not self._python_reads else ():
            original = self._python_reads[name] = getattr(torch.Tensor, name)

            def read(tensor: torch.Tensor, *args: Any, _name: str = name, _orig: Any = original) -> Any:  # fmt: skip
                if tensor.device.type == "cpu":  # elsewhere the copy dispatches an operator
                    self.check(f"Tensor.{_name}", [tensor])
                return _orig(tensor, *args)

            setattr(torch.Tensor, name, read)

    def teardown(self, *_: Any, **__: Any) -> None:
        self._close()
        for name, original in self._python_reads.items():
            setattr(torch.Tensor, name, original)
        self._python_reads.clear()

    on_exception = teardown

    def on_fit_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if self.report:
            content = {"windows": self.windows, "reads": [asdict(r) for r in self.reads]}
            Path(f"{self.report}.{trainer.global_rank}.json").write_text(json.dumps(content, indent=1))  # fmt: skip

    def summary(self) -> str:
        """The reads, one per line, for a failure message."""
        counts: dict[str, int] = {}
        for read in self.reads:
            counts[str(read)] = counts.get(str(read), 0) + 1
        lines = "\n".join(f"{n} x {text}" for text, n in counts.items())
        return f"{len(self.reads)} host reads in {self.windows} step windows:\n{lines}"
