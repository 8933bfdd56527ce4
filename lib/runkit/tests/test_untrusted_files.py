"""A checkpoint or run folder from someone else never runs code the installation did not vouch for.

Each crafted file below loads with ``weights_only=True``; what it would do is in its config's
``_target_``s, which ``hydra.utils.instantiate`` would call. Every one must be refused in one
line before anything is instantiated, and the file it aimed at must be untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TEMPLATE_TARGETS, CliRunner, last_line
from project.models.nets import MLP
from runkit.errors import RunError
from runkit.safety.checkpoints import load_network, save_weights
from runkit.safety.trusted import TRUSTED_TARGETS, check_trusted, is_allowed

NET = {"_target_": "project.models.nets.MLP", "in_features": 64, "hidden": [8], "num_classes": 10}


def crafted_checkpoint(path: Path, config: dict[str, Any]) -> Path:
    """A file shaped like a Lightning checkpoint that carries ``config`` as its run config."""
    net = MLP(in_features=64, hidden=[8], num_classes=10)
    state = {f"net.{key}": value for key, value in net.state_dict().items()}
    data = {
        "pytorch-lightning_version": "2.6.0",
        "state_dict": state,
        "hyper_parameters": {"config": config},
    }
    torch.save(data, path)
    torch.load(path, weights_only=True)  # the crafted file passes torch's own safe loading
    return path


def refusal(path: Path, **kwargs: Any) -> str:
    with pytest.raises(RunError) as info:
        load_network(path, **kwargs, allowed=TEMPLATE_TARGETS)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_checkpoint_whose_target_deletes_a_file_is_refused(tmp_path: Path) -> None:
    victim = tmp_path / "keep me.txt"
    victim.write_text("precious")
    net = {"_target_": "pathlib.Path.unlink", "_args_": [str(victim)]}
    path = crafted_checkpoint(tmp_path / "given.ckpt", {"model": {"net": net}})
    message = refusal(path)
    assert victim.read_text() == "precious"
    assert "'pathlib.Path.unlink'" in message and "model.net._target_" in message
    assert "trusted_targets=[" in message and "allowed=" in message  # how to allow it


def test_clean_weights_with_a_crafted_config_yaml_beside_them_are_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    weights = save_weights(MLP(in_features=64, hidden=[8], num_classes=10), tmp_path / "model.pth")
    net = {"_target_": "pathlib.Path.touch", "_args_": [str(marker)]}
    OmegaConf.save({"model": {"net": net}}, tmp_path / "config.yaml")
    assert "'pathlib.Path.touch'" in refusal(weights)
    assert not marker.exists()


def _touch(marker: Path) -> dict[str, Any]:
    return {"_target_": "pathlib.Path.touch", "_args_": [str(marker)]}


TRICKS = {
    # a target hidden inside an argument list, or a partial, or a list of nodes
    "in-args": lambda m: {"_target_": "torch.nn.Sequential", "_args_": [_touch(m)]},
    "in-kwarg": lambda m: {**NET, "hidden": _touch(m)},
    "partial": lambda m: {**NET, "extra": {**_touch(m), "_partial_": True}},
    "in-list": lambda m: {**NET, "layers": [{"a": [_touch(m)]}]},
    # names that look allowed
    "leading-spaces": lambda m: {"_target_": "  pathlib.Path.touch", "_args_": [str(m)]},
    "prefix-without-dot": lambda m: {"_target_": "torch.nnx.Linear", "in_features": 1},
    "through-an-import": lambda m: {
        "_target_": "torch.nn.modules.module.torch.save",  # torch.nn's module imports torch
        "_args_": [1, str(m)],
    },
    "private-name": lambda m: {"_target_": "torch.nn._reduction.get_enum", "_args_": ["mean"]},
    "not-a-string": lambda m: {"_target_": ["pathlib.Path.touch"], "_args_": [str(m)]},
    # interpolations and resolvers that would build a target after the check
    "interpolated-target": lambda m: {"_target_": "${oc.env:MARKER_TARGET}", "_args_": [str(m)]},
    "decoded-node": lambda m: {**NET, "hidden": "${oc.decode:'{_target_: pathlib.Path.touch}'}"},
}


@pytest.mark.parametrize("trick", TRICKS, ids=list(TRICKS))
def test_tricks_to_slip_a_target_past_the_check_are_refused(
    tmp_path: Path, trick: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MARKER_TARGET", "pathlib.Path.touch")
    marker = tmp_path / "marker"
    path = crafted_checkpoint(tmp_path / "given.ckpt", {"model": {"net": TRICKS[trick](marker)}})
    message = refusal(path)
    assert not marker.exists()
    assert "given.ckpt" in message


def test_a_target_reached_through_a_module_attribute_is_named_by_what_it_is(
    tmp_path: Path,
) -> None:
    path = crafted_checkpoint(
        tmp_path / "given.ckpt", {"model": {"net": TRICKS["through-an-import"](tmp_path / "m")}}
    )
    assert "torch.serialization.save" in refusal(path)


def test_a_prefix_matches_whole_package_names_only() -> None:
    assert is_allowed("project.models.nets.MLP", ["project"])
    assert is_allowed("project.models.nets.MLP", ["project."])
    assert not is_allowed("projectevil.x", ["project"])
    assert not is_allowed("projectevil.x", ["project."])
    assert not is_allowed("torch.save", TRUSTED_TARGETS)
    assert not is_allowed("torch.hub.load", TRUSTED_TARGETS)


@pytest.mark.parametrize(
    "text",
    [
        "model:\n  net: !!python/object/apply:os.system ['touch {marker}']\n",
        "x: &n {{_target_: pathlib.Path.touch}}\nmodel:\n  net: *n\n",
        "- just\n- a list\n",
        "model: [unclosed\n",
    ],
    ids=["yaml-tag", "yaml-alias", "not-a-mapping", "broken-yaml"],
)
def test_hostile_or_broken_config_yaml_is_one_line(tmp_path: Path, text: str) -> None:
    marker = tmp_path / "marker"
    weights = save_weights(MLP(in_features=64, hidden=[8], num_classes=10), tmp_path / "model.pth")
    (tmp_path / "config.yaml").write_text(text.format(marker=marker))
    assert "config.yaml" in refusal(weights)
    assert not marker.exists()


def test_a_node_shared_by_reference_is_refused_before_it_is_expanded(tmp_path: Path) -> None:
    node: dict[str, Any] = {"leaf": 1}
    for _ in range(40):  # copied out, 2**40 nodes: a pickle memo keeps it to 40
        node = {"a": node, "b": node}
    path = crafted_checkpoint(tmp_path / "given.ckpt", {"model": {"net": {**NET, "x": node}}})
    assert "by reference" in refusal(path)


def test_a_config_nested_without_end_is_refused(tmp_path: Path) -> None:
    node: dict[str, Any] = {"leaf": 1}
    for _ in range(500):
        node = {"a": node}
    with pytest.raises(RunError, match="deeper than"):
        check_trusted({"model": node}, TRUSTED_TARGETS, tmp_path / "given.ckpt")


def test_a_users_own_package_loads_once_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "my_nets_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(
        "from torch import nn\n\nclass Tiny(nn.Linear):\n"
        "    def __init__(self):\n        super().__init__(4, 3)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run = tmp_path / "run"
    run.mkdir()
    from torch import nn

    weights = save_weights(nn.Linear(4, 3), run / "model.pth")
    OmegaConf.save({"model": {"net": {"_target_": "my_nets_pkg.nets.Tiny"}}}, run / "config.yaml")
    message = refusal(weights)
    assert "'my_nets_pkg.nets.Tiny'" in message and "'my_nets_pkg.nets.'" in message
    net = load_network(weights, allowed=[*TRUSTED_TARGETS, "my_nets_pkg."])
    assert type(net).__module__ == "my_nets_pkg.nets"


def test_the_template_configs_pass_the_allow_list_eval_yaml_gives() -> None:
    configs = Path(__file__).resolve().parents[3] / "configs"
    trusted = OmegaConf.load(configs / "eval.yaml").trusted_targets
    for group in ("model", "data"):
        for file in sorted((configs / group).glob("*.yaml")):
            node = OmegaConf.to_container(OmegaConf.load(file), resolve=False)
            node = {k: v for k, v in node.items() if k != "defaults"}  # type: ignore[union-attr]
            # interpolations are resolved before a run saves its config; only targets matter here
            targets = {k: v for k, v in _targets(node)}
            check_trusted(targets, trusted, file)


def _targets(node: Any, where: str = "") -> list[tuple[str, dict[str, str]]]:
    found = []
    if isinstance(node, dict):
        if "_target_" in node:
            found.append((where or "top", {"_target_": node["_target_"]}))
        for key, value in node.items():
            found += _targets(value, f"{where}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += _targets(value, f"{where}.{index}")
    return found


@pytest.mark.slow
def test_eval_of_a_crafted_checkpoint_deletes_nothing(tmp_path: Path, cli: CliRunner) -> None:
    victim = tmp_path / "keep me.txt"
    victim.write_text("precious")
    net = {"_target_": "pathlib.Path.unlink", "_args_": [str(victim)]}
    path = crafted_checkpoint(tmp_path / "given.ckpt", {"model": {"net": net}, "data": {}})
    done = cli("eval", f"ckpt_path={path}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    line = last_line(done.stderr)
    assert line.startswith("error: ") and "'pathlib.Path.unlink'" in line, line
    assert "trusted_targets=[" in line
    assert victim.read_text() == "precious"
