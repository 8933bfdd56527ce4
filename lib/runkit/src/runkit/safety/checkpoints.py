"""Checkpoints, ``model.pth`` and networks: written through :mod:`runkit.safety.writes`, loaded checked.

Files load with ``weights_only=True`` after their zip CRCs are checked (torch does not check
them); networks are rebuilt only through trusted ``_target_``s; a sharded checkpoint's
``manifest.json`` (sizes, CRC-32s) is written last.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import warnings
import zipfile
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from fsspec.utils import get_protocol
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn

from runkit.errors import EnvironmentFailure, RunError, file_failure, first_line
from runkit.safety.trusted import TRUSTED_TARGETS, check_trusted
from runkit.safety.writes import FileWriteError, atomic_write

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.pth"
CONFIG_FILE = "config.yaml"
MANIFEST_FILE = "manifest.json"
_PASS = "pass a .ckpt file, a model.pth, a run directory or 'last'"


class CheckpointSaveError(FileWriteError):
    """A checkpoint could not be written; the message names the last good checkpoint."""


class NoRunConfig(RunError):
    """A weights file with no run config inside it or beside it."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Crash-safe local writes beside the target (not in ``$TMPDIR``), verified loads."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
    ) -> None:
        if storage_options is not None or get_protocol(str(path)) != "file":
            return super().save_checkpoint(checkpoint, path, storage_options=storage_options)
        target = Path(str(path).removeprefix("file://"))
        try:
            atomic_write(target, lambda handle: torch.save(checkpoint, handle))
        except FileWriteError as err:
            raise save_failure(target, err.problem) from err.__cause__

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if get_protocol(str(path)) == "file":
            if is_sharded_checkpoint(path):
                return load_sharded(path, map_location=map_location or "cpu")
            if Path(str(path)).is_file():
                verify_archive(path)
        kwargs = {} if map_location is None else {"map_location": map_location}
        safe = True if weights_only is None else weights_only
        return super().load_checkpoint(path, weights_only=safe, **kwargs)


def _newest(paths: Iterable[Path]) -> Path | None:
    return max(paths, key=lambda p: (p.stat().st_mtime_ns, p.name), default=None)


def last_good_checkpoint(directory: Path, prefer: Path | None = None, none: str = "") -> str:
    """Which checkpoint survives in ``directory``: ``prefer`` if it exists, else the newest."""
    if prefer is None or not is_checkpoint(prefer):
        prefer = _newest(p for p in Path(directory).rglob("*.ckpt") if is_checkpoint(p))
    if prefer is None:
        return none or "no checkpoint was kept before it"
    return f"the last good checkpoint is {str(prefer)!r}"


def save_failure(target: Path, problem: str) -> CheckpointSaveError:
    """A write ``problem`` said of the checkpoint ``target``, naming the one that remains."""
    return CheckpointSaveError(
        problem.replace("write ", "write checkpoint ", 1),
        last_good_checkpoint(target.parent, prefer=target),
    )


@contextlib.contextmanager
def full_disk_in_one_line(run_dir: str | Path) -> Iterator[None]:
    """A failed write in the block: one :class:`FileWriteError` line with the last good one."""
    try:
        yield
    except Exception as err:
        chain: list[BaseException] = []
        current: BaseException | None = err
        while current is not None and current not in chain:
            chain.append(current)
            current = current.__cause__ or current.__context__
        ours = next((e for e in chain if isinstance(e, FileWriteError)), None)
        if isinstance(ours, CheckpointSaveError):
            raise ours from None
        failures = (file_failure(e, run_dir) for e in chain if isinstance(e, OSError))
        failed = next((f for f in failures if isinstance(f, EnvironmentFailure)), None)
        if ours is None and failed is None:
            raise
        kept = last_good_checkpoint(Path(run_dir), none="no checkpoint of this run was kept")
        raise FileWriteError(ours.problem if ours else str(failed), kept) from err


