"""What the layout tests share (tests/heads/formats): the tiny target's sizes, drafters with noise on every
weight (so each tensor matters), and how exports, tensors, steps and generations are compared."""

import json
import warnings

import torch
from safetensors.torch import load_file

from headway.heads import EagleHead, MedusaHeads
from headway.heads.formats.eagle import export_eagle

DRAFT_IDS = list(range(0, 200, 5))  # 40 draft tokens of the tiny target's 218
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6]])
H, V = 64, 218  # the tiny target's hidden size and vocabulary
LAYER = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "post_attention_layernorm.weight"]
LAYER3 = LAYER + ["input_layernorm.weight", "hidden_norm.weight"]


def noisy(module, seed=0, skip=()):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if not name.startswith(skip):
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return module


def medusa_heads(target, noisy_lm_heads=True, **kw):
    heads = MedusaHeads.from_target(target, **{"num_heads": 3, **kw})
    return noisy(heads, skip=() if noisy_lm_heads else ("lm_heads",))


def eagle_head(target, version, **kw):
    return noisy(EagleHead.from_target(target, version=version, **kw))


def saved(drafter, path):
    drafter.save_pretrained(path)
    return path


def quiet(fn, *args, **kw):
    with warnings.catch_warnings():  # EAGLE-3 layers [0, 1, 2] of the 2-layer tiny target warn (test_eagle.py)
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


def export_quietly(head, path, fmt, **kw):
    """export_eagle without the warning the tiny 2-layer target's EAGLE-3 layers [0, 1, 2] give (tested in
    test_eagle.py::test_sglang_layout)."""
    return quiet(export_eagle, head, path, fmt, **kw)


def same_tensors(a, b):
    a, b = a.state_dict(), b.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def generate(target, drafter):
    from headway.inference import SpeculativeGenerator

    out = SpeculativeGenerator(target, drafter, tree="tree-7").generate(PROMPT, max_new_tokens=12)
    return out.sequences.tolist(), out.stats.accepted_per_step


def medusa_logits(target, heads):
    heads.bind_target(target)
    with torch.no_grad():
        return heads(torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3)))


def step_logits(head, target, seed=1):
    """One EAGLE step's logits on seeded tokens and features."""
    head.bind_target(target)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, target.config.vocab_size, (2, 5), generator=g)
    feats = torch.randn(2, 5, head.config.feature_width, generator=g)
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        return head.logits(head(ids, head.input_hidden(feats), pos))


def file_names(folder):
    return sorted(p.name for p in folder.iterdir())


def config_and_tensors(path):
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


def one_line(err):
    assert "\n" not in str(err.value)
