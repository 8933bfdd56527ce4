"""Rank 0 hears every rank's figures through the job's TCP store, and no rank waits in a
collective: ``all_gather_object`` in an epoch-end hook deadlocks against Lightning's own metric
sync (rank 0's progress bar all-reduces a ``sync_dist`` value in its ``on_train_epoch_end``)."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

log = logging.getLogger(__name__)

POLL_S = 0.25  # rank 0 waits in slices this long, so Python runs signal handlers between them


@functools.cache
def _client(host: str, port: int) -> Any:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))


def job_store() -> Any | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return _client(host, int(port)) if host and port and dist.is_available() else None


class RankExchange:
    """Every rank's payload for rank 0 in rank order; rounds match by count. Each rank removes
    its own payload two rounds later, when every reader has read it."""

    def __init__(self, name: str, timeout_s: float = 30.0) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._round = 0

    def gather(
        self, trainer: Any, payload: dict[str, Any], every_rank: bool = False
    ) -> list[dict[str, Any]]:
        """Rank 0 (every rank with ``every_rank``): the payloads that arrived within the timeout
        (waited for in slices, so signals are handled); any other rank: ``[payload]``."""
        world, rank = int(trainer.world_size), int(trainer.global_rank)
        store = job_store() if world > 1 else None
        if store is None:
            return [payload]
        self._round += 1
        prefix = f"runkit/{self.name}/{self._round}/"
        if rank != 0 or every_rank:
            store.set(prefix + str(rank), json.dumps(payload))
            with contextlib.suppress(Exception):
                store.delete_key(f"runkit/{self.name}/{self._round - 2}/{rank}")
            if not every_rank:
                return [payload]
        others = [r for r in range(world) if r != rank]
        keys = [prefix + str(r) for r in others]
        deadline = time.monotonic() + self.timeout_s
        while not store.check(keys) and time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # a slice that runs out raises: look again
                store.wait(keys, timedelta(seconds=POLL_S))
        gathered = {rank: payload}
        for other, key in zip(others, keys, strict=True):
            if store.check([key]):
                gathered[other] = json.loads(store.get(key))
        if late := [str(r) for r in others if r not in gathered]:
            log.warning(
                "gpu_stats: rank %s did not reach %s within %.0f s; its figures are left out "
                "this time (a rank held up elsewhere: look at that rank's log)",
                *(",".join(late), self.name, self.timeout_s),
            )
        return [gathered[r] for r in sorted(gathered)]
