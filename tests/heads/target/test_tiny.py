"""Tiny random targets (headway.heads.target.tiny): a word-level tokenizer with a ChatML template, seeded
two-layer models of three architectures built from configs, saved once under a cache folder."""

import pytest
import torch

from headway.heads.target.tiny import TINY_MODELS, build_tiny_target, tiny_config, tiny_model_dir, tiny_tokenizer


def test_the_tokenizer_is_word_level_with_a_chat_template():
    tok = tiny_tokenizer()
    assert len(tok) == 218 and tok.convert_ids_to_tokens(tok("Hello, how are you?")["input_ids"]) == \
        ["hello", ",", "how", "are", "you", "?"]
    assert tok("zebra")["input_ids"] == [tok.unk_token_id] == [0]  # not in the word list
    assert (tok.pad_token_id, tok.eos_token, tok.bos_token) == (1, "<|im_end|>", "<|im_start|>")
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("family, architecture", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                                  ("gpt2", "GPT2LMHeadModel")])
def test_each_family_is_a_seeded_two_layer_model(family, architecture):
    model, tok = build_tiny_target(family, seed=4)
    again, _ = build_tiny_target(family, seed=4)
    other, _ = build_tiny_target(family, seed=5)
    assert type(model).__name__ == architecture and TINY_MODELS[f"tiny-random-{family}"] == family
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (2, 64, len(tok)) and not model.training
    assert (cfg.eos_token_id, cfg.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (3, 1)
    a, b, c = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # the same seed, the same weights
    assert not all(torch.equal(a[k], c[k]) for k in a)
    with pytest.raises(ValueError, match=r"^unknown tiny family 'mamba'; use one of llama, qwen2, gpt2$"):
        tiny_config("mamba", len(tok), tok.eos_token_id, tok.pad_token_id)


def test_a_named_tiny_model_is_saved_once(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tiny_model_dir("tiny-random-llama", tmp_path)
    assert out == tmp_path / "models" / "tiny-random-llama"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir("tiny-random-llama", tmp_path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-random-llama"]  # no temporary folder left
    loaded, reference = AutoModelForCausalLM.from_pretrained(out), build_tiny_target("llama")[0]
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in loaded.state_dict().items())
    reloaded = AutoTokenizer.from_pretrained(out)
    assert reloaded("hello there")["input_ids"] == tiny_tokenizer()("hello there")["input_ids"] == [114, 41]


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_every_named_tiny_model_reloads_its_own_tokenizer(tmp_path, family):
    """load_tokenizer reads the word-level tokenizer back (transformers' AutoTokenizer swaps a Qwen2
    folder's for Qwen2Tokenizer, which encodes these words to nothing)."""
    from headway.heads.target import load_tokenizer

    out = tiny_model_dir(f"tiny-random-{family}", tmp_path)
    text = "hello there how are you"
    expected = tiny_tokenizer()(text)["input_ids"]
    assert expected and load_tokenizer(str(out))(text)["input_ids"] == expected
    assert load_tokenizer(str(out)).chat_template == tiny_tokenizer().chat_template
