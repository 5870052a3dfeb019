"""Every file that ships under configs/ is read by the loader that will read it for a user, and what
it describes resolves: run configs through their training method's RunConfig (strict: an unknown or
mistyped key fails), trees through load_tree, accelerate configs through accelerate's ClusterConfig
(with the DeepSpeed file each names), DeepSpeed configs through the loop's filling. A file no loader
claims fails, so a new config cannot ship unread."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from headway.configs import CONFIG_DIR
from headway.heads.registry import kinds, resolve, training_methods

ROOT = CONFIG_DIR.parents[0]
SHIPPED = sorted(p for p in CONFIG_DIR.rglob("*") if p.suffix in (".yaml", ".json"))
DEPTH = {"tiny-random-llama": 2, "smollm2-135m": 30}  # the targets the shipped run configs name


def _name(path: Path) -> str:
    return str(path.relative_to(CONFIG_DIR))


def check_tree(path: Path) -> None:
    from headway.inference.tree import load_tree

    tree = load_tree(path)
    assert yaml.safe_load(path.read_text())["name"] == path.stem
    assert tree.size >= 2 and tree.depth >= 1  # the root plus at least one candidate


def check_accelerate(path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    data = yaml.safe_load(path.read_text())
    assert set(data) <= set(ClusterConfig.__dataclass_fields__), f"unknown accelerate keys in {path.name}"
    cfg = ClusterConfig.from_yaml_file(str(path))
    assert cfg.num_processes >= 1
    ds_file = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if ds_file:
        assert (ROOT / ds_file).is_file(), f"{path.name} names {ds_file}, which does not ship"


def check_deepspeed(path: Path) -> None:
    from headway.train.accelerator import fill_deepspeed_config
    from headway.train.loop import TrainConfig

    ds = json.loads(path.read_text())
    assert ds["zero_optimization"]["stage"] in (2, 3)
    fill_deepspeed_config(ds, TrainConfig(batch_size=4, grad_accum=2), 2, "no")  # every "auto" resolves
    assert ds["train_batch_size"] == 16 and ds["train_micro_batch_size_per_gpu"] == 4


def check_run_config(path: Path) -> None:
    from headway.train.config import load_config

    method = training_methods().get(path.parent.name)
    assert method is not None, f"{_name(path)}: no training method {path.parent.name!r} reads this folder"
    entry = resolve(method.entry)
    cfg = load_config(entry.RunConfig, path)  # strict: unknown keys and wrong types raise
    assert cfg.train.output_dir and cfg.model in DEPTH, f"{_name(path)} names an unknown target {cfg.model!r}"
    drafter = next(getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name in ("heads", "eagle", "layerskip", "peagle", "dflash"))
    if path.parent.name == "layerskip":
        from headway.heads.layerskip import LayerSkipConfig

        resolved = LayerSkipConfig(**{**vars(drafter), "num_target_layers": DEPTH[cfg.model]})
        assert entry.feature_layers(cfg, DEPTH[cfg.model]) == [resolved.exit_layer, DEPTH[cfg.model]]
    elif path.parent.name in ("eagle", "peagle", "dflash"):
        from headway.heads.dflash import DFlashConfig
        from headway.heads.eagle import EagleConfig
        from headway.heads.peagle import PEagleConfig

        config_class = {"eagle": EagleConfig, "peagle": PEagleConfig, "dflash": DFlashConfig}[path.parent.name]
        resolved = config_class(**{**vars(drafter), "num_target_layers": DEPTH[cfg.model]})
        assert resolved.feature_width == resolved.hidden_size * len(resolved.feature_layers)
        assert entry.feature_layers(cfg, DEPTH[cfg.model])[-1] == DEPTH[cfg.model]  # + the final-norm layer
    else:
        assert drafter.num_heads >= 1 and drafter.num_layers >= 1


def loader_of(path: Path):
    top = path.relative_to(CONFIG_DIR).parts[0]
    if top == "trees":
        return check_tree
    if top == "accelerate":
        return check_accelerate
    if top == "deepspeed":
        return check_deepspeed
    return check_run_config  # fails for a folder no training method reads


@pytest.mark.parametrize("path", SHIPPED, ids=_name)
def test_every_shipped_config_loads_and_resolves(path):
    loader_of(path)(path)


def test_every_example_config_the_registry_names_ships():
    examples = [m.example_config for m in training_methods().values() if m.example_config]
    assert examples and all((CONFIG_DIR / f"{e}.yaml").is_file() for e in examples), examples
    assert {k.name for k in kinds()} >= {"medusa", "eagle", "eagle3"}


def test_a_config_with_a_bad_key_is_caught(tmp_path):
    """The check has teeth: a typo in a shipped run config would fail it."""
    from headway.train.config import ConfigError

    bad = tmp_path / "medusa" / "tiny.yaml"
    bad.parent.mkdir()
    data = yaml.safe_load((CONFIG_DIR / "medusa" / "tiny.yaml").read_text())
    data["heads"]["num_head"] = 3
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises((ConfigError, ValueError), match="num_head"):
        check_run_config(bad)
