"""The Medusa layouts (headway.heads.formats.medusa): official FasterDecoding v0.1, TGI's version 2 and vLLM's
MedusaModel, each as FORMATS.md lists it, computed as their readers compute it, round trips, and refusals."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from headway.heads import load_drafter
from headway.heads.formats.convert import convert, detect_format, export_any, load_any
from headway.heads.formats.medusa import read_medusa_pt
from tests.heads.formats.helpers import (DRAFT_IDS, PROMPT, H, V, file_names, generate, medusa_heads, medusa_logits,
                                         noisy, one_line, saved, same_tensors)

# --- round trips: headway -> FORMAT -> headway ------------------------------------------------------

MEDUSA_CASES = {
    "v0.1": ("medusa-v0.1", {}),
    "v2": ("medusa-v2", {"share_lm_head": True}),
    "vllm": ("vllm-medusa", {"num_layers": 2}),
    "vllm-no-blocks": ("vllm-medusa", {"num_layers": 0}),
    "vllm-reduced": ("vllm-medusa", {"draft_vocab_size": 40, "draft_tokens": DRAFT_IDS}),
    "vllm-shared": ("vllm-medusa", {"share_lm_head": True}),
    "vllm-shared-reduced": ("vllm-medusa", {"share_lm_head": True, "draft_vocab_size": 40, "draft_tokens": DRAFT_IDS}),
}


@pytest.mark.parametrize("case", list(MEDUSA_CASES))
def test_medusa_round_trip_bit_exact(tiny_llama, tmp_path, case):
    target, _ = tiny_llama
    fmt, kw = MEDUSA_CASES[case]
    heads = medusa_heads(target, **kw)
    mid = convert(saved(heads, tmp_path / "src"), tmp_path / "mid", fmt, target=target)
    assert detect_format(mid) == fmt
    back = convert(mid, tmp_path / "back", "headway", target=target)
    assert detect_format(back) == "headway" and file_names(back) == ["README.md", "config.json", "model.safetensors"]
    again = load_drafter(back)
    assert again.config == heads.config
    same_tensors(again, heads)
    assert torch.equal(medusa_logits(target, again), medusa_logits(target, heads))
    # generation with the converted drafter is the original's, round by round
    assert generate(target, load_any(mid, target=target)) == generate(target, heads)


def test_shared_heads_in_v01_carry_copies_of_the_target_lm_head(tiny_llama, tmp_path):
    target, _ = tiny_llama
    target.save_pretrained(tmp_path / "target")  # the target as a folder: loaded for its lm_head
    heads = medusa_heads(target, share_lm_head=True)
    back = load_any(convert(saved(heads, tmp_path / "src"), tmp_path / "v01", "medusa-v0.1",
                            target=str(tmp_path / "target")))
    assert back.config.share_lm_head is False  # v0.1 stores a projection per head
    for k in range(3):
        assert torch.equal(back.lm_heads[k].weight, target.lm_head.weight)
        assert torch.equal(back.blocks[k][0].linear.weight, heads.blocks[k][0].linear.weight)
    assert torch.equal(medusa_logits(target, back), medusa_logits(target, heads))
    assert generate(target, back) == generate(target, heads)


def test_own_lm_heads_equal_to_the_target_fit_v2(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = medusa_heads(target, noisy_lm_heads=False)  # trained blocks, projections still the target's lm_head
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "v2", "medusa-v2", target=target)
    back = load_any(out)
    assert back.config.share_lm_head is True and back.config.vocab_size == V
    assert torch.equal(medusa_logits(target, back), medusa_logits(target, heads))


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
def test_vllm_shared_projection_without_a_target_becomes_copies(request, tmp_path, family):
    target, _ = request.getfixturevalue(family)
    heads = medusa_heads(target, share_lm_head=True, draft_vocab_size=40, draft_tokens=DRAFT_IDS)
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "vllm", "vllm-medusa", target=target)
    back = load_any(out)  # nothing to compare original_lm_head with: each head keeps the stored projection
    assert back.config.share_lm_head is False and back.config.draft_vocab_size == 40
    for k in range(3):
        assert torch.equal(back.lm_heads[k].weight, target.lm_head.weight[DRAFT_IDS])
    assert torch.equal(medusa_logits(target, back), medusa_logits(target, heads))
    assert generate(target, back) == generate(target, heads)


@pytest.mark.parametrize("fmt", ["medusa-v0.1", "medusa-v2", "vllm-medusa"])
def test_bfloat16_round_trip_keeps_dtype(tiny_llama, tmp_path, fmt):
    target, _ = tiny_llama
    heads = medusa_heads(target, share_lm_head=fmt == "medusa-v2").to(torch.bfloat16)
    out = export_any(heads, tmp_path / "out", fmt, target=target)
    back = load_any(out)
    assert back.blocks[0][0].linear.weight.dtype == torch.bfloat16
    same_tensors(back, heads)


# --- each layout as FORMATS.md lists it -------------------------------------------------------------

def test_medusa_v01_layout(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = medusa_heads(target, num_layers=2)
    heads.config.base_model_name_or_path = "org/target"
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "v01", "medusa-v0.1", allow_official_misread=True)
    assert file_names(out) == ["config.json", "medusa_lm_head.pt"]
    config = json.loads((out / "config.json").read_text())
    assert config == {"medusa_num_heads": 3, "medusa_num_layers": 2, "base_model_name_or_path": "org/target"}
    tensors = torch.load(out / "medusa_lm_head.pt", map_location="cpu", weights_only=True)
    assert type(tensors) is dict
    expected = {}
    for i in range(3):
        for j in range(2):
            expected |= {f"{i}.{j}.linear.weight": (H, H), f"{i}.{j}.linear.bias": (H,)}
        expected[f"{i}.2.weight"] = (V, H)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert torch.equal(tensors["1.1.linear.weight"], heads.blocks[1][1].linear.weight)
    assert torch.equal(tensors["2.2.weight"], heads.lm_heads[2].weight)


def _official_medusa_logits(folder, x):
    """[heads, ..., V] logits of a medusa-v0.1 folder as FasterDecoding/Medusa computes them (FORMATS.md):
    each head is ``nn.Sequential(*([ResBlock(H)] * medusa_num_layers), nn.Linear(H, V, bias=False))``, one
    ResBlock object repeated, loaded from medusa_lm_head.pt with ``strict=False``."""
    class ResBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(H, H)

        def forward(self, h):
            return h + nn.functional.silu(self.linear(h))

    config = json.loads((folder / "config.json").read_text())
    heads = nn.ModuleList([nn.Sequential(*([ResBlock()] * config["medusa_num_layers"]), nn.Linear(H, V, bias=False))
                           for _ in range(config["medusa_num_heads"])])
    heads.load_state_dict(read_medusa_pt(folder / "medusa_lm_head.pt"), strict=False)
    with torch.no_grad():
        return torch.stack([head(x) for head in heads])


def test_medusa_v01_is_refused_where_the_official_code_would_compute_it_wrongly(tiny_llama, tmp_path):
    target, _ = tiny_llama
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    one = medusa_heads(target)
    out = convert(saved(one, tmp_path / "one"), tmp_path / "v01-one", "medusa-v0.1")
    with torch.no_grad():
        expected = torch.stack([one.lm_heads[k](one.blocks[k](x)) for k in range(3)])
    assert torch.allclose(_official_medusa_logits(out, x), expected, atol=1e-6)
    deep = saved(medusa_heads(target, num_layers=2), tmp_path / "deep")
    with pytest.raises(ValueError, match=r"2 ResBlocks each, but the official Medusa code .* one ResBlock object "
                                         r"repeated .*\(--allow-official-misread\)") as err:
        convert(deep, tmp_path / "v01-deep", "medusa-v0.1")
    one_line(err)
    assert not (tmp_path / "v01-deep").exists()
    out = convert(deep, tmp_path / "v01-deep", "medusa-v0.1", allow_official_misread=True)  # what the flag writes:
    heads = load_any(out)  # headway (and vLLM) read the blocks apart,
    with torch.no_grad():
        expected = torch.stack([heads.lm_heads[k](heads.blocks[k](x)) for k in range(3)])
    assert not torch.allclose(_official_medusa_logits(out, x), expected, atol=1e-3)  # the official code does not


def test_medusa_v2_layout_scores_with_the_base_lm_head(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = medusa_heads(target, share_lm_head=True)
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "v2", "medusa-v2")
    assert file_names(out) == ["config.json", "medusa_lm_head.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config == {"version": "2", "medusa_num_heads": 3, "medusa_num_layers": 1, "base_model_name_or_path": None,
                      "hidden_size": H, "vocab_size": V}
    tensors = load_file(str(out / "medusa_lm_head.safetensors"))
    assert {k: tuple(v.shape) for k, v in tensors.items()} == {
        **{f"{i}.0.linear.weight": (H, H) for i in range(3)}, **{f"{i}.0.linear.bias": (H,) for i in range(3)}}
    # TGI's MedusaHeadV2: lm_head(x + SiLU(W x + b)) with the base model's lm_head
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs = torch.stack([target.lm_head(x + nn.functional.silu(nn.functional.linear(
            x, tensors[f"{i}.0.linear.weight"], tensors[f"{i}.0.linear.bias"]))) for i in range(3)])
    assert torch.equal(theirs, medusa_logits(target, heads))


def test_vllm_medusa_layout(tiny_llama, tmp_path):
    target, _ = tiny_llama
    heads = medusa_heads(target, num_layers=2)
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "vllm", "vllm-medusa")
    assert file_names(out) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": H, "vocab_size": V,
                      "num_heads": 3, "num_hidden_layers": 2, "medusa_fc_bias": True, "torch_dtype": "float32",
                      "headway": {"base_model_name_or_path": None}}
    tensors = load_file(str(out / "model.safetensors"))
    expected = {f"lm_heads.{h}.weight": (V, H) for h in range(3)}
    for h in range(3):
        for layer in range(2):
            expected |= {f"blocks.{h}.layers.{layer}.weight": (H, H), f"blocks.{h}.layers.{layer}.bias": (H,)}
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert torch.equal(tensors["blocks.2.layers.1.bias"], heads.blocks[2][1].linear.bias)


def _vllm_logits(tensors, config, x, k):
    """vLLM's Medusa.compute_logits for head k: blocks, the head's projection, token_map scatter."""
    for j in range(config["num_hidden_layers"]):
        x = x + nn.functional.silu(nn.functional.linear(x, tensors[f"blocks.{k}.layers.{j}.weight"],
                                                        tensors[f"blocks.{k}.layers.{j}.bias"]))
    proj = tensors["lm_heads.0.weight" if config.get("original_lm_head") else f"lm_heads.{k}.weight"]
    draft = x @ proj.T
    if "token_map" not in tensors:
        return draft
    full = torch.full((*draft.shape[:-1], config["vocab_size"]), -torch.inf)
    full[..., tensors["token_map"]] = draft
    return full


@pytest.mark.parametrize("shared", [False, True])
def test_vllm_reduced_vocabulary_as_vllm_reads_it(tiny_llama, tmp_path, shared):
    target, _ = tiny_llama
    heads = medusa_heads(target, share_lm_head=shared, draft_vocab_size=40, draft_tokens=DRAFT_IDS)
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "vllm", "vllm-medusa", target=target)
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["truncated_vocab_size"] == 40 and config.get("original_lm_head", False) is shared
    assert tensors["token_map"].dtype == torch.int64 and tensors["token_map"].tolist() == DRAFT_IDS
    projections = ["lm_heads.0.weight"] if shared else [f"lm_heads.{h}.weight" for h in range(3)]
    assert sorted(k for k in tensors if k.startswith("lm_heads")) == projections
    assert all(tensors[p].shape == (40, H) for p in projections)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    mine = medusa_logits(target, heads)  # [3, 2, 5, 40] over the draft vocabulary
    for k in range(3):
        theirs = _vllm_logits(tensors, config, x, k)  # [2, 5, 218]
        assert torch.equal(theirs[..., DRAFT_IDS], mine[k])
        assert torch.equal(theirs.argmax(-1), heads.to_target_ids(mine[k].argmax(-1)))


@pytest.mark.parametrize("shared", [False, True])
def test_a_whole_vocabulary_as_draft_vocabulary_exports_unreduced(tiny_llama, tmp_path, shared):
    """draft_vocab_size == vocab_size (here with the draft ids in a shuffled order) is no reduction: every layout
    that holds the heads gets them unreduced (vLLM reads token_map only beside a smaller truncated_vocab_size and
    would take draft row i as token i), and vLLM's logits and a re-import's equal the heads' own per target id."""
    target, _ = tiny_llama
    heads = medusa_heads(target, share_lm_head=shared, draft_vocab_size=V, draft_tokens=list(range(V)))
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        heads.d2t.copy_(perm - torch.arange(V))
        if not shared:
            for proj in heads.lm_heads:
                proj.weight.copy_(proj.weight[perm])  # draft row i scores token perm[i], as before the shuffle
    heads.bind_target(target)
    mine = medusa_logits(target, heads)  # [3, 2, 5, V] in draft order
    want = torch.empty_like(mine).index_copy_(-1, perm, mine)  # by target id
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(3))
    for fmt in ["vllm-medusa", "medusa-v0.1"] + (["medusa-v2"] if shared else []):
        out = export_any(heads, tmp_path / fmt, fmt, target=target)
        if fmt == "vllm-medusa":
            config = json.loads((out / "config.json").read_text())
            tensors = load_file(str(out / "model.safetensors"))
            assert "truncated_vocab_size" not in config and "token_map" not in tensors
            for k in range(3):
                torch.testing.assert_close(_vllm_logits(tensors, config, x, k), want[k], rtol=1e-6, atol=1e-5)
        back = load_any(out, target=target)
        assert back.config.draft_vocab_size is None
        torch.testing.assert_close(medusa_logits(target, back), want, rtol=1e-6, atol=1e-5)


