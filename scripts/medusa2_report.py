"""Medusa-2 against Medusa-1 on the same data: heads' accuracy, tau, and how far the target moved.

    python scripts/medusa2_report.py --run outputs/medusa2-smollm2-135m --medusa1 outputs/demo/quick/heads

Measures, on the run's own held-out split (rebuilt from its run_config.json):
- held-out top-1 / top-5 per head: Medusa-1 heads on the original target's features, Medusa-2
  heads on the tuned target's features (each as it runs);
- drift: mean KL(original || tuned) per held-out assistant token;
and on held-out chat prompts (never trained on), greedy, ``--max-new-tokens`` each:
- greedy agreement: the share of positions where the tuned target's greedy token equals the
  original's, and the mean identical prefix;
- tau of ``SpeculativeGenerator`` (tuned target + Medusa-2 heads; original + Medusa-1 heads), each
  asserted equal to its own target's greedy output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from headway.heads import load_drafter
from headway.heads.target import load_target
from headway.inference import SpeculativeGenerator
from headway.bench.prompts import chat_prompts
from headway.bench.benchmark import run_one
from headway.train.config import from_dict
from headway.train.data import DataConfig, build_datasets
from headway.train.batches import last_hidden_state, pad_batch
from headway.train.losses import head_weights, medusa_loss, summarize
from headway.train.medusa2 import ADAPTER_DIR, self_distill_kl


@torch.no_grad()
def heldout_accuracy(target, heads, examples: list[dict], batch_size: int = 4) -> dict[str, float]:
    """Per-head held-out loss / top-1 / top-5 of ``heads`` reading ``target``'s final hidden states."""
    heads.bind_target(target)
    totals: dict[str, float] = {}
    draft_index = heads.draft_index()
    for b in range(0, len(examples), batch_size):
        batch = pad_batch(examples[b:b + batch_size])
        hidden = last_hidden_state(target, batch["input_ids"], batch["attention_mask"]).float()
        _, counts = medusa_loss(heads, hidden, batch["input_ids"], batch["loss_mask"],
                                head_weights(heads.config.num_heads), draft_index)
        for k, v in counts.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    return summarize(totals)


@torch.no_grad()
def heldout_kl(original, tuned, examples: list[dict], batch_size: int = 4) -> float:
    """Mean KL(original || tuned) over held-out positions whose next token is an assistant token."""
    total, count = 0.0, 0
    for b in range(0, len(examples), batch_size):
        batch = pad_batch(examples[b:b + batch_size])
        rows = batch["loss_mask"][:, 1:].bool()  # [B, T-1]
        logits = [m(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1][rows]
                  for m in (tuned, original)]  # [n, V] each
        total += float(self_distill_kl(*logits))
        count += int(rows.sum())
    return total / max(count, 1)


def agreement(a: list[int], b: list[int], length: int) -> tuple[int, int]:
    """(positions out of ``length`` with the same token, identical prefix length); a missing token differs."""
    same = sum(1 for i in range(length) if i < len(a) and i < len(b) and a[i] == b[i])
    prefix = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
    return same, prefix


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a Medusa-2 output_dir (heads, adapter/, run_config.json)")
    p.add_argument("--medusa1", required=True, help="Medusa-1 heads trained on the same data")
    p.add_argument("--prompts", type=int, default=6, help="held-out chat prompts for tau and greedy agreement")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--tree", default="tree-7", help="Medusa tree for both drafters")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    run = Path(args.run)
    config = json.loads((run / "run_config.json").read_text())
    original, tok = load_target(config["model"], device="cpu")
    tuned, _ = load_target(config["model"], device="cpu", adapter=run / ADAPTER_DIR)
    heads1, heads2 = load_drafter(args.medusa1), load_drafter(run)
    _, heldout = build_datasets(from_dict(DataConfig, config["data"]), tok, config["model"])

    report = {"heldout_sequences": len(heldout),
              "medusa1": heldout_accuracy(original, heads1, heldout),
              "medusa2": heldout_accuracy(tuned, heads2, heldout),
              "kl_original_tuned": heldout_kl(original, tuned, heldout)}
    eos = tok.eos_token_id
    rows = {"same": 0, "prefix": 0, "total": 0}
    tau = {name: {"new": 0, "passes": 0} for name in ("medusa1", "medusa2")}
    gens = {"medusa1": (original, SpeculativeGenerator(original, heads1, tree=args.tree)),
            "medusa2": (tuned, SpeculativeGenerator(tuned, heads2, tree=args.tree))}
    for prompt in chat_prompts(args.prompts):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
        plain = {name: run_one("hf", {}, target, ids, args.max_new_tokens, eos)[0]
                 for name, (target, _) in gens.items()}
        same, prefix = agreement(plain["medusa2"], plain["medusa1"], args.max_new_tokens)
        rows["same"] += same
        rows["prefix"] += prefix
        rows["total"] += args.max_new_tokens
        for name, (target, gen) in gens.items():
            tokens, _, stats = run_one("headway", gen, target, ids, args.max_new_tokens, eos)
            assert tokens == plain[name], f"{name}: speculative output differs from its target's greedy output"
            tau[name]["new"] += stats.new_tokens
            tau[name]["passes"] += stats.target_forward_passes
    report["greedy_agreement"] = rows["same"] / rows["total"]
    report["mean_identical_prefix"] = rows["prefix"] / args.prompts
    report["tau"] = {name: t["new"] / max(t["passes"], 1) for name, t in tau.items()}
    report["prompts"], report["max_new_tokens"], report["tree"] = args.prompts, args.max_new_tokens, args.tree

    print(f"held-out ({len(heldout)} sequences) top-1 / top-5 per head:  Medusa-1 (original target)  "
          f"Medusa-2 (tuned target)")
    for k in range(heads2.config.num_heads):
        a, b = report["medusa1"], report["medusa2"]
        print(f"  head {k} (t+{k + 2}): {a[f'head{k}/top1']:.3f} / {a[f'head{k}/top5']:.3f}      "
              f"{b[f'head{k}/top1']:.3f} / {b[f'head{k}/top5']:.3f}")
    print(f"tau ({args.prompts} held-out chat prompts, {args.max_new_tokens} new tokens, {args.tree}, greedy, "
          f"outputs equal to each target's own): Medusa-1 {report['tau']['medusa1']:.2f}, "
          f"Medusa-2 {report['tau']['medusa2']:.2f}")
    print(f"drift: KL(original || tuned) {report['kl_original_tuned']:.4f} per held-out assistant token; greedy "
          f"agreement {report['greedy_agreement']:.3f} ({rows['same']}/{rows['total']} tokens), mean identical "
          f"prefix {report['mean_identical_prefix']:.1f} tokens")
    (run / "medusa2_report.json").write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
