"""What every drafter shares: its config's target fields, safetensors/Hub I/O, and checks.

Saving and pushing go through huggingface_hub's ``PyTorchModelHubMixin`` (config.json,
model.safetensors, a model card). Loading is strict and safetensors-only: a missing, unexpected,
mis-shaped, truncated or foreign file is a one-line ``ValueError`` that says what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import ModelCard, PyTorchModelHubMixin, snapshot_download
from safetensors import SafetensorError
from safetensors.torch import load_file

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
_DRAFTERS: dict[str, type] = {}


def register_drafter(cls):
    """Class decorator: make a drafter loadable by the ``drafter_type`` in its config.json."""
    _DRAFTERS[cls.config_class.drafter_type_name] = cls
    return cls


def drafter_class(drafter_type: str):
    if drafter_type not in _DRAFTERS:
        raise ValueError(f"unknown drafter_type {drafter_type!r}; known: {sorted(_DRAFTERS)}")
    return _DRAFTERS[drafter_type]


@dataclasses.dataclass
class DrafterConfig:
    """Fields every drafter config carries, so heads can be checked against their target."""

    hidden_size: int = 576  # the target's hidden size (features the drafter reads)
    vocab_size: int = 49152  # the target's vocabulary size
    base_model_name_or_path: str | None = None  # the target the drafter was trained on

    drafter_type_name = "base"  # class attribute, not a field: overridden by each drafter

    def __post_init__(self):
        if self.hidden_size < 1 or self.vocab_size < 1:
            raise ValueError(f"hidden_size and vocab_size must be positive, got {self.hidden_size}, {self.vocab_size}")

    def to_dict(self) -> dict[str, Any]:
        return {"drafter_type": self.drafter_type_name, "headway_version": _version(),
                **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "DrafterConfig":
        data = dict(data)
        found = data.pop("drafter_type", None)
        data.pop("headway_version", None)
        if found != cls.drafter_type_name:
            raise ValueError(f"{source} describes drafter_type {found!r}, expected {cls.drafter_type_name!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{source}: unknown {cls.__name__} key(s) {unknown}; known keys: {sorted(names)}")
        missing = sorted(names - set(data) - {"base_model_name_or_path"})
        if missing:  # a default would silently give the drafter another shape
            raise ValueError(f"{source} lacks {cls.__name__} key(s) {missing}; re-export the drafter")
        return cls(**data)


def _version() -> str:
    from headway import __version__

    return __version__


def read_json(folder: Path, what: str, fix: str = "") -> Any:
    """``folder/config.json`` parsed; a missing or malformed file is a one-line ValueError
    (``what``: the kind of folder expected, ``fix``: what to do about bad JSON)."""
    path = folder / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{folder} has no {CONFIG_NAME}: not {what} folder")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}){fix}") from None


def read_config_file(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_NAME
    data = read_json(folder, "a headway drafter", "; re-export the drafter")
    if not isinstance(data, dict) or "drafter_type" not in data:
        hint = ""
        if isinstance(data, dict) and ("medusa_num_heads" in data or data.get("model_type") in ("medusa", "llama")):
            hint = " (it looks like an official Medusa/EAGLE checkpoint: convert it with scripts/convert.py)"
        raise ValueError(f"{path} has no 'drafter_type': not a headway drafter{hint}")
    return data


def resolve_folder(folder_or_hub_id: str | os.PathLike, **hub_kwargs) -> Path:
    """A local folder as is; otherwise download config.json + model.safetensors from the Hub."""
    path = Path(folder_or_hub_id)
    if path.is_dir():
        return path
    if path.exists() or str(folder_or_hub_id).startswith((".", "/")):
        raise FileNotFoundError(f"no drafter folder at {folder_or_hub_id}")
    try:
        return Path(snapshot_download(str(folder_or_hub_id), allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "README.md"],
                                      **hub_kwargs))
    except Exception as exc:  # offline, unknown repo, bad id: one line, not a Hub trace
        raise FileNotFoundError(f"{folder_or_hub_id!r} is neither a local drafter folder nor a Hub repo that could be "
                                f"loaded ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"{path.parent} has no {WEIGHTS_NAME}; headway reads safetensors weights only")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is corrupt or truncated ({str(exc).splitlines()[0]}); re-export or re-download it") from None


def load_state_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load every expected tensor with its exact shape, or say which ones are wrong."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise ValueError(f"{source} does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, tensor in state.items():
        if tensor.shape != own[key].shape:
            raise ValueError(f"{source}: {key} has shape {tuple(tensor.shape)}, config expects {tuple(own[key].shape)}")
    module.load_state_dict(state, strict=True)


def check_target_compatible(config: DrafterConfig, target_config) -> None:
    """Raise ValueError naming both values when the drafter was built for another target shape."""
    target_config = getattr(target_config, "get_text_config", lambda: target_config)()
    hidden = getattr(target_config, "hidden_size", None)
    vocab = getattr(target_config, "vocab_size", None)
    if hidden is not None and hidden != config.hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} does not match the target's hidden_size {hidden}; "
                         "train or load heads made for this target")
    if vocab is not None and vocab != config.vocab_size:
        raise ValueError(f"drafter vocab_size {config.vocab_size} does not match the target's vocab_size {vocab}; "
                         "train or load heads made for this target")


class DraftVocabulary:
    """Mixin for drafters that may score a reduced draft vocabulary (EAGLE-3's ``d2t``):
    ``target_id = draft_id + d2t[draft_id]``; ``self.d2t`` is a [V'] long buffer or None."""

    d2t: torch.Tensor | None

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary ([V'] long), or None for the full vocabulary."""
        return None if self.d2t is None else self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map indices into the drafter's logits to target token ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def target_to_draft(self) -> torch.Tensor | None:
        """[V] long: the draft index of each target token, -1 where it is outside the draft vocabulary."""
        if self.d2t is None:
            return None
        t2d = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        t2d[self.draft_token_ids] = torch.arange(len(self.d2t), device=self.d2t.device)
        return t2d

    def draft_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """[V, H] -> [V', H]: the rows of a target-vocabulary matrix (e.g. its lm_head) in the draft vocabulary."""
        return weight if self.d2t is None else weight[self.draft_token_ids.to(weight.device)]


class Drafter(torch.nn.Module, PyTorchModelHubMixin, library_name="headway", tags=["speculative-decoding"]):
    """Base class: subclasses set ``config_class`` and take ``config`` as their only init argument."""

    config_class = DrafterConfig

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config

    def save_pretrained(self, save_directory, *, config=None, metrics: dict | None = None, **kwargs):
        """Write config.json, model.safetensors and a model card README.md into ``save_directory``."""
        self._card_metrics = metrics
        out = super().save_pretrained(save_directory, config=self.config.to_dict(), **kwargs)
        return out

    def push_to_hub(self, repo_id: str, *, config=None, **kwargs):
        """Upload the drafter (config, safetensors weights, model card) to a Hub repo."""
        return super().push_to_hub(repo_id, config=self.config.to_dict(), **kwargs)

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        return ModelCard(model_card_text(self.config, getattr(self, "_card_metrics", None)))

    @classmethod
    def from_pretrained(cls, folder_or_hub_id, *, map_location: str | torch.device = "cpu", **hub_kwargs):
        """Load from a local folder or a Hub repo id; strict, safetensors only."""
        folder = resolve_folder(folder_or_hub_id, **hub_kwargs)
        data = read_config_file(folder)
        if cls is Drafter:
            cls = drafter_class(data["drafter_type"])
        config = cls.config_class.from_dict(data, source=str(folder / CONFIG_NAME))
        model = cls(config)
        load_state_strict(model, read_weights(folder / WEIGHTS_NAME), str(folder / WEIGHTS_NAME))
        model.validate()
        return model.to(map_location).eval()

    def validate(self) -> None:
        """Check what the config alone cannot (e.g. vocabulary maps); raise a one-line ValueError."""

    def check_target(self, target_model) -> None:
        check_target_compatible(self.config, target_model.config)


def load_drafter(folder_or_hub_id, **kwargs) -> Drafter:
    """Load any headway drafter; the class is picked from ``drafter_type`` in config.json."""
    return Drafter.from_pretrained(folder_or_hub_id, **kwargs)


def model_card_text(config: DrafterConfig, metrics: dict | None) -> str:
    lines = [
        "---",
        "library_name: headway",
        "tags:\n- speculative-decoding\n- " + config.drafter_type_name,
    ]
    if config.base_model_name_or_path and not Path(config.base_model_name_or_path).is_absolute():
        lines.append(f"base_model: {config.base_model_name_or_path}")
    lines += ["---", "", f"# {config.drafter_type_name} drafter for {config.base_model_name_or_path or 'its target'}", "",
              "Speculative-decoding drafter trained with [headway](https://pypi.org/project/headway/). "
              "Generation with it is lossless: the output is exactly the target model's.", "",
              "```python",
              "from headway.heads import load_drafter",
              "drafter = load_drafter(\"<this folder or repo id>\")",
              "```", "", "## Config", "", "```json", json.dumps(config.to_dict(), indent=2), "```"]
    if metrics:
        lines += ["", "## Held-out metrics", "", "```json", json.dumps(metrics, indent=2), "```"]
    return "\n".join(lines) + "\n"
