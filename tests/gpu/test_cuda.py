"""Checks that need a CUDA device (run by scripts/gpu_check.sh; skipped elsewhere by the `gpu` marker).

- Greedy speculative output on CUDA in bf16 equals the target's own greedy ``generate`` for Medusa,
  EAGLE-3 (static and dynamic trees) and prompt lookup.
- A bf16 training run on CUDA ends with a loadable export.
- With 2 or more GPUs: the accelerate FSDP config (configs/accelerate/gpu-fsdp.yaml) matches DDP.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from headway.heads import EagleHead, MedusaConfig, MedusaHeads, load_drafter
from headway.heads.target.tiny import build_tiny_target
from headway.inference import PromptLookup, SpeculativeGenerator

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_greedy_equals_generate_on_cuda(family):
    target, _ = build_tiny_target(family, seed=3)
    target = target.to("cuda", torch.bfloat16)
    drafters = [(MedusaHeads.from_target(target.float(), MedusaConfig(num_heads=3)), "tree-15"),
                (EagleHead.from_target(target.float(), version=3), None),
                (EagleHead.from_target(target.float(), version=3), {"depth": 4, "top_k": 4, "total_tokens": 12}),
                (PromptLookup(max_matches=3), None)]
    target = target.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for drafter, tree in drafters:
        gen = SpeculativeGenerator(target, drafter, tree=tree)
        for _ in range(4):
            prompt = torch.randint(4, target.config.vocab_size, (1, 12), generator=g).cuda()
            ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32,
                                  eos_token_id=None, pad_token_id=0)
            assert torch.equal(gen.generate(prompt, max_new_tokens=32, eos_token_id=None).sequences, ref)


@needs_cuda
def test_bf16_training_on_cuda_exports(tmp_path):
    out = tmp_path / "medusa"
    cmd = [sys.executable, "-m", "headway.train.medusa", "--config", "medusa/tiny", f"train.output_dir={out}",
           "train.max_steps=20", "train.trackers=[]", "train.mixed_precision=bf16"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert isinstance(load_drafter(out), MedusaHeads)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_fsdp_on_two_gpus_matches_ddp(tmp_path):
    """configs/accelerate/gpu-fsdp.yaml on 2 GPUs (NCCL) ends within tolerance of a DDP run."""
    from safetensors.torch import load_file

    outs = {}
    for mode, flags in {"ddp": ["--multi_gpu"],
                        "fsdp": ["--config_file", str(ROOT / "configs" / "accelerate" / "gpu-fsdp.yaml")]}.items():
        outs[mode] = tmp_path / mode
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *flags, "--num_processes", "2",
               "--mixed_precision", "no", str(ROOT / "train" / "medusa.py"), "--config", "medusa/tiny",
               f"train.output_dir={outs[mode]}", "train.max_steps=12", "train.trackers=[]"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    a, b = (load_file(str(outs[m] / "model.safetensors")) for m in ("ddp", "fsdp"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-3) for k in a)


@needs_cuda
@pytest.mark.parametrize("tree,layers", [("tree-15", 1), ({"depth": 5, "top_k": 8, "total_tokens": 40}, 1),
                                         ("tree-15", 3)])
def test_cuda_graphs_draft_what_eager_drafts(tree, layers):
    """The EAGLE drafter's levels and the target's verification pass captured in CUDA graphs (the default on CUDA):
    greedy output equals generate's, each prompt's first rounds draft what the eager ones draft (fp32: up to the
    kernels' rounding over a longer masked span, so compared until the first difference), and nothing is captured
    twice (one graph per width and span)."""
    from headway.inference.graphs import CudaGraphs

    target, _ = build_tiny_target("llama", seed=3)
    target = target.to("cuda")
    head = EagleHead.from_target(target, version=3, num_layers=layers)  # 3: midlayer, then two plain layers
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, target.config.vocab_size, (1, 12), generator=g).cuda() for _ in range(4)]
    drafts = {}
    for flag in (False, CudaGraphs()):
        gen = SpeculativeGenerator(target, head, tree=tree, cuda_graphs=flag)
        rounds, propose = [], gen.drafter.propose
        gen.drafter.propose = lambda ctx, propose=propose, rounds=rounds: rounds.append(propose(ctx)) or rounds[-1]
        per_prompt = []
        for prompt in prompts:
            ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=32,
                                  eos_token_id=None, pad_token_id=0)
            start = len(rounds)
            assert torch.equal(gen.generate(prompt, max_new_tokens=32, eos_token_id=None).sequences, ref)
            per_prompt.append([d.tokens.tolist() for d in rounds[start:]])
        drafts[bool(flag)] = per_prompt
        if flag:
            assert gen._verify_graphs._calls and gen.drafter._graphs._calls
            assert flag.captures == len(gen._verify_graphs._calls) + len(gen.drafter._graphs._calls)
    same = total = 0
    for eager, graphed in zip(drafts[False], drafts[True]):
        total += len(eager)
        for a, b in zip(eager, graphed):
            if a != b:
                break
            same += 1
    assert same >= 0.8 * total, f"{same} of {total} rounds drafted alike before a difference"
