"""EAGLE drafters: one decoder layer that extrapolates the target's features (one class, two versions).

- EAGLE-1/2 (Li et al., 2024, arXiv:2401.15077; EAGLE-2 arXiv:2406.16858 changes only inference):
  ``f_hat[t+1] = Layer(fc([emb(x[t+1]); f[t]]))`` where f is the target's final-norm hidden state;
  the layer is a Llama decoder layer without input norm, logits come from the target's frozen
  lm_head. Tensors ``fc.*`` and ``layers.0.*`` (the official / vLLM ``EagleLlamaForCausalLM`` names).
- EAGLE-3 (Li et al., 2025, arXiv:2503.01840): the features are the hidden states entering target
  layers low/mid/high, fused by ``fc`` (3H -> H); the attention reads
  ``[input_layernorm(emb); hidden_norm(h)]`` (2H wide), the residual runs on h, then ``norm`` and
  an own trainable ``lm_head`` over a reduced draft vocabulary with ``d2t`` / ``t2d``. Tensors
  ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (the official / SGLang names).

The token embedding is the target's, frozen and bound at run time (``bind_target``), not stored
unless ``store_embeddings``. The step function ``forward(input_ids, hidden, position_ids, ...)``
returns the layer output h' (the predicted feature, fed back as the next step's ``hidden``);
``logits(h')`` scores it. With ``ttt=TTTKeys()`` the attention also sees, at every position, the
keys that earlier unrolled steps wrote there (EAGLE-3's training-time test).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from headway.heads.base import Drafter, DrafterConfig, DraftVocabulary, check_target_compatible
from headway.heads.features import check_feature_layers, num_layers


def default_feature_layers(version: int, depth: int) -> list[int]:
    """EAGLE-1: the final-norm output ``[L]``; EAGLE-3: the inputs of layers 2, L//2, L-3
    (``[0, L//2, L]`` for targets too shallow to have three distinct ones)."""
    if version == 1:
        return [depth]
    ids = [2, depth // 2, depth - 3]
    if len(set(ids)) == 3 and all(0 <= i < depth for i in ids):
        return ids
    return sorted({0, depth // 2, depth})


@dataclasses.dataclass
class EagleConfig(DrafterConfig):
    version: int = 3  # 1: EAGLE-1/2 (fc over [emb; feature], target lm_head); 3: EAGLE-3 (fused features, own lm_head)
    num_attention_heads: int = 9  # the drafter layer's attention heads (from the target by default)
    num_key_value_heads: int = 3
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    intermediate_size: int = 1536  # MLP width
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # extra rope_parameters for non-default RoPE types (e.g. llama3)
    max_position_embeddings: int = 8192
    num_target_layers: int | None = None  # the target's depth (filled by from_target); layer ids are checked against it
    feature_layers: list[int] | None = None  # target hidden-state ids read; None: the version's default
    draft_vocab_size: int | None = None  # score only this many target tokens (d2t/t2d); None: all
    fc_bias: bool | None = None  # None: True for EAGLE-1 (as the official code), False for EAGLE-3
    store_embeddings: bool = False  # keep a frozen copy of the target's embedding in the checkpoint

    drafter_type_name = "eagle"

    def __post_init__(self):
        super().__post_init__()
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 (EAGLE-1/2) or 3 (EAGLE-3), got {self.version}")
        if self.num_target_layers is not None:  # None: a run config's placeholder, filled from the target
            if self.feature_layers is None:
                self.feature_layers = default_feature_layers(self.version, self.num_target_layers)
            self.feature_layers = check_feature_layers(self.feature_layers, self.num_target_layers)
        elif self.feature_layers is not None:
            self.feature_layers = check_feature_layers(self.feature_layers, max(self.feature_layers + [0]))
        if self.version == 1 and self.feature_layers is not None and len(self.feature_layers) != 1:
            raise ValueError(f"EAGLE-1 reads one feature layer, got feature_layers={self.feature_layers}")
        if self.version == 1 and self.num_target_layers is not None and self.feature_layers != [self.num_target_layers]:
            raise ValueError(f"EAGLE-1 extrapolates the target's final-norm feature (layer {self.num_target_layers}), "
                             f"got feature_layers={self.feature_layers}; drop eagle.feature_layers for EAGLE-1")
        if self.fc_bias is None:
            self.fc_bias = self.version == 1
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1 (or null for the full vocabulary), got {self.draft_vocab_size}")

    @property
    def output_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    @property
    def feature_width(self) -> int:
        """Width of the target features the drafter reads: hidden_size x feature layers."""
        if self.feature_layers is None:
            raise ValueError("EagleConfig has no num_target_layers / feature_layers yet: build the drafter with "
                             "EagleHead.from_target(target, ...)")
        return self.hidden_size * len(self.feature_layers)

    def llama_config(self):
        """The drafter layer as a transformers LlamaConfig (one layer): rotary embedding and exports."""
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=1, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, hidden_act=self.hidden_act,
            rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_position_embeddings,
            rope_parameters={"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta},
            tie_word_embeddings=False)


class DraftCache:
    """The drafter's own key/value cache (one layer): ``[B, Hkv, S, D]`` tensors, cropped on roll-back."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        if self.keys is not None and self.keys.shape[2] > length:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # [B, Hkv, S, D] -> [B, Hkv * groups, S, D]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


class EagleAttention(nn.Module):
    """Llama self-attention whose q/k/v read ``in_width`` features (2H for EAGLE-3)."""

    def __init__(self, cfg: EagleConfig, in_width: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_width, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_width, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask=None, cache: DraftCache | None = None, ttt: TTTKeys | None = None):
        # x: [B, T, in_width]; cos/sin: [B, T, D]; mask: additive [B or 1, 1, T, S] or None (causal)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)  # [B, H, T, D]
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        groups = self.heads // self.kv_heads
        if ttt:  # an unrolled step i > 0: step-0 keys causally + the key each step wrote at this position
            out = _ttt_attention(q, k, v, ttt, groups)
            ttt.append((k, v))
        else:
            if ttt is not None:
                ttt.append((k, v))
            if cache is not None:
                k, v = cache.append(k, v)
            s = k.shape[2]
            if mask is None and t > 1 and s > t:  # causal after a cached prefix
                mask = torch.full((t, s), float("-inf"), dtype=q.dtype, device=q.device).triu_(s - t + 1)[None, None]
            out = F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups),
                                                 attn_mask=None if mask is None else mask.to(q.dtype),
                                                 is_causal=mask is None and t > 1)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class TTTKeys:
    """The keys and values each unrolled training-time-test step wrote: [(k_j, v_j)] for steps 0..i-1.

    Deliberately not a list: module hooks that re-wrap tensor arguments (DeepSpeed ZeRO-3's) rebuild
    list and tuple arguments, so a plain list passed down would lose the steps appended inside."""

    def __init__(self):
        self.steps: list = []

    def append(self, kv) -> None:
        self.steps.append(kv)

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, i):
        return self.steps[i]


def _ttt_attention(q, k, v, steps: list, groups: int) -> torch.Tensor:
    """Attention of unrolled step i = len(steps) (EAGLE-3 training-time test).

    q, k, v: [B, H or Hkv, T, D] of this step; steps: [(k_j, v_j)] of steps 0..i-1. Position t sees
    step 0's keys at positions <= t (causal) and, of every later step including this one, only the
    key at t itself (the diagonal): exactly what a depth-i tree node sees at inference.
    """
    scale = q.shape[-1] ** -0.5
    k0, v0 = _expand_kv(steps[0][0], groups), _expand_kv(steps[0][1], groups)
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril_()
    s0 = (q @ k0.transpose(-1, -2)) * scale  # [B, H, T, T]
    s0 = s0.masked_fill(~causal, float("-inf"))
    diag_k = [_expand_kv(kj, groups) for kj, _ in steps[1:]] + [_expand_kv(k, groups)]
    diag_v = [_expand_kv(vj, groups) for _, vj in steps[1:]] + [_expand_kv(v, groups)]
    sd = torch.stack([(q * kj).sum(-1) * scale for kj in diag_k], dim=-1)  # [B, H, T, i]
    acc = torch.promote_types(q.dtype, torch.float32)  # softmax in at least fp32 (bf16 training)
    weights = torch.cat([s0, sd], dim=-1).to(acc).softmax(-1).to(q.dtype)  # [B, H, T, T + i]
    out = weights[..., :t] @ v0  # [B, H, T, D]
    for j, vj in enumerate(diag_v):
        out = out + weights[..., t + j, None] * vj
    return out


class EagleLayer(nn.Module):
    """The drafter's decoder layer. EAGLE-1: no input norm, input ``fc([emb; f])``. EAGLE-3: q/k/v read
    ``[input_layernorm(emb); hidden_norm(h)]`` and the residual runs on h (norm_before_residual false)."""

    def __init__(self, cfg: EagleConfig):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

        h = cfg.hidden_size
        self.version = cfg.version
        self.self_attn = EagleAttention(cfg, 2 * h if cfg.version == 3 else h)
        self.mlp = LlamaMLP(cfg.llama_config())
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
        if cfg.version == 3:
            self.input_layernorm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
            self.hidden_norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, x, emb, cos, sin, mask=None, cache=None, ttt=None):
        # x: [B, T, H] (EAGLE-1: already fc([emb; f])); emb: [B, T, H] token embeddings (EAGLE-3 only)
        if self.version == 3:
            attn_in = torch.cat([self.input_layernorm(emb), self.hidden_norm(x)], dim=-1)  # [B, T, 2H]
        else:
            attn_in = x
        x = x + self.self_attn(attn_in, cos, sin, mask, cache, ttt)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(DraftVocabulary, Drafter):
    """An EAGLE-1 or EAGLE-3 drafter; build with ``EagleHead.from_target(target, version=3)``."""

    config_class = EagleConfig

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

        if config.num_target_layers is None:
            raise ValueError("EagleConfig.num_target_layers is unset: build the drafter with EagleHead.from_target")
        if config.draft_vocab_size is not None and config.draft_vocab_size > config.vocab_size:
            raise ValueError(f"draft_vocab_size {config.draft_vocab_size} exceeds the target's vocab_size "
                             f"{config.vocab_size}; choose at most {config.vocab_size}")
        h = config.hidden_size
        fc_in = config.feature_width if config.version == 3 else 2 * h
        self.fc = nn.Linear(fc_in, h, bias=config.fc_bias)
        layer = EagleLayer(config)
        if config.version == 1:
            self.layers = nn.ModuleList([layer])
        else:
            self.midlayer = layer
            self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
            self.lm_head = nn.Linear(h, config.output_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())  # inv_freq is a non-persistent buffer
        if config.store_embeddings:
            self.embed_tokens = nn.Embedding(config.vocab_size, h).requires_grad_(False)
        if config.draft_vocab_size:
            # target_id = draft_id + d2t[draft_id]; t2d[target_id] is True inside the draft vocabulary
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self._bound = ()  # (embedding [V, H], lm_head rows [V', H] for EAGLE-1): the target's, not saved

    def _apply(self, fn, recurse=True):
        """Module casts and moves (``.to``, ``.half()``, ``.float()``), with RoPE's inverse frequencies
        kept in float32 as transformers computes them: a bf16 cast would round them for good (a bf16
        checkpoint loads through one), and every later position's angle with them."""
        rope = self.rotary_emb
        exact = rope.inv_freq.detach().clone() if rope.inv_freq.dtype == torch.float32 else None
        super()._apply(fn, recurse)
        if exact is not None and rope.inv_freq.dtype != torch.float32:
            rope.inv_freq = exact.to(rope.inv_freq.device)
            rope.original_inv_freq = exact.clone().to(rope.inv_freq.device)
        return self

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_target(cls, target_model, version: int | None = None, config: EagleConfig | None = None,
                    draft_tokens: torch.Tensor | None = None, **overrides) -> "EagleHead":
        """A fresh drafter sized from ``target_model``'s config (hidden size, heads, MLP width, RoPE,
        vocabulary, depth). From ``config`` only the drafter's own choices are taken (version,
        feature_layers, draft_vocab_size, fc_bias, store_embeddings); ``overrides`` win over both.
        ``draft_tokens``: target ids of the reduced draft vocabulary when ``draft_vocab_size`` is set
        (e.g. ``frequent_tokens(data, n)``)."""
        tcfg = target_model.config.get_text_config()
        h = tcfg.hidden_size
        heads = getattr(tcfg, "num_attention_heads", None) or max(1, h // 64)
        rope = dict(getattr(tcfg, "rope_parameters", None) or {})
        theta = rope.pop("rope_theta", None) or getattr(tcfg, "rope_theta", None) or 10000.0
        if rope.get("rope_type", "default") == "default":
            rope = {}
        fields = dict(
            hidden_size=h, vocab_size=tcfg.vocab_size, version=3,
            base_model_name_or_path=getattr(tcfg, "_name_or_path", None) or None,
            num_attention_heads=heads, num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(tcfg, "head_dim", None) or h // heads,
            intermediate_size=getattr(tcfg, "intermediate_size", None) or 4 * h,
            rms_norm_eps=getattr(tcfg, "rms_norm_eps", None) or 1e-6, rope_theta=float(theta),
            rope_scaling=rope or None,
            max_position_embeddings=getattr(tcfg, "max_position_embeddings", None) or 8192,
            num_target_layers=tcfg.num_hidden_layers)
        if config is not None:
            fields.update({k: getattr(config, k) for k in ("version", "feature_layers", "draft_vocab_size",
                                                           "fc_bias", "store_embeddings")})
            if config.fc_bias == (config.version == 1):
                fields["fc_bias"] = None  # the version's default
        if version is not None:
            fields["version"] = version
        head = cls(EagleConfig(**{**fields, **overrides}))
        if head.d2t is not None:
            head.set_draft_vocab(draft_tokens)
        head.init_from_target(target_model)
        return head

    def set_draft_vocab(self, draft_tokens) -> None:
        """Fill d2t/t2d from the target ids of the draft vocabulary."""
        n = self.config.draft_vocab_size
        if draft_tokens is None or len(draft_tokens) != n:
            raise ValueError(f"draft_vocab_size={n} needs as many draft token ids, "
                             f"got {None if draft_tokens is None else len(draft_tokens)}")
        ids = torch.as_tensor(draft_tokens, dtype=torch.long).sort().values.to(self.d2t.device)
        if len(set(ids.tolist())) != n or int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"draft token ids must be {n} distinct ids in [0, {self.config.vocab_size})")
        self.d2t.copy_(ids - torch.arange(n, device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def init_from_target(self, target_model) -> None:
        """Bind the target's embedding (and lm_head), copy what is stored from it."""
        self.bind_target(target_model)
        with torch.no_grad():
            if self.config.store_embeddings:
                self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
            if self.config.version == 3:
                weight = target_model.get_output_embeddings().weight
                self.lm_head.weight.copy_(self.draft_rows(weight).to(self.lm_head.weight.dtype))

    # --- the target -------------------------------------------------------------------------

    def check_target(self, target_model) -> None:
        check_target_compatible(self.config, target_model.config)
        depth = num_layers(target_model)
        if depth != self.config.num_target_layers:
            raise ValueError(f"this EAGLE drafter was built for a target with {self.config.num_target_layers} layers "
                             f"(features {self.config.feature_layers}) but the target has {depth}; "
                             "train or load a drafter made for this target")

    def validate(self) -> None:
        self.check_draft_vocab()

    def check_draft_vocab(self) -> None:
        """d2t must map every draft index to a distinct target id that t2d marks."""
        if self.d2t is None:
            return
        ids = self.draft_token_ids
        v = self.config.vocab_size
        if int(ids.min()) < 0 or int(ids.max()) >= v or len(torch.unique(ids)) != len(ids) or \
                int(self.t2d.sum()) != len(ids) or not bool(self.t2d[ids].all()):
            raise ValueError(f"d2t/t2d are inconsistent with draft_vocab_size {len(ids)} and vocab_size {v} "
                             "(draft ids must map to distinct target ids that t2d marks); re-export the drafter")

    def bind_target(self, target_model) -> "EagleHead":
        """Check shapes against the target and bind its frozen embedding (and EAGLE-1's lm_head)."""
        self.check_target(target_model)
        self.check_draft_vocab()
        embed = target_model.get_input_embeddings().weight.detach()
        rows = None
        if self.config.version == 1:
            lm_head = target_model.get_output_embeddings()
            if getattr(lm_head, "bias", None) is not None:
                raise ValueError("EAGLE-1 scores through the target's lm_head, which must have no bias")
            rows = self.draft_rows(lm_head.weight.detach())
            rows = rows.contiguous() if self.d2t is not None else rows
        self._bound = (embed, rows)
        return self

    # --- the step function ------------------------------------------------------------------

    @property
    def layer(self) -> EagleLayer:
        return self.layers[0] if self.config.version == 1 else self.midlayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [B, T] -> [B, T, H]
        if self.config.store_embeddings:
            return self.embed_tokens(input_ids)
        if not self._bound:
            raise RuntimeError("this EAGLE drafter uses the target's embedding: call head.bind_target(target) first")
        return F.embedding(input_ids, self._bound[0]).to(self.fc.weight.dtype)

    def input_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_width] -> the step's ``hidden`` [..., H] (EAGLE-3: fc fuses them)."""
        if features.shape[-1] != self.config.feature_width:
            raise ValueError(f"features have width {features.shape[-1]}, this drafter reads "
                             f"{self.config.feature_width} (layers {self.config.feature_layers})")
        features = features.to(self.fc.weight.dtype)
        return self.fc(features) if self.config.version == 3 else features

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: DraftCache | None = None,
                ttt: TTTKeys | None = None) -> torch.Tensor:
        """One drafting step: tokens x[t+1] [B, T] with ``hidden`` [B, T, H] (``input_hidden`` of the
        target feature f[t], or a previous step's output) at ``position_ids`` [B, T] -> h' [B, T, H].

        attention_mask: additive [1, 1, T, S] over cache + new entries, or None for causal."""
        emb = self.embed(input_ids)
        hidden = hidden.to(emb.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        x = self.fc(torch.cat([emb, hidden], dim=-1)) if self.config.version == 1 else hidden
        return self.layer(x, emb, cos, sin, attention_mask, cache, ttt)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V'] draft logits (map indices with ``to_target_ids``)."""
        return F.linear(*self.projection(h))

    def projection(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> (the vocabulary projection's input [..., H], its weight [V', H]): ``logits`` is
        ``F.linear`` of the two (the runtime may pick another kernel for the same product)."""
        if self.config.version == 3:
            return self.norm(h), self.lm_head.weight
        if not self._bound:
            raise RuntimeError("EAGLE-1 scores through the target's lm_head: call head.bind_target(target) first")
        return h, self._bound[1].to(h.dtype)

    @classmethod
    def from_pretrained(cls, folder_or_hub_id, *, version: int | None = None, **kwargs):
        """Load a headway EAGLE checkpoint; ``version`` (1 or 3), when given, must match it."""
        head = super().from_pretrained(folder_or_hub_id, **kwargs)
        if not isinstance(head, EagleHead):
            raise ValueError(f"{folder_or_hub_id} holds a {head.config.drafter_type_name} drafter, not an EAGLE head")
        if version is not None and head.config.version != version:
            raise ValueError(f"{folder_or_hub_id} holds an EAGLE-{head.config.version} drafter but EAGLE-{version} "
                             f"was asked for; load it with version={head.config.version} (the layouts differ)")
        return head
