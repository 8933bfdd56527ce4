"""The library tests' own app: the template's flow (train, eval, predict) in miniature, with its
own configs, so that the library is tested without the template's ``project`` package."""

from pathlib import Path


def config_dir() -> Path:
    from runkit import find_configs

    return find_configs(__file__)
