"""DFlash (arXiv:2602.06036): a block-diffusion drafter that fills a block of B tokens in one forward.

The drafter is a few Qwen3-style decoder layers (q_norm / k_norm in the attention) over the target's
own token embedding and lm_head (bound, frozen, not stored: z-lab's and speculators' full-vocabulary
drafters do the same; with ``draft_vocab_size`` only the rows of a reduced draft vocabulary are
scored, ``d2t`` mapping them back, as speculators' reduced-vocabulary DFlash does). The target's features at ``feature_layers`` (transformers hidden_states ids,
as EAGLE-3's) are fused by ``fc`` and ``hidden_norm`` into one context state per position, and every
draft layer reads that context through its own ``k_proj`` / ``v_proj`` (keys normed and rotated at
the context's positions): the target's features are the drafter's key/value cache. A block is the
last accepted token (the anchor, at position p) and B - 1 copies of ``mask_token_id`` at p+1 .. p+B-1;
it attends to every context position before p and, bidirectionally, to the whole block. Slot k's
output, after ``norm`` and the target's lm_head, is the drafter's distribution for the token at p + k:
one forward drafts B - 1 tokens. Training (``headway.train.dflash``) samples anchors in a sequence and
trains each block's slots against the target's distribution at their positions.

Tensors (z-lab's and speculators' names): ``fc``, ``hidden_norm``, ``layers.{i}.self_attn.{q,k,v,o}_proj``,
``layers.{i}.self_attn.{q,k}_norm``, ``layers.{i}.{input,post_attention}_layernorm``, ``layers.{i}.mlp.*``,
``norm``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from headway.heads.base import Drafter, DraftVocabulary, check_target_compatible
from headway.heads.eagle import EagleConfig, Fp32Rope, target_layer_fields
from headway.heads.eagle_layer import DraftCache, _expand_kv
from headway.heads.peagle import default_mask_token
from headway.heads.target.features import check_depth, final_norm, num_layers
from headway.heads.values import check_token_id

DEFAULT_BLOCK_SIZE = 8  # B: the anchor and 7 mask slots (speculators' default; z-lab ships 10 and 16)


@dataclasses.dataclass
class DFlashConfig(EagleConfig):
    num_layers: int = 1  # the drafter's decoder layers (z-lab: 5 for Qwen3-8B; one costs 1/L of a target pass)
    block_size: int = DEFAULT_BLOCK_SIZE  # B: tokens per drafter pass, the anchor + B - 1 drafted
    mask_token_id: int | None = None  # the mask slots' token (None: the target's pad/EOS, set by from_target)

    drafter_type_name = "dflash"

    def __post_init__(self):
        super().__post_init__()
        if self.version != 3:
            raise ValueError(f"DFlash reads fused target features as EAGLE-3 does (version 3), got version {self.version}")
        if self.normalize_features or self.store_embeddings or self.fc_bias:
            raise ValueError("DFlash reads the target's own embedding and scores through its lm_head with a bias-free "
                             "fc: drop normalize_features, store_embeddings and fc_bias")
        if self.block_size < 2:
            raise ValueError(f"DFlash block_size must be >= 2 (the anchor and at least one mask slot), got "
                             f"{self.block_size}")
        # (its upper bound is the target's vocabulary, checked where the drafter meets it: a run config's sizes are
        # placeholders until the target loads, so a Llama 3 token id must not be refused against SmolLM2's 49,152)
        check_token_id("mask_token_id", self.mask_token_id, None)


def _rms_norm(width: int, eps: float) -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm  # Qwen3RMSNorm's arithmetic

    return LlamaRMSNorm(width, eps=eps)


class DFlashAttention(nn.Module):
    """Qwen3 attention (q_norm / k_norm per head before RoPE) whose keys and values are the context's (from the
    fused target features) followed by the block's own."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = _rms_norm(d, cfg.rms_norm_eps)
        self.k_norm = _rms_norm(d, cfg.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [B, T, H] (the context's fused states or the block's normed input) -> k, v [B, Hkv, T, D], k rotated
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        _, k = apply_rotary_pos_emb(k[:, :0], k, cos, sin)  # keys only: an empty query
        return k, v

    def forward(self, x, cos, sin, context, mask=None):
        """x: [B, S, H] the block's normed input; cos/sin [B, S, D] at its positions; context: a ``DraftCache``
        holding the context's keys/values (the block's are appended: the caller crops them) or a pair
        (k, v) [B, Hkv, C, D]; mask: additive [B or 1, 1, S, C + S], None: every key visible."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)  # [B, H, S, D]
        q, _ = apply_rotary_pos_emb(q, q[:, :0], cos, sin)
        k, v = self.keys_values(x, cos, sin)
        if isinstance(context, DraftCache):
            k, v = context.append(k, v)
        else:
            k, v = torch.cat([context[0], k], 2), torch.cat([context[1], v], 2)
        groups = self.heads // self.kv_heads
        out = F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups),
                                             attn_mask=None if mask is None else mask.to(q.dtype))
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DFlashLayer(nn.Module):
    """A Qwen3 decoder layer whose attention also reads the context (``DFlashAttention``)."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP

        self.self_attn = DFlashAttention(cfg)
        self.mlp = LlamaMLP(cfg.llama_config())
        self.input_layernorm = _rms_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _rms_norm(cfg.hidden_size, cfg.rms_norm_eps)

    def context_kv(self, context: torch.Tensor, cos, sin):
        # context: [B, C, H] fused target states (not normed again) -> this layer's (k, v) [B, Hkv, C, D]
        return self.self_attn.keys_values(context, cos, sin)

    def forward(self, x, cos, sin, context, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashHead(Fp32Rope, DraftVocabulary, Drafter):
    """A DFlash drafter; build with ``DFlashHead.from_target(target, block_size=8)``."""

    config_class = DFlashConfig

    def __init__(self, config: DFlashConfig):
        if not isinstance(config, DFlashConfig):
            raise ValueError(f"DFlashHead takes a DFlashConfig, got {type(config).__name__}")
        if config.num_target_layers is None:
            raise ValueError("DFlashConfig.num_target_layers is unset: build the drafter with DFlashHead.from_target")
        super().__init__(config)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        h = config.hidden_size
        self.fc = nn.Linear(config.feature_width, h, bias=False)
        self.hidden_norm = _rms_norm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_layers)])
        self.norm = _rms_norm(h, config.rms_norm_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())  # inv_freq: a non-persistent buffer
        if config.draft_vocab_size:  # target_id = draft_id + d2t[draft_id]: the lm_head rows scored
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        else:
            self.d2t = None  # the full vocabulary (DraftVocabulary's maps are the identity)
        self._bound = ()  # (the target's embedding [V, H], its lm_head rows [V', H]): not saved

    @classmethod
    def from_target(cls, target_model, config: DFlashConfig | None = None, draft_tokens=None,
                    **overrides) -> "DFlashHead":
        """A fresh drafter sized from ``target_model``; from ``config`` only DFlash's own choices (feature_layers,
        num_layers, block_size, mask_token_id, draft_vocab_size); ``overrides`` win. ``norm`` starts as the target's
        final norm. ``draft_tokens``: the target ids whose lm_head rows are scored when ``draft_vocab_size`` is set
        (speculators' reduced-vocabulary DFlash: the target's rows, frozen; a chain's projection costs V'/V)."""
        fields = {**target_layer_fields(target_model), "version": 3}
        if config is not None:
            fields.update({k: getattr(config, k) for k in ("feature_layers", "num_layers", "block_size",
                                                           "mask_token_id", "draft_vocab_size")})
        fields.update(overrides)
        if fields.get("mask_token_id") is None:
            fields["mask_token_id"] = default_mask_token(target_model)
        head = cls(DFlashConfig(**fields))
        if head.d2t is not None:
            head.set_draft_vocab(draft_tokens)
        head.bind_target(target_model)
        with torch.no_grad():
            head.norm.weight.copy_(final_norm(target_model).weight.to(head.norm.weight.dtype))
        return head

    # --- the target -------------------------------------------------------------------------

    def check_target(self, target_model) -> None:
        check_target_compatible(self.config, target_model.config)
        check_depth(target_model, self.config.num_target_layers,
                    f"this DFlash drafter (features {self.config.feature_layers}) was built for")
        check_token_id("mask_token_id", self.config.mask_token_id, self.config.vocab_size)  # the target's, as agreed

    def validate(self) -> None:
        self.check_draft_vocab()
        check_token_id("mask_token_id", self.config.mask_token_id, self.config.vocab_size)

    def bind_target(self, target_model) -> "DFlashHead":
        """Check shapes against the target and bind its frozen embedding and lm_head (its draft vocabulary's rows)."""
        self.check_target(target_model)
        self.check_draft_vocab()
        lm_head = target_model.get_output_embeddings()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("DFlash scores through the target's lm_head, which must have no bias")
        rows = self.draft_rows(lm_head.weight.detach())
        self._bound = (target_model.get_input_embeddings().weight.detach(),
                       rows.contiguous() if self.d2t is not None else rows)
        return self

    def _need_target(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._bound:
            raise RuntimeError("DFlash uses the target's embedding and lm_head: call head.bind_target(target) first")
        return self._bound

    # --- the drafter --------------------------------------------------------------------------

    def check_features(self, features: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] != self.config.feature_width:
            raise ValueError(f"features have width {features.shape[-1]}, this drafter reads "
                             f"{self.config.feature_width} (layers {self.config.feature_layers})")
        return features.to(self.fc.weight.dtype)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_width] -> the context states [..., H] every layer's k/v read."""
        return self.hidden_norm(self.fc(self.check_features(features)))

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """context [B, C, H] at positions [B, C] -> each layer's (k, v) [B, Hkv, C, D]."""
        cos, sin = self.rotary_emb(context, positions)
        return [layer.context_kv(context, cos, sin) for layer in self.layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self._need_target()[0]).to(self.fc.weight.dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, contexts: list,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks of tokens [B, S] (anchor then mask tokens) at ``position_ids`` [B, S] over ``contexts`` (per layer,
        a ``DraftCache`` or a (k, v) pair, as ``context_kv`` makes them) -> the layers' output [B, S, H] (score it
        with ``logits``). attention_mask: additive [B or 1, 1, S, C + S]; None: all of the context and the block."""
        x = self.embed(input_ids)
        cos, sin = self.rotary_emb(x, position_ids)
        for layer, context in zip(self.layers, contexts):
            x = layer(x, cos, sin, context, attention_mask)
        return x

    def projection(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> (``norm(h)``, the target's lm_head rows [V', H]): ``logits`` is their product (map its indices
        with ``to_target_ids``)."""
        return self.norm(h), self._need_target()[1].to(h.dtype)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(*self.projection(h))
