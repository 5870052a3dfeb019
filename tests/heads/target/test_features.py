"""Target features through forward hooks (headway.heads.target.features): exactly the hidden states
transformers computes, only the layers asked for, layer ids checked against the target's depth."""

import pytest
import torch

from headway.heads.target.features import (FeatureCapture, capture_features, check_feature_layers, decoder_layers,
                                           final_norm, num_layers)
from headway.heads.target.tiny import build_tiny_target


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_hooks_capture_exactly_the_hidden_states(family):
    model, _ = build_tiny_target(family, seed=3)
    ids = torch.randint(4, 200, (2, 9))
    ref = model(ids, output_hidden_states=True).hidden_states
    layers = [2, 0, 1]
    got = capture_features(model, ids, layers)
    torch.testing.assert_close(got, torch.cat([ref[i] for i in layers], -1), rtol=0, atol=0)
    with FeatureCapture(model, [2]) as cap:  # the final-norm output: lm_head(feature) == logits
        logits = model(ids).logits
        torch.testing.assert_close(model.get_output_embeddings()(cap.pop()), logits, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="outside the target's depth"):
        FeatureCapture(model, [0, 3])

def test_layer_ids_are_checked_against_the_depth():
    assert check_feature_layers(["2", 0, 1.0], 2) == [2, 0, 1]
    with pytest.raises(ValueError, match=r"^feature_layers is empty: name at least one target layer \(0..2\)$"):
        check_feature_layers([], 2)
    with pytest.raises(ValueError, match=r"^eagle.feature_layers \[-1, 0, 3\] has ids \[-1, 3\] outside the "
                                         r"target's depth: valid ids are 0..2 \(0 = embeddings"):
        check_feature_layers([-1, 0, 3], 2, "eagle.feature_layers")
    with pytest.raises(ValueError, match=r"^feature_layers \[1, 1\] names a layer twice$"):
        check_feature_layers([1, 1], 2)
    # a run config's layers, before the target is loaded: no range claimed but ids >= 0
    assert check_feature_layers([0, 5], None) == [0, 5]
    with pytest.raises(ValueError, match=r"^eagle.feature_layers \[-1, 0, 1\] has negative ids: 0 = embeddings"):
        check_feature_layers([-1, 0, 1], None, "eagle.feature_layers")


def test_a_capture_holds_the_last_forward_and_leaves_no_hooks(tiny_llama):
    model, _ = tiny_llama
    ids = torch.randint(4, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    blocks, norm = decoder_layers(model), final_norm(model)
    assert num_layers(model) == 2 and blocks is model.model.layers and norm is model.model.norm

    def hooks():
        return sum(len(b._forward_pre_hooks) for b in blocks), len(norm._forward_hooks)

    before = hooks()
    with FeatureCapture(model, [1, 2]) as cap:
        assert hooks() == (before[0] + 1, before[1] + 1)  # one hook per layer asked for
        with pytest.raises(RuntimeError, match=r"no features captured for layers \[1, 2\]: run a forward inside"):
            cap.pop()
        with torch.no_grad():
            model(ids)
            model(ids[:, :4])  # each forward replaces the previous capture
        assert cap.pop().shape == (1, 4, 2 * 64)
        with pytest.raises(RuntimeError):  # pop clears the capture
            cap.pop()
    assert hooks() == before
    feats, logits = capture_features(model, ids, [2], with_logits=True)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(model.lm_head(feats), logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(capture_features(model, ids, [2]), feats, rtol=0, atol=0)  # the decoder alone


def test_other_architectures_and_models_without_layers():
    gpt2, _ = build_tiny_target("gpt2")
    assert decoder_layers(gpt2) is gpt2.transformer.h and final_norm(gpt2) is gpt2.transformer.ln_f
    with pytest.raises(ValueError, match=r"^cannot find the decoder layers of Linear: headway reads features from "
                                         r"models whose decoder keeps them in .layers or .h"):
        decoder_layers(torch.nn.Linear(2, 2))
    normless, _ = build_tiny_target("llama")
    del normless.model.norm
    with pytest.raises(ValueError, match=r"^cannot find the final norm of LlamaForCausalLM; feature layer 2 \(after "
                                         r"the final norm\) is not available for it$"):
        with FeatureCapture(normless, [0, 2]):
            pass
