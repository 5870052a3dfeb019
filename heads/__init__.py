"""Drafter modules, their configs and safetensors/Hub I/O (the ground floor of headway)."""

from headway.heads.base import Drafter, DrafterConfig, check_target_compatible, load_drafter, register_drafter
from headway.heads.eagle import EagleConfig, EagleHead
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.heads.target import DEFAULT_MODEL, load_target

__all__ = [
    "DEFAULT_MODEL", "Drafter", "DrafterConfig", "EagleConfig", "EagleHead", "MedusaConfig", "MedusaHeads",
    "check_target_compatible", "load_drafter", "load_target", "register_drafter",
]
