"""Helpers shared by the feature-cache tests: hand-made examples and a cache of them on a tiny target."""

from headway.train.features import cache_features, feature_fingerprint

H = 64  # the tiny targets' hidden size
L = 2  # and their depth
META = {"model": "tiny-random-llama", "data": {"source": "hand-made"}}


def sample_examples(lengths=(7, 12, 5, 9, 16, 3, 11)):
    out = []
    for k, n in enumerate(lengths):
        ids = [(5 + 7 * k + 3 * i) % 200 + 4 for i in range(n)]
        out.append({"input_ids": ids, "loss_mask": [0] * min(2, n - 1) + [1] * (n - min(2, n - 1))})
    return out


def make_cache(target, out, layers=(0, 1, 2), **kw):
    model, tok = target
    kw.setdefault("fingerprint", feature_fingerprint(model, tok, list(layers)))
    return cache_features(model, kw.pop("examples", sample_examples()), out, layers=list(layers),
                          meta=kw.pop("meta", META), **kw)
