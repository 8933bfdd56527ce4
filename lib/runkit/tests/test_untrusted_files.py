"""A checkpoint or config from someone else never instantiates a _target_ not trusted."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from conftest import TEMPLATE_TARGETS, CliRunner, last_line
from tinyapp.models import MLP
from runkit.errors import RunError
from runkit.safety.checkpoints import load_network, save_weights
from runkit.safety.trusted import MAX_DEPTH, TRUSTED_TARGETS, check_trusted, is_allowed

NET = {"_target_": "tinyapp.models.MLP", "in_features": 64, "hidden": [8], "num_classes": 10}


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


def _touch(marker: Path) -> dict[str, Any]:
    return {"_target_": "pathlib.Path.touch", "_args_": [str(marker)]}


def _shared() -> dict[str, Any]:
    node: dict[str, Any] = {"leaf": 1}
    for _ in range(40):  # copied out, 2**40 nodes: a pickle memo keeps it to 40
        node = {"a": node, "b": node}
    return {**NET, "x": node}


IN_CKPT = ("given.ckpt",)
# (the net config in a checkpoint, or a config.yaml's text beside clean weights; what is said)
TRICKS: dict[str, tuple[Any, Any, tuple[str, ...]]] = {
    "deletes-a-file": (
        lambda m, victim: {"_target_": "pathlib.Path.unlink", "_args_": [str(victim)]},
        None,
        ("'pathlib.Path.unlink'", "model.net._target_", "trusted_targets=[", "allowed="),
    ),
    # a target hidden inside an argument list, or a partial, or a list of nodes
    "in-args": (lambda m, v: {"_target_": "torch.nn.Sequential", "_args_": [_touch(m)]}, None, IN_CKPT),
    "in-kwarg": (lambda m, v: {**NET, "hidden": _touch(m)}, None, IN_CKPT),
    "partial": (lambda m, v: {**NET, "extra": {**_touch(m), "_partial_": True}}, None, IN_CKPT),
    "in-list": (lambda m, v: {**NET, "layers": [{"a": [_touch(m)]}]}, None, IN_CKPT),
    # names that look allowed
    "leading-spaces": (lambda m, v: {"_target_": "  pathlib.Path.touch", "_args_": [str(m)]}, None, IN_CKPT),
    "prefix-without-dot": (lambda m, v: {"_target_": "torch.nnx.Linear", "in_features": 1}, None, IN_CKPT),
    "through-an-import": (  # torch.nn's module imports torch
        lambda m, v: {"_target_": "torch.nn.modules.module.torch.save", "_args_": [1, str(m)]}, None, IN_CKPT,
    ),
    "private-name": (lambda m, v: {"_target_": "torch.nn._reduction.get_enum", "_args_": ["mean"]}, None, IN_CKPT),
    "not-a-string": (lambda m, v: {"_target_": ["pathlib.Path.touch"], "_args_": [str(m)]}, None, IN_CKPT),
    # interpolations and resolvers that would build a target after the check
    "interpolated-target": (lambda m, v: {"_target_": "${oc.env:MARKER_TARGET}", "_args_": [str(m)]}, None, IN_CKPT),
    "decoded-node": (lambda m, v: {**NET, "hidden": "${oc.decode:'{_target_: pathlib.Path.touch}'}"}, None, IN_CKPT),
    "shared-by-reference": (lambda m, v: _shared(), None, ("by reference",)),
    # a crafted config.yaml beside clean weights
    "config-yaml": (None, lambda m: OmegaConf.to_yaml({"model": {"net": _touch(m)}}), ("'pathlib.Path.touch'",)),
    "yaml-tag": (None, lambda m: f"model:\n  net: !!python/object/apply:os.system ['touch {m}']\n", ("config.yaml",)),
}  # fmt: skip


@pytest.mark.parametrize("trick", TRICKS, ids=list(TRICKS))
def test_crafted_configs_are_refused_before_anything_runs(
    tmp_path: Path, trick: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MARKER_TARGET", "pathlib.Path.touch")
    marker, victim = tmp_path / "marker", tmp_path / "keep me.txt"
    victim.write_text("precious")
    net, yaml, said = TRICKS[trick]
    if net is not None:
        path = crafted_checkpoint(tmp_path / "given.ckpt", {"model": {"net": net(marker, victim)}})
    else:
        path = save_weights(MLP(in_features=64, hidden=[8], num_classes=10), tmp_path / "model.pth")
        (tmp_path / "config.yaml").write_text(yaml(marker))
    message = refusal(path)
    assert not marker.exists() and victim.read_text() == "precious"
    assert all(words in message for words in said), message


def test_an_allowed_prefix_covers_whole_names_only() -> None:
    assert is_allowed("project.models.nets.MLP", ["project"])
    assert is_allowed("project.models.nets.MLP", ["project."])
    assert not is_allowed("projectevil.x", ["project"])
    assert not is_allowed("projectevil.x", ["project."])
    assert not is_allowed("torch.save", TRUSTED_TARGETS)
    assert not is_allowed("torch.hub.load", TRUSTED_TARGETS)
    assert not is_allowed("os.system", ["", " ", "."])
    assert is_allowed("torch.nn.Linear", [" torch.nn. "])
    assert is_allowed("torch.nn", ["torch.nn."])
    assert not is_allowed("torch.nnx.Linear", ["torch.nn"])
    assert is_allowed("b.c", ["a.", "b"])  # any of them
    assert is_allowed("pkg.modelX.Net", ["pkg.modelX"])
    assert not is_allowed("pkg.model.Net", ["pkg.modelX"])


def test_a_users_own_package_loads_once_allowed(probe_package: str, tmp_path: Path) -> None:
    weights = save_weights(torch.nn.Linear(4, 3), tmp_path / "run" / "model.pth")
    net_config = {"_target_": f"{probe_package}.nets.Tiny"}
    OmegaConf.save({"model": {"net": net_config}}, tmp_path / "run" / "config.yaml")
    message = refusal(weights)
    assert f"'{probe_package}.nets.Tiny'" in message and f"'{probe_package}.nets.'" in message
    net = load_network(weights, allowed=[*TRUSTED_TARGETS, f"{probe_package}."])
    assert type(net).__module__ == f"{probe_package}.nets"


def test_the_template_configs_pass_the_allow_list_eval_yaml_gives() -> None:
    configs = Path(__file__).resolve().parents[3] / "configs"
    trusted = OmegaConf.load(configs / "eval.yaml").trusted_targets
    files = sorted([*(configs / "model").glob("*.yaml"), *(configs / "data").glob("*.yaml")])
    for file in files:
        # a run saves its config resolved: here an interpolation stands for a resolved value
        text = json.dumps(OmegaConf.to_container(OmegaConf.load(file), resolve=False))
        check_trusted(json.loads(text.replace("${", "$")), trusted, file)
    assert len(files) > 2


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


def refused(tree: Any, allowed: Any = ("torch.nn.",)) -> str:
    with pytest.raises(RunError) as info:
        check_trusted(tree, allowed, "given.ckpt")
    assert "\n" not in str(info.value)
    return str(info.value)


def test_check_trusted_names_every_refused_node_and_how_to_allow_it_or_what_is_malformed() -> None:
    tree = {
        "net": {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1},
        "layers": [{"_target_": "torch.nn.ReLU"}, 3, None, 1.5, "text"],
    }
    check_trusted(tree, ["torch.nn."], "given.ckpt")
    check_trusted("plain", ["torch.nn."], "given.ckpt")
    check_trusted([], [], "given.ckpt")
    message = refused({"model": {"layers": [{"_target_": "collections.OrderedDict"}]}})
    assert message == (
        "'given.ckpt' asks to instantiate model.layers.0._target_='collections.OrderedDict', "
        "which is not under the trusted targets [torch.nn.]; only if you trust this file, allow "
        "it with 'trusted_targets=[torch.nn.,collections.]' (eval, predict) or "
        "load_network(..., allowed=[..., 'collections.'])"
    )
    tree = {
        "model": {
            "net": {"_target_": "collections.OrderedDict"},
            "loss": {"_target_": "json.JSONDecoder"},
        },
        "data": {
            "_target_": "json.JSONEncoder",
            "layer": {"_target_": "torch.nn.modules.module.torch.save"},
        },
        "fine": {"_target_": "torch.nn.Linear", "in_features": 1, "out_features": 1},
    }
    message = refused(tree)
    assert message == (
        "'given.ckpt' asks to instantiate data._target_='json.JSONEncoder', "
        "data.layer._target_='torch.nn.modules.module.torch.save' (which is "
        "torch.serialization.save), model.loss._target_='json.JSONDecoder', "
        "model.net._target_='collections.OrderedDict', which are not under the trusted targets "
        "[torch.nn.]; only if you trust this file, allow them with "
        "'trusted_targets=[torch.nn.,json.,torch.serialization.,collections.]' (eval, predict) "
        "or load_network(..., allowed=[..., 'json.', 'torch.serialization.', 'collections.'])"
    )
    check_trusted(tree, ["torch.nn.", "json.", "torch.serialization.", "collections."], "x")
    message = refused({"_target_": "torch.nn.modules.module.torch.save"})
    assert message.startswith(
        "'given.ckpt' asks to instantiate _target_='torch.nn.modules.module.torch.save' "
        "(which is torch.serialization.save), which is not under the trusted targets [torch.nn.]"
    )
    assert "'trusted_targets=[torch.nn.,torch.serialization.]'" in message
    message = refused({"_target_": "os.system"}, allowed=("torch.nn.", "torch.optim."))
    assert "not under the trusted targets [torch.nn., torch.optim.]; " in message
    assert "'trusted_targets=[torch.nn.,torch.optim.,os.]'" in message
    for tree in (
        {"a": {"_target_": "os.system"}, "b": "text"},
        {"b": "text", "a": {"_target_": "os.system"}},
        ["text", {"_target_": "os.system"}],
        [{"_target_": "os.system"}, "text"],
    ):
        assert "'os.system'" in refused(tree)

    assert "_target_='torch.nn._reduction.get_enum'" in refused(
        {"_target_": "torch.nn._reduction.get_enum"}
    )
    for odd in (" torch.nn.Linear", "torch.nn.Linear()", "torch..nn", 5, "_torch.nn"):
        message = refused({"x": {"_target_": odd}})
        assert message == (
            f"'given.ckpt' has x._target_={str(odd)[:80]!r}, not a plain dotted name "
            "(letters, digits, '_' and '.', no leading '_'); refusing to instantiate it"
        )
    assert "'" + "a" * 80 + "'" in refused({"_target_": "a" * 90 + "!"})
    message = refused({"_target_": "torch.nn.NoSuchLayer"})
    assert message.startswith(
        "'given.ckpt' names _target_='torch.nn.NoSuchLayer', which cannot be imported here: "
    )
    assert "NoSuchLayer" in message.split("imported here: ")[1]
    message = refused({"_target_": "torch.nn.nosuchmodule.X"})
    assert "cannot be imported here: " in message
    assert refused({"a": {"b": "${oc.env:HOME}"}}) == (
        "'given.ckpt' holds an interpolation at a.b ('${oc.env:HOME}'); configs saved by a run "
        "are resolved, so this file was edited or crafted"
    )
    assert "at the top" in refused("${x}")
    assert refused({"${x}": 1}) == "'given.ckpt' holds an interpolation in a key ('${x}')"
    assert refused({"list": ["${" + "q" * 80 + "}"]}).count("q") == 58
    shared_list: list[Any] = [1]
    assert "by reference" in refused([shared_list, shared_list])
    check_trusted({"a": 1, "b": 1, "c": "x", "d": "x"}, [], "given.ckpt")  # equal values are fine

    def nested(depth: int) -> Any:
        tree: Any = {}
        for _ in range(depth):
            tree = {"n": tree}
        return tree

    check_trusted(nested(MAX_DEPTH), [], "given.ckpt")
    assert refused(nested(MAX_DEPTH + 1)) == (
        f"'given.ckpt' nests its config deeper than {MAX_DEPTH} levels"
    )
    shared = {"leaf": 1}
    assert refused({"a": shared, "b": shared}) in (
        "'given.ckpt' repeats one config node by reference (at a); configs saved by a run never do",
        "'given.ckpt' repeats one config node by reference (at b); configs saved by a run never do",
    )
    key = "${" + "k" * 80 + "}"
    assert refused({key: 1}) == (f"'given.ckpt' holds an interpolation in a key ({key[:60]!r})")
    message = refused({"_target_": "torch.nn.Linear.no_such_method"})
    assert message.startswith(
        "'given.ckpt' names _target_='torch.nn.Linear.no_such_method', which cannot be imported "
        "here: "
    )
    assert "no_such_method" in message.split("imported here: ")[1]


@pytest.fixture
def probe_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    package = tmp_path / "mutant_probe_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text(
        "class Thing:\n    pass\n\n\n"
        "class Named:\n    def __init__(self, name):\n        self.__name__ = name\n\n\n"
        "make = Named('make')  # an instance: a __module__ and a __name__, no __qualname__\n"
        "LIMIT = 3  # an int: no __module__, no __name__\n"
    )
    (package / "broken.py").write_text("raise RuntimeError()\n")
    (package / "nets.py").write_text(
        "from torch import nn\n\nclass Tiny(nn.Linear):\n"
        "    def __init__(self):\n        super().__init__(4, 3)\n"
    )
    (package / "noisy.py").write_text(  # leaves a trace when imported
        "import os, pathlib\npathlib.Path(os.environ['PROBE_MARKER']).touch()\nX = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mutant_probe_pkg"
    for name in [m for m in sys.modules if m.startswith("mutant_probe_pkg")]:
        del sys.modules[name]


def test_a_target_is_judged_by_what_it_resolves_to_and_imported_only_if_allowed(
    probe_package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = f"{probe_package}."
    check_trusted({"_target_": f"{pkg}layers.Thing"}, [pkg], "given")
    target = "torch.nn.modules.module.Module.train"
    check_trusted({"_target_": target}, ["torch.nn.modules.module.Module"], "given")
    check_trusted({"_target_": f"{pkg}layers.make"}, [f"{pkg}layers"], "given")
    for name, kind, rest in (("layers", "module", "which is not under the trusted targets"),
                             ("layers.LIMIT", "int", "")):  # fmt: skip
        assert refused({"_target_": f"{pkg}{name}"}, [pkg]).startswith(
            f"'given.ckpt' asks to instantiate _target_='{pkg}{name}' (which is {kind}), {rest}"
        )
    assert refused({"_target_": f"{pkg}broken.X"}, [pkg]) == (
        f"'given.ckpt' names _target_='{pkg}broken.X', which cannot be imported here: RuntimeError"
    )
    monkeypatch.setenv("PROBE_MARKER", str(tmp_path / "imported"))
    assert "not under the trusted targets" in refused({"_target_": f"{pkg}noisy.X"})
    assert not (tmp_path / "imported").exists()
