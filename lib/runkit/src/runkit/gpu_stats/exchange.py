"""Rank 0 hears every rank's figures, and no rank ever waits in a collective for them.

Why not ``all_gather_object``: a collective in an epoch-end hook deadlocks against Lightning's
own metric sync (the progress bar, on rank 0 only, all-reduces a ``sync_dist`` value in its
``on_train_epoch_end`` while the other ranks would wait in ours). Every rank posts its payload
(JSON) in the job's key-value store and goes on; rank 0 alone waits for the others' keys, at
most ``timeout_s``, in short slices so that signals are handled, and goes on without the late
ones (one warning naming them).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from runkit import compat

log = logging.getLogger(__name__)

POLL_S = 0.25
"""Rank 0 waits for the store in slices this long, so Python runs signal handlers between them."""


class RankExchange:
    """Every rank's payload for rank 0, in rank order, through the job's key-value store.

    Every rank calls it at the same hooks, so rounds match by count. Rank 0 removes what it
    read; with ``every_rank``, each rank removes its own payload two rounds later.
    """

    def __init__(self, name: str, timeout_s: float = 30.0) -> None:
        self.name = name
        self.timeout_s = timeout_s
        self._round = 0
        self._late: list[str] = []

    def gather(
        self, trainer: Any, payload: dict[str, Any], every_rank: bool = False
    ) -> list[dict[str, Any]]:
        """Rank 0 (every rank with ``every_rank``): every rank's payload that arrived in time,
        in rank order; any other rank, and a run of one process: ``[payload]``."""
        world, rank = int(trainer.world_size), int(trainer.global_rank)
        if world < 2 or not dist.is_available() or not dist.is_initialized():
            return [payload]
        store = compat.default_store()
        self._round += 1
        prefix = f"runkit/{self.name}/{self._round}/"
        if rank != 0:
            store.set(prefix + str(rank), json.dumps(payload))
            if not every_rank:
                return [payload]
            with contextlib.suppress(Exception):  # two rounds on, every reader has read it
                store.delete_key(f"runkit/{self.name}/{self._round - 2}/{rank}")
        elif every_rank:
            store.set(prefix + "0", json.dumps(payload))
        else:  # keys late ranks posted after rank 0 had gone on
            self._late = [key for key in self._late if not self._delete(store, key)]
        others = [r for r in range(world) if r != rank]
        keys = [prefix + str(r) for r in others]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # a slice that runs out raises: look again
                store.wait(keys, timedelta(seconds=POLL_S))
        gathered, late = {rank: payload}, []
        for other, key in zip(others, keys, strict=True):
            if store.check([key]):
                gathered[other] = json.loads(store.get(key))
                if not every_rank:
                    store.delete_key(key)
            else:
                late.append(other)
                self._late.append(key)
        if late:
            log.warning(
                "gpu_stats: rank %s did not reach %s within %.0f s; its figures are left out "
                "this time (a rank held up elsewhere: look at that rank's log)",
                *(",".join(map(str, late)), self.name, self.timeout_s),
            )
        return [gathered[r] for r in sorted(gathered)]

    @staticmethod
    def _delete(store: Any, key: str) -> bool:
        if store.check([key]):
            store.delete_key(key)
            return True
        return False