def test_a_corrupt_draft_vocabulary_is_refused_on_load(tiny_llama, tmp_path):
    """A headway Medusa checkpoint whose d2t maps outside the vocabulary: one line at load, not an index error in
    generate."""
    target, _ = tiny_llama
    folder = saved(medusa_heads(target, draft_vocab_size=40, draft_tokens=DRAFT_IDS), tmp_path / "src")
    state = load_file(str(folder / "model.safetensors"))
    state["d2t"] = state["d2t"] + 10_000
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="d2t are inconsistent .* re-export the drafter"):
        load_drafter(folder)


def test_an_empty_official_checkpoint_is_one_line(tmp_path):
    """A zero-byte medusa_lm_head.pt (an interrupted download): torch's EOFError has no message; the error still
    names the file and the fix."""
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1}))
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"medusa_lm_head.pt is not a readable torch checkpoint \(EOFError\); re-"):
        load_any(tmp_path)


# --- a foreign official Medusa v0.1 checkpoint ------------------------------------------------------

class OfficialResBlock(nn.Module):
    """FasterDecoding/Medusa's ResBlock, rebuilt here: x + SiLU(linear(x))."""

    def __init__(self, hidden):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        self.act = nn.SiLU()

    def forward(self, x):
        return x + self.act(self.linear(x))


