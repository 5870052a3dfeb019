"""The EAGLE decoder layer (headway.heads.eagle_layer): the drafter's own key/value cache (cached steps equal
one causal pass), the training-time test's unrolled keys (equal to what tree drafting computes), and what
each layer's attention reads."""

import pytest
import torch

from headway.heads.eagle_layer import DraftCache, Eagle3Layer, EagleLayer, TTTKeys
from headway.heads.target.features import capture_features
from tests.heads.helpers import make_head


VERSIONS = [(1, 1), (3, 1), (3, 3)]  # (version, decoder layers): EAGLE-3 also with midlayer + 2 plain layers


@pytest.mark.parametrize("version,layers", VERSIONS)
def test_cached_steps_equal_one_causal_pass(target, version, layers):
    head = make_head(target, version, num_layers=layers)
    ids = torch.randint(4, 200, (1, 12))
    hid = head.input_hidden(capture_features(target, ids, head.config.feature_layers)[:, :-1])
    pos = torch.arange(11)[None]
    full = head(ids[:, 1:], hid, pos)
    cache = DraftCache()
    parts = [head(ids[:, 1 + a:1 + b], hid[:, a:b], pos[:, a:b], cache=cache) for a, b in [(0, 4), (4, 5), (5, 11)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-12)
    assert [len(cache.layer(i)) for i in range(layers)] == [11] * layers


@pytest.mark.parametrize("version,layers", VERSIONS)
def test_extend_writes_the_context_keys_and_returns_the_last_output(target, version, layers):
    """The runtime's catch-up (only the last position runs the whole last layer) leaves the cache a full pass
    leaves, in every layer, and returns that pass's last row, after a cached prefix and from an empty cache."""
    head = make_head(target, version, num_layers=layers)
    ids = torch.randint(4, 200, (1, 12))
    hid = head.input_hidden(capture_features(target, ids, head.config.feature_layers)[:, :-1])
    pos = torch.arange(11)[None]
    for a, b in [(0, 6), (6, 11), (6, 7)]:
        full, quick = DraftCache(), DraftCache()
        for cache in (full, quick) if a else ():  # the cached prefix both start from
            head(ids[:, 1:1 + a], hid[:, :a], pos[:, :a], cache=cache)
        expect = head(ids[:, 1 + a:1 + b], hid[:, a:b], pos[:, a:b], cache=full)[:, -1:]
        got = head.extend(ids[:, 1 + a:1 + b], hid[:, a:b], pos[:, a:b], quick)
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-12)
        for i in range(layers):
            torch.testing.assert_close(quick.layer(i).keys, full.layer(i).keys, rtol=0, atol=1e-12)
            torch.testing.assert_close(quick.layer(i).values, full.layer(i).values, rtol=0, atol=1e-12)


@pytest.mark.parametrize("layers", [1, 3])
def test_training_time_test_equals_tree_drafting(target, layers):
    """Unrolled step i at position t computes exactly what a depth-i node computes at inference:
    the context entries up to t in the cache, then the chain of draft nodes below the root (every layer's)."""
    head = make_head(target, 3, num_layers=layers)
    ids = torch.randint(4, 200, (1, 14))
    feats = capture_features(target, ids, head.config.feature_layers)
    n = ids.shape[1] - 1
    hidden, pos, ttt, steps = head.input_hidden(feats[:, :-1]), torch.arange(n)[None], TTTKeys(), []
    for i in range(3):
        tok = torch.cat([ids[:, 1 + i:], ids.new_zeros((1, i))], 1)[:, :n]
        hidden = head(tok, hidden, pos + i, ttt=ttt)
        steps.append(hidden)
    for t in (3, 7, 10):
        cache = DraftCache()
        root = head(ids[:, 1:t + 2], head.input_hidden(feats[:, :t + 1]), torch.arange(t + 1)[None], cache=cache)
        torch.testing.assert_close(root[0, -1], steps[0][0, t], rtol=0, atol=1e-12)
        h = root[:, -1:]
        for i in (1, 2):  # a chain: plain causal after the cached context
            h = head(ids[:, t + 1 + i:t + 2 + i], h, torch.tensor([[t + i]]), cache=cache)
            torch.testing.assert_close(h[0, 0], steps[i][0, t], rtol=0, atol=1e-12)


