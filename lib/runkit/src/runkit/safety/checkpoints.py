"""Saving and loading model state: crash-safe writes, integrity, ``model.pth``, networks from files.

``model.pth`` is what ``torch.save(net.state_dict(), "model.pth")`` writes: a plain ``state_dict``
of the LightningModule's network ``net`` where that holds all its weights (loadable by any PyTorch
code, without Lightning), else of the whole LightningModule (:func:`exported_part`, the one place that rule
lives). Lightning checkpoints (``*.ckpt``) carry the whole training state. Both load with
``weights_only=True``, after their zip CRCs are checked (torch does not check them: a flipped byte
would load as a wrong weight). The run's config travels as plain
data (``config.yaml`` beside ``model.pth``, ``hyper_parameters["config"]`` inside a checkpoint);
the network is rebuilt from it only through trusted ``_target_``s (:mod:`.trusted`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import shutil
import socket
import stat
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

import torch
from fsspec.utils import get_protocol
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch import nn

from runkit.errors import DISK_FULL, EnvironmentFailure, RunError, file_failure
from runkit.safety.trusted import TRUSTED_TARGETS, check_trusted

log = logging.getLogger(__name__)

WEIGHTS_FILE = "model.pth"
CONFIG_FILE = "config.yaml"
# Temporary files: ".<target name>.<pid>-<host tag>-<random>.tmp", so that the next write in the
# directory can tell a dead writer's leftover (kill -9 mid-write) from a live writer's file.
_HOST = f"{zlib.crc32(socket.gethostname().encode()):08x}"
_TEMP = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)-(?P<host>[0-9a-f]{8})-[0-9a-f]{8}\.tmp")
_FOREIGN_TEMP_AGE_S = 24 * 3600  # another machine's temporary file: removed once this old


class FileWriteError(EnvironmentFailure):
    """A file of the run could not be written (full disk, no permission); nothing half-written.

    ``problem`` is the message's first part: what failed, where and why.
    """

    def __init__(self, problem: str, outcome: str = "") -> None:
        super().__init__(f"{problem}; {outcome}" if outcome else problem)
        self.problem = problem


class CheckpointSaveError(FileWriteError):
    """A checkpoint could not be written; the message names the last good checkpoint."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint I/O with crash-safe local writes and verified, safe loads.

    Lightning 2.6 writes local checkpoints through an fsspec transaction that stages the bytes in
    ``$TMPDIR`` and then moves them: a small or full ``/tmp`` fails saves that would fit next to
    the checkpoints, a move across filesystems is a copy (not atomic), and some write errors are
    swallowed (Lightning issue #21800). Here a local checkpoint goes through :func:`atomic_write`,
    so a kill at any moment leaves the old file or the new one, and a full disk is one line naming
    the checkpoint that remains. Remote paths (``s3://`` ...) keep Lightning's way.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None or get_protocol(str(path)) != "file":
            super().save_checkpoint(checkpoint, path, storage_options=storage_options)
            return
        target = Path(str(path).removeprefix("file://"))
        try:
            atomic_write(target, lambda handle: torch.save(checkpoint, handle))
        except FileWriteError as err:
            raise CheckpointSaveError(
                err.problem.replace("write ", "write checkpoint ", 1),
                last_good_checkpoint(target.parent, prefer=target),
            ) from err.__cause__

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's load, after the CRC check, never unpickling objects unless asked to.

        A sharded checkpoint directory (``trainer=fsdp``) is checked against its manifest and
        gathered into one full checkpoint: eval and test on one process load it like a file.
        """
        if get_protocol(str(path)) == "file" and is_sharded_checkpoint(path):
            return load_sharded(path, map_location=map_location or "cpu")
        if get_protocol(str(path)) == "file" and Path(str(path)).is_file():
            verify_archive(path)
        kwargs = {} if map_location is None else {"map_location": map_location}
        safe = True if weights_only is None else weights_only
        return super().load_checkpoint(path, weights_only=safe, **kwargs)


# --------------------------------------------------------------------------- crash-safe writing

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # reading the umask means setting it; put it straight back


class _ErrorKeepingFile:
    """A binary file whose ``write`` remembers its ``OSError``.

    ``torch.save`` turns a failed write (a full disk) into ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``, which says nothing of the cause; this keeps it.
    """

    def __init__(self, handle: IO[bytes]) -> None:
        self.handle = handle
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self.handle.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.handle.flush()

    def tell(self) -> int:
        return self.handle.tell()

    def fileno(self) -> int:
        return self.handle.fileno()


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], None]) -> None:
    """Write a file so that a crash at any moment leaves the old file or the new one, never half.

    The bytes go to a temporary file in the target's own directory (a rename is atomic only
    within one filesystem), are flushed and fsynced, then renamed over the target; the directory
    is fsynced so the rename itself survives a power cut. On failure the temporary file is
    removed and :class:`FileWriteError` says why in one line (``the disk is full`` first).
    Temporary files that writers killed mid-write left in the directory are removed first.
    """
    target = Path(path)
    kept = target.is_file()
    handle: _ErrorKeepingFile | None = None
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target.parent)
        fd, tmp = _temporary(target)
        with os.fdopen(fd, "wb") as raw:
            os.fchmod(raw.fileno(), 0o666 & ~_UMASK)  # mkstemp makes 0600; keep the usual mode
            handle = _ErrorKeepingFile(raw)
            write(handle)  # type: ignore[arg-type]
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, target)
    except BaseException as err:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        cause = err if isinstance(err, OSError) else (handle.error if handle else None)
        if cause is None or not isinstance(err, Exception):
            raise
        raise FileWriteError(*write_failure(target, cause, kept)) from cause
    _fsync_dir(target.parent)


def _temporary_name(target: Path) -> Path:
    """A name beside ``target`` made of it, this process and this machine (``_TEMP``'s pattern,
    which :func:`remove_stale_temporaries` recognises)."""
    return target.parent / f".{target.name}.{os.getpid()}-{_HOST}-{secrets.token_hex(4)}.tmp"


def _temporary(target: Path) -> tuple[int, Path]:
    """A new temporary file beside ``target`` named after it, this process and this machine."""
    while True:
        tmp = _temporary_name(target)
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), tmp
        except FileExistsError:
            continue


def write_failure(target: Path, err: OSError, kept: bool) -> tuple[str, str]:
    """(what failed, what remains) for :class:`FileWriteError`."""
    outcome = "its previous version is unchanged" if kept else "nothing was written"
    if err.errno in DISK_FULL:
        return f"the disk is full: could not write {str(target)!r} ({err.strerror})", outcome
    reason = err.strerror or str(err) or type(err).__name__
    return f"could not write {str(target)!r}: {reason}", outcome


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove the temporary files of writers that died mid-write (``kill -9``), and only those.

    Only names of :func:`atomic_write`'s pattern (files, and the staging directories of sharded
    saves, :func:`new_staging_dir`); only when the writer (the pid in the name, on
    this machine) no longer runs, or the file is a day old and came from another machine.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP.fullmatch(entry.name)
        if match is None or entry.is_symlink():
            continue
        pid, stale = int(match["pid"]), False
        if match["host"] == _HOST:
            stale = pid != os.getpid() and not _alive(pid)
        else:
            with contextlib.suppress(OSError):
                stale = time.time() - entry.stat().st_mtime > _FOREIGN_TEMP_AGE_S
        if stale:
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False):  # a sharded save's staging directory
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


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


def atomic_link(source: str | Path, target: str | Path) -> None:
    """Make ``target`` a second name of ``source``'s bytes, replacing ``target`` atomically.

    A hard link when the filesystem allows one (no second copy on disk), else a crash-safe copy.
    Either way a kill at any moment leaves ``target`` whole: the old file or the new one. A
    sharded checkpoint directory is linked file by file into a new directory (:func:`swap_in`).
    """
    source, target = Path(source), Path(target)
    if source.is_dir():  # a sharded checkpoint: a staging directory of links, swapped in
        staging = new_staging_dir(target)
        for name in [*checkpoint_files(source), MANIFEST_FILE]:
            if (source / name).is_file():
                atomic_link(source / name, staging / name)
        swap_in(staging, target)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent)
    tmp = _temporary_name(target)
    try:
        os.link(source, tmp)
    except OSError:  # no hard links here (some network and FUSE filesystems): copy the bytes
        with source.open("rb") as reader:
            atomic_write(target, lambda handle: shutil.copyfileobj(reader, handle, 1 << 20))
        return
    try:
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise FileWriteError(*write_failure(target, err, target.is_file())) from err
    _fsync_dir(target.parent)


def last_good_checkpoint(directory: Path, prefer: Path | None = None) -> str:
    """Say which checkpoint survives in ``directory``: ``prefer`` if it exists, else the newest."""
    if prefer is not None and is_checkpoint(prefer):
        return f"the last good checkpoint is {str(prefer)!r}"
    found = [p for p in Path(directory).glob("*.ckpt") if is_checkpoint(p)]
    if not found:
        return "no checkpoint was kept before it"
    newest = max(found, key=lambda p: p.stat().st_mtime)
    return f"the last good checkpoint is {str(newest)!r}"


@contextlib.contextmanager
def full_disk_in_one_line(run_dir: str | Path) -> Iterator[None]:
    """Turn a failed write of the run's files anywhere in the block into one
    :class:`FileWriteError` line: a full disk, or the run directory deleted or made unwritable.

    Lightning's loggers write too (the CSV log, at every flush and when a failed fit ends), and
    their ``OSError`` replaces the checkpoint's own error; whichever write failed first, the line
    says what failed, where, and which good checkpoint of the run remains.
    """
    try:
        yield
    except Exception as err:
        chain = _chain(err)
        ours = next((e for e in chain if isinstance(e, FileWriteError)), None)
        if isinstance(ours, CheckpointSaveError):
            raise ours from None
        failures = (file_failure(e, run_dir) for e in chain if isinstance(e, OSError))
        failed = next((f for f in failures if isinstance(f, EnvironmentFailure)), None)
        if ours is None and failed is None:
            raise
        checkpoints = sorted(
            (p for p in Path(run_dir).rglob("*.ckpt") if p.is_file()),
            key=lambda p: p.stat().st_mtime,
        )
        kept = (
            f"the last good checkpoint is {str(checkpoints[-1])!r}"
            if checkpoints
            else "no checkpoint of this run was kept"
        )
        raise FileWriteError(ours.problem if ours else str(failed), kept) from err


def _chain(err: BaseException) -> list[BaseException]:
    chain: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def exported_part(model: nn.Module) -> nn.Module:
    """The module whose weights ``model.pth`` holds: ``model.net`` when it is an ``nn.Module``
    holding every weight of ``model`` (a plain network, loadable without Lightning
    or the LightningModule's code), else ``model`` (a head beside ``net``, as in the
    lightning-hydra-template layout, is part of what the forward uses and must not be dropped).

    Export, eval and :func:`load_network` all go through this rule, so whatever a user's
    LightningModule looks like, the file loads back into the same part of it.
    """
    net = getattr(model, "net", None)
    if not isinstance(net, nn.Module):
        return model
    # Weights: parameters and saved buffers, not extra state (a metric's best-so-far), each once
    # however tied; those that ``net.state_dict()`` does not hold would be lost.
    weights = {id(t) for t in (*model.parameters(), *model.buffers())}
    inside = {id(t) for t in net.state_dict(keep_vars=True).values()}
    saved = (id(t) for t in model.state_dict(keep_vars=True).values())
    return model if any(i in weights and i not in inside for i in saved) else net


def load_exported_weights(model: nn.Module, data: dict[str, Any], source: str | Path) -> nn.Module:
    """Load the weights of a ``model.pth`` or a ``.ckpt`` into the part of ``model`` that
    :func:`exported_part` names, checked key by key (one line on a mismatch); return that part."""
    part = exported_part(model)
    prefix = "net." if part is not model else ""
    load_state_into(part, network_state(data, source, prefix), source)
    return part


def build_layers(model: nn.Module) -> nn.Module:
    """Run a LightningModule's ``configure_model`` (layers built there, not in ``__init__``)
    before its weights are loaded by hand; Lightning requires the hook to be idempotent and
    calls it again in ``fit``/``test``, which then finds the layers made."""
    from lightning.pytorch import LightningModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    if isinstance(model, LightningModule) and is_overridden("configure_model", model):
        model.configure_model()
    return model


def rebuild_model(model_config: dict[str, Any]) -> nn.Module:
    """The LightningModule a run's (trusted) ``model`` config describes, its layers built.

    Runs made before ``callbacks.speed`` existed kept its two switches under ``model``; they are
    dropped here, so such runs still rebuild. Lists and dicts reach the module as plain Python
    containers, as in training (``_convert_="all"``).
    """
    from hydra.utils import instantiate

    retired = ("compile", "channels_last")
    node = {k: v for k, v in model_config.items() if k not in retired}
    return build_layers(instantiate(node, _convert_="all"))


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded (``trainer=fsdp``): exporting it is collective. Asked of its
    FSDP units, not of its parameters: after a forward, FSDP may hold them gathered."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def save_weights(net: nn.Module, path: str | Path) -> Path:
    """Export ``net.state_dict()`` (tensors moved to the CPU) to ``path``, crash-safe.

    A sharded network (``trainer=fsdp``) is gathered tensor by tensor into its full, plain state
    and written by rank 0 only: every rank must call this then (the gathering is collective);
    elsewhere any one process may.
    """
    from torch.distributed.tensor import DTensor

    state = {}
    for key, value in net.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()  # collective: every rank, in the same order
        state[key] = value.detach().cpu()
    if is_sharded(net) and torch.distributed.is_initialized() and torch.distributed.get_rank():
        return Path(path)
    atomic_write(path, lambda handle: torch.save(state, handle))
    return Path(path)


# --------------------------------------------------------------------------- sharded checkpoints
# trainer=fsdp writes a checkpoint as a directory: one file of shards per rank (``__<rank>_0.distcp``,
# torch.distributed.checkpoint), the shards' index (``.metadata``), Lightning's other state
# (``meta.pt``) and, written last, MANIFEST_FILE: every file's size and CRC-32.

MANIFEST_FILE = "manifest.json"
_SHARDED_MARKERS = (MANIFEST_FILE, ".metadata", "meta.pt")


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory (torch.distributed.checkpoint's)."""
    folder = Path(str(path))
    return folder.is_dir() and any((folder / name).is_file() for name in _SHARDED_MARKERS)


def is_checkpoint(path: str | Path) -> bool:
    """A checkpoint file, or a sharded checkpoint directory."""
    return Path(path).is_file() or is_sharded_checkpoint(path)


def new_staging_dir(target: Path) -> Path:
    """An empty directory beside ``target`` for a sharded save, named like :func:`atomic_write`'s
    temporaries (a dead writer's is removed by the next save in the directory)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(target.parent)
    while True:
        tmp = _temporary_name(target)
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def checkpoint_files(folder: Path) -> list[str]:
    """The names of the files of a checkpoint directory, sorted (the manifest's own excluded)."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST_FILE)


def _crc(path: Path) -> int:
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def describe_files(folder: Path, names: Iterable[str]) -> list[dict[str, Any]]:
    """Size and CRC-32 of each named file, each file fsynced (a rank describes its share)."""
    entries = []
    for name in names:
        path = folder / name
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
        entries.append({"name": name, "size": path.stat().st_size, "crc32": _crc(path)})
    return entries


def write_manifest(folder: Path, entries: list[dict[str, Any]]) -> None:
    """Write the directory's manifest (crash-safe), the last file of a sharded save."""
    import json

    listed = {e["name"] for e in entries}
    missing = sorted(set(checkpoint_files(folder)) - listed)
    entries = [*entries, *describe_files(folder, missing)]  # files no rank described (none)
    text = json.dumps({"files": sorted(entries, key=lambda e: e["name"])}, indent=1)
    atomic_write(folder / MANIFEST_FILE, lambda handle: handle.write(text.encode()))


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where
    the system or filesystem cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    done = renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange)
    return done == 0


def swap_in(staging: Path, target: Path) -> None:
    """Make the complete directory ``staging`` the checkpoint ``target``, crash-safe.

    A new name: one rename. Replacing a checkpoint (``last.ckpt``, ``interrupted.ckpt``): the
    two are exchanged atomically, so ``target`` names a complete checkpoint at every moment,
    then the old one is removed; where the system has no atomic exchange, the old one is first
    renamed aside (a kill between the two renames leaves it there, complete, under a temporary
    name that :func:`remove_stale_temporaries` removes later, and ``ckpt_path=<run>`` takes the
    newest checkpoint instead).
    """
    _fsync_dir(staging)
    if target.is_file():
        target.unlink()
    if not target.exists():
        os.replace(staging, target)
    elif _exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)
    else:
        aside = staging.with_name(staging.name.replace(".tmp", "") + f"-{secrets.token_hex(4)}.tmp")
        os.replace(target, aside)
        os.replace(staging, target)
        shutil.rmtree(aside, ignore_errors=True)
    _fsync_dir(target.parent)