def _official_v01(folder, heads=3, layers=2):
    """What the official repo writes: a transformers config and torch.save(medusa_head.state_dict()), with
    its heads as ``Sequential(*([ResBlock] * L), Linear(H, V, bias=False))`` (one block reused L times)."""
    from transformers import PretrainedConfig

    torch.manual_seed(7)
    medusa_head = nn.ModuleList(nn.Sequential(*([OfficialResBlock(H)] * layers), nn.Linear(H, V, bias=False))
                                for _ in range(heads))
    PretrainedConfig(medusa_num_heads=heads, medusa_num_layers=layers,
                     base_model_name_or_path="lmsys/vicuna-7b-v1.3").save_pretrained(folder)
    torch.save(medusa_head.state_dict(), folder / "medusa_lm_head.pt")
    return medusa_head.eval()


def test_official_v01_folder_loads(tiny_llama, tmp_path):
    target, _ = tiny_llama
    official = _official_v01(tmp_path / "official")
    assert detect_format(tmp_path / "official") == "medusa-v0.1"
    heads = load_any(tmp_path / "official", target=target)
    cfg = heads.config
    assert (cfg.num_heads, cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.share_lm_head) == (3, 2, H, V, False)
    assert cfg.base_model_name_or_path == "lmsys/vicuna-7b-v1.3"
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        assert torch.equal(heads(x), torch.stack([head(x) for head in official]))
    sequences, _ = generate(target, heads)
    assert sequences == target.generate(PROMPT, max_new_tokens=12, do_sample=False).tolist()
    # and back into the official layout: the same tensor names and values
    out = convert(tmp_path / "official", tmp_path / "again", "medusa-v0.1")
    theirs = official.state_dict()
    ours = read_medusa_pt(out / "medusa_lm_head.pt")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


