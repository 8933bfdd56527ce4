"""What a helper process asks of the kernel about its parent. Stdlib only, for every layer."""

from __future__ import annotations

import contextlib
import ctypes
import sys


def die_with_parent(signum: int) -> None:
    """Have the kernel send ``signum`` when the parent dies (``PR_SET_PDEATHSIG``, Linux only):
    a caller that must not outlive it also checks ``os.getppid()`` after this call."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signum), 0, 0, 0)  # PR_SET_PDEATHSIG