def manifest_names(folder: Path) -> list[str]:
    """The files a checkpoint directory's manifest lists; ``[]`` when it has none."""
    return [entry["name"] for entry in _manifest(folder) or []]


def _manifest(folder: Path) -> list[dict[str, Any]] | None:
    import json

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
    """One line naming the first damaged file of a checkpoint directory (checked against its
    manifest: present, same size, same CRC-32), or ``None``. ``names``: only these files (a
    rank checks its share); default every file the manifest lists."""
    manifest = _manifest(folder)
    if manifest is None:
        if not (folder / ".metadata").is_file():
            return (
                f"{str(folder)!r} is not a complete sharded checkpoint: it has neither a "
                f"{MANIFEST_FILE} nor a .metadata (a save that did not finish?)"
            )
        log.debug("%s has no %s; its integrity cannot be checked", folder, MANIFEST_FILE)
        return None
    wanted = None if names is None else set(names)
    for entry in manifest:
        if wanted is not None and entry["name"] not in wanted:
            continue
        path = folder / entry["name"]
        if not path.is_file():
            return f"{str(folder)!r} is damaged: shard file {entry['name']!r} is missing"
        size = path.stat().st_size
        if size != entry["size"]:
            return (
                f"{str(folder)!r} is damaged: shard file {entry['name']!r} has {size} bytes, "
                f"{entry['size']} were written; use an intact copy of the checkpoint"
            )
        if _crc(path) != entry["crc32"]:
            return (
                f"{str(folder)!r} is damaged: shard file {entry['name']!r} does not match its "
                "recorded CRC-32 checksum (bytes changed on disk or in a copy); use an intact "
                "copy of the checkpoint"
            )
    return None


