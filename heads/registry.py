"""One entry per drafter kind: everything headway needs to know about a kind, in one place.

peft's ``PEFT_TYPE_TO_CONFIG_MAPPING`` is the model. A ``DrafterKind`` names the kind, its head
class (and so its config class and the ``drafter_type`` its config.json carries), the runtime
proposer that drafts with it, the training entry points that make it, the external formats it is
written as and read from, and what its model card and ``headway info`` show. The loaders
(``load_drafter``), ``inference.as_proposer``, the converters, ``headway info``, the model card, the
command line's training methods and the feature cacher all read this registry; adding a kind is
one ``register_kind`` call (headway's own kinds: ``headway.heads.kinds``).

The proposer and the training entry points live on higher floors (``inference``, ``train``), so an
entry names them as ``"module:attribute"`` / ``"module"`` strings (or holds the objects themselves,
for a kind defined outside headway); ``resolve`` imports them when a higher floor asks. The head
class may be named the same way, so that reading the registry (``headway --help``) imports no torch.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class TrainingMethod:
    """A training entry point: ``headway train NAME`` runs ``resolve(entry).main(argv, exit_process=True)``.

    The entry (a module name, or an object) has ``main(argv, exit_process=False)``, its run config
    dataclass ``RunConfig`` and ``feature_layers(cfg, depth)``: the target layers a feature cache
    must hold for that run (``scripts/cache_features.py``)."""

    entry: Any  # "headway.train.medusa", or an object with main / RunConfig / feature_layers
    description: str  # what it trains, for --help ("Medusa-1 heads")
    example_config: str | None = None  # a shipped config its --help shows ("medusa/tiny")


@dataclasses.dataclass(frozen=True)
class DrafterKind:
    name: str  # the kind: the card's tag, `headway info`'s kind ("medusa", "eagle", "eagle3")
    title: str  # how a person calls it, in cards and messages ("Medusa", "EAGLE-1/2", "EAGLE-3")
    drafter_type: str  # what its config.json's drafter_type says (its config class's drafter_type_name)
    head_class: Any  # the headway.heads.Drafter subclass, or "module:Class" (imported when first needed)
    proposer: Any = None  # the runtime proposer ("module:Class" or the class): Proposer(head)
    training: dict[str, TrainingMethod] = dataclasses.field(default_factory=dict)  # `headway train NAME` -> method
    exports: tuple[str, ...] = ()  # external formats it can be written as (headway's own format always)
    imports: tuple[str, ...] = ()  # external formats read into it
    matches: Callable[[dict], bool] | None = None  # which config.json of its drafter_type is this kind (None: all)
    info_fields: tuple[str, ...] = ()  # config keys `headway info` reports besides the common ones
    describe: Callable[[dict], str] | None = None  # one line on what the drafter is, from `headway info`'s fields
    serving: Any = None  # the card's "Serve it" lines: serving(config, ctx) (or "module:function")

    @property
    def head(self) -> type:
        """The head class (imported on first use: the registry itself imports no torch)."""
        return resolve(self.head_class)

    @property
    def config_class(self) -> type:
        return self.head.config_class

    def owns(self, config: dict) -> bool:
        """Whether a drafter config (config.json's dict) is of this kind."""
        return config.get("drafter_type") == self.drafter_type and (self.matches is None or self.matches(config))

    def description(self, info: dict) -> str:
        return self.describe(info) if self.describe else f"{self.title} drafter"


_KINDS: dict[str, DrafterKind] = {}


def register_kind(kind: DrafterKind) -> DrafterKind:
    """Add (or replace, by name) a drafter kind; returns it."""
    if not isinstance(kind, DrafterKind):
        raise TypeError(f"register_kind takes a DrafterKind, got {type(kind).__name__}")
    _KINDS[kind.name] = kind
    return kind


def unregister_kind(name: str) -> None:
    _KINDS.pop(name, None)


def kinds() -> list[DrafterKind]:
    """Every registered kind, in registration order."""
    return list(_KINDS.values())


def get_kind(name: str) -> DrafterKind:
    """The kind named ``name`` (ValueError naming the known ones)."""
    kind = find_kind(name)
    if kind is None:
        raise ValueError(f"unknown drafter kind {name!r}; known: {list(_KINDS)}")
    return kind


def find_kind(name: str | None) -> DrafterKind | None:
    """The kind named ``name``, or None."""
    return _KINDS.get(name) if name is not None else None


def kind_of_config(config: dict) -> DrafterKind | None:
    """The kind a headway config.json describes; None for a drafter_type no kind registers."""
    return next((k for k in _KINDS.values() if k.owns(config)), None)


def saved_kind(folder) -> DrafterKind | None:
    """The kind of the drafter saved in the local ``folder``, from its config.json alone (no weights read); None
    when there is no such file or it names no registered kind."""
    config = Path(folder) / "config.json"
    try:
        return kind_of_config(json.loads(config.read_text())) if config.is_file() else None
    except (OSError, ValueError):
        return None


def kind_of(drafter) -> DrafterKind | None:
    """The kind of a drafter module: the one whose head class is nearest in the module's class ancestry."""
    for cls in type(drafter).__mro__:
        for kind in _KINDS.values():
            if kind.head is cls:
                return kind
    return None


def head_class(config: dict) -> type:
    """The head class that loads a headway config.json (its dict): its kind's head."""
    kind = kind_of_config(config)
    if kind is None:
        raise ValueError(f"unknown drafter_type {config.get('drafter_type')!r}; "
                         f"known: {sorted({k.drafter_type for k in _KINDS.values()})}")
    return kind.head


def training_methods() -> dict[str, TrainingMethod]:
    """`headway train NAME` -> its method, over every kind, in registration order."""
    methods: dict[str, TrainingMethod] = {}
    for kind in _KINDS.values():
        for name, entry in kind.training.items():
            methods.setdefault(name, entry)
    return methods


def resolve(ref):
    """An entry's reference as an object: ``"module:attribute"`` or ``"module"`` is imported; any
    other value is returned as it is."""
    if not isinstance(ref, str):
        return ref
    module, _, attribute = ref.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, attribute) if attribute else obj


from headway.heads import kinds as _headway_kinds  # noqa: E402, F401  (registers headway's own kinds)
