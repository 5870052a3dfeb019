"""Medusa heads (Cai et al., 2024, arXiv:2401.10774): extra heads on the target's last hidden state.

Head k (0-based) predicts the token k+2 positions ahead of the feature it reads:
``logits_k = W2_k (r_k(h))`` with ``r_k`` a stack of ResBlocks ``x + SiLU(W1 x + b1)``, W1 zero at
init (so every head starts as the target's own next-token head), W2 copied from the target's
lm_head, or shared with the frozen target lm_head to save memory ("version 2" layout).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from headway.heads.base import Drafter, DrafterConfig, register_drafter


@dataclasses.dataclass
class MedusaConfig(DrafterConfig):
    num_heads: int = 4  # heads; head k predicts token t+k+2
    num_layers: int = 1  # ResBlocks per head, each with its own weights
    share_lm_head: bool = False  # True: no own vocabulary projection, use the target's (frozen) lm_head

    drafter_type_name = "medusa"

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"num_heads must be >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


@register_drafter
class MedusaHeads(Drafter):
    """``heads(hidden [B, T, H]) -> logits [num_heads, B, T, V]``; head k predicts token t+k+2."""

    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        h, v = config.hidden_size, config.vocab_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(
            nn.Linear(h, v, bias=False) for _ in range(config.num_heads)
        )
        self._shared = ()  # the target's lm_head when shared: held outside the state dict

    @classmethod
    def from_target(cls, target_model, config: MedusaConfig | None = None, **overrides) -> "MedusaHeads":
        """Heads sized for ``target_model``: vocabulary projections copied from (or shared with) its lm_head."""
        tcfg = target_model.config.get_text_config()
        fields = {"hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size,
                  "base_model_name_or_path": getattr(tcfg, "_name_or_path", None) or None}
        base = dataclasses.asdict(config) if config is not None else {}
        heads = cls(MedusaConfig(**{**base, **fields, **overrides}))
        heads.init_from_target(target_model)
        return heads

    def init_from_target(self, target_model) -> None:
        """Copy the target's lm_head into every head's projection, or bind it when shared."""
        self.check_target(target_model)
        lm_head = target_model.get_output_embeddings()
        if self.lm_heads is None:
            self.bind_lm_head(lm_head)
            return
        with torch.no_grad():
            for proj in self.lm_heads:
                proj.weight.copy_(lm_head.weight.to(proj.weight.dtype))

    def bind_lm_head(self, lm_head: nn.Module) -> None:
        """Use ``lm_head`` (the frozen target's) as every head's projection; it is not saved with the heads."""
        self._shared = (lm_head,)

    def bind_target(self, target_model) -> "MedusaHeads":
        """Check shapes against the target and bind its lm_head when the heads share it."""
        self.check_target(target_model)
        if self.lm_heads is None:
            self.bind_lm_head(target_model.get_output_embeddings())
        return self

    def head_features(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        # hidden: [..., H] -> [..., H]
        return self.blocks[k](hidden)

    def project(self, features: torch.Tensor, k: int) -> torch.Tensor:
        # features: [..., H] -> [..., V]
        if self.lm_heads is not None:
            return self.lm_heads[k](features)
        if not self._shared:
            raise RuntimeError("these Medusa heads share the target's lm_head: call heads.bind_target(target_model) first")
        return self._shared[0](features)

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head k only: [..., H] -> [..., V] (training uses this to keep memory flat)."""
        return self.project(self.head_features(hidden, k), k)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [B, T, H] -> [num_heads, B, T, V]
        return torch.stack([self.head_logits(hidden_states, k) for k in range(self.config.num_heads)])
