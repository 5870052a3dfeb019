"""The target's generation config, honoured exactly: logits processors applied to every tree node.

``generate`` builds a ``LogitsProcessorList`` from the model's ``generation_config`` and its
arguments (repetition penalty, no-repeat n-grams, min new tokens, suppressed and bad words, ...)
and applies it to the next-token scores with the sequence so far. Speculative verification scores
many positions at once, so each tree node is processed with its *own* context: the generated
sequence plus the draft path down to that node. Nodes of one depth have contexts of one length,
so each depth is one batched call. The processed scores are then what greedy argmax and lossless
sampling see, which keeps the output exactly the target's.

Sampling settings (temperature, top-k, top-p) stay ``SpeculativeGenerator.generate``'s arguments,
as before (``temperature=0`` is ``generate(do_sample=False)``); settings that cannot be applied
exactly are refused with a message naming them.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation import logits_process as lp

from headway.inference.tree import Tree, node_path

# processors that are pure functions of (input_ids, scores): safe to call per node, many times per position
PURE = (lp.SequenceBiasLogitsProcessor, lp.EncoderRepetitionPenaltyLogitsProcessor, lp.RepetitionPenaltyLogitsProcessor,
        lp.NoRepeatNGramLogitsProcessor, lp.EncoderNoRepeatNGramLogitsProcessor, lp.NoBadWordsLogitsProcessor,
        lp.MinLengthLogitsProcessor, lp.MinNewTokensLengthLogitsProcessor, lp.ForcedBOSTokenLogitsProcessor,
        lp.ForcedEOSTokenLogitsProcessor, lp.InfNanRemoveLogitsProcessor, lp.ExponentialDecayLengthPenalty,
        lp.SuppressTokensLogitsProcessor, lp.SuppressTokensAtBeginLogitsProcessor, lp.LogitNormalization)

# generation-config fields that headway cannot honour exactly, with what they are at rest
UNSUPPORTED = {
    "guidance_scale": (None, 1, 1.0),  # classifier-free guidance runs a second, unconditional model pass
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "stop_strings": (None,),
    "watermarking_config": (None,),
    "penalty_alpha": (None,),  # contrastive search
}
# sampling-only warpers beyond temperature / top-k / top-p: honoured only by refusing them when sampling
SAMPLING_ONLY = {"min_p": (None, 0, 0.0), "typical_p": (None, 1, 1.0), "epsilon_cutoff": (None, 0, 0.0),
                 "eta_cutoff": (None, 0, 0.0), "top_h": (None,)}


DEFAULT_MAX_NEW_TOKENS = 128  # ``SpeculativeGenerator.generate``'s length when the call sets none


def call_max_new_tokens(max_new_tokens: int | None, prompt_len: int, generation_config=None,
                        kwargs: dict | None = None) -> int:
    """How many tokens a ``generate`` call asks for: ``max_new_tokens`` when given; else what the call's own
    ``generation_config`` or keywords set, read as ``generate`` reads them (``max_new_tokens`` before
    ``max_length``, which counts the prompt's ``prompt_len`` tokens, padding included); else
    DEFAULT_MAX_NEW_TOKENS. A ``max_length`` that leaves no room after the prompt is a one-line ValueError."""
    if max_new_tokens is not None:
        return max_new_tokens
    config = generation_config if isinstance(generation_config, GenerationConfig) else None
    asked = getattr(config, "max_new_tokens", None)
    if asked is not None:
        return asked
    length = (kwargs or {}).get("max_length", getattr(config, "max_length", None))
    if length is None:
        return DEFAULT_MAX_NEW_TOKENS
    if isinstance(length, bool) or not isinstance(length, int):
        raise ValueError(f"max_length must be an integer (the prompt's tokens and the new ones), got {length!r}")
    if length <= prompt_len:
        raise ValueError(f"max_length={length!r} leaves no room after the prompt's {prompt_len} tokens: pass "
                         f"max_new_tokens (new tokens, the prompt not counted) or a max_length > {prompt_len}")
    return length - prompt_len


@dataclasses.dataclass
class GenerationSetup:
    """What ``generate`` would use for one call: the processors (empty: nothing to apply), the EOS ids, and the
    token a batch's rows that stopped early are padded with (``generate``'s: the merged ``pad_token_id``, else the
    first EOS id; None: neither is set, so no row stops early)."""

    processors: LogitsProcessorList
    eos_token_ids: set[int]
    pad_token_id: int | None = None


def prepare_generation(model, prompt: torch.Tensor, max_new_tokens: int, sampling: bool,
                       generation_config: GenerationConfig | None = None,
                       logits_processor: LogitsProcessorList | None = None, **kwargs) -> GenerationSetup:
    """Merge the model's generation config with ``generation_config`` and ``kwargs`` as ``generate``
    does, and build its logits processors for a prompt of ``prompt.shape[0]`` tokens.

    prompt: [T] long. Raises ValueError naming any setting that cannot be honoured exactly.
    """
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise ValueError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}"
                         "; pass settings as keywords instead (e.g. repetition_penalty=1.1)")
    if logits_processor is not None and (not isinstance(logits_processor, (list, tuple))
                                         or not all(callable(p) for p in logits_processor)):
        raise ValueError("logits_processor must be a list of callables (scores = proc(input_ids, scores)), e.g. "
                         "LogitsProcessorList([...])")
    asked = kwargs.get("do_sample", None if generation_config is None else generation_config.do_sample)
    if asked and not sampling:
        raise ValueError("do_sample=True asks for sampling, but headway samples only when generate's temperature is "
                         "> 0 (with its top_k and top_p): pass temperature=0.7 (say) instead of do_sample")
    if asked is None and not sampling and getattr(model.generation_config, "do_sample", False):
        warnings.warn("the target's generation_config samples (do_sample=True); headway decodes greedily unless "
                      "generate is given temperature > 0 (and top_k / top_p)", stacklevel=4)
    config, unused = model._prepare_generation_config(generation_config, **kwargs)
    if unused:
        raise ValueError(f"unknown generation setting(s) {sorted(unused)}: pass GenerationConfig fields "
                         "(e.g. repetition_penalty=1.1, no_repeat_ngram_size=3, min_new_tokens=5)")
    eos = config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else eos.flatten().tolist() if isinstance(eos, torch.Tensor) else \
        list(eos) if isinstance(eos, (list, tuple)) else eos
    if eos is not None and (not isinstance(eos_ids, list) or not eos_ids or not all(
            isinstance(e, int) and not isinstance(e, bool) and e >= 0 for e in eos_ids)):
        raise ValueError(f"eos_token_id must be a token id or a non-empty list of them (None: never stop), got {eos!r}")
    for name, rest in UNSUPPORTED.items():
        value = getattr(config, name, None)
        if value not in rest:
            raise ValueError(f"generation setting {name}={value!r} cannot be honoured exactly by speculative decoding; "
                             f"set {name}={rest[-1]!r} (in generation_config or as an argument)")
    if sampling:
        for name, rest in SAMPLING_ONLY.items():
            value = getattr(config, name, None)
            if value not in rest:
                raise ValueError(f"sampling setting {name}={value!r} is not supported: headway samples with "
                                 f"temperature, top_k and top_p only; set {name}={rest[-1]!r}")
    length = prompt.shape[0]
    config.max_new_tokens = max_new_tokens
    config.max_length = length + max_new_tokens  # as generate does when max_new_tokens is given
    if config.min_new_tokens is not None:
        config.min_length = config.min_new_tokens + length
    config.do_sample = False  # warpers: headway's own temperature / top-k / top-p, applied after these
    model._prepare_special_tokens(config, None, device=prompt.device, batch_size=1)
    processors = model._get_logits_processor(config, input_ids_seq_length=length, encoder_input_ids=prompt[None],
                                             logits_processor=logits_processor or LogitsProcessorList(),
                                             device=prompt.device, model_kwargs={})
    own = {id(p) for p in (logits_processor or [])}  # the user's own: documented to be called per node
    for proc in processors:
        if id(proc) not in own and not isinstance(proc, PURE):
            raise ValueError(f"a generation setting asks for transformers' {type(proc).__name__}, which headway cannot "
                             "apply exactly per tree node; remove that setting from generation_config or the arguments")
    eos = set() if config.eos_token_id is None else set(eos_ids)
    pad = config._pad_token_tensor  # generate's own choice: the merged pad_token_id, else the first EOS id
    return GenerationSetup(processors, eos, None if pad is None else int(pad.reshape(-1)[0]))


def node_contexts(prefix: torch.Tensor, tree: Tree, tokens: torch.Tensor, nodes: list[int]) -> torch.Tensor:
    """The sequence each node's next-token scores condition on: ``prefix`` (ending with the root
    token) plus the draft tokens on the path below the root down to the node.

    prefix: [L]; tokens: [N] node tokens; nodes: R nodes of one depth d -> [R, L + d].
    """
    paths = [tree.cached(("path", n), lambda n=n: node_path(tree.parents, n)[1:]) for n in nodes]  # R x [d]
    below = tokens[torch.tensor(paths, dtype=torch.long, device=tokens.device)]  # [R, d]
    return torch.cat([prefix.expand(len(nodes), -1), below], dim=1)


def apply_processors(processors: LogitsProcessorList, prefix: torch.Tensor, tree: Tree, tokens: torch.Tensor,
                     logits: torch.Tensor) -> torch.Tensor:
    """Each node's scores processed with its own context, as ``generate`` would at that position.

    prefix: [L] the sequence up to and including the root; tokens: [N]; logits: [N, V] ->
    float32 [N, V] (``generate`` processes float32 scores).
    """
    scores = logits.float()
    if not processors:
        return scores
    out = torch.empty_like(scores)
    by_depth: dict[int, list[int]] = {}
    for node, depth in enumerate(tree.depths):
        by_depth.setdefault(depth, []).append(node)
    for nodes in by_depth.values():
        idx = torch.tensor(nodes, device=scores.device)
        out[idx] = processors(node_contexts(prefix, tree, tokens, nodes), scores[idx].clone())
    return out
