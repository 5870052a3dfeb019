"""Drafter modules, their configs and safetensors/Hub I/O (the ground floor of headway).

The names below load on first use (PEP 562), so that ``headway.heads.registry`` and the command
line's help import no torch; ``from headway.heads import MedusaHeads`` works as always.
"""

import importlib

_WHERE = {
    "Drafter": "base", "DrafterConfig": "base", "check_target_compatible": "base", "load_drafter": "base",
    "register_drafter": "base", "EagleConfig": "eagle", "EagleHead": "eagle", "MedusaConfig": "medusa",
    "MedusaHeads": "medusa", "LayerSkipConfig": "layerskip", "LayerSkipHead": "layerskip", "DEFAULT_MODEL": "target", "load_target": "target", "DrafterKind": "registry",
    "TrainingMethod": "registry", "get_kind": "registry", "kind_of": "registry", "drafter_kinds": "registry",
    "register_kind": "registry",
}
_RENAMED = {"drafter_kinds": "kinds"}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'headway.heads' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"headway.heads.{_WHERE[name]}"), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
