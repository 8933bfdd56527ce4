"""The conformance corpus: Lightning's demo classes and :mod:`conformance.members`, run by a bare
Trainer (:mod:`conformance.oracle`) and by the CLI; ``FEATURES`` is own-model-and-data.md's table."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parent / "configs"
SEED = 42  # the template's default seed (train.yaml); the oracle seeds the same way

TRAINER: dict[str, Any] = {  # the same for the oracle and the CLI: a few batches
    "max_epochs": 2, "limit_train_batches": 4, "limit_val_batches": 2, "limit_test_batches": 2,
    "log_every_n_steps": 1, "num_sanity_val_steps": 2,
}  # fmt: skip


@dataclass(frozen=True)
class Member:
    """``configs/{model,data}/<name>.yaml``; ``monitor``: key and mode, or None; ``draws_random``:
    the oracle adds ``ResumeState``; ``fixed_test_data``: false where the generator draws it."""

    name: str
    monitor: tuple[str, str] | None
    ddp: bool = False
    exact_resume: bool = True
    draws_random: bool = False
    fixed_test_data: bool = True

    def overrides(self, **trainer: Any) -> list[str]:
        key = "callbacks.model_checkpoint"
        m = self.monitor
        watch = [f"{key}.monitor={m[0]}", f"{key}.mode={m[1]}"] if m else [f"{key}.monitor=null"]
        return [f"model={self.name}", f"data={self.name}", *watch, f"seed={SEED}",
                *(f"trainer.{k}={v}" for k, v in {**TRAINER, **trainer}.items())]  # fmt: skip


MEMBERS = {m.name: m for m in [
    Member("boring", None, ddp=True), Member("manual_boring", None), Member("demo", None),
    Member("transformer", None, draws_random=True),
    Member("iterable", ("val_loss/dataloader_idx_0", "min"), exact_resume=False, draws_random=True,
           fixed_test_data=False),
    Member("patterns", ("val_score", "max"), ddp=True, draws_random=True),
]}  # fmt: skip


@dataclass(frozen=True)
class Feature:
    name: str
    member: str
    template: str
    present: Callable[[Any, Any], bool]


def overrides_hook(cls: Any, hook: str) -> bool:  # not Lightning's default
    base = next(c for c in cls.__mro__ if c.__module__.startswith("lightning.pytorch.core"))
    return getattr(cls, hook, None) is not getattr(base, hook, None)


def _source_has(text: str) -> Callable[[Any, Any], bool]:
    import inspect

    return lambda model, data: any(text in inspect.getsource(c) for c in (model, data))


FEATURES = [
    Feature("Lightning's `BoringModel` / `BoringDataModule`", "boring",
            "as a bare Trainer (one process, DDP x2); eval, exact resume, SIGTERM under DDP",
            lambda m, d: m.__name__ == "BoringModel" and d.__name__ == "BoringDataModule"),
    Feature("Lightning's `ManualOptimBoringModel` (manual optimisation)", "manual_boring",
            "as a bare Trainer; eval, exact resume", lambda m, d: m.__name__ == "ManualOptimBoringModel"),
    Feature("Lightning's `DemoModel`", "demo", "as a bare Trainer; exact resume",
            lambda m, d: m.__name__ == "DemoModel"),
    Feature("Lightning's `LightningTransformer` on generated tokens", "transformer",
            "other dropout masks than a bare Trainer (the reseed at each epoch's first batch); resume not exact", lambda m, d: m.__base__.__name__ == "LightningTransformer"),
    Feature("Lightning's `IterableBoringDataModule` (several train loaders, iterable data)",
            "iterable", "other data than a bare Trainer after the first batch (the reseed); resume not exact",
            lambda m, d: d.__name__ == "IterableBoringDataModule"),
    Feature("`configure_optimizers`: one optimiser", "demo", "as under Lightning",
            _source_has("return torch.optim.Adam(")),
    Feature("`configure_optimizers`: `[optimizers], [schedulers]`", "boring",
            "as under Lightning", _source_has("return [optimizer], [lr_scheduler]")),
    Feature("`configure_optimizers`: dict with a scheduler object", "iterable",
            "as under Lightning", _source_has('"lr_scheduler": torch.optim.lr_scheduler.StepLR')),
    Feature("`configure_optimizers`: scheduler dict with `monitor` and `interval`", "patterns",
            "the suffixed monitor is accepted", _source_has('"interval": "epoch"')),
    Feature("several validation and test loaders (`dataloader_idx` keys)", "patterns",
            "`/dataloader_idx_N` monitors accepted; test figures per loader",
            lambda m, d: d.val_dataloader.__annotations__.get("return") == "list[DataLoader]"),
    Feature("a key logged in `on_validation_epoch_end`", "patterns",
            "monitored by the checkpoint", lambda m, d: overrides_hook(m, "on_validation_epoch_end")),
    Feature("layers built in `setup()`", "patterns", "evaluated and resumed",
            lambda m, d: overrides_hook(m, "setup")),
    Feature("layers built in `configure_model`", "iterable", "evaluated and resumed",
            lambda m, d: overrides_hook(m, "configure_model")),
    Feature("no `validation_step`", "transformer", "no validation, no best checkpoint",
            lambda m, d: not overrides_hook(m, "validation_step")),
    Feature("no `test_step`", "demo", "the test phase is skipped with one line",
            lambda m, d: not overrides_hook(m, "test_step")),
    Feature("`predict_step`", "patterns", "not run by train or eval",
            lambda m, d: overrides_hook(m, "predict_step")),
    Feature("`training_step` returning a dict", "patterns", "as under Lightning",
            _source_has('return {"loss": loss')),
    Feature("`save_hyperparameters` with a nested module and containers", "patterns",
            "plain lists and dicts reach the module", _source_has("save_hyperparameters(ignore")),
    Feature("`prepare_data` writing files", "patterns", "as under Lightning",
            lambda m, d: overrides_hook(d, "prepare_data")),
    Feature("`setup(stage)`", "patterns", "as under Lightning", lambda m, d: overrides_hook(d, "setup")),
    Feature("`transfer_batch_to_device`", "patterns", "as under Lightning",
            lambda m, d: overrides_hook(d, "transfer_batch_to_device")),
    Feature("workers (`num_workers=2`) with augmentation from torch's generator", "patterns",
            "first epoch as a bare Trainer, later ones not (the reseed); resume not exact; "
            "SIGTERM to the process group under DDP is one stop: interrupted.ckpt, exit 143", _source_has("num_workers: int = 2")),
]  # fmt: skip


def feature_table() -> str:
    rows = ["| Lightning feature | corpus member | what the template does |", "|---|---|---|"]
    rows += [f"| {f.name} | `{f.member}` | {f.template} |" for f in FEATURES]
    return "\n".join(rows)