def verify_checkpoint_dir(folder: str | Path) -> None:
    """Refuse a sharded checkpoint directory with a missing or damaged file, in one line."""
    problem = damaged_files(Path(folder))
    if problem:
        raise RunError(problem)


def load_sharded(folder: str | Path, map_location: Any = "cpu") -> dict[str, Any]:
    """A sharded checkpoint directory as one full Lightning checkpoint, on one process.

    The manifest is checked first; ``meta.pt`` (Lightning's loops, callbacks, hyperparameters)
    is loaded with ``weights_only=True``; every tensor of ``state_dict`` is gathered from the
    shards at its full size (torch.distributed.checkpoint without a process group). Optimiser
    states are left out: this is for test and eval, not for resuming.
    """
    import torch.distributed.checkpoint as dcp

    folder = Path(folder)
    verify_checkpoint_dir(folder)
    meta = folder / "meta.pt"
    data = load_file(meta, map_location=map_location) if meta.is_file() else {}
    reader = dcp.FileSystemReader(str(folder))
    try:
        state = {
            f"state_dict.{key}": torch.empty(tuple(item.size), dtype=item.properties.dtype)
            for key, item in _tensor_index(reader).items()
        }
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, no_dist=True)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunError(f"{str(folder)!r} is not a readable sharded checkpoint: {reason}") from err
    data["state_dict"] = {key[len("state_dict.") :]: value for key, value in state.items()}
    return data


