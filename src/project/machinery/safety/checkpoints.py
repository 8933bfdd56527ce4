"""Saving and loading model state: crash-safe writes, ``model.pth``, networks back from files.

``model.pth`` is what ``torch.save(net.state_dict(), "model.pth")`` writes: a plain ``state_dict``
of the network, loadable by any PyTorch code. Lightning checkpoints (``*.ckpt``) carry the whole
training state. Both load with ``weights_only=True``: the run's config travels as plain data
(``config.yaml`` beside ``model.pth``, ``hyper_parameters["config"]`` inside a checkpoint), and
the network is rebuilt from it.
"""

from __future__ import annotations

import errno
import os
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from torch import nn

from project.errors import ProjectError

WEIGHTS_FILE = "model.pth"
CONFIG_FILE = "config.yaml"
# Test hook: when set to an errno name (ENOSPC, EIO...), every checkpoint write fails half-way
# with that error, as a full disk would make it fail. Used by the bad-input tests.
FAULT_ENV = "PROJECT_FAIL_CHECKPOINT_WRITES"


class CheckpointSaveError(ProjectError):
    """A checkpoint could not be written (full disk, no permission); the previous file is intact."""

    exit_code = 1


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with crash-safe local writes and errors that are never lost.

    Lightning 2.6 writes local checkpoints through an fsspec transaction that stages the bytes in
    ``$TMPDIR`` and then moves them: a small or full ``/tmp`` fails saves that would fit next to
    the checkpoints, a move across filesystems is a copy (not atomic), and some write errors are
    swallowed (Lightning issue #21800). Here a local checkpoint goes through :func:`atomic_write`
    (temporary file beside the target, fsync, rename, fsync of the directory), so a kill at any
    moment leaves the old file or the new one. Remote paths (``s3://`` ...) keep Lightning's way.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        target = Path(str(path).removeprefix("file://"))
        try:
            atomic_write(target, lambda handle: _save_with_faults(checkpoint, handle))
        except OSError as err:
            reason = err.strerror or str(err)
            raise CheckpointSaveError(
                f"could not write checkpoint {str(target)!r}: {reason}; "
                "the previous checkpoint files are unchanged"
            ) from err

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's load, but never unpickling arbitrary objects unless asked explicitly."""
        kwargs = {} if map_location is None else {"map_location": map_location}
        safe = True if weights_only is None else weights_only
        return super().load_checkpoint(path, weights_only=safe, **kwargs)


def _save_with_faults(obj: Any, handle: IO[bytes]) -> None:
    fault = os.environ.get(FAULT_ENV, "")
    if not fault:
        torch.save(obj, handle)
        return
    code = getattr(errno, fault, errno.ENOSPC)
    handle.write(b"PK\x03\x04 partial")  # some bytes reach the temporary file first
    raise OSError(code, os.strerror(code))


def with_atomic_io(plugins: Any) -> list[Any]:
    """The user's Trainer plugins plus :class:`AtomicCheckpointIO`, unless they bring a CheckpointIO."""
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

    if plugins is None:
        listed: list[Any] = []
    elif isinstance(plugins, str) or not isinstance(plugins, Iterable):
        listed = [plugins]
    else:
        listed = list(plugins)
    if not any(isinstance(plugin, CheckpointIO) for plugin in listed):
        listed.append(AtomicCheckpointIO())
    return listed


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # reading the umask means setting it; put it straight back


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file so that a crash at any moment leaves the old file or the new one, never half.

    The bytes go to a temporary file in the target's own directory (a rename is atomic only
    within one filesystem), are flushed and fsynced, then renamed over the target; the directory
    is fsynced so the rename itself survives a power cut. Any error is raised, and the temporary
    file is removed.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o666 & ~_UMASK)  # mkstemp makes 0600; keep the usual mode
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_dir(target.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename is done anyway
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save_weights(net: nn.Module, path: str | Path) -> Path:
    """Export ``net.state_dict()`` (tensors moved to the CPU) to ``path``, crash-safe."""
    state = {key: value.detach().cpu() for key, value in net.state_dict().items()}
    atomic_write(path, lambda handle: torch.save(state, handle))
    return Path(path)


def load_file(path: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True``; a missing or unreadable file is one clear line."""
    file = Path(path)
    if not file.is_file():
        raise ProjectError(f"ckpt_path={str(path)!r} does not exist or is not a file")
    if file.stat().st_size == 0:
        raise ProjectError(f"ckpt_path={str(path)!r} is empty; expected a .ckpt or model.pth file")
    try:
        data = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ProjectError(
            f"{str(path)!r} is not a readable checkpoint or state_dict (truncated or corrupt?): {reason}"
        ) from err
    if not isinstance(data, dict):
        raise ProjectError(f"{str(path)!r} holds a {type(data).__name__}, not a state_dict")
    return data


def network_state(data: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The network's ``state_dict`` from a Lightning checkpoint or from a ``model.pth``."""
    if "state_dict" in data and "pytorch-lightning_version" in data:
        prefix = "net."
        return {k[len(prefix) :]: v for k, v in data["state_dict"].items() if k.startswith(prefix)}
    return data


def run_config(path: str | Path, data: dict[str, Any]) -> dict[str, Any]:
    """The config of the run that wrote ``path``: inside a checkpoint, or ``config.yaml`` beside it."""
    hparams = data.get("hyper_parameters") or {}
    if isinstance(hparams, dict) and isinstance(hparams.get("config"), dict):
        return hparams["config"]
    for candidate in (Path(path).parent / CONFIG_FILE, Path(path).parent.parent / CONFIG_FILE):
        if candidate.is_file():
            from omegaconf import OmegaConf

            config = OmegaConf.to_container(OmegaConf.load(candidate), resolve=False)
            assert isinstance(config, dict)
            return config
    raise ProjectError(
        f"cannot rebuild the network for {str(path)!r}: no config inside it and no {CONFIG_FILE} "
        "beside it; pass the network config with model=..."
    )


def state_mismatch(expected: dict[str, torch.Tensor], state: dict[str, torch.Tensor]) -> str | None:
    """How ``state`` fails to fit a module whose ``state_dict()`` is ``expected``, in one line.

    ``None`` when every key is present with the right shape; else the missing keys, the unexpected
    ones and the ones of another shape (a few of each), e.g. for a file of another architecture.
    """
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(
        k for k in set(expected) & set(state) if expected[k].shape != state[k].shape
    )
    details = [
        f"{label}: {', '.join(keys[:6])}{' ...' if len(keys) > 6 else ''}"
        for label, keys in (
            ("missing keys", missing),
            ("unexpected keys", unexpected),
            ("shape mismatch", mismatched),
        )
        if keys
    ]
    return "; ".join(details) or None


def load_state_into(net: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """``load_state_dict`` that reports a wrong architecture in one line with the offending keys."""
    mismatch = state_mismatch(net.state_dict(), state)
    if mismatch:
        raise ProjectError(f"{str(source)!r} does not fit {type(net).__name__}: {mismatch}")
    net.load_state_dict(state)


def load_network(
    path: str | Path, device: str | torch.device = "cpu", net_config: dict[str, Any] | None = None
) -> nn.Module:
    """Load a trained network from a ``.ckpt`` or ``model.pth`` onto ``device``, ready to predict.

    The network is rebuilt from the run's saved config unless ``net_config`` (a ``model.net``
    node with a ``_target_``) is given. Returns the network in eval mode::

        net = load_network("logs/train/runs/<run>/model.pth", device="cuda:0")
        predictions = net(images.to("cuda:0")).argmax(-1)
    """
    from hydra.utils import instantiate

    data = load_file(path, map_location=device)
    if net_config is None:
        net_config = run_config(path, data)["model"]["net"]
    net = instantiate(net_config)
    load_state_into(net, network_state(data), path)
    return net.to(device).eval()


def resolve_ckpt_path(
    value: str | None, log_dir: str | Path, task_name: str = "train"
) -> Path | None:
    """Turn the ``ckpt_path`` a user typed into a checkpoint file, or fail in one line.

    Accepted: a ``.ckpt`` / ``model.pth`` file; a run directory (its ``checkpoints/last.ckpt``);
    ``last``: the newest run under ``<log_dir>/<task_name>`` that has a ``last.ckpt``.
    The file is checked to be a complete torch archive, without unpickling anything.
    """
    if value in (None, ""):
        return None
    if value == "last":
        runs = sorted(
            Path(log_dir).glob(f"{task_name}/*runs/**/checkpoints/last.ckpt"),
            key=lambda p: p.stat().st_mtime,
        )
        if not runs:
            raise ProjectError(
                f"ckpt_path=last found no checkpoints/last.ckpt under {Path(log_dir) / task_name}; "
                "pass a .ckpt file or a run directory"
            )
        path = runs[-1]
    else:
        path = Path(value).expanduser()
        if path.is_dir():
            for candidate in (path / "checkpoints" / "last.ckpt", path / "last.ckpt"):
                if candidate.is_file():
                    path = candidate
                    break
            else:
                raise ProjectError(
                    f"ckpt_path={value!r} is a directory without checkpoints/last.ckpt; "
                    "pass a .ckpt file, a run directory or 'last'"
                )
    if not path.is_file():
        raise ProjectError(
            f"ckpt_path={value!r} does not exist; pass a .ckpt file, a model.pth, a run directory or 'last'"
        )
    if path.stat().st_size == 0:
        raise ProjectError(f"ckpt_path={value!r} is an empty file; expected a checkpoint")
    if not zipfile.is_zipfile(path):
        raise ProjectError(
            f"ckpt_path={value!r} is not a complete torch checkpoint (truncated, or another kind of file)"
        )
    return path.resolve()
