"""Lightning's ModelCheckpoint with ``last.ckpt`` current at every save point (Lightning 2.6
refreshes it only with a top-k file): a link to the file just written, else saved. A resumed
run links the earlier run's best files into its own directory."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from fsspec.utils import get_protocol
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

from runkit.safety.checkpoints import is_checkpoint
from runkit.safety.resume import run_dir_of
from runkit.safety.writes import atomic_link

log = logging.getLogger(__name__)


class ModelCheckpoint(LightningModelCheckpoint):
    """Drop-in for ``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        given = inspect.signature(super().__init__).bind(*args, **kwargs).arguments
        self._own_last = self.save_last is True
        if self._own_last:
            self.save_last = False  # Lightning writes no last.ckpt: _follow does
        self._on_epoch_end: bool | None = given.get("save_on_train_epoch_end")
        self._every_steps: int = given.get("every_n_train_steps") or 0
        self._last_step = -1
        self._resuming: pl.Trainer | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        due = self._every_steps > 0 and trainer.global_step % self._every_steps == 0
        self._follow(trainer, due, super().on_train_batch_end, module, *args)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        due = self._epoch_due(trainer, True)
        self._follow(trainer, due, super().on_train_epoch_end, module)

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        due = self._epoch_due(trainer, False)
        self._follow(trainer, due, super().on_validation_end, module)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if trainer.fast_dev_run:
            return  # nothing is written under fast_dev_run
        super().on_train_end(trainer, module)
        if self._own_last and self._last_step < 0:  # Lightning's rule: none written yet
            self._write_last(trainer, None)

    def on_exception(self, trainer: pl.Trainer, module: pl.LightningModule, err: Any) -> None:
        super().on_exception(trainer, module, err)
        if self._own_last and self.save_on_exception and not trainer.fast_dev_run:
            self._write_last(trainer, None)

    def _epoch_due(self, trainer: pl.Trainer, at_epoch_end: bool) -> bool:
        if not self.every_n_epochs or (trainer.current_epoch + 1) % self.every_n_epochs:
            return False
        on_end = self._on_epoch_end
        if on_end is None:
            batches = trainer.num_val_batches
            on_end = trainer.check_val_every_n_epoch == 1 and (
                not (sum(batches) if isinstance(batches, list) else batches)
                or trainer.val_check_interval == 1.0
            )
        return on_end == at_epoch_end

    def _follow(
        self, trainer: pl.Trainer, due: bool, hook: Callable[..., None], *args: Any
    ) -> None:
        if not self._own_last:
            return hook(trainer, *args)
        if not self.last_model_path:  # named in the state of every file written from now on
            self.last_model_path = self._last_name(trainer)
        best, topk = self.best_model_path, set(self.best_k_models)
        hook(trainer, *args)
        new = [path for path in self.best_k_models if path not in topk]
        written = (
            new[0] if new else (self.best_model_path if self.best_model_path != best else None)
        )
        saving = (
            trainer.state.fn == "fit" and not trainer.sanity_checking and not trainer.fast_dev_run
        )
        if written or (due and saving and trainer.global_step != self._last_step):
            self._write_last(trainer, written)

    def _last_name(self, trainer: pl.Trainer) -> str:
        name, version = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST), 1
        while self.file_exists(name, trainer):
            name = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST, ver=version)
            version += 1
        return name

    def _write_last(self, trainer: pl.Trainer, written: str | None) -> None:
        last = self.last_model_path or self._last_name(trainer)
        self.last_model_path = last
        local = written is not None and get_protocol(written) == "file"
        # Rank 0 decides, all ranks agree.
        if local and trainer.strategy.broadcast(trainer.is_global_zero and is_checkpoint(written)):
            if trainer.is_global_zero and Path(written) != Path(last):  # type: ignore[arg-type]
                atomic_link(written, last)  # type: ignore[arg-type]
            trainer.strategy.barrier("ModelCheckpoint.last")
        else:
            trainer.save_checkpoint(last, self.save_weights_only)
        self._last_step = trainer.global_step

    def on_load_checkpoint(self, trainer: pl.Trainer, module: Any, checkpoint: Any) -> None:
        self._resuming = trainer  # load_state_dict, called next, needs the path resumed from

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer, self._resuming = self._resuming, None
        earlier_dir = state_dict.get("dirpath", self.dirpath)
        if trainer is not None and trainer.state.fn != "fit":
            return  # test/validate with ckpt_path=...: this callback saves nothing, keeps its own
        if trainer is None or trainer.ckpt_path is None or earlier_dir == self.dirpath:
            return super().load_state_dict(state_dict)  # the same directory: Lightning's way
        best = state_dict.get("best_model_path") or ""
        scores = state_dict.get("best_k_models", {})
        files = [p for p in [*scores, best] if p and (self.save_top_k != -1 or p == best)]
        carried = None
        if trainer.is_global_zero:
            carried = self._carry(files, str(earlier_dir), Path(trainer.ckpt_path))
        carried = trainer.strategy.broadcast(carried, src=0)
        if not carried:
            if files:
                log.warning(
                    "The best checkpoints of the run resumed from are not beside %s; this run "
                    "chooses its best among its own checkpoints",
                    trainer.ckpt_path,
                )
            self.best_model_path = ""
            return None
        self.best_k_models = {carried[p]: scores[p] for p in scores if p in carried}
        self.best_model_path = carried.get(best, "")
        self.best_model_score = state_dict.get("best_model_score")
        kth = state_dict.get("kth_best_model_path") or ""
        if kth in carried:
            self.kth_best_model_path = carried[kth]
            self.kth_value = state_dict.get("kth_value", self.kth_value)
        return None

    def _carry(self, files: list[str], earlier_dir: str, resumed: Path) -> dict[str, str] | None:
        """Link the earlier run's ``files`` (the run may have moved) here: old -> new path."""
        assert self.dirpath is not None
        homes = [resumed.parent, Path(earlier_dir), run_dir_of(resumed) / Path(earlier_dir).name]
        located: dict[str, Path] = {}
        for old in files:
            try:
                relative = Path(old).relative_to(earlier_dir)
            except ValueError:
                relative = Path(Path(old).name)
            found = next((h / relative for h in homes if is_checkpoint(h / relative)), None)
            if found is None:
                return None
            located[old] = found
        for found in located.values():
            if not (Path(self.dirpath) / found.name).exists():
                atomic_link(found, Path(self.dirpath) / found.name)
        return {old: str(Path(self.dirpath) / found.name) for old, found in located.items()}
