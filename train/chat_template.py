"""A conversation into token ids and an assistant-only loss mask, found from the chat template itself:
each assistant turn's text is the difference between the rendered conversation up to that turn
(with the generation prompt) and up to its end, so any prefix-stable template works without
per-model marker strings."""

from __future__ import annotations

import bisect


def _render(tokenizer, messages, add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def render_spans(tokenizer, messages) -> tuple[str, list[tuple[int, int]]]:
    """Render a conversation; return its text and the ``[start, end)`` character span of each
    assistant turn. A turn's span runs from the end of the generation prompt to the end of the
    turn, minus trailing whitespace (ChatML: ``"content<|im_end|>"``, not the newline after it).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: set tokenizer.chat_template or use an instruct model")
    text = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (text.startswith(before) and text.startswith(through) and len(through) >= len(before)):
            raise ValueError(
                f"chat template is not prefix-stable at assistant turn {i} (rendering the first turns is not "
                "a prefix of the full conversation), so assistant tokens cannot be located; use a template "
                "that renders earlier turns unchanged"
            )
        start, end = len(before), len(through)
        while end > start and text[end - 1].isspace():
            end -= 1
        if end > start:
            spans.append((start, end))
    return text, spans


def tokenize_conversation(tokenizer, messages, max_length: int) -> dict:
    """``{"input_ids", "loss_mask"}``: a token is trained (mask 1) iff it starts inside an
    assistant span. Truncated to ``max_length`` tokens."""
    text, spans = render_spans(tokenizer, messages)
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ValueError("the tokenizer cannot return character offsets: load a fast tokenizer (use_fast=True)") from None
    starts = [s for s, _ in spans]
    mask = []
    for tok_start, _ in enc["offset_mapping"][:max_length]:
        k = bisect.bisect_right(starts, tok_start) - 1  # last span starting at or before the token
        mask.append(int(k >= 0 and tok_start < spans[k][1]))
    return {"input_ids": list(enc["input_ids"][:max_length]), "loss_mask": mask}
