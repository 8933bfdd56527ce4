"""Lightning's ModelCheckpoint with ``last.ckpt`` always current, one serialisation per step, and
runs that resume from a moved folder.

* Lightning 2.6 refreshes ``last.ckpt`` only at steps that also wrote a top-k file, so once the
  metric stops improving it falls behind; here every save point refreshes it.
* Best and last at one step: ``last.ckpt`` is a hard link to the file just written (a copy where
  there are no hard links), swapped in atomically; Lightning's ``save_last="link"`` symlink
  dangles once the folder is copied or the best is rotated out.
* A resumed run writes to a new directory: the earlier run's best checkpoints are found relative
  to the checkpoint resumed from and linked in, so the resumed run's best is its own.
* Under ``fast_dev_run`` nothing is written (Lightning's ``on_train_end`` would write ``last``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from fsspec.utils import get_protocol
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from runkit import compat
from runkit.safety.checkpoints import atomic_link, is_checkpoint
from runkit.safety.resume import run_dir_of

log = logging.getLogger(__name__)


class ModelCheckpoint(LightningModelCheckpoint):
    """Drop-in for ``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._written: tuple[int, str] | None = None  # (global step, file) serialised last
        self._resuming: pl.Trainer | None = None
        compat.skip_unused_batch_hooks(self)

    # private overrides (compat.PRIVATE_APIS): Lightning 2.6 has no public hook for these
    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        self._written = (trainer.global_step, filepath)

    def _save_topk_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        # The file written now may become last.ckpt too: it carries last.ckpt's path.
        previous_last = self.last_model_path
        if self.save_last is True:
            self.last_model_path = self._last_filepath(trainer, monitor_candidates)
        try:
            super()._save_topk_checkpoint(trainer, monitor_candidates)
        finally:
            self.last_model_path = previous_last
        # A save point either way: Lightning then refreshes last.ckpt even if no file was written.
        self._last_global_step_saved = trainer.global_step

    def _save_last_checkpoint(
        self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]
    ) -> None:
        written = self._written
        same_step = written is not None and written[0] == trainer.global_step
        if self.save_last is not True or not same_step or get_protocol(written[1]) != "file":
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        filepath = self._last_filepath(trainer, monitor_candidates)
        # Rank 0 decides, all ranks agree.
        linkable = trainer.is_global_zero and is_checkpoint(written[1])
        if not trainer.strategy.broadcast(linkable, src=0):
            super()._save_last_checkpoint(trainer, monitor_candidates)
            return
        previous, self.last_model_path = self.last_model_path, filepath
        if trainer.is_global_zero and Path(written[1]) != Path(filepath):
            atomic_link(written[1], filepath)
        trainer.strategy.barrier("ModelCheckpoint.last")
        self._last_checkpoint_saved = filepath
        # A previous last.ckpt of another name (versioned), in this directory, not resumed from.
        old = Path(previous).absolute() if previous else None
        resumed = Path(trainer.ckpt_path).absolute() if trainer.ckpt_path else None
        if (
            old
            and previous != filepath
            and old != resumed
            and Path(self.dirpath or "").absolute() in old.parents
        ):
            trainer.strategy.remove_checkpoint(previous)

    def _last_filepath(self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]) -> str:
        """The name Lightning gives ``last.ckpt`` (versioned if taken)."""
        filepath = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        if self._enable_version_counter:
            version = self.STARTING_VERSION
            while self.file_exists(filepath, trainer) and filepath != self.last_model_path:
                filepath = self.format_checkpoint_name(
                    monitor_candidates, self.CHECKPOINT_NAME_LAST, ver=version
                )
                version += 1
        return filepath

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.fast_dev_run:
            super().on_train_end(trainer, pl_module)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._resuming = trainer  # load_state_dict, called next, needs the path resumed from

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer, self._resuming = self._resuming, None
        earlier_dir = state_dict.get("dirpath", self.dirpath)
        if trainer is not None and trainer.state.fn != TrainerFn.FITTING:
            return  # test/validate with ckpt_path=...: this callback saves nothing, keeps its own
        if trainer is None or trainer.ckpt_path is None or earlier_dir == self.dirpath:
            super().load_state_dict(state_dict)  # the same directory: Lightning's way
            return
        files = [
            path
            for path in [*state_dict.get("best_k_models", {}), state_dict.get("best_model_path")]
            if path and (self.save_top_k != -1 or path == state_dict.get("best_model_path"))
        ]
        carried: dict[str, str] | None = None
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
            return
        scores = state_dict.get("best_k_models", {})
        self.best_k_models = {carried[p]: scores[p] for p in scores if p in carried}
        self.best_model_path = carried.get(state_dict.get("best_model_path") or "", "")
        self.best_model_score = state_dict.get("best_model_score")
        kth = state_dict.get("kth_best_model_path") or ""
        if kth in carried:
            self.kth_best_model_path = carried[kth]
            self.kth_value = state_dict.get("kth_value", self.kth_value)

    def _carry(self, files: list[str], earlier_dir: str, resumed: Path) -> dict[str, str] | None:
        """Link the earlier run's ``files`` (looked for relative to the checkpoint resumed from
        first: the run may have moved) into this run's directory: old -> new path; ``None``
        unless every one is found."""
        assert self.dirpath is not None
        homes = [resumed.parent, Path(earlier_dir), run_dir_of(resumed) / Path(earlier_dir).name]
        located: dict[str, Path] = {}
        for old in files:
            try:
                relative = Path(old).relative_to(earlier_dir)
            except ValueError:
                relative = Path(Path(old).name)
            found = next(
                (home / relative for home in homes if is_checkpoint(home / relative)), None
            )
            if found is None:
                return None
            located[old] = found
        carried = {}
        for old, found in located.items():
            new = Path(self.dirpath) / found.name
            if not new.exists():
                atomic_link(found, new)
            carried[old] = str(new)
        return carried
