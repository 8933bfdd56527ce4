"""What a helper process asks of the kernel about its parent. Stdlib only, for every layer."""

from __future__ import annotations

import contextlib
import ctypes
import sys

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux).

    ``PR_SET_PDEATHSIG``: the one way a child learns at once, without polling, that a ``kill -9``
    took its parent. Elsewhere (macOS has no such request) nothing happens; a caller that must not
    outlive its parent also checks ``os.getppid()`` after this call, since a parent that died
    before it sends nothing.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