def sharded_shapes(folder: str | Path) -> dict[str, torch.Size]:
    """The full shape of every tensor of a sharded checkpoint's ``state_dict``, from its index."""
    import torch.distributed.checkpoint as dcp

    try:
        index = _tensor_index(dcp.FileSystemReader(str(folder)))
    except Exception as err:
        raise RunError(f"{str(folder)!r} is not a readable sharded checkpoint: {err}") from err
    return {key: torch.Size(item.size) for key, item in index.items()}


def _tensor_index(reader: Any) -> dict[str, Any]:
    """The index entry of every tensor of a sharded checkpoint's ``state_dict``, by its key in
    the network (``state_dict.`` dropped)."""
    index = reader.read_metadata().state_dict_metadata
    return {
        key[len("state_dict.") :]: item
        for key, item in index.items()
        if key.startswith("state_dict.") and hasattr(item, "size")
    }


# --------------------------------------------------------------------------- verified loading

_VERIFIED: set[tuple[int, int, int, int]] = set()  # (device, inode, size, mtime) checked already


def verify_archive(path: str | Path) -> None:
    """Refuse a torch zip archive whose records do not match their stored CRC-32, in one line.

    ``torch.load`` does not check the CRCs ``torch.save`` writes, so a flipped byte in a tensor
    loads as a wrong weight (``test/loss=nan``). Reading the archive once more costs about half a
    ``torch.load`` (0.06 s for 100 MB from the page cache). Files that are not zip archives (the
    legacy format) and archives written without CRCs (all zero, ``torch.serialization.
    set_crc32_options(False)``) cannot be checked and pass. A file is checked once per process.
    """
    file = Path(path)
    try:
        stat = file.stat()
    except OSError as err:
        raise RunError(f"cannot read {str(path)!r}: {err.strerror}") from err
    key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if key in _VERIFIED or not zipfile.is_zipfile(file):
        return
    try:
        with zipfile.ZipFile(file) as archive:
            records = archive.infolist()
            if records and all(info.CRC == 0 for info in records):
                log.debug("%s was written without CRCs; its integrity cannot be checked", file)
                _VERIFIED.add(key)
                return
            damaged = archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as err:
        raise RunError(
            f"{str(path)!r} is damaged: its archive structure cannot be read ({err})"
        ) from err
    if damaged is not None:
        raise RunError(
            f"{str(path)!r} is damaged: record {damaged!r} does not match its stored CRC-32 "
            "checksum (bytes changed on disk or in a copy); use an intact copy of the file"
        )
    _VERIFIED.add(key)


