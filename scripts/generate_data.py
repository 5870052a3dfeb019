"""Self-distillation: let the target model answer real prompts, and save the conversations.

Drafters learn to predict the target's own continuations (as Medusa-2 and EAGLE-3 do), and no
instruction dataset ships offline, so the training set is the target's answers to packaged
prompts. Output is JSONL, one ``{"id", "messages", "finished"}`` record per prompt, appended and flushed per
batch; a rerun skips ids already written, so an interrupted run resumes where it stopped.

    python scripts/generate_data.py --model smollm2-135m --num-prompts 256
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from headway.train.data import default_data_path, default_prompts, load_conversations

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


def read_done_ids(out_path: Path) -> set[str]:
    """Ids already in ``out_path``; lines that are not complete JSON records (a kill mid-write)
    are dropped by rewriting the file atomically."""
    if not out_path.is_file():
        return set()
    with open(out_path, encoding="utf-8") as f:
        raw = f.read()
    good, done, bad = [], set(), 0
    for line in raw.split("\n"):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            done.add(str(record["id"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            bad += 1
            continue
        good.append(line)
    repaired = "".join(line + "\n" for line in good)
    if repaired != raw:
        if bad:
            warnings.warn(f"{out_path}: dropped {bad} incomplete line(s) left by an interrupted run")
        fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", dir=out_path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(repaired)
        os.replace(tmp, out_path)
    return done


def _generation_config(model, tokenizer, max_new_tokens: int, temperature: float):
    gen = copy.deepcopy(model.generation_config)
    gen.max_new_tokens = max_new_tokens
    gen.pad_token_id = tokenizer.pad_token_id
    if gen.eos_token_id is None:
        gen.eos_token_id = tokenizer.eos_token_id
    if temperature > 0:
        # Plain temperature sampling: the target's own distribution, no top-k/top-p truncation.
        gen.do_sample, gen.temperature, gen.top_k, gen.top_p = True, temperature, 0, 1.0
    else:
        gen.do_sample, gen.temperature, gen.top_k, gen.top_p = False, None, None, None
    return gen


def _batch_seed(seed: int, first_id: str) -> int:
    # Keyed by the batch's first prompt, so a resumed run samples the same way for the same batch.
    return int(hashlib.sha256(f"{seed}:{first_id}".encode()).hexdigest()[:8], 16)


def generate_responses(model, tokenizer, prompts, out_path, batch_size: int = DEFAULT_BATCH_SIZE,
                       max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, temperature: float = DEFAULT_TEMPERATURE,
                       seed: int = DEFAULT_SEED) -> int:
    """Answer each prompt with ``model`` and append ``{"id", "messages", "finished"}`` lines to
    ``out_path`` (``finished`` is False when the reply was cut at ``max_new_tokens``).

    Prompts whose id is already in the file are skipped. Returns the number of records written.
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

    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = read_done_ids(out_path)
    todo, seen = [], set(done)
    for prompt in prompts:
        pid = prompt_id(prompt)
        if pid not in seen:  # also drops duplicate prompts
            seen.add(pid)
            todo.append((pid, prompt))
    if done:
        logger.info("%s: %d records present, %d prompts left", out_path, len(done), len(todo))

    gen = _generation_config(model, tokenizer, max_new_tokens, temperature)
    eos = gen.eos_token_id
    eos_ids = torch.tensor(eos if isinstance(eos, (list, tuple)) else [eos if eos is not None else -1])
    padding_side, tokenizer.padding_side = tokenizer.padding_side, "left"  # new tokens follow every prompt
    written = 0
    try:
        with open(out_path, "a", encoding="utf-8") as f, tqdm(total=len(todo), unit="prompt") as bar:
            for b in range(0, len(todo), batch_size):
                batch = todo[b : b + batch_size]
                texts = [
                    tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                  add_generation_prompt=True)
                    for _, p in batch
                ]
                # The template already holds BOS/markers; adding special tokens would double them.
                enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt").to(model.device)
                if gen.do_sample:
                    torch.manual_seed(_batch_seed(seed, batch[0][0]))
                with torch.inference_mode():
                    out = model.generate(**enc, generation_config=gen)
                new = out[:, enc["input_ids"].shape[1] :]  # [B, prompt_len + new] -> [B, new]
                replies = tokenizer.batch_decode(new, skip_special_tokens=True)
                # "finished": the reply ended with EOS rather than being cut at max_new_tokens.
                finished = torch.isin(new, eos_ids.to(new.device)).any(dim=1).tolist()
                lines = [
                    json.dumps({"id": pid, "messages": [{"role": "user", "content": p},
                                                        {"role": "assistant", "content": r.strip()}],
                                "finished": fin}, ensure_ascii=False) + "\n"
                    for (pid, p), r, fin in zip(batch, replies, finished)
                ]
                # One write + fsync per batch: a kill loses at most this batch (or leaves a
                # partial line that read_done_ids repairs).
                f.write("".join(lines))
                f.flush()
                os.fsync(f.fileno())
                written += len(lines)
                bar.update(len(lines))
    finally:
        tokenizer.padding_side = padding_side
    return written


def read_prompts(path: str) -> list[str]:
    """Prompts from a file: one per line for .txt, else the first user turn of each record."""
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
    p.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="how many prompts to answer")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE, help="0 = greedy, >0 = sampled")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help="prompt shuffle and sampling seed")
    p.add_argument("--prompts", default=None,
                   help="json/jsonl/parquet records (first user turn used) or .txt lines; default: packaged prompts")
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
            default_prompts(limit=args.num_prompts, seed=args.seed)
        out = Path(args.out) if args.out else default_data_path(args.model)
        from headway.heads.target import load_target

        model, tokenizer = load_target(args.model)
        n = generate_responses(model, tokenizer, prompts, out, batch_size=args.batch_size,
                               max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logger.info("wrote %d new records to %s", n, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
