"""The library's tests run tinyapp, not the template; its configs are a copy of the template's, so
every file must stay the template's but for where the targets live (then so does every composition)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from tinyapp import config_dir

TEMPLATE_CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def as_read(path: Path) -> tuple[list[str], Any]:
    """Its ``@package`` header and content, each ``_target_`` by its last name, no trusted targets."""
    text = re.sub(r"(_target_: )[\w.]+\.(\w+)", r"\1\2", path.read_text())
    content = yaml.safe_load(text)
    if isinstance(content, dict):
        content.pop("trusted_targets", None)
    return re.findall(r"^#\s*@package\b.*$", text, flags=re.M), content


def test_tinyapp_has_every_config_file_of_the_template_as_the_template_has_it() -> None:
    ours = {p.relative_to(config_dir()): p for p in config_dir().rglob("*.yaml")}
    theirs = {p.relative_to(TEMPLATE_CONFIGS): p for p in TEMPLATE_CONFIGS.rglob("*.yaml")}
    assert sorted(ours) == sorted(theirs) and len(ours) > 40
    for name, path in theirs.items():
        assert as_read(ours[name]) == as_read(path), name
