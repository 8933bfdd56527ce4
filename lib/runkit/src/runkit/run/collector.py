"""The cyclic garbage collector is held off while the entry point imports torch and Lightning
(many objects, next to no garbage, yet repeated full collections), then frozen and turned on."""

from __future__ import annotations

import gc

_collector_paused = False


def pause_collector() -> bool:
    """Hold the collector off until the heavy imports are done; True if it was on."""
    global _collector_paused
    _collector_paused = gc.isenabled()  # else the caller manages the collector
    gc.disable()
    return _collector_paused


def resume_collector(freeze: bool) -> None:
    """Turn the collector back on (once); ``freeze`` first, so later forks share what is alive."""
    global _collector_paused
    if _collector_paused:
        _collector_paused = False
        if freeze:
            gc.freeze()
        gc.enable()
