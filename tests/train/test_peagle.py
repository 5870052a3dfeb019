"""P-EAGLE training: the parallel mask, the loss (its depth 0 is EAGLE-3's step 0), COD sampling (each kept slot
computes what it computes in the full layout), the tiny config end to end (train, export, load, generate the
target's output) and bad input."""

import json
from pathlib import Path

import pytest
import torch

from headway.heads import load_drafter
from headway.heads.peagle import PEagleHead
from headway.heads.target.features import capture_features
from headway.heads.target.tiny import build_tiny_target
from headway.inference import SpeculativeGenerator
from headway.train.eagle_losses import eagle3_loss
from headway.train.peagle import cod_anchors, main, parallel_forward, parallel_mask, peagle_loss
from tests.train.train_utils import failed_run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "peagle" / "tiny.yaml"


def test_the_parallel_mask():
    m = parallel_mask(3, 3, "cpu")  # rows: real 0..2, depth-1 slots of anchors 0..2, depth-2 slots
    assert m[:3, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert not m[:3, 3:].any()  # real positions never see slots
    slot = 3 + 1  # anchor 1, depth 1: real 0..1 and itself
    assert m[slot].nonzero().flatten().tolist() == [0, 1, 4]
    assert m[6 + 2].nonzero().flatten().tolist() == [0, 1, 2, 5, 8]  # anchor 2, depth 2: real 0..2, (2,1), itself


def test_depth_zero_is_eagle3s_first_step():
    target, _ = build_tiny_target("llama")
    head = PEagleHead.from_target(target, parallel_depths=3)
    head.bind_target(target)
    ids = torch.randint(3, 200, (2, 12))
    assert head.config.feature_layers == [0, 1, 2]  # a 2-layer target's default: the final norm's (2) is last
    feats = capture_features(target, ids, head.config.feature_layers)
    fused, last = feats[..., :head.config.feature_width], feats[..., -64:]
    rows = target.lm_head.weight.detach().float()
    mask = torch.ones_like(ids)
    _, ours = peagle_loss(head, fused, last, ids, mask, rows, None, None, chunk_size=0)
    _, theirs = eagle3_loss(head, fused, last, ids, mask, rows, None, None, steps=1, chunk_size=0)
    assert torch.allclose(ours["step0/loss_sum"], theirs["step0/loss_sum"], atol=1e-4)
    assert int(ours["step0/top1"]) == int(theirs["step0/top1"]) and {"step1/count", "step2/count"} <= set(ours)


@pytest.mark.parametrize("layers", [1, 3])
def test_tiny_config_trains_exports_loads_and_generates_the_targets_output(tmp_path, capsys, layers):
    out = tmp_path / "pe"
    main(["--config", str(TINY), f"train.output_dir={out}", "train.max_steps=6", f"peagle.num_layers={layers}"])
    assert "depth 2 (token t+4): held-out top-1" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "peagle" and config["parallel_depths"] == 3 and config["num_layers"] == layers
    head = load_drafter(out)
    target, tok = build_tiny_target("llama")
    prompt = tok("hello there, how are you", return_tensors="pt").input_ids
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16)
    assert torch.equal(SpeculativeGenerator(target, head, tree=None).generate(prompt, max_new_tokens=16).sequences, ref)


@pytest.mark.parametrize("override, message", [
    ("peagle.parallel_depths=1", "parallel_depths must be >= 2"),
    ("peagle.normalize_features=true", "ignores fc_norm for peagle"),
    ("peagle.num_layers=0", "num_layers must be an integer >= 1, got 0"),
    ("loss.decay=0", "loss.decay must be > 0"),
    ("loss.cod_ratio=0", "loss.cod_ratio must be in (0, 1] and loss.cod_floor in [0, 1], got 0.0 and 0.2"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, override, message):
    _, errors = failed_run(main, TINY, tmp_path / "x", override, capsys)
    assert len(errors) == 1 and message in errors[0], errors


def test_cod_sampling_keeps_whole_chains():
    torch.manual_seed(0)
    kept = cod_anchors(40, 5, ratio=0.7, floor=0.2)
    assert [a.numel() for a in kept] == [40, 28, 19, 13, 9]  # int(40 * max(0.7**d, 0.2))
    for shallow, deep in zip(kept, kept[1:]):
        assert set(deep.tolist()) <= set(shallow.tolist()) and deep.tolist() == sorted(deep.tolist())
    assert [a.numel() for a in cod_anchors(40, 5, ratio=0.5, floor=0.2)][-1] == 8  # the floor
    state = torch.get_rng_state()
    assert all(a.tolist() == list(range(40)) for a in cod_anchors(40, 5))  # ratio 1: all, and no random draw
    assert torch.equal(state, torch.get_rng_state())


def test_a_sampled_layout_computes_what_the_full_one_does():
    """A kept slot sees the real positions up to its anchor and its own chain, all kept: its output is the full
    layout's for the same anchor and depth; the loss over a sample counts only its anchors."""
    target, _ = build_tiny_target("llama")
    head = PEagleHead.from_target(target, parallel_depths=4)
    head.bind_target(target)
    ids = torch.randint(3, 200, (2, 30))
    feats = capture_features(target, ids, head.config.feature_layers)
    fused = feats[..., :head.config.feature_width]
    n = ids.shape[1] - 1
    torch.manual_seed(1)
    sample = cod_anchors(n, 4, ratio=0.5, floor=0.0)
    full = [torch.arange(n)] * 4
    with torch.no_grad():
        h_full = parallel_forward(head, fused, ids, full)  # [B, 4N, H]
        h_sample = parallel_forward(head, fused, ids, sample)
    offset = 0
    for d, at in enumerate(sample):
        assert torch.allclose(h_sample[:, offset:offset + at.numel()], h_full[:, d * n + at], atol=1e-5)
        offset += at.numel()
    rows, mask = target.lm_head.weight.detach().float(), torch.ones_like(ids)
    _, metrics = peagle_loss(head, fused, feats[..., -64:], ids, mask, rows, None, None, chunk_size=0, anchors=sample)
    assert [int(metrics[f"step{d}/count"]) for d in range(4)] == [
        2 * int((at <= n - 2 - d).sum()) for d, at in enumerate(sample)]  # anchors whose token x[t+2+d] exists


def test_training_with_cod_sampling(tmp_path, capsys, monkeypatch):
    """loss.cod_ratio < 1: training steps draw a sample per batch; evaluation takes every anchor."""
    import headway.train.peagle as peagle

    drawn, evaluated = [], []
    draw, loss = peagle.cod_anchors, peagle.peagle_loss
    monkeypatch.setattr(peagle, "cod_anchors", lambda *a: drawn.append(a) or draw(*a))
    monkeypatch.setattr(peagle, "peagle_loss", lambda *a, **k: evaluated.append(k["anchors"] is None) or loss(*a, **k))
    main(["--config", str(TINY), f"train.output_dir={tmp_path / 'cod'}", "train.max_steps=3", "loss.cod_ratio=0.5"])
    assert "depth 2 (token t+4): held-out top-1" in capsys.readouterr().out
    assert drawn and all(ratio == 0.5 for _, _, ratio, _ in drawn)
    assert evaluated.count(False) == len(drawn) and evaluated.count(True) > 0  # evaluation: every anchor