def exported_part(model: nn.Module) -> nn.Module:
    """What ``model.pth`` holds: ``model.net`` if it holds every saved weight, else ``model``."""
    net = getattr(model, "net", None)
    if not isinstance(net, nn.Module):
        return model
    weights = {id(t) for t in (*model.parameters(), *model.buffers())}
    inside = {id(t) for t in net.state_dict(keep_vars=True).values()}
    saved = (id(t) for t in model.state_dict(keep_vars=True).values())
    return model if any(i in weights and i not in inside for i in saved) else net


def load_exported_weights(model: nn.Module, data: dict[str, Any], source: str | Path) -> nn.Module:
    part = exported_part(model)
    load_state_into(part, network_state(data, source, "net." if part is not model else ""), source)
    return part


def rebuild_model(model_config: dict[str, Any]) -> nn.Module:
    """The LightningModule of a trusted ``model`` config, its ``configure_model`` run."""
    from hydra.utils import instantiate
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    node = {k: v for k, v in model_config.items() if k not in ("compile", "channels_last")}
    model = instantiate(node, _convert_="all")
    if isinstance(model, LightningModule) and is_overridden("configure_model", model):
        model.configure_model()  # idempotent by Lightning's rule
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def save_weights(net: nn.Module, path: str | Path) -> Path:
    """Export ``net.state_dict()`` crash-safe; a sharded one is gathered (every rank calls)."""
    from torch.distributed.tensor import DTensor

    state = {
        key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
        for key, value in net.state_dict().items()
    }
    dist = torch.distributed
    if not (is_sharded(net) and dist.is_initialized() and dist.get_rank()):
        atomic_write(path, lambda handle: torch.save(state, handle))
    return Path(path)


def is_sharded_checkpoint(path: str | Path) -> bool:
    folder = Path(str(path))
    return folder.is_dir() and any(
        (folder / name).is_file() for name in (MANIFEST_FILE, ".metadata", "meta.pt")
    )


def is_checkpoint(path: str | Path) -> bool:
    return Path(path).is_file() or is_sharded_checkpoint(path)


def checkpoint_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(folder: Path, names: list[str]) -> list[dict[str, Any]]:
    for name in names:
        with (folder / name).open("rb") as handle:
            os.fsync(handle.fileno())
    return [
        {"name": n, "size": (folder / n).stat().st_size, "crc32": _crc(folder / n)} for n in names
    ]


def write_manifest(folder: Path, entries: list[dict[str, Any]]) -> None:
    missing = sorted(set(checkpoint_files(folder)) - {e["name"] for e in entries})
    entries = sorted([*entries, *describe_files(folder, missing)], key=lambda e: e["name"])
    atomic_write(folder / MANIFEST_FILE, json.dumps({"files": entries}, indent=1))


def manifest_names(folder: Path) -> list[str]:
    return [entry["name"] for entry in _manifest(folder) or []]


def _manifest(folder: Path) -> list[dict[str, Any]] | None:
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text(encoding="utf-8"))["files"]
        return [
            {"name": str(e["name"]), "size": int(e["size"]), "crc32": int(e["crc32"])}
            for e in files
        ]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise RunError(
            f"{str(folder)!r} is damaged: its {MANIFEST_FILE} cannot be read ({err})"
        ) from err


def damaged_files(folder: Path, names: Iterable[str] | None = None) -> str | None:
    """One line naming the first file unlike the manifest, or ``None``; ``names``: only these."""
    manifest = _manifest(folder)
    if manifest is None:
        if (folder / ".metadata").is_file():
            return None  # no manifest: its integrity cannot be checked
        return (
            f"{str(folder)!r} is not a complete sharded checkpoint: it has neither a "
            f"{MANIFEST_FILE} nor a .metadata (a save that did not finish?)"
        )
    wanted = None if names is None else set(names)
    for entry in manifest:
        path, size = folder / entry["name"], entry["size"]
        if wanted is not None and entry["name"] not in wanted:
            continue
        shard = f"{str(folder)!r} is damaged: shard file {entry['name']!r}"
        if not path.is_file():
            return f"{shard} is missing"
        if path.stat().st_size != size:
            problem = f"has {path.stat().st_size} bytes, {size} were written"
        elif _crc(path) != entry["crc32"]:
            problem = (
                "does not match its recorded CRC-32 checksum (bytes changed on disk or in a copy)"
            )
        else:
            continue
        return f"{shard} {problem}; use an intact copy of the checkpoint"
    return None


