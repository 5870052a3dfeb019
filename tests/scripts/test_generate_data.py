"""Self-distillation script: batched generation to JSONL, stable ids, resume after a kill."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "generate_data.py"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "hello world how are you fine thanks what is this a test good bye one two three four".split()
PROMPTS = [f"{WORDS[i % 18]} {WORDS[(3 * i) % 18]} {WORDS[(5 * i + 1) % 18]} {i}" for i in range(10)]


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def gen():
    spec = importlib.util.spec_from_file_location("generate_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama and a word-level ChatML tokenizer, both built in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<|im_start|>", "<|im_end|>"]
    digits = [str(i) for i in range(10)]
    vocab = {w: i for i, w in enumerate(specials + ["user", "assistant", "system"] + WORDS + digits)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>",
                                  eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(vocab), pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, bos_token_id=None)
    return LlamaForCausalLM(config).eval(), tok


def read(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def run(gen, tiny, prompts, out, **kw):
    model, tok = tiny
    kw = {"batch_size": 4, "max_new_tokens": 6, "temperature": 0.0, "seed": 0, **kw}
    return gen.generate_responses(model, tok, prompts, out, **kw)


def test_writes_one_record_per_prompt(gen, tiny, tmp_path):
    out = tmp_path / "d" / "out.jsonl"
    assert run(gen, tiny, PROMPTS, out) == len(PROMPTS)
    records = read(out)
    assert [r["id"] for r in records] == [gen.prompt_id(p) for p in PROMPTS]
    for r, p in zip(records, PROMPTS):
        user, assistant = r["messages"]
        assert user == {"role": "user", "content": p}
        assert assistant["role"] == "assistant" and assistant["content"] == assistant["content"].strip()
        assert "<|im_end|>" not in assistant["content"] and "<pad>" not in assistant["content"]
    assert any(r["messages"][1]["content"] for r in records)
    assert all(isinstance(r["finished"], bool) for r in records)
    assert tiny[1].padding_side == "right"  # restored
    assert run(gen, tiny, PROMPTS, out) == 0  # complete file: nothing to do


def test_resume_after_interruption(gen, tiny, tmp_path):
    full = tmp_path / "full.jsonl"
    run(gen, tiny, PROMPTS, full)
    lines = full.read_text().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_text("".join(lines[:5]) + lines[5][: len(lines[5]) // 2])  # killed mid-write
    with pytest.warns(UserWarning, match="dropped 1 incomplete line"):
        assert run(gen, tiny, PROMPTS, part) == 5
    resumed = read(part)
    ids = [r["id"] for r in resumed]
    assert len(ids) == len(set(ids)) == len(PROMPTS)
    assert set(ids) == {r["id"] for r in read(full)}
    assert resumed[:5] == read(full)[:5]


def test_ids_are_stable(gen, tiny, tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    run(gen, tiny, PROMPTS[:6], a)
    run(gen, tiny, PROMPTS[:6][::-1] + PROMPTS[:2], b, batch_size=3)  # reordered, duplicates
    by_id = lambda path: {r["id"]: r["messages"][0]["content"] for r in read(path)}  # noqa: E731
    assert by_id(a) == by_id(b) and len(by_id(b)) == 6
    assert gen.prompt_id("hello") == gen.prompt_id("hello") != gen.prompt_id("hello!")


def test_sampling_is_seeded(gen, tiny, tmp_path):
    outs = [tmp_path / f"{name}.jsonl" for name in ("s0", "s0b", "s1")]
    for out, seed in zip(outs, (0, 0, 1)):
        run(gen, tiny, PROMPTS, out, temperature=1.0, seed=seed, max_new_tokens=10)
    text = [[r["messages"][1]["content"] for r in read(o)] for o in outs]
    assert text[0] == text[1] and text[0] != text[2]


def test_bad_arguments(gen, tiny, tmp_path):
    with pytest.raises(ValueError, match="temperature"):
        run(gen, tiny, PROMPTS, tmp_path / "x.jsonl", temperature=-1)
    with pytest.raises(ValueError, match="batch_size"):
        run(gen, tiny, PROMPTS, tmp_path / "x.jsonl", batch_size=0)


def test_read_prompts(gen, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": " hi there "},
                                                  {"from": "gpt", "value": "yo"}]}) + "\n")
    assert gen.read_prompts(str(path)) == ["hi there"]
    txt = tmp_path / "p.txt"
    txt.write_text("one\n\ntwo\n")
    assert gen.read_prompts(str(txt)) == ["one", "two"]
