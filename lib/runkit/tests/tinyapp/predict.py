"""``python -m tinyapp.predict ckpt_path=...``: the template's predict.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tinyapp import config_dir
import runkit

log = logging.getLogger(__name__)


def predict(cfg: Any) -> None:
    from lightning.pytorch.utilities import rank_zero_only

    out = Path(cfg.paths.output_dir)
    _, model, ckpt, datamodule = runkit.load_trained(cfg)
    rank_zero_only(log.info)(runkit.prepare_predict(model, datamodule))
    trainer = runkit.run_trainer(cfg, out)
    with runkit.phase("predict", trainer), runkit.full_disk_in_one_line(out):
        trainer.predict(
            model,
            datamodule=datamodule,
            ckpt_path=ckpt,
            return_predictions=False,
            weights_only=True,
        )
    if trainer.is_global_zero:
        log.info("Run directory: %s", out)


main = runkit.hydra_entry(predict, config_name="predict", config_dir=config_dir())

if __name__ == "__main__":
    main()