class Payload:
    """A custom class: unpickling it would need the code of this module."""

    def __reduce__(self):
        return (_ran_code, ())


def _ran_code():
    raise AssertionError("unpickling ran code from the checkpoint")


def test_pickle_that_needs_code_is_refused(tmp_path):
    _official_v01(tmp_path / "official")
    torch.save({"0.0.linear.weight": Payload()}, tmp_path / "official" / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match=r"needs arbitrary code to unpickle.*weights_only=True.*Unsupported global: "
                                         r"GLOBAL .*_ran_code was not an allowed global by default\); re-save") as err:
        load_any(tmp_path / "official")
    one_line(err)
    (tmp_path / "official" / "medusa_lm_head.pt").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable torch checkpoint") as err:
        load_any(tmp_path / "official")
    one_line(err)


# --- refusals and bad input -------------------------------------------------------------------------

def test_shared_or_own_lm_heads_a_layout_cannot_hold(tiny_llama, tmp_path):
    target, _ = tiny_llama
    shared = saved(medusa_heads(target, share_lm_head=True), tmp_path / "shared")
    for fmt in ("medusa-v0.1", "vllm-medusa"):
        with pytest.raises(ValueError, match=r"share the target's lm_head .* pass the target \(--target\)") as err:
            convert(shared, tmp_path / "o", fmt)
        one_line(err)
    own = saved(medusa_heads(target), tmp_path / "own")
    with pytest.raises(ValueError, match=r"their own lm_heads; pass the target \(--target\)"):
        convert(own, tmp_path / "o", "medusa-v2")
    with pytest.raises(ValueError, match=r"lm_heads of head\(s\) \[0, 1, 2\] differ from it"):
        convert(own, tmp_path / "o", "medusa-v2", target=target)
    deep = saved(medusa_heads(target, share_lm_head=True, num_layers=2), tmp_path / "deep")
    with pytest.raises(ValueError, match="one ResBlock per head .* these heads have 2"):
        convert(deep, tmp_path / "o", "medusa-v2")


