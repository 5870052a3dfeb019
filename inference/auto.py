"""``tree="auto"``: each round, how much to speculate, down to none (a plain decoding step).

The drafter proposes its default tree; the controller keeps the part of it that promises the most
new tokens per unit of time and verifies only that. A node's chance of being accepted is the
drafter's own estimate where it gives one (``Draft.scores``: EAGLE-2's cumulative probabilities,
Medusa heads' top-k probabilities multiplied along the path, suffix decoding's continuation
frequencies), scaled by how well those estimates matched the acceptance seen so far; otherwise the
acceptance seen so far at the node's depth and sibling rank. Keeping the k best nodes (best first,
each below a kept parent, siblings in their rank order) promises

    E(k) = 1 + sum of the k scores                  new tokens (the bonus token included)

at a cost of t(k + 1)/t(1) + t_draft/t(1) one-token steps, with t(k)/t(1) the target's measured cost
curve (``headway.inference.cost_curve``) and t_draft the drafter's measured time; the k with the
best ratio is verified, k = 0 being a plain step. When even the best k would be slower than plain
decoding once the drafting is paid for, the next rounds skip the drafter (plain steps, its
features kept for it), then try it again, waiting twice as long each time it still does not pay (at
most ``MAX_BACKOFF`` rounds). Verification is unchanged, so the output is exactly the target's.
"""

from __future__ import annotations

import heapq

import torch

from headway.inference.cost_curve import CostCurve
from headway.inference.drafter import Draft
from headway.inference.tree import Tree

MAX_BACKOFF = 16  # rounds without drafting, at most, before the drafter is tried again
PRIOR = (1.0, 2.0)  # pseudo-counts (accepted, tried) of a node of rank 0 before any was seen
DECAY = 0.97  # weight of the past in the acceptance estimates (about the last 30 rounds count)
CHEAP_DRAFT = 0.02  # a drafter costing under this share of a step is never skipped (retrieval)


class AutoTree:
    """The per-round choice of ``tree="auto"``; one per generator (its estimates carry over calls)."""

    def __init__(self, curve: CostCurve):
        self.curve = curve
        self.seen: dict[tuple[int, int], list[float]] = {}  # (depth, rank) -> [accepted, tried]
        self.predicted, self.accepted = 1.0, 1.0  # the drafter's scores vs what was accepted (calibration)
        self.draft_cost = 0.0  # drafting time per round / t(1), running mean
        self.skip, self.backoff = 0, 1
        self.rate = 1.0  # the last round's best tokens per step, drafting included
        self._predicted_now = 0.0  # the drafter's scores summed over the nodes kept this round

    def reset(self) -> None:
        """A new generate call: try the drafter at once."""
        self.skip, self.backoff = 0, 1

    def should_draft(self) -> bool:
        if self.skip > 0:
            self.skip -= 1
            return False
        return True

    def _prob(self, depth: int, rank: int) -> float:
        acc, tried = self.seen.get((depth, rank), (0.0, 0.0))
        prior_acc = PRIOR[0] / (rank + 1)
        return (acc + prior_acc) / (tried + PRIOR[1])

    def scores(self, draft: Draft) -> list[float]:
        """Each node's estimated chance of being accepted (the root's 1.0)."""
        tree = draft.tree
        if draft.scores is not None:
            scale = min(2.0, self.accepted / max(self.predicted, 1e-9))
            return [1.0] + [min(1.0, s * scale) for s in draft.scores[1:]]
        out = [1.0] * tree.size
        for i in range(1, tree.size):
            out[i] = out[tree.parents[i]] * self._prob(tree.depths[i], tree.ranks[i])
        return out

    def select(self, draft: Draft, prefix_len: int) -> Draft:
        """The part of ``draft`` worth verifying this round (the root alone: a plain step)."""
        tree = draft.tree
        if tree.size == 1:
            self.rate, self._predicted_now = 1.0 / (1.0 + self.draft_cost), 0.0
            return draft
        score = self.scores(draft)
        ordered = tree.children  # siblings in node order: the order sampled children were drawn in
        sampled = draft.q is not None  # sampled children must stay a prefix of their draw order
        heap = [(-score[c], c) for c in (ordered[0][:1] if sampled else ordered[0])]
        heapq.heapify(heap)
        kept, expected, chain_so_far = [0], 1.0, True
        best_k, best_rate = 0, 1.0 / (self.curve.rel(1, prefix_len) + self.draft_cost)
        while heap:
            neg, node = heapq.heappop(heap)
            parent = tree.parents[node]
            chain_so_far = chain_so_far and parent == kept[-1]
            kept.append(node)
            expected += -neg
            rate = expected / (self.curve.rel(len(kept), prefix_len, chain_so_far) + self.draft_cost)
            if rate > best_rate:
                best_k, best_rate = len(kept) - 1, rate
            for c in ordered[node][:1] if sampled else ordered[node]:
                heapq.heappush(heap, (-score[c], c))
            if sampled:  # the next sibling in draw order becomes a candidate
                siblings = ordered[parent]
                j = siblings.index(node) + 1
                if j < len(siblings):
                    heapq.heappush(heap, (-score[siblings[j]], siblings[j]))
        self.rate = best_rate
        self._predicted_now = sum(score[n] for n in kept[1:best_k + 1])
        return prune(draft, sorted(kept[:best_k + 1]))

    def observe(self, draft: Draft, path: list[int], draft_seconds: float, prefix_len: int, drafted: bool) -> None:
        """Learn from a verified round: which nodes were tried and accepted, what drafting cost."""
        if not drafted:
            return
        t1 = self.curve.seconds(prefix_len)
        self.draft_cost = 0.8 * self.draft_cost + 0.2 * draft_seconds / max(t1, 1e-9)
        tree, on_path = draft.tree, set(path)
        for key in self.seen:
            self.seen[key][0] *= DECAY
            self.seen[key][1] *= DECAY
        for i in range(1, tree.size):
            if tree.parents[i] in on_path:  # tried: its parent was accepted
                stat = self.seen.setdefault((tree.depths[i], tree.ranks[i]), [0.0, 0.0])
                stat[0] += i in on_path
                stat[1] += 1
        if draft.scores is not None and tree.size > 1:
            self.predicted = DECAY * self.predicted + self._predicted_now
            self.accepted = DECAY * self.accepted + (len(path) - 1)
        if self.rate < 1.0 and self.draft_cost > CHEAP_DRAFT:  # drafting lost to plain decoding this round
            self.skip, self.backoff = self.backoff, min(2 * self.backoff, MAX_BACKOFF)
        else:
            self.backoff = 1


def prune(draft: Draft, keep: list[int]) -> Draft:
    """``draft`` cut to the nodes ``keep`` (ascending, closed under parents; node 0 first)."""
    if len(keep) == draft.tree.size:
        return draft
    index = {old: new for new, old in enumerate(keep)}
    parents = [-1] + [index[draft.tree.parents[n]] for n in keep[1:]]
    ranks = [draft.tree.ranks[n] for n in keep]
    tokens = draft.tokens[torch.tensor(keep, device=draft.tokens.device)]
    q = draft.q
    if isinstance(q, dict):
        q = {index[n]: v for n, v in q.items() if n in index}
    elif q is not None:
        q = q[torch.tensor(keep, device=q.device)]
    scores = [draft.scores[n] for n in keep] if draft.scores is not None else None
    return Draft(Tree(parents, ranks=ranks, name=f"auto-{len(keep)}"), tokens, q, scores=scores)
