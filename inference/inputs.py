"""What every generation path checks before it runs, plain or speculative, CLI or API: the
generation settings (before any model loads) and the prompt against the target's config."""

from __future__ import annotations

import warnings

import torch

from headway.inference.verify import check_sampling_args


def check_settings(max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0) -> None:
    """A one-line ValueError for a setting no decoding can honour (a negative temperature, top_p 0, ...)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
    check_sampling_args(temperature, top_k, top_p)


def fit_context(target_config, prompt_len: int, max_new_tokens: int, stacklevel: int = 2) -> int:
    """``max_new_tokens``, cut (with a warning) so that the prompt and its answer fit the target's positions."""
    context = context_length(target_config)
    if context is not None and prompt_len + max_new_tokens > context:
        warnings.warn(f"prompt ({prompt_len}) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
                      f"({context}); generating at most {context - prompt_len} tokens", stacklevel=stacklevel)
        return context - prompt_len
    return max_new_tokens


def check_call(input_ids, generator, streamer) -> None:
    """A one-line ValueError for a ``generate`` argument of the wrong kind: ids that are not a tensor or list of
    token ids, a seed where a ``torch.Generator`` goes, a streamer without ``put``/``end``."""
    if input_ids is None or isinstance(input_ids, (str, bytes)):
        raise ValueError(f"input_ids must be token ids (a tensor [1, T] / [B, T] or a list of ints), got "
                         f"{type(input_ids).__name__}: tokenize the text first")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)), got "
                         f"{type(generator).__name__}")
    if streamer is not None and not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise ValueError(f"streamer must have put() and end() (e.g. transformers' TextStreamer), got "
                         f"{type(streamer).__name__}")


def context_length(target_config) -> int | None:
    """The target's positions (max_position_embeddings), or None when its config names none."""
    return getattr(target_config.get_text_config(), "max_position_embeddings", None)


def check_prompt(input_ids, target_config) -> torch.Tensor:
    """input_ids [1, T] or [T] -> [T] long, or a one-line ValueError: a batch, an empty or non-integer
    tensor, a prompt that fills the target's context, ids outside its vocabulary."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise ValueError(f"one prompt is batch size 1; got input_ids of shape {tuple(ids.shape)} "
                             "(SpeculativeGenerator.generate takes a batch with its attention_mask)")
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be a non-empty integer tensor [1, T] or [T], got {tuple(ids.shape)} {ids.dtype}")
    context = context_length(target_config)
    if context is not None and ids.shape[0] >= context:
        raise ValueError(f"the prompt has {ids.shape[0]} tokens but the model's context is {context} "
                         "(max_position_embeddings): shorten the prompt")
    vocab = target_config.get_text_config().vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"input_ids contain ids outside the target's vocabulary [0, {vocab})")
    return ids.long()


def check_generation(target_config, input_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                     top_p: float = 1.0) -> torch.Tensor:
    """``check_settings`` then ``check_prompt``: the prompt as [T] long ids."""
    check_settings(max_new_tokens, temperature, top_k, top_p)
    return check_prompt(input_ids, target_config)
