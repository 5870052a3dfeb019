"""The target's KV cache across rounds: compaction keeps exactly the accepted path (the next forward
sees prompt + path only), crops roll back, and caches that cannot be compacted are refused."""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from headway.inference.kv_cache import (BufferLayer, arena_of, check_compactable, compact_cache, compact_rows, crop_to,
                                        new_cache, select_rows, step_mask)
from headway.inference.tree import load_tree, node_path
from headway.inference.target_forward import tree_forward
from tests.inference.spec_utils import causal_logits, prefilled


@pytest.mark.parametrize("keep_leaf", [3, 14])
def test_compaction_leaks_nothing(family_model, keep_leaf):
    model = family_model
    tree = load_tree("tree-15")
    prompt, nodes, cache = prefilled(model, tree, prompt_len=7, seed=1)
    with torch.no_grad():
        tree_forward(model, cache, tree, nodes, prefix_len=6)
        path = node_path(tree.parents, keep_leaf)
        compact_cache(cache, 6, path, tree.size)
        assert cache.get_seq_length() == 6 + len(path)
        # the next forward (two tokens) sees exactly prompt + accepted path
        nxt = torch.tensor([11, 12])
        out = model(input_ids=nxt[None], position_ids=torch.arange(6 + len(path), 8 + len(path))[None],
                    cache=cache, use_cache=True).logits[0]
    fresh = causal_logits(model, torch.cat([prompt[:-1], nodes[path], nxt]))[-2:]
    torch.testing.assert_close(out, fresh, rtol=0, atol=1e-10)


def test_sliding_window_cache_refused():
    from transformers import DynamicCache, MistralConfig

    cfg = MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, sliding_window=16)
    with pytest.raises(ValueError, match="sliding"):
        check_compactable(DynamicCache(config=cfg))


def _filled(model, length: int, buffers: bool = True):
    """A new cache (of ``BufferLayer``s, or transformers' own ``DynamicCache``) after one forward over ``length``
    tokens, and a copy of every layer's keys and values."""
    cache = new_cache(model) if buffers else DynamicCache(config=model.config)
    ids = torch.arange(4, 4 + length)[None]
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return cache, [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_new_cache_is_an_empty_compactable_dynamic_cache(tiny_llama):
    model, _ = tiny_llama
    cache = new_cache(model)
    assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 0
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(type(layer) is BufferLayer and isinstance(layer, DynamicLayer) for layer in cache.layers)


def test_buffer_layers_are_written_in_place_and_act_as_dynamic_layers(family_model):
    """A BufferLayer cache gives the logits a DynamicLayer cache gives through prefill, decoding past its capacity
    (it grows), crop, compaction, a batch row dropped and a tensor assigned; its forwards write into one buffer."""
    model = family_model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 14), generator=g)
    caches = [DynamicCache(config=model.config), new_cache(model, capacity=8)]
    outs = []
    with torch.no_grad():
        for cache in caches:
            got = [model(input_ids=ids[:, :6], cache=cache, use_cache=True).logits]
            buffer = cache.layers[0]._buf["keys"] if isinstance(cache.layers[0], BufferLayer) else None
            got.append(model(input_ids=ids[:, 6:8], cache=cache, use_cache=True).logits)
            if buffer is not None:  # written in place: the same storage, no concatenation
                assert cache.layers[0]._buf["keys"].data_ptr() == buffer.data_ptr()
            got.append(model(input_ids=ids[:, 8:12], cache=cache, use_cache=True).logits)  # past capacity 8: grows
            cache.crop(-3)  # keys and values both lose 3 (transformers assigns them one after the other)
            assert cache.get_seq_length() == 9 and cache.layers[0].values.shape[2] == 9
            compact_cache(cache, 5, [1, 3], 4)  # keep entries 6 and 8 after the first 5
            pos = torch.tensor([[7, 8]]).expand(2, -1)
            got.append(model(input_ids=ids[:, 12:14], position_ids=pos, cache=cache, use_cache=True).logits)
            cache.batch_select_indices(torch.tensor([1]))  # a row leaves the batch
            got.append(model(input_ids=ids[1:, :1], position_ids=torch.tensor([[9]]), cache=cache, use_cache=True).logits)
            for layer in cache.layers:  # a tensor assigned (a repack) is copied in
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
            got.append(model(input_ids=ids[1:, 1:2], position_ids=torch.tensor([[10]]), cache=cache, use_cache=True).logits)
            outs.append(got)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_buffer_layer_crop_moves_its_lengths_as_a_dynamic_layer_crops(tiny_llama):
    """crop(-n) keeps the buffer and drops n slots (all of them when n is past the length), as DynamicLayer's
    slicing does; crop(0) changes nothing and a positive count is refused as transformers refuses it."""
    model, _ = tiny_llama
    ids = torch.arange(3, 13)[None]
    caches = [DynamicCache(config=model.config), new_cache(model, capacity=32)]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids, cache=cache, use_cache=True)
    layer, plain = caches[1].layers[0], caches[0].layers[0]
    storage = layer._buf["values"].data_ptr()
    for n in (0, -4, -100):
        for cache in caches:
            cache.crop(n)
        assert layer.keys.shape == plain.keys.shape and layer.values.shape == plain.values.shape
        assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)
    assert layer._buf["values"].data_ptr() == storage
    with pytest.raises(ValueError, match="positive"):
        layer.crop(2)


