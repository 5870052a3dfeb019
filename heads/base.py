"""What every drafter shares: its config's target fields, safetensors/Hub I/O, and checks.

Saving and pushing go through huggingface_hub's ``PyTorchModelHubMixin`` (config.json,
model.safetensors, a model card). Loading is strict and safetensors-only: a missing, unexpected,
mis-shaped, truncated or foreign file is a one-line ``ValueError`` that says what to do.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
from huggingface_hub import ModelCard, PyTorchModelHubMixin, snapshot_download
from safetensors import SafetensorError
from safetensors.torch import load_file

from headway.heads.registry import DrafterKind, head_class, kinds, register_kind
from headway.heads.values import first_line

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def register_drafter(cls):
    """Class decorator: make a drafter loadable by the ``drafter_type`` in its config.json (a minimal
    registry entry; ``headway.heads.registry.register_kind`` also names its proposer, training and
    formats)."""
    if not any(k.head_class is cls for k in kinds()):
        name = cls.config_class.drafter_type_name
        register_kind(DrafterKind(name=name, title=cls.__name__, drafter_type=name, head_class=cls))
    return cls


@dataclasses.dataclass
class DrafterConfig:
    """Fields every drafter config carries, so heads can be checked against their target."""

    hidden_size: int = 576  # the target's hidden size (features the drafter reads)
    vocab_size: int = 49152  # the target's vocabulary size
    base_model_name_or_path: str | None = None  # the target the drafter was trained on

    drafter_type_name = "base"  # class attribute, not a field: overridden by each drafter
    # fields added after a release whose absence from a saved config means the drafter they did not exist
    # for (their default keeps its behaviour): read as the default; every other field must be present
    later_fields: ClassVar[tuple[str, ...]] = ()

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
        missing = sorted(names - set(data) - {"base_model_name_or_path", *cls.later_fields})
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
            hint = (" (it looks like an official Medusa/EAGLE checkpoint: "
                    "convert it with `headway convert --to headway SRC DST`)")
        raise ValueError(f"{path} has no 'drafter_type': not a headway drafter{hint}")
    return data


def resolve_folder(folder_or_hub_id: str | os.PathLike, *, revision: str | None = None, **hub_kwargs) -> Path:
    """A local folder as is; otherwise the Hub repo's config.json, model.safetensors and README.md
    at ``revision`` (a branch, tag or commit; default ``main``), from the cache when offline."""
    path = Path(folder_or_hub_id)
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repo ids, but {folder_or_hub_id} is a local "
                             "folder; drop revision or pass the repo id")
        return path
    if path.exists() or str(folder_or_hub_id).startswith((".", "/")):
        raise FileNotFoundError(f"no drafter folder at {folder_or_hub_id}")
    try:
        return Path(snapshot_download(str(folder_or_hub_id), revision=revision,
                                      allow_patterns=[CONFIG_NAME, WEIGHTS_NAME, "README.md"], **hub_kwargs))
    except Exception as exc:  # offline, unknown repo or revision, bad id: one line, not a Hub trace
        raise FileNotFoundError(_hub_load_error(str(folder_or_hub_id), revision, exc)) from None


def _hub_load_error(repo_id: str, revision: str | None, exc: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import (HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    at = f"{repo_id!r} at revision {revision!r}" if revision else repo_id
    if isinstance(exc, HFValidationError):
        return f"{repo_id!r} is neither a local drafter folder nor a Hub repo id (namespace/name)"
    if isinstance(exc, RevisionNotFoundError):
        return f"the Hub repo {repo_id} has no revision {revision!r}: pass one of its branches, tags or commits"
    if isinstance(exc, RepositoryNotFoundError):
        return (f"no Hub repo {repo_id} (or it is private or gated: log in with `hf auth login` or set HF_TOKEN), "
                "and no local folder of that name")
    if isinstance(exc, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
        return (f"{at} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
                "forbids downloading: download it once online, or unset HF_HUB_OFFLINE")
    return (f"{at} is neither a local drafter folder nor a Hub repo that could be loaded "
            f"({type(exc).__name__}: {first_line(exc)})")


def built_from_config(build, source, also: tuple = ()):
    """``build()``: a drafter made from a config's settings. A value that cannot build one (a hand-edited or foreign
    config.json: an unknown activation or rope type, a null or mistyped size, a size the attention cannot split) is
    one line naming ``source`` and the fix, not the KeyError or TypeError from deep inside the module's code (kept
    as the cause). ``also``: more exception types that mean a bad value here (where ``build`` does nothing else)."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        return build()
    except (KeyError, TypeError, StrictDataclassError, *also) as exc:
        raise ValueError(f"{source}: a setting cannot build the drafter ({type(exc).__name__}: {first_line(exc)}); "
                         "correct that value in config.json or re-export the drafter") from exc


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ValueError(f"{path.parent} has no {WEIGHTS_NAME}; headway reads safetensors weights only")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{path} is corrupt or truncated ({first_line(exc)}); re-export or re-download it") from None


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The tensor shapes in the safetensors file ``path``, from its header alone; a one-line ValueError when it is
    missing or cannot be read (``read_weights``'s messages)."""
    from safetensors import safe_open

    if not path.is_file():
        raise ValueError(f"{path.parent} has no {path.name}; headway reads safetensors weights only")
    try:
        with safe_open(str(path), "pt") as f:
            return {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception as exc:  # noqa: BLE001 -- safetensors raises its own error types for a cut or garbled header
        raise ValueError(f"{path} is corrupt or truncated ({first_line(exc)}); re-export or re-download it") from None


def check_shapes(own: dict[str, tuple], found: dict[str, tuple], source: str) -> None:
    """Every tensor the module holds (``own``: name -> shape) and no other, each with its shape, or say which not."""
    missing = sorted(set(own) - set(found))
    unexpected = sorted(set(found) - set(own))
    if missing or unexpected:
        raise ValueError(f"{source} does not match the config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, shape in found.items():
        if tuple(shape) != tuple(own[key]):
            raise ValueError(f"{source}: {key} has shape {tuple(shape)}, config expects {tuple(own[key])}")


def load_state_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load every expected tensor with its exact shape, or say which ones are wrong."""
    check_shapes({k: tuple(t.shape) for k, t in module.state_dict().items()},
                 {k: tuple(t.shape) for k, t in state.items()}, source)
    module.load_state_dict(state, strict=True)


def model_identity(name_or_path: str | None) -> str | None:
    """A model's name as a Hub id, a local folder and a Hub cache snapshot of it all spell it: the repository's own
    name, lower-cased ("HuggingFaceTB/SmolLM2-135M", "/models/smollm2-135m/" and ".../models--HuggingFaceTB--SmolLM2-135M
    /snapshots/<hash>" -> "smollm2-135m"); None when nothing is known."""
    parts = [p for p in str(name_or_path or "").replace("\\", "/").split("/") if p]
    for part in parts:
        if part.startswith("models--"):
            return part.split("--")[-1].lower()
    return parts[-1].lower() if parts else None


def warn_other_target(config: DrafterConfig, target_config) -> None:
    """Warn (once per pair) when the drafter names the target it was trained on and this target is another one of
    the same shape: the output stays the target's exactly, but its drafts will seldom be accepted."""
    trained = model_identity(config.base_model_name_or_path)
    given = model_identity(getattr(target_config, "_name_or_path", None))
    if trained and given and trained != given:
        warnings.warn(f"this drafter was trained on {config.base_model_name_or_path!r}, not on the target "
                      f"{target_config._name_or_path!r}; the output is still the target's, but expect little "
                      "speed-up: use a drafter trained for this target", UserWarning, stacklevel=3)


def check_target_compatible(config: DrafterConfig, target_config) -> None:
    """Raise ValueError naming both values when the drafter was built for another target shape; warn when it names
    another target of the same shape (``warn_other_target``)."""
    outer = target_config
    target_config = getattr(target_config, "get_text_config", lambda: target_config)()
    hidden = getattr(target_config, "hidden_size", None)
    vocab = getattr(target_config, "vocab_size", None)
    if hidden is not None and hidden != config.hidden_size:
        raise ValueError(f"drafter hidden_size {config.hidden_size} does not match the target's hidden_size {hidden}; "
                         "train or load heads made for this target")
    if vocab is not None and vocab != config.vocab_size:
        raise ValueError(f"drafter vocab_size {config.vocab_size} does not match the target's vocab_size {vocab}; "
                         "train or load heads made for this target")
    warn_other_target(config, outer)


class DraftVocabulary:
    """Mixin for drafters that may score a reduced draft vocabulary (EAGLE-3's ``d2t``):
    ``target_id = draft_id + d2t[draft_id]``; ``self.d2t`` is a [V'] long buffer or None."""

    d2t: torch.Tensor | None

    @property
    def draft_token_ids(self) -> torch.Tensor | None:
        """Target ids of the draft vocabulary ([V'] long), or None for the full vocabulary."""
        return None if self.d2t is None else self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    @property
    def reduces_vocabulary(self) -> bool:
        """Whether the draft vocabulary leaves target tokens out (a ``d2t`` over all of them only reorders them: a
        layout without a draft vocabulary holds such a drafter unreduced)."""
        return self.d2t is not None and len(self.d2t) < self.config.vocab_size

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Map indices into the drafter's logits to target token ids."""
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def draft_index(self) -> torch.Tensor | None:
        """[V] long: the draft index of each target token, -1 where it is outside the draft vocabulary.
        (Not a checkpoint's ``t2d``: that is EAGLE-3's [V] bool mask of the draft vocabulary.)"""
        if self.d2t is None:
            return None
        index = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=self.d2t.device)
        index[self.draft_token_ids] = torch.arange(len(self.d2t), device=self.d2t.device)
        return index

    def draft_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """[V, H] -> [V', H]: the rows of a target-vocabulary matrix (e.g. its lm_head) in the draft vocabulary."""
        return weight if self.d2t is None else weight[self.draft_token_ids.to(weight.device)]

    def widen(self, q: torch.Tensor) -> torch.Tensor:
        """A distribution over the draft vocabulary [..., V'] -> over the target's [..., V] (zero outside it)."""
        if self.d2t is None:
            return q
        full = q.new_zeros(*q.shape[:-1], self.config.vocab_size)
        full[..., self.draft_token_ids.to(q.device)] = q
        return full

    def set_draft_vocab(self, draft_tokens) -> None:
        """Fill ``d2t`` (and EAGLE-3's ``t2d`` mask, when the drafter has one) from the target ids of the draft
        vocabulary: ``draft_vocab_size`` distinct ids of the target's vocabulary, in any order."""
        n = self.config.draft_vocab_size
        if draft_tokens is None or len(draft_tokens) != n:
            raise ValueError(f"draft_vocab_size={n} needs as many draft token ids, "
                             f"got {None if draft_tokens is None else len(draft_tokens)}")
        ids = torch.as_tensor(draft_tokens, dtype=torch.long).sort().values.to(self.d2t.device)
        if len(set(ids.tolist())) != n or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft token ids must be {n} distinct ids in [0, {self.config.vocab_size})")
        self.d2t.copy_(ids - torch.arange(n, device=ids.device))
        t2d = getattr(self, "t2d", None)
        if t2d is not None:
            t2d.zero_()
            t2d[ids] = True

    def check_draft_vocab(self) -> None:
        """d2t must map every draft index to a distinct target id (that ``t2d`` marks, when there is one)."""
        if self.d2t is None:
            return
        ids, v = self.draft_token_ids, self.config.vocab_size
        t2d = getattr(self, "t2d", None)
        if int(ids.min()) < 0 or int(ids.max()) >= v or len(torch.unique(ids)) != len(ids) or \
                (t2d is not None and (int(t2d.sum()) != len(ids) or not bool(t2d[ids].all()))):
            raise ValueError(f"d2t{'/t2d' if t2d is not None else ''} are inconsistent with draft_vocab_size {len(ids)} "
                             f"and vocab_size {v} (draft ids must map to distinct target ids"
                             f"{' that t2d marks' if t2d is not None else ''}); re-export the drafter")


class Drafter(torch.nn.Module, PyTorchModelHubMixin, library_name="headway", tags=["speculative-decoding"]):
    """Base class: subclasses set ``config_class`` and take ``config`` as their only init argument."""

    config_class = DrafterConfig

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.config = config

    def save_pretrained(self, save_directory, *, config=None, metrics: dict | None = None, **kwargs):
        """Write config.json, model.safetensors and a model card README.md into ``save_directory``
        (the card reads ``metrics`` and any run_config.json / benchmark.json already there)."""
        from headway.heads.hub.card import model_card

        if kwargs.pop("push_to_hub", False):
            raise ValueError("save_pretrained(push_to_hub=True) is not supported: save, then call push_to_hub(repo_id)")
        folder = Path(save_directory)
        folder.mkdir(parents=True, exist_ok=True)
        # written first: the mixin keeps an existing README.md, and this one describes these weights
        (folder / "README.md").write_text(model_card(folder, config=self.config.to_dict(), metrics=metrics))
        return super().save_pretrained(folder, config=self.config.to_dict(), **kwargs)

    def _save_pretrained(self, save_directory: Path) -> None:
        """The weights file: every tensor copied out on its own storage (a DeepSpeed-trained module's
        parameters may be views into one flat buffer, which safetensors refuses to save)."""
        from headway.heads.files import save_safetensors

        state = {k: v.detach().cpu().clone().contiguous() for k, v in self.state_dict().items()}
        save_safetensors(state, Path(save_directory) / WEIGHTS_NAME, metadata={"format": "pt"})

    def push_to_hub(self, repo_id: str, *, private: bool = False, token: str | None = None,
                    revision: str | None = None, commit_message: str = "Upload headway drafter",
                    metrics: dict | None = None) -> str:
        """Upload the drafter (config, safetensors weights, model card) to the Hub repo
        ``namespace/name``; returns the commit URL. See :func:`headway.heads.hub.push`."""
        import tempfile

        from headway.heads.hub import push

        with tempfile.TemporaryDirectory(prefix="headway-push-") as tmp:
            self.save_pretrained(tmp, metrics=metrics)
            if metrics:  # where a training run keeps them, so the pushed card and files carry them
                (Path(tmp) / "eval_metrics.json").write_text(json.dumps(metrics, indent=2))
            return push(tmp, repo_id, private=private, token=token, revision=revision, commit_message=commit_message)

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        from headway.heads.hub.card import model_card_text

        return ModelCard(model_card_text(self.config.to_dict()))

    @classmethod
    def from_pretrained(cls, folder_or_hub_id, *, revision: str | None = None,
                        map_location: str | torch.device = "cpu", **hub_kwargs):
        """Load from a local folder or a Hub repo id (``revision``: a branch, tag or commit to pin);
        strict, safetensors only. ``hub_kwargs`` go to ``huggingface_hub.snapshot_download``."""
        folder = resolve_folder(folder_or_hub_id, revision=revision, **hub_kwargs)
        data = read_config_file(folder)
        if cls is Drafter:
            cls = head_class(data)
        model = build_saved(cls, data, folder / CONFIG_NAME)
        state = read_weights(folder / WEIGHTS_NAME)
        floats = {t.dtype for t in state.values() if t.is_floating_point()}
        if len(floats) == 1:  # keep the checkpoint's precision (a bf16 export loads as bf16)
            model.to(floats.pop())
        load_state_strict(model, state, str(folder / WEIGHTS_NAME))
        model.validate()
        return model.to(map_location).eval()

    def validate(self) -> None:
        """Check what the config alone cannot (e.g. vocabulary maps); raise a one-line ValueError."""

    def check_target(self, target_model) -> None:
        check_target_compatible(self.config, target_model.config)


def load_drafter(folder_or_hub_id, **kwargs) -> Drafter:
    """Load any headway drafter; the class is picked from ``drafter_type`` in config.json."""
    return Drafter.from_pretrained(folder_or_hub_id, **kwargs)


def build_saved(cls, data: dict, source: Path) -> Drafter:
    """A ``cls`` drafter built from the config.json dict ``data`` (read from ``source``), its weights not loaded."""
    return built_from_config(lambda: cls(cls.config_class.from_dict(data, source=str(source))), source,
                             also=(AttributeError, IndexError, ZeroDivisionError))


def check_saved(folder: Path) -> None:
    """What ``load_drafter`` refuses in a local headway folder, found from config.json and the safetensors header
    alone (no weights read; the drafter built on the meta device): a config that cannot build the drafter, a
    missing or unreadable model.safetensors, tensors missing, unexpected or of another shape. A one-line
    ValueError. (``validate``'s checks of the values, e.g. the vocabulary maps, need the weights: not made.)"""
    data = read_config_file(folder)
    with torch.device("meta"):
        model = build_saved(head_class(data), data, folder / CONFIG_NAME)
    own = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    check_shapes(own, read_shapes(folder / WEIGHTS_NAME), str(folder / WEIGHTS_NAME))
