"""Peak memory and time of one Medusa loss forward + backward: plain vs fused, row-chunked loss.

    python scripts/train_memory.py [--tokens 2048] [--hidden 576] [--vocab 49152] [--heads 4 8]
                                   [--chunk-sizes 0 512] [--threads 2]

Defaults are the SmolLM2-135M target's shapes (hidden 576, vocabulary 49152) with 2048 counted
tokens per head. Each (heads, chunk size) case runs in its own child process on CPU with random
heads (nothing is downloaded): one warm-up step, then the kernel's peak-RSS mark is reset
(``/proc/self/clear_refs``) and one more forward + backward is measured. "peak" is the RSS high
water mark during that step above the RSS before it (weights, inputs and the previous step's
gradients excluded); chunk size 0 is the plain path that keeps every head's [n, V] logits.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB -> MiB
    raise RuntimeError(f"/proc/self/status has no {field}; this script needs Linux")


def child(tokens: int, hidden: int, vocab: int, heads: int, chunk: int, threads: int) -> dict:
    import torch

    from headway.heads import MedusaConfig, MedusaHeads
    from headway.train.losses import head_weights, medusa_loss

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=heads))
    for proj in model.lm_heads:
        torch.nn.init.normal_(proj.weight, std=0.02)
    seq = 512  # rows per sequence; the batch makes ``tokens`` counted rows for every head
    batch = -(-tokens // (seq - heads - 1))
    x = torch.randn(batch, seq, hidden)
    ids = torch.randint(0, vocab, (batch, seq))
    mask = torch.zeros_like(ids)
    mask.view(-1)[-tokens:] = 1  # the last ``tokens`` positions count for every head

    def step() -> float:
        model.zero_grad(set_to_none=False)  # gradients stay allocated, as in a run after its first step
        start = time.perf_counter()
        loss, _ = medusa_loss(model, x, ids, mask, head_weights(heads), chunk_size=chunk)
        loss.backward()
        return time.perf_counter() - start

    step()  # warm-up: allocates gradients and the allocator's pools
    before = _status_mb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    seconds = step()
    return {"heads": heads, "chunk": chunk, "peak_mb": _status_mb("VmHWM") - before, "seconds": seconds}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="counted tokens per head (n)")
    p.add_argument("--hidden", type=int, default=576, help="hidden size H (SmolLM2-135M: 576)")
    p.add_argument("--vocab", type=int, default=49152, help="vocabulary V (SmolLM2-135M: 49152)")
    p.add_argument("--heads", type=int, nargs="+", default=[4, 8], help="Medusa head counts to measure")
    p.add_argument("--chunk-sizes", type=int, nargs="+", default=[0, 512], help="0: the plain, unchunked loss")
    p.add_argument("--threads", type=int, default=2, help="torch threads per child process")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.tokens, args.hidden, args.vocab, args.heads[0], args.chunk_sizes[0],
                               args.threads)))
        return
    shape = ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
             "--threads", str(args.threads)]
    print(f"n={args.tokens} tokens per head, H={args.hidden}, V={args.vocab}, {args.threads} threads, CPU\n")
    print("| heads | loss path | peak above start (MiB) | forward+backward (s) |")
    print("|---|---|---|---|")
    for heads in args.heads:
        for chunk in args.chunk_sizes:
            cmd = [sys.executable, __file__, "--child", "--heads", str(heads), "--chunk-sizes", str(chunk), *shape]
            r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            path = "plain (chunk_size=0)" if chunk == 0 else f"fused, chunk_size={chunk}"
            print(f"| {heads} | {path} | {r['peak_mb']:.0f} | {r['seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
