"""Folders an earlier headway exported still load and compute the same (tests/fixtures/compat).

Each fixture is a drafter saved by the version ``expected.json`` names (see make_fixtures.py there);
it must load through the public loaders, give the same raw outputs on the stored inputs, and make
the same drafts: replayed at the contexts the recorded rounds drafted at, each round accepts the
tokens it did then; and today's generator makes the same greedy tokens, which are also the target's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from headway.heads import EagleHead, MedusaHeads, load_drafter
from headway.heads.target.features import capture_features
from headway.heads.target.tiny import build_tiny_target
from headway.heads.eagle import Eagle1Head, Eagle3Head
from headway.inference import SpeculativeGenerator
from headway.inference.proposer import DraftContext, as_proposer
from headway.inference.tree import node_path
from headway.inference.verify import verify_greedy

FIXTURES = sorted((Path(__file__).parent / "fixtures" / "compat").glob("v*"))
CLASSES = {"medusa": MedusaHeads, "eagle1": EagleHead, "eagle3": EagleHead}
KIND_CLASSES = {"medusa": MedusaHeads, "eagle1": Eagle1Head, "eagle3": Eagle3Head}  # what each loads as today


@pytest.fixture(scope="module", params=FIXTURES, ids=[f.name for f in FIXTURES])
def release(request):
    folder = request.param
    record = json.loads((folder / "expected.json").read_text())
    spec = record["target"]
    target, _ = build_tiny_target(spec["family"], seed=spec["seed"])
    return folder, record, load_file(str(folder / "expected.safetensors")), target.to(getattr(torch, spec["dtype"]))


def test_every_drafter_kind_has_a_fixture(release):
    assert FIXTURES, "no compatibility fixtures found"
    assert set(release[1]["drafters"]) == set(CLASSES)


@torch.no_grad()
def raw_outputs(name: str, drafter, stored: dict[str, torch.Tensor]) -> torch.Tensor:
    if name == "medusa":
        return drafter(stored["input.hidden"])  # [heads, 1, 5, V]
    feats = stored["input.hidden3"] if name == "eagle3" else stored["input.hidden"]
    positions = torch.arange(feats.shape[1])[None]
    return drafter.logits(drafter(stored["input.tokens"], drafter.input_hidden(feats), positions))  # [1, 5, V']


@pytest.mark.parametrize("name", list(CLASSES))
def test_an_earlier_export_loads_and_computes_the_same(release, name):
    folder, record, stored, target = release
    drafter = load_drafter(folder / name)
    assert isinstance(drafter, CLASSES[name]) and type(drafter) is KIND_CLASSES[name]
    assert type(CLASSES[name].from_pretrained(folder / name)) is KIND_CLASSES[name]
    drafter = drafter.to(target.dtype).bind_target(target)
    raw = raw_outputs(name, drafter, stored)
    assert raw.shape == stored[name].shape
    torch.testing.assert_close(raw, stored[name], rtol=1e-9, atol=1e-9)

    gen = SpeculativeGenerator(target, drafter, tree=record["tree"])
    for prompt, run in zip(record["prompts"], record["drafters"][name]["generations"]):
        ids = torch.tensor([prompt])
        replayed = replay_rounds(target, drafter, record["tree"], len(prompt), run["sequence"], record["new_tokens"],
                                 len(run["accepted_per_step"]))
        assert replayed == run["accepted_per_step"], f"{name}: the drafts changed"
        out = gen.generate(ids, max_new_tokens=record["new_tokens"])
        assert out.sequences[0].tolist() == run["sequence"]
        plain = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=record["new_tokens"])
        assert out.sequences[0].tolist() == plain[0].tolist()


@torch.no_grad()
def replay_rounds(target, drafter, tree, prompt_len: int, sequence: list[int], new_tokens: int, rounds: int) -> list[int]:
    """The recorded rounds drafted with today's drafter: round r at the context the record had reached
    (the prompt and what the earlier rounds accepted), shown the target's features of every position
    but the root's, its tree verified greedily by a plain forward over each node's path. Returns the
    tokens each round accepted (its accepted nodes and the target's one). (Today's generator runs the
    prompt in the first round's pass, so its own rounds draft at other contexts.)"""
    proposer = as_proposer(drafter)
    proposer.bind(target)
    spec = proposer.resolve_tree(tree)
    out, at = [], prompt_len
    for _ in range(rounds):
        context = torch.tensor(sequence[:at])
        features = capture_features(target, context[None, :-1], proposer.feature_layers)[0]  # [L - 1, F]
        proposer.reset()
        budget = new_tokens - (at - prompt_len)
        draft = proposer.propose(DraftContext(context, features, spec, budget - 1, None, None))
        tokens = draft.tokens.tolist()
        paths = [context.tolist() + [tokens[j] for j in node_path(draft.tree.parents, i)[1:]]
                 for i in range(draft.tree.size)]
        argmax = [int(target(input_ids=torch.tensor([ids])).logits[0, -1].argmax()) for ids in paths]
        path, _ = verify_greedy(draft.tree.children, tokens, argmax)
        out.append(min(len(path), budget))
        at += out[-1]
    return out
