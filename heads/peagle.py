"""P-EAGLE (parallel EAGLE, arXiv:2602.01469): an EAGLE-3 drafter that proposes K tokens in one pass.

The drafter is EAGLE-3's (``fc`` over the fused target layers, one decoder layer, ``norm``, its own
``lm_head`` over the draft vocabulary) plus one learnt vector, ``mask_hidden`` (as wide as the fused
features, so it goes through ``fc`` like them). A round feeds the context as EAGLE-3 does (the root's
position pairs the root token with the target's last feature: depth 1's prediction) and, in the same
causal pass, K - 1 slots at the next positions, each pairing the ``mask_token_id`` token's embedding with
``fc(mask_hidden)``: slot j predicts the token j + 1 places after the root. Slots see the context and the
slots before them, never the drafted tokens, so the K predictions come from one forward (vLLM's
``parallel_drafting``; speculators' and SpecForge's ``PEagleDraftModel``). Training: every position of a
sequence is an anchor for chains of K - 1 slots (``headway.train.peagle``).

headway keeps the target's token embedding (bound, not stored, as for EAGLE-3), so the mask token's
embedding is the target's row for ``mask_token_id`` and only ``mask_hidden`` carries the slots' learnt
input (speculators also trains its own embedding; vLLM shares the target's when the drafter has none).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from headway.heads.eagle import EagleConfig, Eagle3Head
from headway.heads.values import check_token_id

DEFAULT_PARALLEL_DEPTHS = 4  # tokens per drafter pass (speculators' and SpecForge's examples: 4-5)


def default_mask_token(target_model) -> int:
    """The target's pad token, else its EOS, else 0: the slots' token (its embedding is a fixed input; the
    learnt part is ``mask_hidden``)."""
    for source in (target_model.generation_config, target_model.config.get_text_config()):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            value = value[0] if isinstance(value, (list, tuple)) and value else value
            if isinstance(value, int) and value >= 0:
                return value
    return 0


@dataclasses.dataclass
class PEagleConfig(EagleConfig):
    parallel_depths: int = DEFAULT_PARALLEL_DEPTHS  # K: tokens drafted per pass (the root's + K - 1 slots)
    mask_token_id: int | None = None  # the slots' token (None: the target's pad/EOS, set by from_target)

    drafter_type_name = "peagle"

    def __post_init__(self):
        super().__post_init__()
        if self.version != 3:
            raise ValueError(f"P-EAGLE extends EAGLE-3 (version 3), got version {self.version}")
        if self.normalize_features:
            raise ValueError("P-EAGLE with normalize_features (EAGLE-3.1's norms) is not read by vLLM's P-EAGLE "
                             "path (it ignores fc_norm for peagle): set normalize_features=false")
        if self.parallel_depths < 2:
            raise ValueError(f"parallel_depths must be >= 2 (the root's prediction and at least one slot), "
                             f"got {self.parallel_depths}")
        # (its upper bound is the target's vocabulary, checked where the drafter meets it: a run config's sizes are
        # placeholders until the target loads, so a Llama 3 token id must not be refused against SmolLM2's 49,152)
        check_token_id("mask_token_id", self.mask_token_id, None)


class PEagleHead(Eagle3Head):
    """EAGLE-3 plus ``mask_hidden`` [feature_width]; build with ``PEagleHead.from_target``."""

    config_class = PEagleConfig

    def __init__(self, config: PEagleConfig):
        if not isinstance(config, PEagleConfig):
            raise ValueError(f"PEagleHead takes a PEagleConfig, got {type(config).__name__}")
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.randn(config.feature_width) * 0.02)

    def check_target(self, target_model) -> None:
        super().check_target(target_model)  # the vocabularies agree: the mask token is the target's
        check_token_id("mask_token_id", self.config.mask_token_id, self.config.vocab_size)

    def validate(self) -> None:
        super().validate()
        check_token_id("mask_token_id", self.config.mask_token_id, self.config.vocab_size)

    @classmethod
    def from_target(cls, target_model, version: int | None = None, config: EagleConfig | None = None,
                    draft_tokens: torch.Tensor | None = None, **overrides) -> "PEagleHead":
        """``EagleHead.from_target`` plus P-EAGLE's own choices from ``config`` (parallel_depths,
        mask_token_id; the mask token defaults to the target's pad/EOS)."""
        if isinstance(config, PEagleConfig):
            overrides = {"parallel_depths": config.parallel_depths, "mask_token_id": config.mask_token_id,
                         **overrides}
        if overrides.get("mask_token_id") is None:
            overrides["mask_token_id"] = default_mask_token(target_model)
        return super().from_target(target_model, version=3, config=config, draft_tokens=draft_tokens, **overrides)

    def slot_hidden(self) -> torch.Tensor:
        """The slots' step input ``fc(mask_hidden)`` [H]."""
        return self.input_hidden(self.mask_hidden.to(self.fc.weight.dtype))

    def slot_inputs(self, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The inputs of ``s`` slots: the mask token's ids [s] and the step input ``fc(mask_hidden)`` [s, H]. Without
        gradients ``fc(mask_hidden)`` is computed once per version of the two weights (a runtime round would pay a
        product of fc's whole weight for it: 5% of a default-target round's drafting), recomputed after they change
        in place (an optimizer step, ``load_state_dict``) or move. (An edit through ``.data`` is not seen; the drafts
        would then come from the old slots, which verification keeps exact anyway.)"""
        ids = torch.full((s,), self.config.mask_token_id, dtype=torch.long, device=device)
        if torch.is_grad_enabled() and self.mask_hidden.requires_grad:
            return ids, self.slot_hidden().expand(s, -1)
        try:
            key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in (self.fc.weight, self.mask_hidden))
        except RuntimeError:  # weights made under inference_mode keep no version: computed each time
            return ids, self.slot_hidden().expand(s, -1)
        cached = self.__dict__.get("_slot_hidden")
        if cached is None or cached[0] != key:
            cached = (key, self.slot_hidden())
            self.__dict__["_slot_hidden"] = cached
        return ids, cached[1].expand(s, -1)

    def slots(self, positions: torch.Tensor, cache=None, attention_mask=None) -> torch.Tensor:
        """K - 1 slots at ``positions`` [B, S] after ``cache`` (causal: each sees the context and the slots
        before it) -> their outputs h' [B, S, H]. The runtime runs the slots inside the catch-up's forward
        (``PEagleProposer``); this pass alone is the reference its tests and the exports' tests compare with."""
        b, s = positions.shape
        ids, hidden = self.slot_inputs(s, positions.device)
        return self(ids.expand(b, s), hidden.expand(b, s, -1), positions, attention_mask=attention_mask, cache=cache)
