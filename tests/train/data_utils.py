"""Helpers shared by the data tests: a word-level tokenizer built in code, JSONL records, and the
autouse fixture that gives each test its own Hugging Face and headway caches (import it into a test
module to apply it there)."""

import json

import pytest


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "hello world how are you fine thanks what is this a test good bye".split()


def word_tokenizer(template=CHATML):
    """A word-level tokenizer built in code, with a ChatML-like template (no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    vocab = {w: i for i, w in enumerate(specials + ["user", "assistant", "system"] + WORDS)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = template
    return tok


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def word_records(n):
    """n distinct small conversations in the word tokenizer's vocabulary."""
    return [
        {"messages": [{"role": "user", "content": f"hello how are you {' '.join(['a'] * (i % 7))}"},
                      {"role": "assistant", "content": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 5))}]}
        for i in range(n)
    ]
