"""Tiny random targets for tests and the quick config: real architectures, word-level tokenizer.

``tiny-random-llama`` / ``tiny-random-qwen2`` / ``tiny-random-gpt2`` are built from configs with a
fixed seed (nothing is downloaded), with a word-level tokenizer over a fixed English word list
and a ChatML chat template, and saved once under the headway cache like any model folder.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from headway.heads.files import publish_folder, temporary_folder

SPECIALS = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# A small fixed vocabulary: frequent English words plus punctuation and the chat roles.
WORDS = """the be to of and a in that have i it for not on with he as you do at this but his by from they we say her
she or an will my one all would there their what so up out if about who get which go me when make can like time no
just him know take people into year your good some could them see other than then now look only come its over think
also back after use two how our work first well way even new want because any these give day most us is are was were
been has had did does am hello hi hey thanks thank please yes yeah okay ok sure sorry what's it's i'm don't can't
you're name favorite color food movie book music song game sport weather today tomorrow week weekend morning night
love hate fun great nice cool really very much more many too little big small old young happy sad tired busy free
friend family school class teacher student home house car dog cat play read watch listen eat drink sleep talk tell
ask answer question help where why how who when which computer robot language python program code learn know
""".split() + list(".,!?'\"-:;()")
TINY_MODELS = {"tiny-random-llama": "llama", "tiny-random-qwen2": "qwen2", "tiny-random-gpt2": "gpt2"}


def tiny_tokenizer():
    """A word-level fast tokenizer (lower-cased, punctuation split) with a ChatML template."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + list(dict.fromkeys(WORDS + ["system", "user", "assistant"])))}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<|im_end|>", bos_token="<|im_start|>")
    fast.chat_template = CHATML
    return fast


def tiny_config(family: str, vocab_size: int, eos_id: int, pad_id: int):
    """A 2-layer model of the given family (hidden 64) with explicit special-token ids."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=eos_id, pad_token_id=pad_id)
    if family == "llama":
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, **common)
    if family == "qwen2":
        return Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False, **common)
    if family == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=1024, **common)
    raise ValueError(f"unknown tiny family {family!r}; use one of llama, qwen2, gpt2")


def build_tiny_target(family: str = "llama", seed: int = 0):
    """(model, tokenizer) of a seeded random tiny model; nothing touches the network."""
    from transformers import AutoModelForCausalLM

    tokenizer = tiny_tokenizer()
    config = tiny_config(family, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def tiny_model_dir(name: str, cache_dir: Path) -> Path:
    """Folder of the named tiny model under ``cache_dir``, built on first use."""
    out = cache_dir / "models" / name
    if (out / "config.json").is_file():
        return out
    model, tokenizer = build_tiny_target(TINY_MODELS[name])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_folder(out, ".tiny-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists() or not (tmp / "config.json").is_file():
        # transformers writes model files on global rank 0 only: other ranks wait for its folder
        shutil.rmtree(tmp)
        deadline = time.monotonic() + 120
        while not (out / "config.json").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        publish_folder(tmp, out, replace=False)
    return out
