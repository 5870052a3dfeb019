"""headway's own drafter kinds (headway.heads.kinds): registered under their names, which config.json each
owns, the formats and training methods they name, and the one line ``headway info`` says of each."""

import pytest

from headway.heads.kinds import EAGLE1, EAGLE3, EAGLE_FORMATS, MEDUSA, MEDUSA_FORMATS
from headway.heads.registry import get_kind, training_methods


def test_the_kinds_are_registered_with_their_formats_and_training():
    assert get_kind("medusa") is MEDUSA and get_kind("eagle") is EAGLE1 and get_kind("eagle3") is EAGLE3
    assert (MEDUSA.title, EAGLE1.title, EAGLE3.title) == ("Medusa", "EAGLE-1/2", "EAGLE-3")
    assert MEDUSA.exports == MEDUSA.imports == MEDUSA_FORMATS == ("medusa-v0.1", "medusa-v2", "vllm-medusa")
    assert EAGLE1.exports == ("eagle",) and EAGLE3.exports == ("sglang", "speculators")
    assert EAGLE1.imports == EAGLE3.imports == EAGLE_FORMATS  # either version reads from any EAGLE layout
    assert list(MEDUSA.training) == ["medusa", "medusa2"] and EAGLE1.training is EAGLE3.training
    assert {"medusa", "medusa2", "eagle"} <= set(training_methods())
    assert MEDUSA.head_class == "headway.heads.medusa:MedusaHeads"  # a name: reading the registry imports no torch


def test_which_config_is_which_kind():
    assert MEDUSA.owns({"drafter_type": "medusa"}) and not MEDUSA.owns({"drafter_type": "eagle", "version": 1})
    assert EAGLE1.owns({"drafter_type": "eagle", "version": 1}) and not EAGLE3.owns({"drafter_type": "eagle",
                                                                                      "version": 1})
    assert EAGLE3.owns({"drafter_type": "eagle", "version": 3}) and not EAGLE1.owns({"drafter_type": "eagle",
                                                                                      "version": 3})
    assert EAGLE3.owns({"drafter_type": "eagle"}) and not EAGLE1.owns({"drafter_type": "eagle"})  # 3 by default
    assert not EAGLE3.owns({"drafter_type": "medusa", "version": 3})


@pytest.mark.parametrize("kind, info, line", [
    (MEDUSA, {"num_heads": 3, "num_layers": 1, "share_lm_head": True},
     "Medusa-1 heads: 3 heads x 1 ResBlock, the target's lm_head; head k predicts token t+k+2"),
    (MEDUSA, {"num_heads": 4, "num_layers": 2, "share_lm_head": False, "draft_vocab_size": 40},
     "Medusa-1 heads: 4 heads x 2 ResBlocks, own lm_head (draft vocabulary 40); head k predicts token t+k+2"),
    (MEDUSA, {"num_heads": 2, "num_layers": 0, "share_lm_head": False, "draft_vocab_size": None},
     "Medusa-1 heads: 2 heads x 0 ResBlocks, own lm_head (full vocabulary); head k predicts token t+k+2"),
    (EAGLE1, {"version": 1, "feature_layers": [32]},
     "EAGLE-1/2 drafter: one decoder layer over [token embedding; target feature], the target's lm_head"),
    (EAGLE3, {"feature_layers": [2, 16, 29], "draft_vocab_size": 32000},
     "EAGLE-3 drafter: one decoder layer over fused target layers [2, 16, 29], own lm_head (draft vocabulary 32000)"),
    (EAGLE3, {"feature_layers": [0, 1, 2], "draft_vocab_size": None},
     "EAGLE-3 drafter: one decoder layer over fused target layers [0, 1, 2], own lm_head (full vocabulary)"),
    (EAGLE3, {"feature_layers": [0, 1, 2], "draft_vocab_size": None, "num_layers": 4},
     "EAGLE-3 drafter: 4 decoder layers over fused target layers [0, 1, 2], own lm_head (full vocabulary)"),
], ids=["medusa-shared", "medusa-reduced", "medusa-no-blocks", "eagle1", "eagle3-reduced", "eagle3-full", "eagle3-deep"])
def test_the_describe_lines(kind, info, line):
    assert kind.description(info) == line
