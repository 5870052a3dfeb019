"""The verification cost curve t(k)/t(1): measured once per setup and cached under its fingerprint, read
between and past the measured widths, and corrected online by the passes generation times."""

import json
import warnings

import pytest
import torch

from headway.inference import MedusaProposer
from headway.inference import cost_curve as cc
from headway.inference.auto import AutoTree
from headway.inference.proposer import Draft
from headway.inference.tree import Tree
from tests.inference.spec_utils import made_up_curve, tiny_vocab_model


@pytest.fixture(scope="module")
def target():
    return tiny_vocab_model(0)


def test_the_cost_curve_is_measured_once_and_never_taken_from_another_setup(target, tmp_path, monkeypatch):
    path = tmp_path / "curve.json"
    measured = cc.load_cost_curve(target, path=path)
    assert path.is_file() and measured.ks[0] == 1 and measured.rel(1, 50) == pytest.approx(1.0)
    assert all(len(row) == len(measured.ks) for row in measured.chain + measured.tree)
    monkeypatch.setattr(cc, "measure", lambda t: (_ for _ in ()).throw(AssertionError("measured again")))
    assert cc.load_cost_curve(target, path=path, recheck=False) == measured  # from the file
    data = json.loads(path.read_text())
    data["fingerprint"]["dtype"] = "torch.bfloat16"
    path.write_text(json.dumps(data))
    with pytest.raises(AssertionError, match="measured again"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cc.load_cost_curve(target, path=path)
    assert any("measured for another setup (dtype" in str(w.message) for w in seen)
    with pytest.raises(AssertionError, match="measured again"):
        cc.load_cost_curve(target, path=path.with_name("other.json"), refresh=True)
    assert MedusaProposer  # exported


def test_online_correction_replaces_a_wrong_curve_with_the_timed_passes():
    """The curve claims every width costs one step; generation times one-token passes at 0.5 s and
    four-token passes at 1 s: within a few rounds t(4)/t(1) reads about 2, and a draft worth 1.6
    tokens is no longer verified."""
    online = cc.OnlineCost(made_up_curve(0.0))
    assert online.rel(4, 10) == pytest.approx(1.0)
    for _ in range(20):
        online.observe(1, 10, True, 0.5)
        online.observe(4, 10, False, 1.0)
    assert online.rel(4, 10) == pytest.approx(2.0, rel=0.1) and online.plain_passes() > 4
    auto = AutoTree(made_up_curve(0.0))
    auto.cost = online
    draft = Draft(Tree([-1, 0, 0, 1]), torch.tensor([9, 1, 2, 3]), scores=[1.0, 0.4, 0.1, 0.1])
    assert auto.select(draft, 10).tree.size == 1  # 1.6 tokens for 2 steps: a plain step


def test_the_curve_times_a_one_token_step_as_t1(target, monkeypatch):
    """t(k) is a pass over k tokens, t(1) one token (not a one-token chain below the root: two)."""
    import time

    def fake_forward(target, cache, tree, tokens, prefix_len, **kwargs):
        assert tokens.shape[0] == tree.size
        time.sleep(0.003 * tree.size)  # a pass costing its width

    monkeypatch.setattr(cc, "tree_forward", fake_forward)
    measured = cc.measure(target, ks=(1, 2, 4), prefixes=(8,), reps=3)
    assert measured.rel(2, 8, True) == pytest.approx(2.0, rel=0.25)
    assert measured.rel(4, 8, True) == pytest.approx(4.0, rel=0.25) and measured.rel(4, 8) == pytest.approx(4.0, rel=0.25)


def two_band_curve() -> cc.CostCurve:
    """Widths 1, 2, 4, 8 after 100 and 1,000 tokens; trees cost more than chains, the long band more."""
    return cc.CostCurve(ks=[1, 2, 4, 8], prefixes=[100, 1000], t1=[0.01, 0.02],
                        chain=[[1.0, 1.2, 1.6, 2.4], [1.0, 1.5, 2.5, 4.5]],
                        tree=[[1.0, 1.4, 2.0, 3.0], [1.0, 2.0, 3.0, 5.0]], fingerprint={})


def test_rel_reads_the_nearest_band_and_interpolates_between_widths():
    curve = two_band_curve()
    assert curve.rel(4, 100) == 2.0 and curve.rel(4, 100, is_chain=True) == 1.6
    assert curve.rel(4, 400) == 2.0 and curve.rel(4, 700) == 3.0  # the nearest band
    assert curve.rel(3, 100) == pytest.approx(1.7) and curve.rel(6, 100, True) == pytest.approx(2.0)  # linear
    assert curve.rel(16, 100) == pytest.approx(5.0) and curve.rel(12, 1000, True) == pytest.approx(6.5)  # extrapolated
    assert curve.rel(1, 100) == 1.0 and curve.rel(0, 1000) == 1.0  # the first width, and below it
    assert curve.seconds(90) == 0.01 and curve.seconds(5000) == 0.02


def test_online_cost_starts_from_the_curve_and_corrects_each_band_of_widths():
    online = cc.OnlineCost(two_band_curve())
    assert online.seconds(4, 100) == pytest.approx(0.01 * 2.0) and online.rel(4, 100) == pytest.approx(2.0)
    assert online.measured(4, 100, True) == pytest.approx(0.01 * 1.6)
    online.observe(3, 100, False, 0.0)  # no time: ignored
    assert online.factor(3) == 1.0 and online.weight == [0.0] * 6
    online.observe(3, 100, False, 2 * online.measured(3, 100))  # twice as slow as the curve says
    assert online.factor(3) == pytest.approx(2.0 ** (1 / 3)) == online.factor(2) == online.factor(4)  # prior 2 passes
    assert online.factor(5) == online.factor(1) == 1.0  # other bands untouched
    assert online.rel(3, 100) == pytest.approx(1.7 * 2.0 ** (1 / 3)) and online.plain_passes() == 0.0


def test_binary_tree_hangs_node_i_below_node_i_minus_1_over_2():
    tree = cc.binary_tree(7)
    assert tree.parents == [-1, 0, 0, 1, 1, 2, 2] and tree.name == "binary-7" and not tree.is_chain
    assert cc.binary_tree(1).size == 1


def test_the_cache_file_is_named_by_the_fingerprint(target, tmp_path):
    fp = cc.fingerprint(target)
    assert fp["dtype"] == "torch.float64" and fp["device"] == "cpu" and fp["vocab_size"] == 8
    assert fp["format"] == cc.FORMAT and fp["threads"] == torch.get_num_threads() and fp["packed"] is False
    path = cc.cache_path(target, tmp_path)
    assert path.parent == tmp_path and path.suffix == ".json" and len(path.stem) == 20
    assert cc.cache_path(target, tmp_path) == path  # stable
    assert cc.cache_path(tiny_vocab_model(0, dtype=torch.float32), tmp_path) != path  # another dtype, another file
    from headway.heads.target import headway_cache_dir

    assert cc.cache_path(target) == headway_cache_dir() / "cost_curves" / path.name


def test_an_unreadable_or_refreshed_curve_is_measured_again(target, tmp_path, monkeypatch):
    made = made_up_curve(0.2)
    calls = []
    monkeypatch.setattr(cc, "measure", lambda t: calls.append(t) or made)
    path = tmp_path / "curve.json"
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable; measuring it again"):
        assert cc.load_cost_curve(target, path=path) == made
    assert calls == [target] and cc.CostCurve(**json.loads(path.read_text())) == made  # saved
    assert cc.load_cost_curve(target, path=path, refresh=True) == made and len(calls) == 2


def test_a_curve_measured_on_a_busier_machine_is_measured_again(target, tmp_path, monkeypatch):
    """Each load times a few one-token steps: a cached t(1) at least STALE_RATIO times today's was measured under
    load (its wide passes look cheap) and is measured again; one measured on a quieter machine than today's stays
    (today's load is the online correction's business)."""
    path = tmp_path / "curve.json"
    measured = cc.load_cost_curve(target, path=path, recheck=False)
    today = cc.seconds_per_pass([target], cc.chain(0), torch.zeros(1, measured.prefixes[0], dtype=torch.long), 5)[0]
    fresh = made_up_curve(0.3)
    monkeypatch.setattr(cc, "measure", lambda t: fresh)
    data = json.loads(path.read_text())
    data["t1"] = [today / 10] * len(data["t1"])  # measured on a machine ten times quieter: kept
    path.write_text(json.dumps(data))
    monkeypatch.setattr(cc, "_CHECKED", set())
    assert cc.load_cost_curve(target, path=path).t1 == data["t1"]
    data["t1"] = [today * 20] * len(data["t1"])  # twenty times busier: a process already checked it keeps it,
    path.write_text(json.dumps(data))
    assert cc.load_cost_curve(target, path=path).t1 == data["t1"]
    monkeypatch.setattr(cc, "_CHECKED", set())  # a new process measures it again, and saves it
    with pytest.warns(UserWarning, match=r"measured on a busier machine \(a one-token step after \d+ tokens took"):
        assert cc.load_cost_curve(target, path=path) == fresh
    assert cc.CostCurve(**json.loads(path.read_text())) == fresh


def test_differs_names_the_first_three_changed_keys():
    old = {"a": 1, "b": 2, "c": 3, "d": 4, "e": 5}
    new = {"a": 1, "b": 9, "c": 8, "d": 7, "f": 6}
    assert cc._differs(old, new) == "b 2 vs 9, c 3 vs 8, d 4 vs 7"
    assert cc._differs({"x": 1}, {}) == "x 1 vs None"
