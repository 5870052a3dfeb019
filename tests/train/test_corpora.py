"""The packaged prompts: deterministic, deduplicated, mixed from both packages; the held-out window."""

import pytest

from headway.train import corpora as C


def test_default_prompts():
    prompts = C.default_prompts(limit=50)
    assert len(prompts) == 50 and len(set(prompts)) == 50
    assert prompts == C.default_prompts(limit=50)
    assert prompts != C.default_prompts(limit=50, seed=1)
    chitchat, chatterbot = set(C._chitchat_prompts()), set(C._chatterbot_prompts())
    assert any(p in chitchat for p in prompts) and any(p in chatterbot for p in prompts)
    assert all(p in chitchat or p in chatterbot for p in prompts)
    assert len(C.default_prompts()) > 1000


def test_training_prompts_never_hold_the_benchmark_prompts():
    everything = C.default_prompts()
    held = C.held_out_prompts()
    assert held == everything[C.HELD_OUT_START:C.HELD_OUT_START + C.HELD_OUT_SIZE]
    # Up to the window the training prompts are the default ones, so cached data sets keep their bytes.
    assert C.training_prompts(limit=C.HELD_OUT_START) == everything[:C.HELD_OUT_START]
    keys = {p.casefold() for p in held}
    for seed in (0, 1):
        train = C.training_prompts(seed=seed)
        assert len(train) == len(everything) - C.HELD_OUT_SIZE
        assert not keys & {p.casefold() for p in train}
    assert C.training_prompts(limit=C.HELD_OUT_START + 1)[-1] == everything[C.HELD_OUT_START + C.HELD_OUT_SIZE]
    with pytest.raises(ValueError, match="at most 200"):
        C.held_out_prompts(C.HELD_OUT_SIZE + 1)