def test_short_sequences_in_training_time_test(target):
    """Batches shorter than the unrolled depth: deeper steps see only padding and count nothing."""
    from headway.train.eagle_losses import eagle3_loss

    head = make_head(target, 3).float()
    for t in (2, 3, 5):
        ids = torch.randint(5, 125, (2, t))
        feats = capture_features(target, ids, [0, 1, 2]).float()
        loss, counts = eagle3_loss(head, feats, feats[..., -64:], ids, torch.ones_like(ids),
                                   head.draft_rows(target.lm_head.weight).float(), head.draft_index(), steps=7)
        loss.backward()
        assert torch.isfinite(loss) and all(int(counts[f"step{i}/count"]) == 0 for i in range(max(t - 2, 0), 7)
                                            if f"step{i}/count" in counts)


def test_the_draft_cache_appends_along_the_sequence_and_crops():
    cache = DraftCache()
    cache.crop(3)  # nothing cached: nothing to crop
    assert len(cache) == 0 and cache.keys is None
    k1, v1 = torch.arange(24.0).view(2, 1, 3, 4), -torch.arange(24.0).view(2, 1, 3, 4)  # [B, Hkv, S, D]
    keys, values = cache.append(k1, v1)
    assert torch.equal(keys, k1) and torch.equal(values, v1) and len(cache) == 3
    k2, v2 = torch.ones(2, 1, 2, 4), torch.zeros(2, 1, 2, 4)
    storage = keys.data_ptr()
    keys, values = cache.append(k2, v2)
    assert keys.data_ptr() == storage  # written in place: no concatenation copies the cache
    assert len(cache) == 5 and torch.equal(keys, torch.cat([k1, k2], 2)) and torch.equal(values, torch.cat([v1, v2], 2))
    cache.crop(4)  # roll back to 4 positions
    assert len(cache) == 4 and torch.equal(cache.keys, torch.cat([k1, k2[:, :, :1]], 2))
    cache.crop(9)  # longer than the cache: unchanged
    assert len(cache) == 4 and torch.equal(cache.values, torch.cat([v1, v2[:, :, :1]], 2))
    k3 = torch.randn(2, 1, 200, 4)
    keys, values = cache.append(k3, -k3)  # past its buffer: it grows, keeping what it held
    assert len(cache) == 204 and torch.equal(keys, torch.cat([k1, k2[:, :, :1], k3], 2))


def test_ttt_keys_hold_each_step_in_order():
    ttt = TTTKeys()
    assert len(ttt) == 0 and not ttt  # empty: step 0 attends causally, as without a training-time test
    steps = [(torch.full((1, 1, 2, 4), float(i)), torch.full((1, 1, 2, 4), -float(i))) for i in range(3)]
    for kv in steps:
        ttt.append(kv)
    assert len(ttt) == 3 and ttt and not isinstance(ttt, (list, tuple))
    assert all(ttt[i][0] is steps[i][0] and ttt[i][1] is steps[i][1] for i in range(3))


def test_what_each_layer_attention_reads(target):
    x = torch.randn(1, 4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    emb = torch.randn(1, 4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    eagle1 = make_head(target, 1).layer
    assert type(eagle1) is EagleLayer and eagle1.attention_input(x, emb) is x
    assert eagle1.self_attn.q_proj.in_features == 64
    eagle3 = make_head(target, 3).layer
    assert type(eagle3) is Eagle3Layer and eagle3.self_attn.q_proj.in_features == 128
    both = eagle3.attention_input(x, emb)  # [input_layernorm(emb); hidden_norm(x)]
    assert both.shape == (1, 4, 128)
    torch.testing.assert_close(both[..., :64], eagle3.input_layernorm(emb), rtol=0, atol=0)
    torch.testing.assert_close(both[..., 64:], eagle3.hidden_norm(x), rtol=0, atol=0)
