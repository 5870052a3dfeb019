"""DFlash training: the anchors, the block mask, the training pass's blocks equal the runtime's (a block after its
context alone), the loss by formula, the KL falling, the tiny config end to end (train, export, load, generate the
target's output) and bad input."""

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from headway.heads import load_drafter
from headway.heads.dflash import DFlashHead
from headway.heads.target.features import capture_features
from headway.heads.target.tiny import build_tiny_target
from headway.inference import SpeculativeGenerator
from headway.train.dflash import block_mask, block_outputs, dflash_loss, main, pick_anchors
from tests.train.train_utils import failed_run, two_process_cpu_run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "dflash" / "tiny.yaml"


@pytest.fixture(scope="module")
def tiny():
    target, _ = build_tiny_target("llama")
    torch.manual_seed(0)
    head = DFlashHead.from_target(target, block_size=4, num_layers=2)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ids = torch.randint(3, 200, (2, 14))
    feats = capture_features(target, ids, head.config.feature_layers)  # [2, 14, 3H]; the last 64: the final norm
    return target, head, ids, feats


def test_anchors_are_distinct_counted_positions():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0, 0, 1]])
    starts, valid = pick_anchors(mask, 3, torch.Generator().manual_seed(0))
    assert starts.shape == (2, 3)
    row = starts[0][valid[0]].tolist()
    assert len(set(row)) == 3 and row == sorted(row) and all(mask[0, a + 1] for a in row)
    assert starts[1][valid[1]].tolist() == [6] and valid[1].sum() == 1  # one candidate: the rest padding
    everything, ok = pick_anchors(mask, 100)
    assert ok[0].sum() == 5 and everything[0][ok[0]].tolist() == [1, 2, 3, 5, 6]


def test_the_block_mask():
    starts, valid = torch.tensor([[2, 5]]), torch.tensor([[True, False]])
    allowed = block_mask(starts, valid, 6, 3, torch.float32)[0, 0] == 0  # [6 queries, 6 context + 6 block]
    assert allowed[0].nonzero().flatten().tolist() == [0, 1, 6, 7, 8]  # anchor 2: context 0..1, its block
    assert allowed[2].nonzero().flatten().tolist() == [0, 1, 6, 7, 8]  # bidirectional in the block
    assert allowed[3].nonzero().flatten().tolist() == [9, 10, 11]  # an invalid anchor: its block alone


def test_training_blocks_equal_the_runtimes(tiny):
    """Each anchor's block in the one masked training pass equals a block run after its context alone (the runtime:
    the context's k/v of positions < a, no mask)."""
    _, head, ids, feats = tiny
    fused = feats[..., :head.config.feature_width]
    starts, valid = torch.tensor([[0, 3, 9], [5, 6, 10]]), torch.ones(2, 3, dtype=torch.bool)
    with torch.no_grad():
        h = block_outputs(head, fused, ids, starts, valid)  # [2, 3, 4, H]
        for b in range(2):
            for j, a in enumerate(starts[b].tolist()):
                kv = head.context_kv(head.context(fused[b:b + 1, :a]), torch.arange(a)[None])
                block = torch.tensor([[int(ids[b, a])] + [head.config.mask_token_id] * 3])
                alone = head(block, torch.arange(a, a + 4)[None], kv)[0]
                assert torch.allclose(h[b, j], alone, atol=1e-5), (b, a)


def test_the_loss_by_formula(tiny):
    """Slot k's rows: the soft cross-entropy against the target's distribution at a+k-1, averaged, weighted
    exp(-(k-1)/gamma); chunked and unchunked agree."""
    target, head, ids, feats = tiny
    fused, last = feats[..., :head.config.feature_width], feats[..., -64:]
    rows = target.lm_head.weight.detach().float()
    mask = torch.ones_like(ids)
    loss, metrics = dflash_loss(head, fused, last, ids, mask, rows, None, anchors=4, gamma=2.0, chunk_size=0,
                                generator=torch.Generator().manual_seed(1))
    chunked, _ = dflash_loss(head, fused, last, ids, mask, rows, None, anchors=4, gamma=2.0, chunk_size=3,
                             generator=torch.Generator().manual_seed(1))
    starts, valid = pick_anchors(mask, 4, torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = block_outputs(head, fused, ids, starts, valid)
        expected = 0.0
        for k in range(1, 4):
            terms = []
            for b in range(2):
                for j, a in enumerate(starts[b].tolist()):
                    if valid[b, j] and a + k < ids.shape[1]:
                        p = F.softmax(last[b, a + k - 1] @ rows.T, -1)
                        terms.append(-(p * F.log_softmax(head.logits(h[b, j, k]), -1)).sum())
            assert int(metrics[f"step{k - 1}/count"]) == len(terms)
            expected += math.exp(-(k - 1) / 2.0) * torch.stack(terms).mean()
    assert torch.allclose(loss, expected, atol=1e-4) and torch.allclose(chunked, loss, atol=1e-4)


def test_the_kl_falls(tiny):
    """Fitting one batch: the KL to the target's distribution over every slot halves in 60 steps."""
    target, _, ids, feats = tiny
    torch.manual_seed(3)
    head = DFlashHead.from_target(target, block_size=4)
    fused, last = feats[..., :head.config.feature_width], feats[..., -64:]
    rows = target.lm_head.weight.detach().float()
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss, _ = dflash_loss(head, fused, last, ids, torch.ones_like(ids), rows, None, anchors=6, kind="kl",
                              generator=torch.Generator().manual_seed(0))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses[::10]


def test_tiny_config_trains_exports_loads_and_generates_the_targets_output(tmp_path, capsys):
    out = tmp_path / "df"
    main(["--config", str(TINY), f"train.output_dir={out}", "train.max_steps=6"])
    assert "slot 2 (token t+4): held-out top-1" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "dflash" and config["block_size"] == 4 and config["draft_vocab_size"] == 128
    head = load_drafter(out)
    assert isinstance(head, DFlashHead)
    target, tok = build_tiny_target("llama")
    prompt = tok("hello there, how are you", return_tensors="pt").input_ids
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16)
    assert torch.equal(SpeculativeGenerator(target, head, tree=None).generate(prompt, max_new_tokens=16).sequences, ref)


@pytest.mark.slow  # launches two training processes
@pytest.mark.multiprocess
def test_two_process_cpu_ddp_stays_in_sync(tmp_path):
    """Each rank draws its own anchors; the gradients are averaged, so the ranks' drafters stay equal (the helper
    compares their fingerprints) and it trains."""
    out = tmp_path / "ddp"
    res, _ = two_process_cpu_run(ROOT / "train" / "dflash.py", TINY, out, "train.max_steps=10", "train.save_every=0")
    assert "2 process(es) on cpu" in res.stdout
    evals = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "eval/step0/loss" in m]
    assert evals[-1]["step"] == 10 and evals[-1]["eval/step0/loss"] < evals[0]["eval/step0/loss"], evals
    assert isinstance(load_drafter(out), DFlashHead)


@pytest.mark.parametrize("override, message", [
    ("dflash.block_size=1", "block_size must be >= 2"),
    ("dflash.fc_bias=true", "drop normalize_features, store_embeddings and fc_bias"),
    ("loss.gamma=0", "loss.gamma must be > 0"),
    ("loss.kind=mse", "unknown loss kind 'mse'"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, override, message):
    _, errors = failed_run(main, TINY, tmp_path / "x", override, capsys)
    assert len(errors) == 1 and message in errors[0], errors
