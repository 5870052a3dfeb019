"""LayerSkip exit-head training: the loss is the soft cross-entropy (or another divergence) against the
target's own distribution, training lowers the KL to it, and the tiny config trains, exports, loads back
and generates the target's own output; bad input is a one-line error."""

import json
from pathlib import Path

import pytest
import torch

from headway.heads import load_drafter
from headway.heads.layerskip import LayerSkipHead
from headway.heads.target.tiny import build_tiny_target
from headway.inference import SpeculativeGenerator
from headway.train.layerskip import LayerSkipLossConfig, LayerSkipTrainingModule, exit_loss, main
from tests.train.train_utils import failed_run

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "layerskip" / "tiny.yaml"


def test_exit_loss_is_the_soft_cross_entropy_of_position_t_against_the_targets_next_token_distribution():
    torch.manual_seed(0)
    target, _ = build_tiny_target("llama")
    target = target.double()
    head = LayerSkipHead.from_target(target, exit_layer=1, draft_vocab_size=40, draft_tokens=list(range(3, 43))).double()
    rows = head.draft_rows(target.lm_head.weight.detach())  # [V', H]
    early, final = torch.randn(2, 7, 64, dtype=torch.float64), torch.randn(2, 7, 64, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    for chunk in (0, 3):
        loss, counts = exit_loss(head, early, final, mask, rows, head.draft_index(), chunk_size=chunk)
        keep = mask[:, 1:].bool()  # position t predicts token t+1: it counts where t+1 does
        q = head(early[:, :-1][keep]).log_softmax(-1)
        p = (final[:, :-1][keep] @ rows.T).softmax(-1)
        want = -(p * q).sum(-1).mean()
        assert torch.allclose(loss, want) and int(counts["step0/count"]) == int(keep.sum())


def test_training_lowers_the_kl_to_the_target():
    target, _ = build_tiny_target("llama", seed=1)
    head = LayerSkipHead.from_target(target, exit_layer=1)
    module = LayerSkipTrainingModule(head, target, LayerSkipLossConfig(kind="kl"))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, target.config.vocab_size, (8, 24), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": torch.ones_like(ids)}
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss, _ = module(batch)
        first = float(loss.detach()) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(module(batch)[0]) < 0.5 * first, first


def test_tiny_config_trains_exports_loads_and_generates_the_targets_output(tmp_path, capsys):
    out = tmp_path / "ls"
    main(["--config", str(TINY), f"train.output_dir={out}", "train.max_steps=8"])
    assert "exit at layer 1: held-out top-1" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["drafter_type"] == "layerskip" and config["exit_layer"] == 1 and config["draft_vocab_size"] == 128
    head = load_drafter(out)
    assert isinstance(head, LayerSkipHead) and head.d2t is not None
    target, tok = build_tiny_target("llama")
    prompt = tok("hello there, how are you", return_tensors="pt").input_ids
    gen = SpeculativeGenerator(target, head, tree=None)
    ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=16)
    assert torch.equal(gen.generate(prompt, max_new_tokens=16).sequences, ref)


@pytest.mark.parametrize("override, message", [
    ("layerskip.exit_layer=2", "layerskip.exit_layer must be in 1..1 (the target has 2 layers), got 2"),
    ("layerskip.num_draft=0", "num_draft must be >= 1"),
    ("loss.kind=nope", "unknown loss kind 'nope'"),
])
def test_bad_input_is_a_one_line_error(tmp_path, capsys, override, message):
    err, errors = failed_run(main, TINY, tmp_path / "x", override, capsys)  # (the target loads before exit_layer
    # is checked against its depth)
    assert "Traceback" not in err and len(errors) == 1 and message in errors[0], err
