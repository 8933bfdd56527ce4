"""Jobs that claim a fake GPU, hold it ``hold_s`` s (a stop ends it) and write ``claims.json``; the
job whose ``hold_s`` is ``late_hold_s`` claims once ``after_claims`` others have (test_sweep.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hydra.core.hydra_config import HydraConfig

import runkit
from runkit.gpus import inventory
from runkit.gpus.claims import SelectionPolicy
from runkit.gpus.inventory import TorchCuda
from runkit.gpus.resolve import resolve_for_run
from runkit.safety import signals


def task(cfg) -> dict:
    inventory.probe_torch = lambda uuids=True: TorchCuda(True, 2)
    out = Path(HydraConfig.get().runtime.output_dir)
    after = cfg.after_claims if cfg.hold_s == cfg.late_hold_s else 0
    while after and len(list(out.parent.glob("*/claimed"))) < after:
        time.sleep(0.05)  # a late job: it asks only when the others hold their GPUs
    policy = SelectionPolicy(wait_s=cfg.gpu_wait_s, util_window_s=0.2, lock_dir=cfg.gpu_lock_dir)
    plan = resolve_for_run("gpu", 1, select=cfg.select_gpus, policy=policy, environ={})
    claimed = time.time()
    (out / "claimed").write_text(str(plan.devices))
    while time.time() < claimed + cfg.hold_s and signals.request.received is None:
        time.sleep(0.05)  # a stop signal ends the hold, as a run stops at its next batch
    record = {"gpus": plan.devices, "claimed": claimed, "released": time.time()}
    (out / "claims.json").write_text(json.dumps(record))
    metrics = {"hold_s": float(cfg.hold_s)}
    (out / "metrics.json").write_text(json.dumps({"metrics": metrics}))
    return metrics


main = runkit.hydra_entry(task, "config", Path(__file__).parent / "sweep_app_configs")

if __name__ == "__main__":
    main()
