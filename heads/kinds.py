"""headway's own drafter kinds, registered (``headway.heads.registry``): Medusa heads, EAGLE-1/2,
EAGLE-3, LayerSkip exit heads, P-EAGLE and DFlash. A kind defined elsewhere registers the same way, with its own ``DrafterKind``."""

from __future__ import annotations

from headway.heads.registry import DrafterKind, TrainingMethod, register_kind

# The layouts of headway.heads.formats.medusa / .eagle (written out: the registry imports no torch;
# tests/heads/test_registry.py checks they are those modules' FORMATS)
MEDUSA_FORMATS = ("medusa-v0.1", "medusa-v2", "vllm-medusa")
EAGLE_FORMATS = ("eagle", "sglang", "speculators")


def _vocab(info: dict) -> str:
    return f"draft vocabulary {info['draft_vocab_size']}" if info.get("draft_vocab_size") else "full vocabulary"


def _describe_medusa(info: dict) -> str:
    layers = info.get("num_layers")
    lm_head = "the target's lm_head" if info.get("share_lm_head") else f"own lm_head ({_vocab(info)})"
    return (f"Medusa-1 heads: {info.get('num_heads')} heads x {layers} ResBlock{'s' * (layers != 1)}, "
            f"{lm_head}; head k predicts token t+k+2")


def _describe_eagle1(info: dict) -> str:
    return "EAGLE-1/2 drafter: one decoder layer over [token embedding; target feature], the target's lm_head"


def _decoder_layers(info: dict) -> str:
    layers = info.get("num_layers") or 1
    return "one decoder layer" if layers == 1 else f"{layers} decoder layers"


def _describe_eagle3(info: dict) -> str:
    if info.get("normalize_features"):
        return (f"EAGLE-3.1 drafter: {_decoder_layers(info)} over fused target layers {info.get('feature_layers')}, "
                f"each normalised before fc, post-norm states fed back, own lm_head ({_vocab(info)})")
    return (f"EAGLE-3 drafter: {_decoder_layers(info)} over fused target layers {info.get('feature_layers')}, "
            f"own lm_head ({_vocab(info)})")


_EAGLE_INFO = ("version", "feature_layers", "num_target_layers", "intermediate_size", "normalize_features",
               "num_layers")
_EAGLE_IMPORTS = EAGLE_FORMATS  # import_eagle reads either version from any of them
_EAGLE_TRAINING = {"eagle": TrainingMethod("headway.train.eagle", "an EAGLE-1 or EAGLE-3 drafter (eagle.version)",
                                           "eagle/eagle3-tiny")}

MEDUSA = register_kind(DrafterKind(
    name="medusa", title="Medusa", drafter_type="medusa", head_class="headway.heads.medusa:MedusaHeads",
    proposer="headway.inference.medusa:MedusaProposer",
    training={"medusa": TrainingMethod("headway.train.medusa", "Medusa-1 heads", "medusa/tiny"),
              "medusa2": TrainingMethod("headway.train.medusa2", "Medusa-2 heads jointly with a LoRA adapter on the target",
                                        "medusa2/tiny")},
    exports=MEDUSA_FORMATS, imports=MEDUSA_FORMATS,
    info_fields=("num_heads", "num_layers", "share_lm_head"), describe=_describe_medusa,
    serving="headway.heads.hub.card:medusa_serving"))
EAGLE1 = register_kind(DrafterKind(
    name="eagle", title="EAGLE-1/2", drafter_type="eagle", head_class="headway.heads.eagle:Eagle1Head",
    proposer="headway.inference.eagle:EagleProposer",
    training=_EAGLE_TRAINING, exports=("eagle",), imports=_EAGLE_IMPORTS,
    matches=lambda config: config.get("version") == 1, info_fields=_EAGLE_INFO, describe=_describe_eagle1,
    serving="headway.heads.hub.card:eagle1_serving"))
EAGLE3 = register_kind(DrafterKind(
    name="eagle3", title="EAGLE-3", drafter_type="eagle", head_class="headway.heads.eagle:Eagle3Head",
    proposer="headway.inference.eagle:EagleProposer",
    training=_EAGLE_TRAINING, exports=("sglang", "speculators"), imports=_EAGLE_IMPORTS,
    matches=lambda config: config.get("version", 3) == 3, info_fields=_EAGLE_INFO, describe=_describe_eagle3,
    serving="headway.heads.hub.card:eagle3_serving"))


def _describe_layerskip(info: dict) -> str:
    return (f"LayerSkip self-speculation: the target's first {info.get('exit_layer')} of {info.get('num_target_layers')} "
            f"layers and a trained exit norm + lm_head ({_vocab(info)}), a chain of {info.get('num_draft')}")


LAYERSKIP = register_kind(DrafterKind(
    name="layerskip", title="LayerSkip", drafter_type="layerskip",
    head_class="headway.heads.layerskip:LayerSkipHead", proposer="headway.inference.layerskip:LayerSkipProposer",
    training={"layerskip": TrainingMethod("headway.train.layerskip", "a LayerSkip exit head on the target's own "
                                          "early layers (self-speculation)", "layerskip/tiny")},
    info_fields=("exit_layer", "num_target_layers", "num_draft", "draft_vocab_size"), describe=_describe_layerskip))


def _describe_peagle(info: dict) -> str:
    return (f"P-EAGLE drafter: EAGLE-3 ({_decoder_layers(info)}) over fused target layers "
            f"{info.get('feature_layers')} drafting "
            f"{info.get('parallel_depths')} tokens per pass (mask token {info.get('mask_token_id')}, a learnt mask "
            f"hidden state), own lm_head ({_vocab(info)})")


PEAGLE = register_kind(DrafterKind(
    name="peagle", title="P-EAGLE", drafter_type="peagle", head_class="headway.heads.peagle:PEagleHead",
    proposer="headway.inference.peagle:PEagleProposer",
    training={"peagle": TrainingMethod("headway.train.peagle", "a P-EAGLE drafter (EAGLE-3 drafting K tokens in one "
                                       "pass)", "peagle/tiny")},
    exports=("speculators",), imports=("speculators",),
    info_fields=(*_EAGLE_INFO, "parallel_depths", "mask_token_id"), describe=_describe_peagle))


def _describe_dflash(info: dict) -> str:
    return (f"DFlash block drafter: {info.get('num_layers')} layer(s) over fused target layers "
            f"{info.get('feature_layers')} as every layer's context, a block of {info.get('block_size')} "
            f"(the anchor and mask token {info.get('mask_token_id')}) per pass, the target's embedding and lm_head")


DFLASH = register_kind(DrafterKind(
    name="dflash", title="DFlash", drafter_type="dflash", head_class="headway.heads.dflash:DFlashHead",
    proposer="headway.inference.dflash:DFlashProposer",
    training={"dflash": TrainingMethod("headway.train.dflash", "a DFlash block drafter (B - 1 tokens from one pass "
                                       "over the target's features)", "dflash/tiny")},
    exports=("speculators", "z-lab"), imports=("speculators", "z-lab"),
    info_fields=("feature_layers", "num_target_layers", "num_layers", "block_size", "mask_token_id"),
    describe=_describe_dflash))
