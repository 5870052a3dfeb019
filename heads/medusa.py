"""Medusa heads (Cai et al., 2024, arXiv:2401.10774): extra heads on the target's last hidden state.

Head k (0-based) predicts the token k+2 positions ahead of the feature it reads:
``logits_k = W2_k (r_k(h))`` with ``r_k`` a stack of ResBlocks ``x + SiLU(W1 x + b1)``, W1 zero at
init (so every head starts as the target's own next-token head), W2 copied from the target's
lm_head, or shared with the frozen target lm_head to save memory ("version 2" layout).

Optional reduced draft vocabulary (EAGLE-3's d2t idea applied to Medusa): the heads score only
the ``draft_vocab_size`` most frequent tokens of the training data. On a CPU the full vocabulary
projection is most of a head's cost; drafts outside the reduced set are simply never proposed,
which keeps verification exact (it only changes which candidates are tried).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from headway.heads.base import Drafter, DrafterConfig, DraftVocabulary


@dataclasses.dataclass
class MedusaConfig(DrafterConfig):
    num_heads: int = 4  # heads; head k predicts token t+k+2
    num_layers: int = 1  # ResBlocks per head, each with its own weights
    share_lm_head: bool = False  # True: no own vocabulary projection, use the target's (frozen) lm_head
    draft_vocab_size: int | None = None  # score only this many target tokens (None: the full vocabulary)

    drafter_type_name = "medusa"

    def __post_init__(self):
        super().__post_init__()
        if self.num_heads < 1 or self.num_layers < 0:
            raise ValueError(f"num_heads must be >= 1 and num_layers >= 0, got {self.num_heads}, {self.num_layers}")
        # the upper bound (the target's vocabulary) is checked when heads are built: in a run config
        # vocab_size is still a placeholder that the target fills in
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1 (or null for the full vocabulary), got {self.draft_vocab_size}")

    @property
    def output_size(self) -> int:
        """Width of each head's logits: the draft vocabulary if reduced, else the target's."""
        return self.draft_vocab_size or self.vocab_size


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W zero-initialised so the block starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(DraftVocabulary, Drafter):
    """``heads(hidden [B, T, H]) -> logits [num_heads, B, T, V']``; head k predicts token t+k+2.

    ``V'`` is the target vocabulary, or the draft vocabulary when ``draft_vocab_size`` is set;
    ``to_target_ids`` maps draft indices back to target token ids (identity otherwise).
    """

    config_class = MedusaConfig

    def __init__(self, config: MedusaConfig):
        super().__init__(config)
        if config.draft_vocab_size is not None and config.draft_vocab_size > config.vocab_size:
            raise ValueError(f"draft_vocab_size {config.draft_vocab_size} exceeds the target's vocab_size {config.vocab_size}")
        h = config.hidden_size
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(h) for _ in range(config.num_layers)]) for _ in range(config.num_heads)
        )
        self.lm_heads = None if config.share_lm_head else nn.ModuleList(
            nn.Linear(h, config.output_size, bias=False) for _ in range(config.num_heads)
        )
        if config.draft_vocab_size:
            # d2t as in EAGLE-3: target_id = draft_id + d2t[draft_id]
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None
        self._shared = ()  # (weight [V', H],) of the target's lm_head when shared: not in the state dict

    @classmethod
    def from_target(cls, target_model, config: MedusaConfig | None = None, draft_tokens: torch.Tensor | None = None,
                    **overrides) -> "MedusaHeads":
        """Heads sized for ``target_model``, projections copied from (or shared with) its lm_head.

        ``draft_tokens``: target ids of the reduced draft vocabulary (needed when
        ``draft_vocab_size`` is set), e.g. ``frequent_tokens(train_data, n)``.
        """
        tcfg = target_model.config.get_text_config()
        fields = {"hidden_size": tcfg.hidden_size, "vocab_size": tcfg.vocab_size,
                  "base_model_name_or_path": getattr(tcfg, "_name_or_path", None) or None}
        base = dataclasses.asdict(config) if config is not None else {}
        heads = cls(MedusaConfig(**{**base, **fields, **overrides}))
        if heads.d2t is not None:
            if draft_tokens is None or len(draft_tokens) != heads.config.draft_vocab_size:
                raise ValueError(f"draft_vocab_size={heads.config.draft_vocab_size} needs as many draft token ids, "
                                 f"got {None if draft_tokens is None else len(draft_tokens)}")
            ids = torch.as_tensor(draft_tokens, dtype=torch.long).sort().values
            heads.d2t.copy_(ids - torch.arange(len(ids)))
        heads.init_from_target(target_model)
        return heads

    def init_from_target(self, target_model) -> None:
        """Copy the target's lm_head into every head's projection, or bind it when shared."""
        self.check_target(target_model)
        if self.lm_heads is None:
            self.bind_target(target_model)
            return
        weight = target_model.get_output_embeddings().weight
        with torch.no_grad():
            for proj in self.lm_heads:
                proj.weight.copy_(self.draft_rows(weight).to(proj.weight.dtype))

    def validate(self) -> None:
        self.check_draft_vocab()

    def bind_target(self, target_model) -> "MedusaHeads":
        """Check shapes against the target and, when the heads share its lm_head, bind it (not saved)."""
        self.check_target(target_model)
        self.check_draft_vocab()
        if self.lm_heads is None:
            lm_head = target_model.get_output_embeddings()
            if getattr(lm_head, "bias", None) is not None:
                raise ValueError("share_lm_head needs a target lm_head without bias; train with share_lm_head=false")
            weight = lm_head.weight.detach()
            # a reduced vocabulary is sliced once here, not on every call
            self._shared = (self.draft_rows(weight).contiguous() if self.d2t is not None else weight,)
        return self

    def head_features(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        # hidden: [..., H] -> [..., H]
        return self.blocks[k](hidden)

    def project(self, features: torch.Tensor, k: int) -> torch.Tensor:
        # features: [..., H] -> [..., V']
        if self.lm_heads is not None:
            return self.lm_heads[k](features)
        return nn.functional.linear(features, self.projection_weight(k).to(features.dtype))

    def projection_weight(self, k: int) -> torch.Tensor:
        """Head k's vocabulary projection [V', H]: its own lm_head, or the target's bound (shared) one."""
        if self.lm_heads is not None:
            return self.lm_heads[k].weight
        if not self._shared:
            raise RuntimeError("these Medusa heads share the target's lm_head: call heads.bind_target(target_model) first")
        return self._shared[0]

    def head_logits(self, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Logits of head k only: [..., H] -> [..., V'] (training uses this to keep memory flat)."""
        return self.project(self.head_features(hidden, k), k)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states: [B, T, H] -> [num_heads, B, T, V']
        return torch.stack([self.head_logits(hidden_states, k) for k in range(self.config.num_heads)])
