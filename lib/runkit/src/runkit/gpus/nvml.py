"""The one door to NVML: :func:`nvml_session` yields ``pynvml`` or a look-alike that tests swap
in (:func:`use_library`, ``RUNKIT_NVML_BACKEND=module:factory``); nvitop's ``libnvml`` cannot."""

from __future__ import annotations

import functools
import importlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

BACKEND_ENV = "RUNKIT_NVML_BACKEND"
UNSUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
_override: Any = None
_lock = threading.Lock()  # one factory call per spec, whichever thread asks first


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here: no library, no driver, or initialisation failed."""


def use_library(lib: Any | None) -> None:
    global _override
    _override = lib


@functools.cache
def _from_spec(spec: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr or "create")
    except (ImportError, AttributeError) as err:
        raise NvmlUnavailable(
            f"{BACKEND_ENV}={spec!r} does not name an importable 'module:factory'"
        ) from err
    return factory()


def load_library() -> Any:
    if _override is not None:
        return _override
    if spec := os.environ.get(BACKEND_ENV):
        with _lock:
            return _from_spec(spec)
    try:
        import pynvml
    except ImportError as err:
        raise NvmlUnavailable(
            "the NVML bindings are not installed (pip install nvidia-ml-py)"
        ) from err
    return pynvml


@contextmanager
def nvml_session() -> Iterator[Any]:
    """NVML initialised for a ``with`` block (sessions nest); :class:`NvmlUnavailable` if it cannot."""
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
    """``query(*args)`` (a callable or a pynvml function's name), or ``None`` where NVML cannot."""
    func = getattr(lib, query, None) if isinstance(query, str) else query
    try:
        return None if func is None else func(*args)
    except (lib.NVMLError, AttributeError):
        return None


def error_classes(lib: Any, names: Iterable[str]) -> tuple[type[BaseException], ...]:
    """The pynvml exception classes called ``names`` that ``lib`` has (old bindings lack some)."""
    return tuple(getattr(lib, n) for n in names if isinstance(getattr(lib, n, None), type))


def as_text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def bare_uuid(uuid: str) -> str:
    """A UUID without ``GPU-``/``MIG-``, lower case: how torch's and NVML's compare."""
    text = str(uuid).strip().lower()
    return text[4:] if text.startswith(("gpu-", "mig-")) else text


def find_handle(lib: Any, uuid: str) -> tuple[Any, str] | None:
    """NVML's handle and UUID for a UUID in any spelling (bare, ``GPU-``, ``MIG-``), or ``None``."""
    is_mig = str(uuid).strip().upper().startswith("MIG-")
    for prefix in ("MIG-", "GPU-") if is_mig else ("GPU-", "MIG-"):
        try:
            return lib.nvmlDeviceGetHandleByUUID(prefix + bare_uuid(uuid)), prefix + bare_uuid(uuid)
        except lib.NVMLError:
            continue
    return None