def test_buffer_layer_length_is_read_without_views(tiny_llama, monkeypatch):
    """get_seq_length answers as DynamicLayer's (empty, written, cropped, compacted, reset, reused) without making
    a view of its buffers (transformers' reads keys twice: a model asks every pass, LayerSkip per early layer)."""
    model, _ = tiny_llama
    caches = [DynamicCache(config=model.config), new_cache(model, capacity=32)]
    layer = caches[1].layers[0]
    views = []
    view = BufferLayer._view
    monkeypatch.setattr(BufferLayer, "_view", lambda self, name: views.append(name) or view(self, name))

    def same():
        views.clear()
        assert caches[1].get_seq_length() == caches[0].get_seq_length()
        assert layer.get_seq_length() == caches[0].layers[0].get_seq_length()
        return not views or layer._buf["keys"] is None  # no view once the layer has its buffer

    assert same()
    with torch.no_grad():
        for ids in (torch.arange(3, 13)[None], torch.arange(20, 25)[None]):
            for cache in caches:
                model(input_ids=ids, past_key_values=cache, use_cache=True)
            assert same()
    for cache in caches:
        cache.crop(-6)
    assert same() and caches[1].get_seq_length() == 9
    compact_cache(caches[1], 4, [0, 2, 3], 5)
    for layer_ in caches[0].layers:  # the same entries kept by hand
        keep = torch.tensor([0, 1, 2, 3, 4, 6, 7])
        layer_.keys, layer_.values = layer_.keys[:, :, keep], layer_.values[:, :, keep]
    assert same() and caches[1].get_seq_length() == 7
    for cache in caches:
        cache.reset()
    assert same()


@pytest.mark.parametrize("buffers", [True, False])
@pytest.mark.parametrize("keep", [[0, 2, 5], [1, 3], [0, 1, 2], [0, 1, 2, 3, 4, 5], [0, 1, 4, 5], [2]])
def test_compact_cache_keeps_exactly_the_kept_entries(tiny_llama, keep, buffers):
    """After the first 4 entries only the entries at offsets ``keep`` of the 6 written stay, in order (the ones
    already in place are left where they are, the rest gathered down), in headway's buffers and in plain
    dynamic layers."""
    model, _ = tiny_llama
    cache, before = _filled(model, 10, buffers)
    compact_cache(cache, 4, keep, 6)
    assert cache.get_seq_length() == 4 + len(keep)
    rows = list(range(4)) + [4 + k for k in keep]
    for layer, (keys, values) in zip(cache.layers, before):
        assert layer.keys.shape[2] == len(rows)
        assert torch.equal(layer.keys, keys[:, :, rows]) and torch.equal(layer.values, values[:, :, rows])


