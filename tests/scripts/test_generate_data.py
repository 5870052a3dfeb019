"""Self-distillation script: batched generation to JSONL, stable ids, resume after a kill, and the
same bytes from 2 launched processes (accelerate launch, torchrun) as from one."""

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from tests.train.data_utils import _isolated  # noqa: F401  (autouse: own HF and headway caches)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "generate_data.py"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "hello world how are you fine thanks what is this a test good bye one two three four".split()
PROMPTS = [f"{WORDS[i % 18]} {WORDS[(3 * i) % 18]} {WORDS[(5 * i + 1) % 18]} {i}" for i in range(10)]


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


def fake_rank(rank, world):
    """What the split reads of accelerate's PartialState, for one rank run in this process (ranks
    run one after the other, so the barriers have nothing to wait for)."""
    return types.SimpleNamespace(process_index=rank, num_processes=world, wait_for_everyone=lambda: None)


def test_replies_do_not_depend_on_batch_size(gen, tiny, tmp_path):
    # each prompt samples from its own generator; padding round-off is too small to move this tiny target
    for temperature in (0.0, 1.0):
        texts = []
        for bs in (1, 3, 10):
            out = tmp_path / f"t{temperature}-b{bs}.jsonl"
            run(gen, tiny, PROMPTS, out, batch_size=bs, temperature=temperature, max_new_tokens=10)
            texts.append(out.read_text())
        assert texts[0] == texts[1] == texts[2]


def test_batches_hold_prompts_of_similar_length_and_the_file_keeps_prompt_order(gen, tiny, tmp_path):
    prompts = ["a b c d e f g h", "a", "a b c d", "a b", "a b c d e f", "a b c"]
    batches = gen.plan_batches(prompts + ["a"], 2)  # the duplicate is dropped
    assert [[p for _, p in b] for b in batches] == [["a", "a b"], ["a b c", "a b c d"], ["a b c d e f", "a b c d e f g h"]]
    out = tmp_path / "sorted.jsonl"
    run(gen, tiny, prompts, out, batch_size=2, max_new_tokens=4)
    assert [r["messages"][0]["content"] for r in read(out)] == prompts


def test_ranks_split_batches_and_rank0_merges_in_prompt_order(gen, tiny, tmp_path):
    one = tmp_path / "one.jsonl"
    run(gen, tiny, PROMPTS, one, batch_size=3, temperature=1.0)
    two = tmp_path / "two.jsonl"
    # rank 1 answers batches 1 and 3 (of the prompts sorted by length) into its own part file and merges nothing
    batches = gen.plan_batches(PROMPTS, 3)
    assert run(gen, tiny, PROMPTS, two, batch_size=3, temperature=1.0, state=fake_rank(1, 2)) == 4
    part = gen.part_path(two, 1)
    assert [r["id"] for r in read(part)] == [pid for b in (1, 3) for pid, _ in batches[b]]
    assert not two.exists()
    # rank 0 answers batches 0 and 2, then merges both parts
    assert run(gen, tiny, PROMPTS, two, batch_size=3, temperature=1.0, state=fake_rank(0, 2)) == 6
    assert two.read_bytes() == one.read_bytes()
    assert not gen.parts_dir(two).exists()


def test_resume_drops_a_cut_record_and_keeps_foreign_records(gen, tiny, tmp_path):
    full = tmp_path / "full.jsonl"
    run(gen, tiny, PROMPTS, full, batch_size=3)
    lines = full.read_text().splitlines(keepends=True)
    # a 2-process run killed after rank 0 wrote batch 0 and cut the first record of batch 2, and rank 1
    # wrote batch 1; the output already holds a record of a prompt this run does not ask for
    out = tmp_path / "out.jsonl"
    other = json.dumps({"id": "other", "messages": [], "finished": True}) + "\n"
    out.write_text(other)
    gen.parts_dir(out).mkdir()
    gen.part_path(out, 0).write_text("".join(lines[0:3]) + lines[6][:20])
    gen.part_path(out, 1).write_text("".join(lines[3:6]))
    # resumed by one process (rank 0): it drops the cut record and answers batches 2 and 3
    with pytest.warns(UserWarning, match="rank-00000.jsonl: dropped 1 incomplete line"):
        assert run(gen, tiny, PROMPTS, out, batch_size=3) == 4
    assert out.read_text() == "".join(lines) + other
    assert not gen.parts_dir(out).exists()