def load_file(path: str | Path, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True`` after :func:`verify_archive`; one line on failure.

    ``mmap=True`` maps the tensors instead of reading them: for looking at shapes only.
    A sharded checkpoint directory is gathered into one (:func:`load_sharded`).
    """
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
            # an archive from an old torch without aligned records cannot be mapped: read it
            data = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RunError(
            f"{str(path)!r} is not a readable checkpoint or state_dict (truncated or corrupt?): {reason}"
        ) from err
    if not isinstance(data, dict):
        raise RunError(f"{str(path)!r} holds a {type(data).__name__}, not a state_dict")
    return data


def network_state(
    data: dict[str, Any], source: str | Path = "", prefix: str = "net."
) -> dict[str, torch.Tensor]:
    """The network's ``state_dict`` from a Lightning checkpoint or from a ``model.pth``.

    ``prefix``: where the part lies inside the LightningModule's state (``net.``; ``""`` for the
    whole module, see :func:`exported_part`).
    """
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


class NoRunConfig(RunError):
    """A weights file with no run config inside it or beside it."""


def run_config(
    path: str | Path,
    data: dict[str, Any],
    allowed: Iterable[str] = TRUSTED_TARGETS,
    needs: tuple[str, ...] = ("model",),
) -> dict[str, Any]:
    """The ``model`` and ``data`` config of the run that wrote ``path``, checked against ``allowed``.

    Read from inside the checkpoint, or from ``config.yaml`` beside ``path`` (or one level up).
    Only those two nodes are returned: they are what a network and its data are rebuilt from, and
    every ``_target_`` in them must lie under ``allowed`` (:func:`.trusted.check_trusted`).
    ``needs``: the nodes the caller rebuilds; a config without one of them is one line.
    """
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
    """A ``config.yaml`` as plain data: YAML tags and aliases refused, interpolations kept as text."""
    import yaml
    from omegaconf import OmegaConf

    try:
        text = path.read_text(encoding="utf-8")
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent):
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
    """How ``state`` fails to fit a module whose ``state_dict()`` is ``expected``, in one line.

    ``None`` when every key is present with the right shape; else the missing keys, the unexpected
    ones and the ones of another shape (a few of each), e.g. for a file of another architecture.
    ``built_later``: the module has not been set up yet, so layers its ``setup()`` or
    ``configure_model`` builds are not in ``expected``; unexpected keys are then left to the load
    that runs after those hooks (Lightning's, strict), and only the rest is judged here.
    """
    missing = sorted(set(expected) - set(state))
    unexpected = [] if built_later else sorted(set(state) - set(expected))
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


STANDS_FOR: dict[str, Path] = {}
"""A checkpoint written for Lightning to load (:func:`as_lightning_checkpoint`) -> its source."""


def as_lightning_checkpoint(state: dict[str, torch.Tensor], source: str | Path) -> Path:
    """``state`` (a whole module's, keys as in its ``state_dict()``) as a minimal Lightning
    checkpoint in a temporary file, for ``trainer.test(ckpt_path=...)``: Lightning then loads it
    where it loads any checkpoint, after ``setup()`` and ``configure_model`` built every layer,
    strictly (every weight of the module filled). Removed when the process exits."""
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
    """Lightning's multi-line ``load_state_dict`` error for ``trainer.ckpt_path`` as one line
    naming the keys, judged against the module as set up; ``None`` when that is not the error."""
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
    source = STANDS_FOR.get(str(path), path)
    return RunError(
        f"{str(source)!r} does not fit {type(trainer.lightning_module).__name__} as set up "
        f"(after setup() and configure_model): {mismatch}"
    )


def load_state_into(net: nn.Module, state: dict[str, torch.Tensor], source: str | Path) -> None:
    """``load_state_dict`` that reports a wrong architecture in one line with the offending keys."""
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
    """Load a trained network from a ``.ckpt`` or ``model.pth`` onto ``device``, ready to predict.

    The network is rebuilt from the run's saved config unless ``net_config`` (a ``model.net``
    node with a ``_target_``) is given. A saved config may only name classes under ``allowed``
    (add your own package: ``allowed=[*TRUSTED_TARGETS, "my_project."]``). Returns the network
    in eval mode; for a LightningModule without a ``net`` (:func:`exported_part`), the whole
    LightningModule::

        net = load_network("logs/train/runs/<run>/model.pth", device="cuda:0")
        predictions = net(images.to("cuda:0")).argmax(-1)
    """
    from hydra.utils import instantiate

    data = load_file(path, map_location=device)
    if net_config is None:
        model_config = run_config(path, data, allowed)["model"]
        net_config = model_config.get("net")
        if not isinstance(net_config, dict):  # no network node: the module is what is rebuilt
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
    """Turn the ``ckpt_path`` a user typed into a checkpoint file, or fail in one line.

    Accepted: a ``.ckpt`` / ``model.pth`` file, or a sharded ``.ckpt`` directory (its manifest
    checked); a run directory; ``last``: the newest run under
    ``<log_dir>/<task_name>`` that has a ``last.ckpt``. A run directory gives its
    ``checkpoints/last.ckpt``, else its newest checkpoint (``interrupted.ckpt`` of a run stopped
    before its first save point, say; the choice is logged). ``tested_weights`` (eval): its
    ``model.pth`` first, the weights whose test figures the run reported.
    The file is checked to be a complete torch archive with intact CRCs, without unpickling.
    """
    if value in (None, ""):
        return None
    if value == "last":
        runs = sorted(
            Path(log_dir).glob(f"{task_name}/*runs/**/checkpoints/last.ckpt"),
            key=lambda p: p.stat().st_mtime,
        )
        if not runs:
            raise RunError(
                "ckpt_path=last found no checkpoints/last.ckpt under "
                f"{Path(log_dir).absolute() / task_name}; pass a .ckpt file or a run directory"
            )
        path = runs[-1]
    else:
        path = Path(value).expanduser().absolute()  # lines name the file judged
        if path.is_dir() and not is_sharded_checkpoint(path):
            path = _checkpoint_in(path, value, tested_weights)
    if is_sharded_checkpoint(path):
        verify_checkpoint_dir(path)
        return path.resolve()
    _check_file(path, value)
    if not zipfile.is_zipfile(path):
        raise RunError(
            f"{typed_as(path, value)} is not a complete torch checkpoint (truncated, or another "
            "kind of file)"
        )
    verify_archive(path)
    return path.resolve()


def _check_file(path: Path, value: str) -> None:
    """Refuse a path that is not a non-empty regular file, in one line naming it (never opened:
    reading a FIFO would wait forever)."""
    named = typed_as(path, value)
    if not path.exists():
        raise RunError(
            f"{named} does not exist; pass a .ckpt file, a model.pth, a run directory or 'last'"
        )
    if not path.is_file():
        kind = _SPECIAL.get(stat.S_IFMT(path.stat().st_mode), "a special file")
        raise RunError(
            f"{named} is {kind}, not a regular file; pass a .ckpt file, a model.pth, a run "
            "directory or 'last'"
        )
    if path.stat().st_size == 0:
        raise RunError(f"{named} is an empty file; expected a checkpoint")


_SPECIAL = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def typed_as(path: str | Path, value: str) -> str:
    """``ckpt_path='<the file as resolved>'``, and the value typed when that is another (``last``,
    a run directory, a relative path): a line names the file it judged."""
    shown = str(Path(path).absolute())
    return f"ckpt_path={shown!r}" + ("" if value == shown else f" (typed {value!r})")


def _checkpoint_in(folder: Path, value: str, tested_weights: bool) -> Path:
    """The file a run directory stands for (see :func:`resolve_ckpt_path`)."""
    first = [folder / WEIGHTS_FILE] if tested_weights else []
    for candidate in (*first, folder / "checkpoints" / "last.ckpt", folder / "last.ckpt"):
        if is_checkpoint(candidate):
            if candidate.name == WEIGHTS_FILE:
                log.info("ckpt_path=%s: using its %s (the weights it tested)", value, WEIGHTS_FILE)
            return candidate
    found = [
        p for d in (folder / "checkpoints", folder) for p in d.glob("*.ckpt") if is_checkpoint(p)
    ]
    if not found:
        raise RunError(
            f"{typed_as(folder, value)} is a directory without checkpoints/last.ckpt or any other "
            ".ckpt file; pass a .ckpt file, a model.pth, a run directory or 'last'"
        )
    newest = max(found, key=lambda p: (p.stat().st_mtime_ns, p.name))
    log.info("ckpt_path=%s has no last.ckpt: using its newest checkpoint, %s", value, newest.name)
    return newest
