"""Python's cyclic garbage collector during a run's start-up: off while torch and Lightning are
imported, frozen and back on once they are.

Used by the entry point (:func:`runkit.run.cli.hydra_entry`, which pauses it) and by the
preflight (:mod:`runkit.run.preflight`, whose checks import every ``_target_``).
"""

from __future__ import annotations

import gc

# True while the entry point holds Python's cyclic garbage collector off (see pause_collector).
_collector_paused = False


def pause_collector() -> bool:
    """Hold the cyclic garbage collector off until the job's imports are done; True if it was on.

    Importing torch and Lightning creates ~400k objects and next to no garbage, yet the collector
    runs a full collection over all of them again and again on the way (one costs ~0.2 s on a
    laptop-class core): 0.7-1.2 s of a ~5.5 s ``import lightning`` (measured by the library's start-up benchmark).
    :func:`resume_collector` turns it back on once the heavy imports are done: after the
    preflight (Hydra's ``on_run_start``/``on_multirun_start``, which imports every ``_target_``),
    or at the latest when the job starts, so a sweep's parent process collects as usual.
    """
    global _collector_paused
    if not gc.isenabled():
        return False  # the caller manages the collector
    gc.disable()
    _collector_paused = True
    return True


def resume_collector(freeze: bool) -> None:
    """Turn the collector back on (once; the first job of a process). ``freeze``: first move
    every object alive now (modules, classes, the config) to the permanent generation
    (``gc.freeze``), so later collections skip them, and processes forked later (the GPU sampler,
    DataLoader workers) share those pages instead of copying each on the first collection, as the
    ``gc`` documentation recommends. What it costs: the little garbage the config composition left
    (kilobytes) stays in memory."""
    global _collector_paused
    if not _collector_paused:
        return
    _collector_paused = False
    if freeze:
        gc.freeze()
    gc.enable()
