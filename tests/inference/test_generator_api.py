"""The generate() contract: exact stopping, stats, seeds, lossy flag and clear errors on bad input."""

import warnings

import pytest
import torch

from headway.heads.target.tiny import build_tiny_target
from headway.inference import DraftModelProposer, PromptLookup, SpeculativeGenerator


@pytest.fixture(scope="module")
def target():
    return build_tiny_target("llama", seed=0)[0]


@pytest.fixture(scope="module")
def self_draft():
    return build_tiny_target("llama", seed=0)[0]  # identical to the target: every draft is accepted


def test_stops_exactly_and_reports_stats(target, self_draft):
    gen = SpeculativeGenerator(target, self_draft, tree="chain-4")
    ids = torch.tensor([[5, 6, 7, 8]])
    for n in [1, 2, 3, 5, 6, 11, 23]:
        out = gen.generate(ids, max_new_tokens=n)
        s = out.stats
        assert out.sequences.shape == (1, 4 + n) and s.new_tokens == n
        assert s.accepted_per_step[:-1] == [5] * (len(s.accepted_per_step) - 1)  # a perfect drafter: gamma + 1 per pass
        assert s.target_forward_passes == -(-n // 5) and s.mean_accepted_length == n / s.target_forward_passes
        assert all(r == 1.0 for r in s.depth_acceptance)
        assert min(s.time_draft, s.time_verify, s.time_bookkeeping, s.time_prefill) >= 0 and not s.lossy
        assert set(s.as_dict()) >= {"new_tokens", "mean_accepted_length", "depth_acceptance", "time_total"}
    # 1-D input and a one-token prompt work too
    assert gen.generate(torch.tensor([5]), max_new_tokens=3).sequences.shape == (1, 4)


def test_sampling_seeded_by_generator(target):
    gen = SpeculativeGenerator(target, PromptLookup(max_matches=2))
    ids = torch.tensor([[5, 6, 7, 5, 6]])
    run = lambda seed: gen.generate(ids, max_new_tokens=20, temperature=1.0, top_p=0.9,
                                    generator=torch.Generator().manual_seed(seed)).sequences
    assert torch.equal(run(0), run(0)) and not torch.equal(run(0), run(1))
    torch.manual_seed(3)
    a = gen.generate(ids, max_new_tokens=20, temperature=1.0).sequences
    torch.manual_seed(3)
    assert torch.equal(a, gen.generate(ids, max_new_tokens=20, temperature=1.0).sequences)


def test_typical_acceptance_is_flagged_lossy(target, self_draft):
    gen = SpeculativeGenerator(target, self_draft, tree="tree-7", acceptance="typical")
    out = gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10, temperature=0.7,
                       generator=torch.Generator().manual_seed(0))
    assert out.stats.lossy and out.stats.acceptance == "typical" and out.sequences.shape == (1, 13)
    greedy = gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=10)
    assert not greedy.stats.lossy  # temperature 0 is plain greedy verification


def test_context_is_respected(target):
    gen = SpeculativeGenerator(target, PromptLookup())
    long = torch.full((1, 1024), 5)
    with pytest.raises(ValueError, match="context is 1024"):
        gen.generate(long, max_new_tokens=1)
    with pytest.warns(UserWarning, match="exceeds the model's context"):
        out = gen.generate(long[:, :1020], max_new_tokens=10)
    assert out.sequences.shape[1] == 1024


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
])
def test_bad_generation_arguments(target, kwargs, match):
    gen = SpeculativeGenerator(target, PromptLookup())
    with pytest.raises(ValueError, match=match):
        gen.generate(torch.tensor([[5, 6]]), **{"max_new_tokens": 4, **kwargs})


def test_bad_inputs_and_settings(target, tmp_path):
    gen = SpeculativeGenerator(target, PromptLookup())
    with pytest.raises(ValueError, match="batch size 1"):
        gen.generate(torch.tensor([[5, 6], [7, 8]]))
    with pytest.raises(ValueError, match="non-empty"):
        gen.generate(torch.tensor([[]], dtype=torch.long))
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        gen.generate(torch.tensor([[5, 10_000]]))
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeGenerator(target, PromptLookup(), acceptance="fast")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- [0]\n- [1, 1]\n")
    with pytest.raises(ValueError, match="prefix \\[1\\] is missing"):
        SpeculativeGenerator(target, PromptLookup(), tree=bad)


def test_no_future_warning_from_the_cache_keyword(target, self_draft):
    gen = SpeculativeGenerator(target, self_draft, tree="tree-7")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=6, temperature=1.0)


def test_draft_model_with_another_tokenizer_is_refused(tmp_path):
    """Same vocabulary size, different token ids: refused by comparing the saved tokenizers."""
    from transformers import AutoModelForCausalLM

    from headway.heads.target.tiny import build_tiny_target

    target, tok = build_tiny_target("llama", seed=0)
    draft, dtok = build_tiny_target("llama", seed=1)
    target.save_pretrained(tmp_path / "t")
    tok.save_pretrained(tmp_path / "t")
    vocab = dtok.get_vocab()
    a, b = "hello", "robot"
    vocab[a], vocab[b] = vocab[b], vocab[a]  # swap two ids: same size, other tokenizer
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer, backend.pre_tokenizer = dtok.backend_tokenizer.normalizer, dtok.backend_tokenizer.pre_tokenizer
    swapped = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>")
    draft.save_pretrained(tmp_path / "d")
    swapped.save_pretrained(tmp_path / "d")
    t = AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    d = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    with pytest.raises(ValueError, match="tokenizer differs"):
        SpeculativeGenerator(t, DraftModelProposer(d))
    with pytest.raises(ValueError, match="tokenizer differs"):
        SpeculativeGenerator(target, DraftModelProposer(draft, tokenizer=swapped, target_tokenizer=tok))
    SpeculativeGenerator(target, DraftModelProposer(draft, tokenizer=dtok, target_tokenizer=tok))  # same: accepted


def test_pre_rename_names_still_import_with_a_warning():
    import headway.inference as inf

    for old, new in [("Drafter", "Proposer"), ("MedusaDrafter", "MedusaProposer"), ("as_drafter", "as_proposer")]:
        with pytest.warns(DeprecationWarning, match=new):
            assert getattr(inf, old) is getattr(inf, new)
    with pytest.raises(AttributeError):
        inf.NoSuchName
