"""EAGLE drafters: one decoder layer that extrapolates the target's features (two classes over one layer module).

- EAGLE-1/2 (Li et al., 2024, arXiv:2401.15077; EAGLE-2 arXiv:2406.16858 changes only inference):
  ``f_hat[t+1] = Layer(fc([emb(x[t+1]); f[t]]))`` where f is the target's final-norm hidden state;
  the layer is a Llama decoder layer without input norm, logits come from the target's frozen
  lm_head. Tensors ``fc.*`` and ``layers.0.*`` (the official / vLLM ``EagleLlamaForCausalLM`` names).
- EAGLE-3 (Li et al., 2025, arXiv:2503.01840): the features are the hidden states entering target
  layers low/mid/high, fused by ``fc`` (3H -> H); the attention reads
  ``[input_layernorm(emb); hidden_norm(h)]`` (2H wide), the residual runs on h, then ``norm`` and
  an own trainable ``lm_head`` over a reduced draft vocabulary with ``d2t`` / ``t2d``. Tensors
  ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (the official / SGLang names). With
  ``num_layers`` N > 1 (speculators' ``num_hidden_layers``; P-EAGLE's published drafters have 4) plain
  pre-norm Llama layers ``layers.1`` .. ``layers.{N-1}`` follow ``midlayer``, each with its own KV cache.

The token embedding is the target's, frozen and bound at run time (``bind_target``), not stored
unless ``store_embeddings``. The step function ``forward(input_ids, hidden, position_ids, ...)``
returns the layer output h' (the predicted feature, fed back as the next step's ``hidden``);
``logits(h')`` scores it. With ``ttt=TTTKeys()`` the attention also sees, at every position, the
keys that earlier unrolled steps wrote there (EAGLE-3's training-time test).

``EagleHead`` holds what both share (the config, RoPE, the bound embedding, the step, the draft
vocabulary, Hub I/O); ``Eagle1Head`` and ``Eagle3Head`` hold what differs. ``EagleHead(config)``
and ``EagleHead.from_target(..., version=)`` build the class ``config.version`` names, so callers
need not know the two classes.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from headway.heads.base import Drafter, DrafterConfig, DraftVocabulary, check_target_compatible
from headway.heads.eagle_layer import DraftCache, Eagle3Layer, EagleLayer, PlainLayer, TTTKeys
from headway.heads.target.features import check_depth, check_feature_layers


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
    # EAGLE-3.1: an RMSNorm on each captured layer's state before ``fc`` (``fc_norm.{i}``), and the post-norm
    # state (the one the lm_head reads) fed to the next step; vLLM/speculators' fc_norm + norm_output
    normalize_features: bool = False
    # EAGLE-3's decoder layers: midlayer (2H-wide attention over [emb; h]) then num_layers - 1 plain pre-norm ones
    num_layers: int = 1

    drafter_type_name = "eagle"
    later_fields = ("normalize_features", "num_layers")  # absent in older configs: their defaults

    def __post_init__(self):
        super().__post_init__()
        if self.version not in (1, 3):
            raise ValueError(f"EAGLE version must be 1 (EAGLE-1/2) or 3 (EAGLE-3), got {self.version}")
        if self.num_target_layers is not None:  # None: a run config's placeholder, filled from the target
            if self.feature_layers is None:
                self.feature_layers = default_feature_layers(self.version, self.num_target_layers)
            self.feature_layers = check_feature_layers(self.feature_layers, self.num_target_layers)
        elif self.feature_layers is not None:
            self.feature_layers = check_feature_layers(self.feature_layers, None)  # the target's depth: unknown yet
        if self.version == 1 and self.feature_layers is not None and len(self.feature_layers) != 1:
            raise ValueError(f"EAGLE-1 reads one feature layer, got feature_layers={self.feature_layers}")
        if self.version == 1 and self.num_target_layers is not None and self.feature_layers != [self.num_target_layers]:
            raise ValueError(f"EAGLE-1 extrapolates the target's final-norm feature (layer {self.num_target_layers}), "
                             f"got feature_layers={self.feature_layers}; drop eagle.feature_layers for EAGLE-1")
        if self.normalize_features and self.version != 3:
            raise ValueError("normalize_features (EAGLE-3.1) normalises each of EAGLE-3's fused feature layers; "
                             "EAGLE-1 reads one final-norm feature: set version=3 or normalize_features=false")
        if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 1:
            raise ValueError(f"num_layers must be an integer >= 1, got {self.num_layers!r}")
        if self.num_layers > 1 and self.version != 3:
            raise ValueError(f"EAGLE-1 has one decoder layer (the official layout's layers.0), got "
                             f"num_layers={self.num_layers}; set version=3 or num_layers=1")
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


def target_layer_fields(target_model) -> dict:
    """An EAGLE-style drafter layer's sizes from ``target_model``'s config: hidden size, heads, MLP width, RoPE,
    vocabulary, depth (EagleConfig's field names; DFlash's too)."""
    tcfg = target_model.config.get_text_config()
    h = tcfg.hidden_size
    heads = getattr(tcfg, "num_attention_heads", None) or max(1, h // 64)
    rope = dict(getattr(tcfg, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(tcfg, "rope_theta", None) or 10000.0
    if rope.get("rope_type", "default") == "default":
        rope = {}
    return dict(
        hidden_size=h, vocab_size=tcfg.vocab_size,
        base_model_name_or_path=getattr(tcfg, "_name_or_path", None) or None,
        num_attention_heads=heads, num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(tcfg, "head_dim", None) or h // heads,
        intermediate_size=getattr(tcfg, "intermediate_size", None) or 4 * h,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", None) or 1e-6, rope_theta=float(theta),
        rope_scaling=rope or None,
        max_position_embeddings=getattr(tcfg, "max_position_embeddings", None) or 8192,
        num_target_layers=tcfg.num_hidden_layers)


class Fp32Rope(nn.Module):
    """Mixin for a drafter with a ``rotary_emb``: module casts and moves (``.to``, ``.half()``, ``.float()``)
    keep RoPE's inverse frequencies in float32 as transformers computes them: a bf16 cast would round them for
    good (a bf16 checkpoint loads through one), and every later position's angle with them."""

    def _apply(self, fn, recurse=True):
        rope = self.rotary_emb
        exact = rope.inv_freq.detach().clone() if rope.inv_freq.dtype == torch.float32 else None
        super()._apply(fn, recurse)
        if exact is not None and rope.inv_freq.dtype != torch.float32:
            rope.inv_freq = exact.to(rope.inv_freq.device)
            rope.original_inv_freq = exact.clone().to(rope.inv_freq.device)
        return self