def test_foreign_files_that_do_not_match_their_config(tiny_llama, tmp_path):
    target, _ = tiny_llama
    out = convert(saved(medusa_heads(target), tmp_path / "src"), tmp_path / "vllm", "vllm-medusa")
    config_path, weights_path = out / "config.json", out / "model.safetensors"
    tensors = load_file(str(weights_path))
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "medusa_fc_bias": False}))
    with pytest.raises(ValueError, match="stores block biases but .* lacks medusa_fc_bias: true"):
        load_any(out)
    config_path.write_text(json.dumps({**config, "truncated_vocab_size": 40}))
    with pytest.raises(ValueError, match="truncated_vocab_size 40 of vocab_size 218 needs a token_map"):
        load_any(out)
    config_path.write_text(json.dumps(config))
    save_file({k: v for k, v in tensors.items() if k != "lm_heads.1.weight"}, str(weights_path))
    with pytest.raises(ValueError, match=r"missing \['lm_heads.1.weight'\], unexpected \[\]") as err:
        load_any(out)
    one_line(err)
    save_file({**tensors, "blocks.0.layers.0.bias": torch.zeros(3)}, str(weights_path))
    with pytest.raises(ValueError, match=r"wrong shapes \['blocks.0.layers.0.bias \(3,\) \(expected \(64,\)\)'\]"):
        load_any(out)
    with pytest.raises(ValueError, match="holds the 'vllm-medusa' layout but fmt='medusa-v0.1'"):
        load_any(out, "medusa-v0.1")
    # vLLM's config class also takes medusa_num_heads / medusa_num_layers
    save_file(tensors, str(weights_path))
    renamed = {k: v for k, v in config.items() if k not in ("num_heads", "num_hidden_layers")}
    config_path.write_text(json.dumps({**renamed, "medusa_num_heads": 3, "medusa_num_layers": 1}))
    assert load_any(out).config.num_heads == 3


def test_vllm_heads_without_bias_and_with_full_projections(tiny_llama, tmp_path):
    """What vLLM itself accepts: bias-free blocks (medusa_fc_bias false) and full-vocabulary lm_heads that
    token_map slices at load."""
    target, _ = tiny_llama
    heads = medusa_heads(target, draft_vocab_size=40, draft_tokens=DRAFT_IDS)
    with torch.no_grad():
        for seq in heads.blocks:
            seq[0].linear.bias.zero_()
    out = convert(saved(heads, tmp_path / "src"), tmp_path / "vllm", "vllm-medusa")
    tensors = load_file(str(out / "model.safetensors"))
    full = noisy(nn.Linear(H, V, bias=False), seed=4).weight.detach()
    full[DRAFT_IDS] = tensors["lm_heads.0.weight"]
    tensors = {k: v for k, v in tensors.items() if not k.endswith(".bias")} | {"lm_heads.0.weight": full}
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "medusa_fc_bias": False}))
    back = load_any(out)
    same_tensors(back, heads)