# ---------------------------------------------------------------------------------------------
# Really launched: 2 processes on CPU (gloo)
# ---------------------------------------------------------------------------------------------

CLI = ["--model", "tiny-random-llama", "--num-prompts", "20", "--batch-size", "3", "--max-new-tokens", "12"]
# Wraps the script so that each rank records its pid and stalls before its third batch (to be
# killed there: the launcher starts ranks in sessions of their own, so killing it leaves them).
STALLING = """
import importlib.util, os, sys, time
import headway.heads.target as target
with open({pids!r} + "/" + os.environ["RANK"], "w") as f:
    f.write(str(os.getpid()))
real = target.load_target

def load_target(*args, **kwargs):
    model, tokenizer = real(*args, **kwargs)
    generate, calls = model.generate, []

    def stalling(*a, **k):
        calls.append(1)
        if len(calls) > 2:
            time.sleep(600)
        return generate(*a, **k)

    model.generate = stalling
    return model, tokenizer

target.load_target = load_target
spec = importlib.util.spec_from_file_location("generate_data", {script!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
sys.exit(module.main())
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, script=SCRIPT, torchrun=False):
    port = str(_free_port())
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", port]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", port]
    return subprocess.Popen([*cmd, str(script), *args], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish(proc, timeout=180) -> str:
    log, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, log[-4000:]
    return log


def one_process(gen, out, *args) -> bytes:
    assert gen.main([*CLI, "--out", str(out), *args]) == 0
    return out.read_bytes()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("launcher, args", [("accelerate", []), ("torchrun", ["--temperature", "1.0", "--seed", "3"])])
def test_two_processes_write_what_one_writes(gen, tmp_path, launcher, args):
    log = finish(launch(*CLI, "--out", str(tmp_path / "two.jsonl"), *args, torchrun=launcher == "torchrun"))
    # 20 prompts in 7 batches of 3: rank 0 answers batches 0, 2, 4, 6 (11 prompts), rank 1 the rest
    assert "rank 0 of 2: wrote 11 new records" in log and "rank 1 of 2: wrote 9 new records" in log, log[-3000:]
    want = one_process(gen, tmp_path / "one.jsonl", *args)
    assert (tmp_path / "two.jsonl").read_bytes() == want and len(want.splitlines()) == 20
    assert not gen.parts_dir(tmp_path / "two.jsonl").exists()


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_two_process_run_resumes_to_the_same_file(gen, tmp_path):
    out = tmp_path / "two.jsonl"
    wrapper = tmp_path / "stalling.py"
    (tmp_path / "pids").mkdir()
    wrapper.write_text(STALLING.format(script=str(SCRIPT), pids=str(tmp_path / "pids")))
    proc = launch(*CLI, "--out", str(out), script=wrapper)
    parts = [gen.part_path(out, r) for r in (0, 1)]
    deadline = time.monotonic() + 150
    try:
        # each rank writes two batches (6 records), then stalls in its third
        while not all(p.is_file() and len(gen.read_records(p)[0]) == 6 for p in parts):
            assert proc.poll() is None and time.monotonic() < deadline, "the stalling run ended or never got going"
            time.sleep(0.1)
    finally:
        for pid in [int(f.read_text()) for f in (tmp_path / "pids").iterdir() if f.read_text()] + [-proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)  # a negative pid: the launcher's process group
        proc.communicate(timeout=60)
    assert not out.exists()
    text = parts[1].read_text()
    parts[1].write_text(text[: len(text) - 30])  # rank 1's last record cut by the kill
    log = finish(launch(*CLI, "--out", str(out)))
    # rank 0: batches 4 and 6 (5 prompts); rank 1: the cut record of batch 3 and batch 5 (1 + 3)
    assert "rank 0 of 2: wrote 5 new records" in log and "rank 1 of 2: wrote 4 new records" in log, log[-3000:]
    assert out.read_bytes() == one_process(gen, tmp_path / "one.jsonl")
    assert not gen.parts_dir(out).exists()
