"""The one door to NVML, the library behind ``nvidia-smi``.

Everything that reads GPU state goes through :func:`nvml_session`, which yields the ``pynvml``
module (package ``nvidia-ml-py``) or anything with its functions and error classes: tests swap in
:mod:`runkit.testing.fake_nvml` with :func:`use_library`, or for a subprocess with
``RUNKIT_NVML_BACKEND=package.module:factory``. The real code path is the tested one; only the
shared library underneath is replaced. Also here, as every NVML user needs them: :func:`optional`,
:func:`as_text`, :func:`bare_uuid` and :func:`find_handle`.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

BACKEND_ENV = "RUNKIT_NVML_BACKEND"

UNSUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
"""pynvml errors meaning "this GPU or driver cannot answer that", as opposed to a failing GPU."""

_override: Any = None
_env_cache: dict[str, Any] = {}
_lock = threading.Lock()


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here: no library, no driver, or initialisation failed."""


def use_library(lib: Any | None) -> None:
    """Make every later :func:`nvml_session` use ``lib`` (a pynvml look-alike); ``None`` undoes it."""
    global _override
    _override = lib


def load_library() -> Any:
    """Return the pynvml-compatible object this process uses, without initialising it."""
    if _override is not None:
        return _override
    spec = os.environ.get(BACKEND_ENV)
    if spec:
        with _lock:
            if spec not in _env_cache:
                _env_cache[spec] = _load_from_spec(spec)
            return _env_cache[spec]
    try:
        import pynvml
    except ImportError as err:  # nvidia-ml-py is a core dependency, but be kind to trimmed envs
        raise NvmlUnavailable(
            "the NVML bindings are not installed (pip install nvidia-ml-py)"
        ) from err
    return pynvml


def _load_from_spec(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr or "create")
    except (ImportError, AttributeError) as err:
        raise NvmlUnavailable(
            f"{BACKEND_ENV}={spec!r} does not name an importable 'module:factory'"
        ) from err
    return factory()


@contextmanager
def nvml_session() -> Iterator[Any]:
    """Initialise NVML for the duration of a ``with`` block and always shut it down again.

    NVML counts initialisations itself, so sessions may nest (the callback's sampler thread and a
    device listing can overlap). Raises :class:`NvmlUnavailable` with a one-line reason when NVML
    cannot start, for example on a machine without an NVIDIA driver.

    Why not nvitop's ``libnvml``: its lazy module-level init and atexit shutdown import ``pynvml``
    directly, out of reach of ``RUNKIT_NVML_BACKEND`` (the library's design notes).
    """
    lib = load_library()
    try:
        lib.nvmlInit()
    except lib.NVMLError as err:
        raise NvmlUnavailable(f"NVML is not available ({err})") from err
    try:
        yield lib
    finally:
        lib.nvmlShutdown()


def optional(lib: Any, query: str | Callable[..., Any], *args: Any) -> Any:
    """``query(*args)``, or ``None`` where NVML cannot answer it: not supported by this GPU or
    driver, or missing from the bindings. ``query`` is a callable or a pynvml function's name."""
    func = getattr(lib, query, None) if isinstance(query, str) else query
    if func is None:
        return None
    try:
        return func(*args)
    except (lib.NVMLError, AttributeError):
        return None


def error_classes(lib: Any, names: Iterable[str]) -> tuple[type[BaseException], ...]:
    """The pynvml exception classes called ``names`` that ``lib`` has (old bindings lack some)."""
    return tuple(getattr(lib, n) for n in names if isinstance(getattr(lib, n, None), type))


def as_text(value: bytes | str) -> str:
    """NVML returns ``bytes`` in old bindings and ``str`` in new ones; give ``str`` always."""
    return value.decode() if isinstance(value, bytes) else value


def bare_uuid(uuid: str) -> str:
    """A device UUID without its ``GPU-``/``MIG-`` prefix, in lower case: torch reports the bare
    hex and NVML the prefixed form, so this is the one form in which they compare."""
    text = str(uuid).strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def find_handle(lib: Any, uuid: str) -> tuple[Any, str] | None:
    """NVML's handle and UUID for a device UUID in any spelling (bare as torch gives it, ``GPU-``
    or ``MIG-``), or ``None`` when NVML knows no such device."""
    is_mig = str(uuid).strip().upper().startswith("MIG-")
    for prefix in ("MIG-", "GPU-") if is_mig else ("GPU-", "MIG-"):
        candidate = prefix + bare_uuid(uuid)
        try:
            return lib.nvmlDeviceGetHandleByUUID(candidate), candidate
        except lib.NVMLError:
            continue
    return None