class _Counted(torch.overrides.TorchFunctionMode):
    """Counts the tensor calls made under it by name."""

    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def test_one_arena_holds_every_layer_and_compacts_them_at_once(tiny_llama):
    """Every layer's keys and values are slices of one tensor, written in place through a growth past the capacity;
    a compaction gathers all layers in one call (not two per layer) and keeps exactly the kept entries."""
    model, _ = tiny_llama
    cache = new_cache(model, capacity=8)
    with torch.no_grad():
        model(input_ids=torch.arange(4, 10)[None], cache=cache, use_cache=True)
        data = arena_of(cache)
        assert data is not None and data.shape[0] == 2 * len(cache.layers) and data.shape[3] == 8
        model(input_ids=torch.arange(10, 14)[None], cache=cache, use_cache=True)  # 10 slots: the arena grows
    data = arena_of(cache)
    assert data is not None and data.shape[3] >= 10
    for i, layer in enumerate(cache.layers):  # views of the one tensor: layer i's keys at 2i, values at 2i + 1
        assert layer.keys.data_ptr() == data[2 * i].data_ptr() and layer.values.data_ptr() == data[2 * i + 1].data_ptr()
    fresh = DynamicCache(config=model.config)
    with torch.no_grad():  # the entries written before the growth survived it
        model(input_ids=torch.arange(4, 10)[None], cache=fresh, use_cache=True)
        model(input_ids=torch.arange(10, 14)[None], cache=fresh, use_cache=True)
    for layer, want in zip(cache.layers, fresh.layers):
        assert torch.equal(layer.keys, want.keys) and torch.equal(layer.values, want.values)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with _Counted() as counted:
        compact_cache(cache, 4, [0, 2, 5], 6)
    assert counted.calls.get("index_select") == 1
    rows = [0, 1, 2, 3, 4, 6, 9]
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys[:, :, rows]) and torch.equal(layer.values, values[:, :, rows])


def test_a_layer_given_another_batch_leaves_the_arena_and_compacts_alone(family_model):
    """A row dropped from the batch (transformers' ``batch_select_indices``) gives each layer a buffer of its own:
    compaction then goes layer by layer and still keeps exactly the kept entries."""
    model = family_model
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.arange(4, 14).reshape(2, 5).repeat(1, 2), cache=cache, use_cache=True)
    assert arena_of(cache) is not None
    cache.batch_select_indices(torch.tensor([1]))
    assert arena_of(cache) is None
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with _Counted() as counted:
        compact_cache(cache, 4, [1, 3], 6)
    assert counted.calls.get("index_select") == 2 * len(cache.layers)
    for layer, (keys, values) in zip(cache.layers, before):
        assert torch.equal(layer.keys, keys[:, :, [0, 1, 2, 3, 5, 7]])
        assert torch.equal(layer.values, values[:, :, [0, 1, 2, 3, 5, 7]])


def test_keys_and_values_of_different_widths_keep_their_own_buffers():
    """Multi-head latent attention (DeepSeek-V3) caches values narrower than keys: such a layer stays out of the
    arena, and the cache computes what transformers' own does."""
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    cfg = DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=2,
                           num_experts_per_tok=1, first_k_dense_replace=2, n_shared_experts=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.arange(1, 9)[None]
    ref, cache = DynamicCache(config=cfg), new_cache(model, capacity=4)
    with torch.no_grad():
        for part in (ids[:, :6], ids[:, 6:]):  # past the capacity: the own buffers grow
            want = model(input_ids=part, cache=ref, use_cache=True).logits
            assert torch.equal(model(input_ids=part, cache=cache, use_cache=True).logits, want)
    assert arena_of(cache) is None and cache.layers[0].keys.shape[-1] != cache.layers[0].values.shape[-1]
    compact_cache(cache, 2, [0, 3, 5], 6)
    for layer, plain in zip(cache.layers, ref.layers):
        assert torch.equal(layer.keys, plain.keys[:, :, [0, 1, 2, 5, 7]])
        assert torch.equal(layer.values, plain.values[:, :, [0, 1, 2, 5, 7]])


def test_a_copied_or_pickled_cache_compacts_its_own_buffers(tiny_llama):
    """pickle and deepcopy give layers with buffers of their own (no arena): compacting the copy changes its own
    entries, exactly, and not the original's."""
    import copy
    import pickle

    model, _ = tiny_llama
    cache = new_cache(model, capacity=8)
    with torch.no_grad():
        model(input_ids=torch.arange(4, 14)[None], cache=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    for twin in (pickle.loads(pickle.dumps(cache)), copy.deepcopy(cache)):
        assert arena_of(twin) is None
        compact_cache(twin, 2, [0, 3, 5], 8)
        for layer, (keys, values) in zip(twin.layers, before):
            assert torch.equal(layer.keys, keys[:, :, [0, 1, 2, 5, 7]])
            assert torch.equal(layer.values, values[:, :, [0, 1, 2, 5, 7]])
    assert arena_of(cache) is not None and all(torch.equal(layer.keys, keys) for layer, (keys, _) in
                                               zip(cache.layers, before))
    alone = pickle.loads(pickle.dumps(cache))  # no arena: each buffer pickled alone, not the arena's storage each
    assert len(pickle.dumps(cache)) <= len(pickle.dumps(alone)) * 1.05


def test_the_arena_is_freed_once_every_layer_left_it(family_model):
    """Rows leaving the batch give every layer buffers of its own: the arena's tensor (every layer at the old batch)
    is not kept alive by it."""
    model = family_model
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.arange(4, 24).reshape(4, 5), cache=cache, use_cache=True)
    arena = cache.layers[0].arena
    assert arena.data is not None
    cache.batch_select_indices(torch.tensor([2]))
    assert arena.data is None and arena_of(cache) is None and cache.layers[0].keys.shape[0] == 1