class EagleHead(Fp32Rope, DraftVocabulary, Drafter):
    """An EAGLE-1 or EAGLE-3 drafter; build with ``EagleHead.from_target(target, version=3)``.

    ``EagleHead(config)`` is an ``Eagle1Head`` or an ``Eagle3Head`` (``config.version``); each of those
    sets ``version`` and fills the hooks below (``_build``, ``step_input``, ``input_hidden``,
    ``projection``, ``_bind_rows``, ``_copy_from_target``)."""

    config_class = EagleConfig
    version: int | None = None  # set by the two subclasses
    layer: EagleLayer  # the decoder layer (stored as layers.0 or midlayer: the official tensor names)

    def __new__(cls, config: EagleConfig | None = None, *args, **kwargs):
        if config is None:  # copy / pickle rebuilding an instance of the class they already know
            return super().__new__(cls)
        if cls.version is None:  # EagleHead itself: the class the config's version names
            cls = next((c for c in cls.__subclasses__() if c.version == config.version), None) or cls
            if cls.version is None:
                raise ValueError(f"no EAGLE drafter class for version {config.version}; use 1 or 3")
        elif config.version != cls.version:
            raise ValueError(f"{cls.__name__} is EAGLE-{cls.version} but the config says version={config.version}; "
                             "build it with EagleHead(config)")
        return super().__new__(cls)

    def __init__(self, config: EagleConfig):
        super().__init__(config)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        if config.num_target_layers is None:
            raise ValueError("EagleConfig.num_target_layers is unset: build the drafter with EagleHead.from_target")
        if config.draft_vocab_size is not None and config.draft_vocab_size > config.vocab_size:
            raise ValueError(f"draft_vocab_size {config.draft_vocab_size} exceeds the target's vocab_size "
                             f"{config.vocab_size}; choose at most {config.vocab_size}")
        self._build(config)
        self.rotary_emb = LlamaRotaryEmbedding(config.llama_config())  # inv_freq is a non-persistent buffer
        if config.store_embeddings:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size).requires_grad_(False)
        if config.draft_vocab_size:
            # target_id = draft_id + d2t[draft_id]; t2d[target_id] is True inside the draft vocabulary
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        else:
            self.d2t = self.t2d = None
        self._bound = ()  # (embedding [V, H], _bind_rows' result): the target's, not saved

    def _build(self, config: EagleConfig) -> None:
        """Create ``fc``, the decoder layer and the version's own modules (in the official order)."""
        raise NotImplementedError

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_target(cls, target_model, version: int | None = None, config: EagleConfig | None = None,
                    draft_tokens: torch.Tensor | None = None, **overrides) -> "EagleHead":
        """A fresh drafter sized from ``target_model``'s config (hidden size, heads, MLP width, RoPE,
        vocabulary, depth). From ``config`` only the drafter's own choices are taken (version,
        feature_layers, draft_vocab_size, fc_bias, store_embeddings); ``overrides`` win over both.
        ``draft_tokens``: target ids of the reduced draft vocabulary when ``draft_vocab_size`` is set
        (e.g. ``frequent_tokens(data, n)``)."""
        fields = {**target_layer_fields(target_model), "version": cls.version or 3}
        if config is not None:
            fields.update({k: getattr(config, k) for k in ("version", "feature_layers", "draft_vocab_size",
                                                           "fc_bias", "store_embeddings", "normalize_features",
                                                           "num_layers")})
            if config.fc_bias == (config.version == 1):
                fields["fc_bias"] = None  # the version's default
        if version is not None:
            fields["version"] = version
        head = cls(cls.config_class(**{**fields, **overrides}))
        if head.d2t is not None:
            head.set_draft_vocab(draft_tokens)
        head.init_from_target(target_model)
        return head

    def init_from_target(self, target_model) -> None:
        """Bind the target's embedding (and lm_head), copy what is stored from it."""
        self.bind_target(target_model)
        with torch.no_grad():
            if self.config.store_embeddings:
                self.embed_tokens.weight.copy_(target_model.get_input_embeddings().weight)
            self._copy_from_target(target_model)

    def _copy_from_target(self, target_model) -> None:
        """Initialise the version's own weights from the target's (under no_grad)."""

    # --- the target -------------------------------------------------------------------------

    def check_target(self, target_model) -> None:
        check_target_compatible(self.config, target_model.config)
        check_depth(target_model, self.config.num_target_layers,
                    f"this EAGLE drafter (features {self.config.feature_layers}) was built for")

    def validate(self) -> None:
        self.check_draft_vocab()

    def bind_target(self, target_model) -> "EagleHead":
        """Check shapes against the target and bind its frozen embedding (and EAGLE-1's lm_head)."""
        self.check_target(target_model)
        self.check_draft_vocab()
        self._bound = (target_model.get_input_embeddings().weight.detach(), self._bind_rows(target_model))
        return self

    def _bind_rows(self, target_model) -> torch.Tensor | None:
        """What else of the target the version scores with (EAGLE-1: its lm_head rows [V', H])."""
        return None

    # --- the step function ------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [B, T] -> [B, T, H]
        if self.config.store_embeddings:
            return self.embed_tokens(input_ids)
        if not self._bound:
            raise RuntimeError("this EAGLE drafter uses the target's embedding: call head.bind_target(target) first")
        return F.embedding(input_ids, self._bound[0]).to(self.fc.weight.dtype)

    def check_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_width], checked and cast to the drafter's dtype."""
        if features.shape[-1] != self.config.feature_width:
            raise ValueError(f"features have width {features.shape[-1]}, this drafter reads "
                             f"{self.config.feature_width} (layers {self.config.feature_layers})")
        return features.to(self.fc.weight.dtype)

    def input_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_width] -> the step's ``hidden`` [..., H]."""
        raise NotImplementedError

    def step_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder layer's input [B, T, H] from the tokens' embeddings and the step's ``hidden``."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None, cache: DraftCache | None = None,
                ttt: TTTKeys | None = None) -> torch.Tensor:
        """One drafting step: tokens x[t+1] [B, T] with ``hidden`` [B, T, H] (``input_hidden`` of the
        target feature f[t], or a previous step's output) at ``position_ids`` [B, T] -> h' [B, T, H].

        attention_mask: additive [1, 1, T, S] over cache + new entries, or None for causal."""
        emb = self.embed(input_ids)
        hidden = hidden.to(emb.dtype)
        cos, sin = self.rotary_emb(hidden, position_ids)
        return self.step_output(self.decode(self.step_input(emb, hidden), emb, cos, sin, attention_mask, cache, ttt))

    @property
    def decoder_layers(self) -> list[EagleLayer]:
        """The decoder layers in order (``layer`` first)."""
        return [self.layer]

    def decode(self, x, emb, cos, sin, mask=None, cache: DraftCache | None = None, ttt: TTTKeys | None = None):
        """The decoder layers over x [B, T, H] (each its own layer of ``cache`` and ``ttt``) -> [B, T, H]."""
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, emb, cos, sin, mask, None if cache is None else cache.layer(i),
                      None if ttt is None else ttt.layer(i))
        return x

    def write_context(self, x, emb, cos, sin, cache: DraftCache) -> None:
        """Context positions whose outputs nobody reads, into ``cache``: the last layer writes only their
        keys/values; the layers before it run whole (the next one reads their outputs), causally after the cache."""
        *before, last = self.decoder_layers
        for i, layer in enumerate(before):
            x = layer(x, emb, cos, sin, None, cache.layer(i))
        last.write_context(x, emb, cos, sin, cache.layer(len(before)))

    def step_output(self, h: torch.Tensor) -> torch.Tensor:
        """The decoder layer's output [..., H] -> the step's output (fed back and scored); as it is by default."""
        return h

    def extend(self, input_ids: torch.Tensor, hidden: torch.Tensor, position_ids: torch.Tensor,
               cache: DraftCache, outputs: int = 1) -> torch.Tensor:
        """Feed context positions to ``cache`` and return the last ``outputs`` ones' h' [B, outputs, H]:
        ``forward``'s last rows (the same arithmetic, up to rounding), at a quarter of its cost on a long
        prompt. The earlier positions' outputs are never read, so they only write their keys and values
        (no query, attention output, o_proj or MLP); the last ones run the whole layer against them.

        input_ids [B, T], hidden [B, T, H], position_ids [B, T], as ``forward`` takes them (no mask:
        the positions are causal after the cache)."""
        cut = input_ids.shape[1] - min(max(outputs, 1), input_ids.shape[1])
        if cut > 0:
            emb = self.embed(input_ids[:, :cut])
            ctx = hidden[:, :cut].to(emb.dtype)
            cos, sin = self.rotary_emb(ctx, position_ids[:, :cut])
            self.write_context(self.step_input(emb, ctx), emb, cos, sin, cache)
        return self(input_ids[:, cut:], hidden[:, cut:], position_ids[:, cut:], cache=cache)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V'] draft logits (map indices with ``to_target_ids``)."""
        return F.linear(*self.projection(h))

    def projection(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., H] -> (the vocabulary projection's input [..., H], its weight [V', H]): ``logits`` is
        ``F.linear`` of the two (the runtime may pick another kernel for the same product)."""
        raise NotImplementedError

    @classmethod
    def from_pretrained(cls, folder_or_hub_id, *, version: int | None = None, **kwargs):
        """Load a headway EAGLE checkpoint; ``version`` (1 or 3), when given, must match it (so must the
        class's own: ``Eagle3Head.from_pretrained`` of an EAGLE-1 folder is refused in one line)."""
        head = super(EagleHead, EagleHead).from_pretrained(folder_or_hub_id, **kwargs)  # the folder's version
        if not isinstance(head, EagleHead):
            raise ValueError(f"{folder_or_hub_id} holds a {head.config.drafter_type_name} drafter, not an EAGLE head")
        version = version or cls.version
        if version is not None and head.config.version != version:
            how = f"version={head.config.version}" if cls is EagleHead else "EagleHead.from_pretrained or load_drafter"
            raise ValueError(f"{folder_or_hub_id} holds an EAGLE-{head.config.version} drafter but EAGLE-{version} "
                             f"was asked for; load it with {how} (the layouts differ)")
        return head


class Eagle1Head(EagleHead):
    """EAGLE-1/2: ``fc([emb; f])`` into the decoder layer (``layers.0``), scored by the target's lm_head."""

    version = 1

    def _build(self, config: EagleConfig) -> None:
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fc_bias)
        self.layers = nn.ModuleList([EagleLayer(config)])

    @property
    def layer(self) -> EagleLayer:
        return self.layers[0]

    def _bind_rows(self, target_model) -> torch.Tensor:
        lm_head = target_model.get_output_embeddings()
        if getattr(lm_head, "bias", None) is not None:
            raise ValueError("EAGLE-1 scores through the target's lm_head, which must have no bias")
        rows = self.draft_rows(lm_head.weight.detach())
        return rows.contiguous() if self.d2t is not None else rows

    def input_hidden(self, features: torch.Tensor) -> torch.Tensor:
        return self.check_features(features)  # the final-norm feature is the step's hidden as it is

    def step_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([emb, hidden], dim=-1))  # [B, T, 2H] -> [B, T, H]

    def projection(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._bound:
            raise RuntimeError("EAGLE-1 scores through the target's lm_head: call head.bind_target(target) first")
        return h, self._bound[1].to(h.dtype)


class Eagle3Head(EagleHead):
    """EAGLE-3: ``fc`` fuses the captured layers, the decoder layer (``midlayer``) reads the normed
    embedding beside the normed hidden state, then ``norm`` and an own ``lm_head`` (draft vocabulary).

    EAGLE-3.1 (``normalize_features``): ``fc_norm[i]`` normalises captured layer i before ``fc``, and a
    step's output is ``norm`` of the layer's (what the lm_head reads, and what the next step reads);
    vLLM's ``fc_norm`` + ``norm_output``."""

    version = 3

    def _build(self, config: EagleConfig) -> None:
        h = config.hidden_size
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        if config.normalize_features:  # one norm per captured layer, before fc (in feature_layers' order)
            self.fc_norm = nn.ModuleList([LlamaRMSNorm(h, eps=config.rms_norm_eps) for _ in config.feature_layers])
        self.fc = nn.Linear(config.feature_width, h, bias=config.fc_bias)
        self.midlayer = Eagle3Layer(config)
        if config.num_layers > 1:  # named layers.1 .. layers.{N-1}, after midlayer (the published P-EAGLE drafters')
            self.layers = nn.ModuleDict({str(i): PlainLayer(config) for i in range(1, config.num_layers)})
        self.norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.output_size, bias=False)

    @property
    def layer(self) -> Eagle3Layer:
        return self.midlayer

    @property
    def decoder_layers(self) -> list[EagleLayer]:
        return [self.midlayer, *(self.layers.values() if self.config.num_layers > 1 else ())]

    def _copy_from_target(self, target_model) -> None:
        weight = target_model.get_output_embeddings().weight
        self.lm_head.weight.copy_(self.draft_rows(weight).to(self.lm_head.weight.dtype))

    def input_hidden(self, features: torch.Tensor) -> torch.Tensor:
        features = self.check_features(features)  # [..., k*H]
        if self.config.normalize_features:  # each captured layer's state normalised on its own
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(x) for norm, x in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(features)  # [..., k*H] -> [..., H]

    def step_input(self, emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def step_output(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h) if self.config.normalize_features else h

    def projection(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # EAGLE-3.1's step output is normed already (step_output)
        return (h if self.config.normalize_features else self.norm(h)), self.lm_head.weight
