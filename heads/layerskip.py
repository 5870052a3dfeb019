"""LayerSkip self-speculation's exit head (Elhoushi et al., 2024, arXiv:2404.16710).

The target drafts for itself: its own first ``exit_layer`` decoder layers, then this head, a trained
exit norm and LM head, give the next token. The head holds no copy of the target's layers; the runtime
(``headway.inference.layerskip``) runs them from the target itself, sharing the target's KV cache,
and verification resumes from the saved layer-``exit_layer`` states.

``logits = lm_head(norm(h_E))`` where ``h_E`` is the state entering decoder layer ``E`` (feature
layer ``E``: ``headway.heads.target.features``). ``norm`` starts as a copy of the target's final norm
and ``lm_head`` as the target's own rows, so an untrained head is the plain early exit the paper's
models are trained for; training fits both to the target's next-token distribution at layer E.
Optional reduced draft vocabulary (``draft_vocab_size``, EAGLE-3's ``d2t``): on a CPU a full
vocabulary projection costs a large share of a step, and it is paid once per drafted token.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from headway.heads.base import DraftVocabulary, Drafter, DrafterConfig, check_target_compatible
from headway.heads.target.features import check_depth, decoder_layers, final_norm

DEFAULT_EXIT_FRACTION = 0.9  # exit_layer = round(L x this) when unset: the sweep (BENCHMARKS.md) put 27 of 30 (top-1
# 0.70, tau 2.0-3.0) far above 15 (0.34) and 2 (0.23) on SmolLM2-135M
DEFAULT_NUM_DRAFT = 4  # tokens drafted per round: a chain of this depth


def default_exit_layer(depth: int) -> int:
    return min(depth - 1, max(1, round(depth * DEFAULT_EXIT_FRACTION)))


@dataclasses.dataclass
class LayerSkipConfig(DrafterConfig):
    num_target_layers: int | None = None  # the target's depth (filled by from_target)
    exit_layer: int | None = None  # drafting runs the target's layers 0..exit_layer-1; None: about 0.9 of the depth
    num_draft: int = DEFAULT_NUM_DRAFT  # the default chain's depth (tokens drafted per round)
    draft_vocab_size: int | None = None  # score only this many target tokens (d2t); None: all
    rms_norm_eps: float = 1e-5  # the exit norm's (the target's own by from_target)

    drafter_type_name = "layerskip"

    def __post_init__(self):
        super().__post_init__()
        if self.num_target_layers is not None:
            if self.num_target_layers < 2:
                raise ValueError(f"LayerSkip needs a target of at least 2 layers, got {self.num_target_layers}")
            if self.exit_layer is None:
                self.exit_layer = default_exit_layer(self.num_target_layers)
            if not 1 <= self.exit_layer < self.num_target_layers:
                raise ValueError(f"exit_layer must be in 1..{self.num_target_layers - 1} (the target has "
                                 f"{self.num_target_layers} layers), got {self.exit_layer}")
        if self.num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {self.num_draft}")
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in 1..{self.vocab_size} (or null for the full vocabulary), "
                             f"got {self.draft_vocab_size}")

    @property
    def output_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size


def check_llama_style(target_model) -> None:
    """LayerSkip drives the target's decoder layer by layer: embed_tokens, layers taking
    position_embeddings, rotary_emb, an RMS final norm. Refuse other layouts in one line."""
    base = target_model.get_decoder() if hasattr(target_model, "get_decoder") else None
    missing = [name for name in ("embed_tokens", "rotary_emb", "norm") if not hasattr(base, name)]
    if base is None or missing:
        raise ValueError(f"LayerSkip runs the target's layers one by one and supports Llama-style decoders (Llama, "
                         f"Qwen2, Mistral, SmolLM2: embed_tokens, rotary_emb, norm); {type(target_model).__name__} "
                         f"lacks {missing or 'a decoder'}")
    decoder_layers(target_model)


class LayerSkipHead(DraftVocabulary, Drafter):
    """The exit norm and LM head of a LayerSkip drafter; build with ``LayerSkipHead.from_target``."""

    config_class = LayerSkipConfig

    def __init__(self, config: LayerSkipConfig):
        super().__init__(config)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        if config.num_target_layers is None:
            raise ValueError("LayerSkipConfig.num_target_layers is unset: build the drafter with "
                             "LayerSkipHead.from_target")
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.output_size, bias=False)
        if config.draft_vocab_size:  # target_id = draft_id + d2t[draft_id]
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None

    @classmethod
    def from_target(cls, target_model, config: LayerSkipConfig | None = None,
                    draft_tokens=None, **overrides) -> "LayerSkipHead":
        """A head sized from ``target_model`` (hidden size, vocabulary, depth, norm epsilon), its norm and
        lm_head copied from the target's final norm and lm_head rows. From ``config`` only the drafter's own
        choices are taken (exit_layer, num_draft, draft_vocab_size); ``draft_tokens``: target ids of the
        reduced draft vocabulary when ``draft_vocab_size`` is set."""
        check_llama_style(target_model)
        tcfg = target_model.config.get_text_config()
        fields = dict(hidden_size=tcfg.hidden_size, vocab_size=tcfg.vocab_size,
                      base_model_name_or_path=getattr(tcfg, "_name_or_path", None) or None,
                      num_target_layers=tcfg.num_hidden_layers,
                      rms_norm_eps=getattr(tcfg, "rms_norm_eps", None) or 1e-6)
        if config is not None:
            fields.update(exit_layer=config.exit_layer, num_draft=config.num_draft,
                          draft_vocab_size=config.draft_vocab_size)
        head = cls(LayerSkipConfig(**{**fields, **overrides}))
        if head.d2t is not None:
            head.set_draft_vocab(draft_tokens)
        device = target_model.get_output_embeddings().weight.device
        head.to(device)
        with torch.no_grad():
            head.norm.weight.copy_(final_norm(target_model).weight)
            head.lm_head.weight.copy_(head.draft_rows(target_model.get_output_embeddings().weight))
        return head

    def validate(self) -> None:
        self.check_draft_vocab()

    def check_target(self, target_model) -> None:
        check_target_compatible(self.config, target_model.config)
        check_depth(target_model, self.config.num_target_layers,
                    f"this LayerSkip drafter exits at layer {self.config.exit_layer} of")
        check_llama_style(target_model)

    def projection(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed states [..., H], lm_head weight [V', H]): what the logits are the product of."""
        return self.norm(h), self.lm_head.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # [..., H] layer-E states -> [..., V'] logits over the draft vocabulary
        x, w = self.projection(h.to(self.lm_head.weight.dtype))
        return x @ w.T

    logits = forward