def test_select_rows_keeps_the_arena_and_what_batch_select_keeps(family_model):
    """The rows a batch keeps, through the arena in one gather: the same entries as transformers'
    ``batch_select_indices`` on its own cache, the layers still in one (smaller) arena, later forwards the same."""
    model = family_model
    ids = torch.arange(4, 28).reshape(4, 6)
    ref, cache = DynamicCache(config=model.config), new_cache(model, capacity=16)
    with torch.no_grad():
        for c in (ref, cache):
            model(input_ids=ids, cache=c, use_cache=True)
        index = torch.tensor([3, 1])
        ref.batch_select_indices(index)
        with _Counted() as counted:
            select_rows(cache, index)
        assert counted.calls.get("index_select") == 1
        data = arena_of(cache)
        assert data is not None and data.shape[1] == 2 and data.shape[3] == 16
        for layer, plain in zip(cache.layers, ref.layers):
            assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)
        nxt = torch.tensor([[5], [6]])
        want = model(input_ids=nxt, cache=ref, use_cache=True).logits
        assert torch.equal(model(input_ids=nxt, cache=cache, use_cache=True).logits, want)
    plain = new_cache(model)  # not in an arena (a copy): transformers' own selection
    with torch.no_grad():
        model(input_ids=ids, cache=plain, use_cache=True)
    import copy

    twin = copy.deepcopy(plain)
    select_rows(twin, index)
    assert twin.layers[0].keys.shape[0] == 2 and torch.equal(twin.layers[0].keys, plain.layers[0].keys[[3, 1]])


def test_a_cache_that_needs_gradients_stays_out_of_the_arena(tiny_llama):
    """Outside the runtime's no_grad a forward's keys need gradients: shared storage would make one layer's write
    invalidate another's saved tensors, so such layers keep their own buffers and backward works."""
    model, _ = tiny_llama
    cache = new_cache(model)
    logits = model(input_ids=torch.arange(4, 10)[None], cache=cache, use_cache=True).logits
    logits = model(input_ids=torch.arange(10, 12)[None], cache=cache, use_cache=True).logits
    logits.sum().backward()
    assert arena_of(cache) is None
    model.zero_grad(set_to_none=True)


def test_compact_rows_gathers_every_layer_at_once(tiny_llama):
    """A batch's per-row paths, through the arena in one gather: each row's kept entries, in order."""
    model, _ = tiny_llama
    cache = new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.arange(4, 24).reshape(2, 10), cache=cache, use_cache=True)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    with _Counted() as counted:
        assert compact_rows(cache, 4, [[0, 2, 5], [1]], 6) == 3
    assert counted.calls.get("gather") == 1
    for layer, (keys, values) in zip(cache.layers, before):
        for r, keep in enumerate([[0, 2, 5], [1, 0, 0]]):  # a shorter row repeats slot ``start`` (masked out)
            rows = [0, 1, 2, 3] + [4 + k for k in keep]
            assert torch.equal(layer.keys[r], keys[r][:, rows]) and torch.equal(layer.values[r], values[r][:, rows])


def test_crop_to_drops_the_entries_after_the_context(tiny_llama):
    model, _ = tiny_llama
    cache, before = _filled(model, 9)
    crop_to(cache, 6)
    assert cache.get_seq_length() == 6
    assert all(torch.equal(layer.keys, keys[:, :, :6]) and torch.equal(layer.values, values[:, :, :6])
               for layer, (keys, values) in zip(cache.layers, before))
    crop_to(cache, 8)  # already shorter: unchanged
    assert cache.get_seq_length() == 6


def test_step_mask_hides_each_rows_holes_and_shows_its_chain():
    valid = torch.tensor([[False, True, True], [True, False, True]])  # [B=2, S=3]: row 0 left-padded, row 1 a hole
    mask = step_mask(valid, 2, torch.float64)  # [2, 1, 1, 5]
    low = torch.finfo(torch.float64).min
    assert mask.shape == (2, 1, 1, 5) and mask.dtype == torch.float64
    assert mask[:, 0, 0].tolist() == [[low, 0, 0, 0, 0], [0, low, 0, 0, 0]]