def sharded_state(folder: str | Path, load: bool = True) -> dict[str, torch.Tensor]:
    """A sharded checkpoint's ``state_dict`` (``load=False``: empty, on ``meta``), or one line."""
    import torch.distributed.checkpoint as dcp

    prefix = "state_dict."
    try:
        reader = dcp.FileSystemReader(str(folder))
        state = {
            key[len(prefix) :]: torch.empty(
                tuple(item.size),
                dtype=item.properties.dtype,  # type: ignore[union-attr]
                device="cpu" if load else "meta",
            )
            for key, item in reader.read_metadata().state_dict_metadata.items()
            if key.startswith(prefix) and hasattr(item, "size")
        }
        if load:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load({"state_dict": state}, storage_reader=reader, no_dist=True)
    except Exception as err:
        raise RunError(
            f"{str(folder)!r} is not a readable sharded checkpoint: {first_line(err)}"
        ) from err
    return state


def load_sharded(folder: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A sharded checkpoint as one full checkpoint on one process, no optimiser state."""
    folder = Path(folder)
    if problem := damaged_files(folder):
        raise RunError(problem)
    meta = folder / "meta.pt"
    data = load_file(meta, map_location=map_location) if meta.is_file() else {}
    data["state_dict"] = sharded_state(folder)
    return data


def verify_archive(path: str | Path) -> None:
    """Refuse a zip archive whose records do not match their CRC-32 (legacy files pass)."""
    try:
        Path(path).stat()
    except OSError as err:
        raise RunError(f"cannot read {str(path)!r}: {err.strerror}") from err
    if not zipfile.is_zipfile(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            records = archive.infolist()
            damaged = None if all(i.CRC == 0 for i in records) else archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as err:
        raise RunError(
            f"{str(path)!r} is damaged: its archive structure cannot be read ({err})"
        ) from err
    if damaged is not None:
        raise RunError(
            f"{str(path)!r} is damaged: record {damaged!r} does not match its stored CRC-32 "
            "checksum (bytes changed on disk or in a copy); use an intact copy of the file"
        )


def load_file(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` after :func:`verify_archive`; one line on failure."""
    file = Path(path)
    if is_sharded_checkpoint(file):
        return load_sharded(file, map_location=map_location)
    _check_file(file, str(path))
    verify_archive(file)
    try:
        try:
            data = torch.load(file, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            # an archive of an old torch, without aligned records, cannot be mapped
            data = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:
        raise RunError(
            f"{str(path)!r} is not a readable checkpoint or state_dict (truncated or corrupt?): "
            f"{first_line(err)}"
        ) from err
    if not isinstance(data, dict):
        raise RunError(f"{str(path)!r} holds a {type(data).__name__}, not a state_dict")
    return data


def network_state(
    data: dict[str, Any], source: str | Path = "", prefix: str = "net."
) -> dict[str, torch.Tensor]:
    if "state_dict" in data and "pytorch-lightning_version" in data:
        state = data["state_dict"]
        if not isinstance(state, dict):
            raise RunError(f"{str(source)!r} has a state_dict that is not a dict")
        data = {k[len(prefix) :]: v for k, v in state.items() if str(k).startswith(prefix)}
    odd = next((k for k, v in data.items() if not isinstance(v, torch.Tensor)), None)
    if odd is not None:
        raise RunError(
            f"{str(source)!r} is not a network's state_dict: {str(odd)[:60]!r} is not a tensor"
        )
    return data


def run_config(
    path: str | Path,
    data: dict[str, Any],
    allowed: Iterable[str] = TRUSTED_TARGETS,
    needs: tuple[str, ...] = ("model",),
) -> dict[str, Any]:
    """The trusted ``model``/``data`` config inside ``path`` or in a ``config.yaml`` near it."""
    hparams = data.get("hyper_parameters") or {}
    if isinstance(hparams, dict) and isinstance(hparams.get("config"), dict):
        config, source = hparams["config"], Path(path)
    else:
        candidates = (Path(path).parent / CONFIG_FILE, Path(path).parent.parent / CONFIG_FILE)
        source = next((c for c in candidates if c.is_file()), None)
        if source is None:
            raise NoRunConfig(
                f"cannot rebuild the network for {str(path)!r}: no config inside it and no "
                f"{CONFIG_FILE} beside it; pass the network config with model=..."
            )
        config = _read_yaml(source)
    parts = {key: config[key] for key in ("model", "data") if key in config}
    missing = [key for key in needs if not isinstance(parts.get(key), dict)]
    if missing:
        raise RunError(f"{str(source)!r} has no {missing[0]} config to rebuild it from")
    check_trusted(parts, allowed, source)
    return parts


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml
    from omegaconf import OmegaConf

    try:
        text = path.read_text(encoding="utf-8")
        if any(isinstance(e, yaml.AliasEvent) for e in yaml.parse(text, Loader=yaml.SafeLoader)):
            raise RunError(f"{str(path)!r} uses a YAML alias; configs saved by a run do not")
        config = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except RunError:
        raise
    except Exception as err:
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise RunError(f"cannot read {str(path)!r} as a run config: {reason}") from err
    if not isinstance(config, dict):
        raise RunError(f"{str(path)!r} is not a run config (a YAML mapping)")
    return config


def state_mismatch(
    expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor], built_later: bool = False
) -> str | None:
    """How ``state`` fails to fit ``expected``, in one line, or ``None``."""
    kinds = {
        "missing keys": sorted(set(expected) - set(state)),
        "unexpected keys": [] if built_later else sorted(set(state) - set(expected)),
        "shape mismatch": sorted(
            k for k in set(expected) & set(state) if expected[k].shape != state[k].shape
        ),
    }
    details = [
        f"{label}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
        for label, keys in kinds.items()
        if keys
    ]
    return "; ".join(details) or None


STANDS_FOR: dict[str, Path] = {}  # a file of as_lightning_checkpoint -> the one it stands for


def as_lightning_checkpoint(state: dict[str, torch.Tensor], source: str | Path) -> Path:
    import atexit
    import tempfile

    import lightning

    handle, name = tempfile.mkstemp(suffix=".ckpt", prefix="weights-")
    with os.fdopen(handle, "wb") as file:
        torch.save({"state_dict": state, "pytorch-lightning_version": lightning.__version__}, file)
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    STANDS_FOR[name] = Path(source)
    return Path(name)


def explain_load_failure(trainer: Any, err: BaseException) -> RunError | None:
    path = getattr(trainer, "ckpt_path", None)
    if not path or not isinstance(err, RuntimeError) or "state_dict" not in str(err):
        return None
    try:
        state = load_file(path, mmap=True).get("state_dict")
        mismatch = state_mismatch(trainer.lightning_module.state_dict(), state)
    except Exception:  # not a file we can read again: Lightning's own error stands
        return None
    if not mismatch:
        return None
    return RunError(
        f"{str(STANDS_FOR.get(str(path), path))!r} does not fit "
        f"{type(trainer.lightning_module).__name__} as set up (after setup() and "
        f"configure_model): {mismatch}"
    )


def load_state_into(net: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    mismatch = state_mismatch(net.state_dict(), state)
    if mismatch:
        raise RunError(f"{str(source)!r} does not fit {type(net).__name__}: {mismatch}")
    net.load_state_dict(state)


def load_network(
    path: str | Path,
    device: str | torch.device = "cpu",
    net_config: dict[str, Any] | None = None,
    allowed: Iterable[str] = TRUSTED_TARGETS,
) -> nn.Module:
    """A trained network from a ``.ckpt``/``model.pth``, rebuilt from a trusted config."""
    from hydra.utils import instantiate

    data = load_file(path, map_location=device)
    if net_config is None:
        model_config = run_config(path, data, allowed)["model"]
        net_config = model_config.get("net")
        if not isinstance(net_config, dict):  # no network node: the module is rebuilt
            if not isinstance(model_config.get("_target_"), str):
                raise RunError(
                    f"{str(path)!r}: its run config has neither a model.net nor a model._target_ "
                    "to rebuild the model from"
                )
            model = rebuild_model(model_config)
            return load_exported_weights(model, data, path).to(device).eval()
    net = instantiate(net_config, _convert_="all")
    load_state_into(net, network_state(data, path), path)
    return net.to(device).eval()


def resolve_ckpt_path(
    value: str | None, log_dir: str | Path, task_name: str = "train", tested_weights: bool = False
) -> Path | None:
    """The checked checkpoint a ``ckpt_path`` names (file, sharded or run directory, ``last``)."""
    if value in (None, ""):
        return None
    if value == "last":
        path = _newest(Path(log_dir).glob(f"{task_name}/*runs/**/checkpoints/last.ckpt"))
        if path is None:
            raise RunError(
                "ckpt_path=last found no checkpoints/last.ckpt under "
                f"{Path(log_dir).absolute() / task_name}; pass a .ckpt file or a run directory"
            )
    else:
        path = Path(value).expanduser().absolute()  # lines name the file judged
        if path.is_dir() and not is_sharded_checkpoint(path):
            path = _checkpoint_in(path, value, tested_weights)
    if is_sharded_checkpoint(path):
        if problem := damaged_files(path):
            raise RunError(problem)
        return path.resolve()
    _check_file(path, value)
    if not zipfile.is_zipfile(path):
        raise RunError(
            f"{typed_as(path, value)} is not a complete torch checkpoint (truncated, or another "
            "kind of file)"
        )
    verify_archive(path)
    return path.resolve()


_SPECIAL = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def _check_file(path: Path, value: str) -> None:
    if not path.exists():
        raise RunError(f"{typed_as(path, value)} does not exist; {_PASS}")
    if not path.is_file():
        kind = _SPECIAL.get(stat.S_IFMT(path.stat().st_mode), "a special file")
        raise RunError(f"{typed_as(path, value)} is {kind}, not a regular file; {_PASS}")
    if path.stat().st_size == 0:
        raise RunError(f"{typed_as(path, value)} is an empty file; expected a checkpoint")


def typed_as(path: str | Path, value: str) -> str:
    shown = str(Path(path).absolute())
    return f"ckpt_path={shown!r}" + ("" if value == shown else f" (typed {value!r})")


def _checkpoint_in(folder: Path, value: str, tested_weights: bool) -> Path:
    first = [folder / WEIGHTS_FILE] if tested_weights else []
    for candidate in (*first, folder / "checkpoints" / "last.ckpt", folder / "last.ckpt"):
        if is_checkpoint(candidate):
            if candidate.name == WEIGHTS_FILE:
                log.info("ckpt_path=%s: using its %s (the weights it tested)", value, WEIGHTS_FILE)
            return candidate
    found = (p for d in (folder / "checkpoints", folder) for p in d.glob("*.ckpt"))
    newest = _newest(p for p in found if is_checkpoint(p))
    if newest is None:
        raise RunError(
            f"{typed_as(folder, value)} is a directory without checkpoints/last.ckpt or any other "
            f".ckpt file; {_PASS}"
        )
    log.info("ckpt_path=%s has no last.ckpt: using its newest checkpoint, %s", value, newest.name)
    return newest
