"""``tree="auto"`` (the default): each round, how much to speculate, down to none (a plain decoding step).

The drafter proposes its default tree; the controller keeps the part of it that promises the most
new tokens per unit of time and verifies only that. A node's chance of being accepted is the
drafter's own estimate (``Draft.scores``: EAGLE-2's cumulative probabilities, the draft
probabilities of a static tree, Medusa heads' top-k probabilities multiplied along the path,
suffix decoding's continuation frequencies, prompt lookup's n-gram length) calibrated against the
acceptance seen so far: per drafter (a hybrid's parts apart), per depth and per band of the
drafter's conditional estimate, a node's chance given its parent is the share of such nodes
accepted, shrunk towards the drafter's own figure while few were tried; a new request counts the
earlier requests' evidence as at most ``CELL_CAP`` tries a cell (its share kept), so a request on
text of another kind recalibrates within a few rounds (measured: EAGLE-3 on chat right after
translation, 1.07x plain without the cap and the shorter wait below, 1.32x with them, 1.38x fresh).
Sampled candidates are the exception: their shape is judged only by what was known before they were
drawn (the root's row of q, the nodes' ranks and depths, the acceptance seen so far), never by what
was drawn, or the verified tree would favour the drafter's likely draws and the output would no
longer be the target's (``AutoTree._conds``). Keeping the k best nodes (best first, each below a
kept parent, siblings in their rank order) promises

    E(k) = 1 + sum of the k scores                  new tokens (the bonus token included)

at a cost of t(k + 1)/t(1) + t_draft/t(1) one-token steps: t(k)/t(1) the target's measured cost
curve (``headway.inference.cost_curve``) as corrected by the passes timed during generation
(``OnlineCost``; while drafting pays little, a few early rounds are plain steps until t(1) itself
has been timed), t_draft this round's drafting time. The k with the best ratio is verified, k = 0
being a plain step.

A pass costs what its width costs, and the width need not be the node count: for one sequence
(``pad_cheapest``) a pass is padded to the cheapest width up to MAX_PAD at least as wide, where the
corrected curve says that saves more than 1 - PAD_GAIN of it, and each k is priced at that width (a
batch's shared pass likewise, over all its rows' tokens: ``headway.inference.batch.fit_widths``). On
a CPU target with prepacked linears (``headway.inference.cpu_gemm``) a one-token step keeps the
unpacked kernel and a pass of 4-6 tokens measured 0.90-0.94 of it, so a plain step then runs as the
root and its padding (dropped from the cache, as a tree's padding is), cheaper than ``generate``'s own
step; a step timed to correct t(1) runs unpadded.

When even the best k is slower than plain decoding once the drafting is paid for, the next rounds
skip the drafter (plain steps, its features kept for it), then try it again, waiting twice as long
each time it still does not pay (at most ``MAX_BACKOFF`` rounds; a new request tries it at once,
its next wait at most ``REQUEST_WAIT``, or tests it once it has made ``PROBE_AFTER`` tokens when it
can be probed and lost lately). A drafter that can
be tested without a target pass (``Proposer.probe``: EAGLE's, P-EAGLE's, Medusa's and DFlash's first
guesses after the last ``PROBE_ROWS`` positions, scored against the tokens that followed) is probed before it is tried
again (greedy decoding): the guesses count as tried depth-1 nodes of their calibration cells, and the
round drafts only when a chain at their calibrated chance would pay for the drafting seen lately
(else it sits out longer). A probe costs about one draft level; a try costs the drafting and a wider
pass, which on text the drafter does not know (measured: translation, copying) is most of what
"auto" lost against plain decoding. A hybrid's retrieval part drafts every round; its model drafter
is skipped the same way whenever, with retrieval's candidates at hand, it did not add enough to
pay for itself (``gate``), counted apart per band of what retrieval alone promises (beside a long,
confident copy a model drafter seldom adds anything; beside a weak one it may); a model part whose
last try lost is probed first there too, and drafts only when its chain promises more than retrieval
alone (a probe that fails sits out its band and the bands above it, whose bar is higher). Probes read
only tokens already made, so the shape verified never depends on this round's draws. Verification is
unchanged, so the output is exactly the target's.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
from typing import NamedTuple

import torch

from headway.inference.cost_curve import CostCurve, OnlineCost
from headway.inference.proposer import Draft, Probe, can_probe, exact_float
from headway.inference.tree import Tree, shaped_tree
from headway.inference.target_forward import verify_width
from headway.inference.graphs import graph_width

MAX_BACKOFF = 16  # rounds without drafting, at most, before the drafter is tried again
PRIOR_WEIGHT = 2.0  # tries the drafter's own estimate counts for in a calibration cell
DECAY = 0.97  # weight of the past in the acceptance estimates (about the last 30 rounds count)
BINS = 5  # bands of the drafter's conditional estimate a calibration cell covers
DEPTHS = 4  # calibration cells per depth 1, 2, 3, and 4 or deeper
CHEAP_DRAFT = 0.02  # a drafter costing under this share of a step is never skipped (retrieval)
RETRIEVAL_BANDS = (1.2, 1.6, 2.2)  # retrieval's own tokens per step: a hybrid's model part backs off per band
COST_DECAY = 0.8  # weight of the past in the drafting cost a round (the last few drafted rounds count)
REQUEST_WAIT = 4  # a new request: a drafter that lost waits at most this long again after its next loss
CELL_CAP = 4.0  # a new request: each calibration cell's evidence weighs at most this many tries (its share kept)
PROBE_ROWS = 8  # positions a drafter that lost is tested on (``Proposer.probe``) before a round is tried again
PROBE_AFTER = 4  # a new request: rounds a drafter that lost lately sits out first (answer tokens to test it on)
PLAIN_PASSES = 4  # one-token passes timed before t(1)'s correction is trusted; until then every
PLAIN_EVERY = 8  # PLAIN_EVERY-th round is a plain step, while drafting pays less than
PLAIN_BELOW = 1.5  # this many tokens per step (above it, t(1)'s error cannot turn the choice)
MAX_PAD = 8  # one sequence: a pass is padded to the cheapest width up to this many tokens (``AutoTree.width``)
PAD_GAIN = 0.97  # ... when it costs under this share of the narrower pass (prepacked CPU linears: 4-6 rows ~0.9)


def cheapest_width(width: int, cost) -> int:
    """The width a pass of ``width`` tokens runs at: the cheapest under ``cost(w)`` (its time, in any unit) from
    ``width`` up to MAX_PAD, where that costs under PAD_GAIN of ``width`` itself; else ``width``."""
    if width >= MAX_PAD:
        return width
    costs = {w: cost(w) for w in range(width, MAX_PAD + 1)}
    cheapest = min(costs, key=costs.get)
    return cheapest if costs[cheapest] < PAD_GAIN * costs[width] else width


class Backoff:
    """Rounds to sit out after a round that did not pay, doubling while it keeps not paying."""

    def __init__(self):
        self.skip, self.wait = 0, 1

    def take(self) -> bool:
        """True: sit this round out."""
        if self.skip > 0:
            self.skip -= 1
            return True
        return False

    def lost(self) -> None:
        self.skip, self.wait = self.wait, min(2 * self.wait, MAX_BACKOFF)

    def paid(self) -> None:
        self.wait = 1

    def join(self, other: "Backoff") -> None:
        """Sit out at least as long as ``other``, which just lost on evidence that holds here too."""
        self.skip, self.wait = max(self.skip, other.skip), max(self.wait, other.wait)


class GateRound(NamedTuple):
    """What a hybrid's gate saw and decided this round."""

    retrieved: bool  # retrieval proposed candidates
    rate: float  # retrieval alone: its best tokens per step, drafting included (0.0 when nothing was retrieved)
    drafted: bool  # the model drafter drafted too
    band: int | None  # the RETRIEVAL_BANDS band of ``rate`` (None when nothing was retrieved)


class AutoTree:
    """The per-round choice of ``tree="auto"``; one per generator (its estimates carry over calls)."""

    def __init__(self, curve: CostCurve, pad_to: int = 1):
        self.cost = OnlineCost(curve)
        self.pad_to = pad_to  # the generator's padding of verification widths
        self.graphed = False  # passes captured in CUDA graphs: widths padded to powers of two (target_graphs)
        self.pad_cheapest = False  # one sequence's passes run at the cheapest width at least as wide (``width``)
        self.timing = False  # this round is a one-token step timed for t(1): run unpadded
        self._widths: dict[tuple, int] = {}  # this round's padded widths (``width``), by (nodes, prefix, chain)
        # (source, depth, band) -> [accepted, tried]; source: Draft.sources' entry (an int, or a hybrid's (id, part))
        self.cells: dict[tuple, list[float]] = {}
        self.drafter_backoff = Backoff()  # the whole drafter (a hybrid: its model part when nothing was retrieved)
        # a hybrid's model part next to retrieved candidates, per band of what retrieval alone promises
        # (its tokens per step): beside a long confident copy a model drafter rarely adds anything
        self.model_backoff = [Backoff() for _ in range(len(RETRIEVAL_BANDS) + 1)]
        self.rounds = 0
        self.made = self.probes = 0  # tokens made in this request (probes test the drafter on them); probes run
        self.rate = 1.0  # the last round's best tokens per step, drafting included
        self._gate: GateRound | None = None  # this round's, when the drafter is a hybrid
        self._draft_steps = 0.0  # this round's drafting time / t(1)
        # a round's drafting / t(1), averaged over the rounds drafted after a request's first token (the first
        # one after the prompt's pass also takes in the whole prompt's features); None: none measured yet
        self.draft_cost: float | None = None
        self.ranked: tuple[list[int], list[float]] = ([0], [1.0])  # the last select's nodes best first, and E(k)

    def width(self, nodes: int, prefix_len: int = 0, is_chain: bool = True) -> int:
        """The width a pass over ``nodes`` nodes after ``prefix_len`` runs at (what it costs): a captured graph's
        width, or the generator's padding (``pad_to``); with ``pad_cheapest`` (one sequence, not a batch) the
        cheapest width up to MAX_PAD at least as wide, under the corrected cost curve, where it saves more than
        1 - PAD_GAIN of the pass. (On a CPU target with prepacked linears a pass of 4-6 tokens measured 0.90-0.94
        of a one-token step, whose single row keeps the unpacked kernel: a plain step padded to 6 is cheaper.)"""
        if self.graphed:
            return graph_width(nodes)
        width = verify_width(nodes, self.pad_to)
        if not self.pad_cheapest or width >= MAX_PAD:
            return width
        key = (width, prefix_len, is_chain)
        if key not in self._widths:
            self._widths[key] = cheapest_width(width, lambda w: self.cost.rel(w, prefix_len, is_chain))
        return self._widths[key]

    def pass_width(self, tree: Tree, prefix_len: int) -> int | None:
        """The width the generator runs this round's pass over ``tree`` at (None: its own padding)."""
        if not self.pad_cheapest or self.graphed or self.timing:
            return None
        return self.width(tree.size, prefix_len, tree.is_chain)

    def plain_cost(self, prefix_len: int) -> float:
        """A plain step's pass in one-token steps: 1, or less when it is padded to a cheaper width."""
        return self.cost.rel(self.width(1, prefix_len), prefix_len, True)

    def plain_rate(self, prefix_len: int) -> float:
        """A plain step's tokens per one-token step."""
        return 1.0 / self.plain_cost(prefix_len)

    def fork(self, cost, pad_to: int) -> "AutoTree":
        """A controller for one row of a batch: this one's calibration (shared: every row's rounds teach it),
        ``cost`` (the batch's view of the cost curve: headway.inference.batch.BatchCost), its own backoffs."""
        clone = AutoTree(self.cost.curve, pad_to)
        clone.cost, clone.cells = cost, self.cells
        return clone

    def reset(self) -> None:
        """A new generate call, maybe on text of another kind: try the drafter at once (if it still loses, it
        waits at most REQUEST_WAIT rounds, doubling from there; one that can be probed is probed once the request
        has made PROBE_AFTER tokens), and count each calibration cell's evidence as at most CELL_CAP tries."""
        for backoff in (self.drafter_backoff, *self.model_backoff):
            backoff.skip, backoff.wait = 0, min(backoff.wait, REQUEST_WAIT)
        self.made = self.probes = 0  # tokens made in this request; probes run
        for stat in self.cells.values():  # the last requests' evidence counts as at most CELL_CAP tries here
            if stat[1] > CELL_CAP:
                stat[0], stat[1] = stat[0] * CELL_CAP / stat[1], CELL_CAP

    def wants_probe(self) -> bool:
        """This round tries again a drafter whose last try lost: a probe (``probed``) may decide instead."""
        return self.drafter_backoff.wait > 1

    def probe_first(self, proposer, ctx) -> tuple[bool, bool]:
        """A round ``should_draft`` lets draft: when it tries again a drafter that lost (greedy, not a hybrid:
        its gate probes), test the drafter first (``Proposer.probe`` on the tokens made in this request).
        Returns (whether the round drafts, whether the probe ran: the drafter then took in every feature
        of ``ctx`` but the root's)."""
        if proposer.gated or ctx.sampling is not None or not self.wants_probe() or not can_probe(proposer):
            return True, False
        return self._retest(lambda rows: proposer.probe(ctx, rows), ctx.tokens.shape[0])

    def _retest(self, probe, prefix_len: int, backoff: Backoff | None = None, bar: float | None = None
                ) -> tuple[bool, bool]:
        """A drafter whose last try lost (its ``backoff``: the whole drafter's by default) tested before a round
        is tried, once the request has made PROBE_AFTER tokens to test it on: ``probe(rows)`` (None: no test,
        the round is tried). Returns (whether the round drafts, whether the probe ran)."""
        if self.made < PROBE_AFTER:  # a new request: sit out its first tokens
            return False, False
        found = probe(min(PROBE_ROWS, self.made))
        if found is None:
            return True, False
        return self.probed(found, prefix_len, backoff=backoff, bar=bar), True

    def probed(self, probe: Probe, prefix_len: int, backoff: Backoff | None = None, bar: float | None = None) -> bool:
        """Learn from a drafter's probe and say whether the round drafts after all: when a chain of first
        guesses at their calibrated rate would make more than ``bar`` tokens per step (None: a plain step's),
        drafting paid for; else it sits out longer (``backoff``: the whole drafter's by default)."""
        if self._probe_rate(probe, 0, prefix_len) > (self.plain_rate(prefix_len) if bar is None else bar):
            return True
        (backoff or self.drafter_backoff).lost()
        return False

    def _probe_rate(self, probe: Probe, source: int, prefix_len: int) -> float:
        """A probe's guesses counted as tried depth-1 nodes of drafter ``source``; the best tokens per step of a
        chain of k (1 .. DEPTHS) nodes, its first accepted at the probed positions' mean calibrated chance and
        each deeper one at the share accepted at its depth so far, drafting costing ``draft_cost``."""
        self.probes += 1
        chances = []
        for cond, hit in zip(probe.confidence, probe.hits):
            stat = self.cells.setdefault((source, 1, min(int(cond * BINS), BINS - 1)), [0.0, 0.0])
            stat[0] += hit
            stat[1] += 1
            chances.append((stat, cond))
        a = sum((acc + PRIOR_WEIGHT * cond) / (tried + PRIOR_WEIGHT) for (acc, tried), cond in chances) / len(chances)
        expected, best, reach = 1.0, 0.0, 1.0
        for k in range(1, DEPTHS + 1):
            # depth 1: the probe's chance; deeper: the share accepted at that depth in rounds tried (any band),
            # the probe's chance counted as PRIOR_WEIGHT tries
            acc, tried = map(sum, zip(*[v for key, v in self.cells.items() if key[:2] == (source, k)] or [(0.0, 0.0)]))
            reach *= a if k == 1 else (acc + PRIOR_WEIGHT * a) / (tried + PRIOR_WEIGHT)
            expected += reach
            steps = self.cost.rel(self.width(k + 1, prefix_len), prefix_len, True) + (self.draft_cost or 0.0)
            best = max(best, expected / steps)
        return best

    def should_draft(self, gated: bool = False) -> bool:
        """Whether to draft this round at all (False: a plain step). ``gated``: the drafter asks ``gate``
        itself whether its costly part drafts (a hybrid), so its backoff is taken there: retrieval
        drafts every round, as it does alone."""
        self.rounds += 1
        self._gate = None
        self.timing = False
        self._widths.clear()  # the curve's correction moved with the last pass
        if self.cost.plain_passes() < PLAIN_PASSES and self.rounds % PLAIN_EVERY == 0 and self.rate < PLAIN_BELOW:
            self.timing = True
            return False  # time a one-token step (unpadded): t(1) as generation sees it
        return gated or not self.drafter_backoff.take()

    def gate(self, retrieval: Draft, seconds: float, prefix_len: int, probe=None) -> bool:
        """A hybrid drafter's question: with ``retrieval`` drafted (in ``seconds``, after ``prefix_len``
        tokens), should its model drafter draft too? ``probe(rows)``: its ``Proposer.probe`` (None: sampling, or a
        drafter without one): a model drafter whose last try lost is tested first (once the request has made
        PROBE_AFTER tokens), and drafts only when a chain of its first guesses promises more than retrieval alone."""
        rate, band = 0.0, None
        if retrieval.tree.size > 1:
            t1 = self.cost.seconds(1, prefix_len)
            rate = self._best(retrieval, prefix_len, seconds / t1)[1]  # retrieval alone, drafting included
            band = bisect.bisect_right(RETRIEVAL_BANDS, rate)
        # nothing retrieved: the model drafter alone decides the round
        backoff = self.drafter_backoff if band is None else self.model_backoff[band]
        drafted = not backoff.take()
        if drafted and probe is not None and backoff.wait > 1:  # its chain must beat retrieval alone
            drafted, probed = self._retest(probe, prefix_len, backoff, max(self.plain_rate(prefix_len), rate))
            if probed and not drafted:  # the probe judged the drafter, not the band: a band that asks more
                for higher in self.model_backoff[0 if band is None else band + 1:]:  # would have failed it too
                    higher.join(backoff)
        self._gate = GateRound(band is not None, rate, drafted, band)
        return drafted

    def _conds(self, draft: Draft) -> list[float]:
        """The drafter's own chance of each node given its parent (the root's 1.0).

        Sampled candidates (``Draft.q``): the shape verified must not depend on this round's draws, or
        the verifier's "x was drawn from q" no longer holds (keeping a draw because it scored well
        favours the drafter's likely tokens: measured, 20,000 draft-model samples, p = 6e-15). So a
        sampled draft is judged only by what was known before it was drawn: the root's row of q (the
        distribution the first level was drawn from, before any draw), as sum q^2 (the expected draft
        probability of a draw), over the node's rank among its siblings; depth and the acceptance seen
        so far do the rest.
        """
        tree = draft.tree
        if draft.q is not None:  # (its scores, left on the device or not, are never read)
            row = draft.q.get(0) if isinstance(draft.q, dict) else draft.q[0]
            conf = float(row.double().square().sum()) if row is not None else 0.5
            return [1.0] + [conf / (tree.ranks[i] + 1) for i in range(1, tree.size)]
        raw = draft.score_list()
        if raw is None:  # no estimate: one in two for a first choice
            return [1.0] + [0.5 / (tree.ranks[i] + 1) for i in range(1, tree.size)]
        out = [1.0] * tree.size
        for i in range(1, tree.size):
            parent = raw[tree.parents[i]]
            out[i] = min(1.0, raw[i] / parent) if parent > 0 else 0.0
        return out

    def _cell(self, draft: Draft, cond: float, node: int) -> tuple[int, int, int]:
        """The calibration cell of ``node`` whose own conditional estimate is ``cond``."""
        source = draft.sources[node] if draft.sources is not None else 0
        return source, min(draft.tree.depths[node], DEPTHS), min(int(cond * BINS), BINS - 1)

    def scores(self, draft: Draft) -> list[float]:
        """Each node's estimated chance of being accepted (the root's 1.0), calibrated."""
        tree, conds = draft.tree, self._conds(draft)
        out = [1.0] * tree.size
        for i in range(1, tree.size):
            acc, tried = self.cells.get(self._cell(draft, conds[i], i), (0.0, 0.0))
            out[i] = out[tree.parents[i]] * (acc + PRIOR_WEIGHT * conds[i]) / (tried + PRIOR_WEIGHT)
        return out

    def _best(self, draft: Draft, prefix_len: int, draft_steps: float) -> tuple[list[int], float]:
        """(the nodes worth verifying, ascending, the root first; their tokens per step, drafting included)."""
        tree = draft.tree
        plain = self.plain_cost(prefix_len) + draft_steps  # a plain step's cost, drafting paid
        if tree.size == 1:
            self.ranked = ([0], [1.0])
            return [0], 1.0 / plain
        score = self.scores(draft)
        ordered = tree.children  # siblings in node order: the order sampled children were drawn in
        sampled = draft.q is not None  # sampled children must stay a prefix of their draw order
        heap = [(-score[c], c) for c in (ordered[0][:1] if sampled else ordered[0])]
        heapq.heapify(heap)
        kept, expected, chain_so_far = [0], 1.0, True
        gains = [1.0]  # expected new tokens of the first j + 1 nodes kept, best first
        best_k, best_rate = 0, 1.0 / plain
        while heap:
            neg, node = heapq.heappop(heap)
            parent = tree.parents[node]
            chain_so_far = chain_so_far and parent == kept[-1]
            kept.append(node)
            expected += -neg
            gains.append(expected)
            width = self.width(len(kept), prefix_len, chain_so_far)
            rate = expected / (self.cost.rel(width, prefix_len, chain_so_far) + draft_steps)
            if rate > best_rate:
                best_k, best_rate = len(kept) - 1, rate
            for c in ordered[node][:1] if sampled else ordered[node]:
                heapq.heappush(heap, (-score[c], c))
            if sampled:  # the next sibling in draw order becomes a candidate
                siblings = ordered[parent]
                j = siblings.index(node) + 1
                if j < len(siblings):
                    heapq.heappush(heap, (-score[siblings[j]], siblings[j]))
        # (best-first nodes, their expected tokens) up to the choice: a batch may verify fewer (headway.inference.batch)
        self.ranked = (kept[:best_k + 1], gains[:best_k + 1])
        return sorted(kept[:best_k + 1]), best_rate

    def select(self, draft: Draft, prefix_len: int, draft_seconds: float = 0.0, timed: bool = True) -> Draft:
        """The part of ``draft`` worth verifying this round (the root alone: a plain step). ``timed`` False: the
        drafting time is not a round's (it captured a graph) and teaches nothing."""
        t1 = self.cost.seconds(1, prefix_len)
        self._draft_steps = draft_seconds / t1
        model_drafted = self._gate is None or self._gate.drafted  # (a hybrid's retrieval alone costs next to nothing)
        if self.made > 1 and model_drafted and timed:  # not the round that took in the prompt: drafting's cost
            self.draft_cost = self._draft_steps if self.draft_cost is None else (
                COST_DECAY * self.draft_cost + (1 - COST_DECAY) * self._draft_steps)
        elif model_drafted and self.draft_cost is not None:  # the prompt's catch-up is paid once: judge a usual round
            self._draft_steps = self.draft_cost
        elif not timed:
            self._draft_steps = 0.0
        draft = host_scored(draft)  # one read here, not one per use
        keep, self.rate = self._best(draft, prefix_len, self._draft_steps)
        return prune(draft, keep)

    def observe(self, draft: Draft, path: list[int], prefix_len: int, drafted: bool, verify_seconds: float = 0.0,
                width: int | None = None) -> None:
        """Learn from a verified round: what its pass cost, which nodes were tried and accepted, and
        whether drafting paid."""
        self.made += len(path)
        if verify_seconds > 0:
            self.cost.observe(width or draft.tree.size, prefix_len, draft.tree.is_chain, verify_seconds)
        if not drafted:
            return
        tree, on_path, conds = draft.tree, set(path), self._conds(draft)
        for stat in self.cells.values():
            stat[0] *= DECAY
            stat[1] *= DECAY
        for i in range(1, tree.size):
            if tree.parents[i] in on_path:  # tried: its parent was accepted
                stat = self.cells.setdefault(self._cell(draft, conds[i], i), [0.0, 0.0])
                stat[0] += i in on_path
                stat[1] += 1
        gate, self._gate = self._gate, None
        if gate is not None and gate.retrieved:  # a hybrid round with retrieved candidates
            if gate.drafted:  # did the model drafter beat what retrieval alone would have made of the round?
                backoff = self.model_backoff[gate.band]
                backoff.paid() if self.rate > gate.rate else backoff.lost()
        elif gate is None or gate.drafted:  # the drafter (or the hybrid's model part, alone) drafted
            lost = self.rate < self.plain_rate(prefix_len) and self._draft_steps > CHEAP_DRAFT
            self.drafter_backoff.lost() if lost else self.drafter_backoff.paid()


def host_scored(draft: Draft) -> Draft:
    """``draft`` with the scores a drafter left on the device read to the host, and a device tree's shape with them
    (one read); a sampled draft as it is, its scores never read (``AutoTree._conds`` judges it by the root's row
    of q)."""
    return host_scored_rows([draft])[0]


def host_scored_rows(drafts: list[Draft]) -> list[Draft]:
    """``host_scored`` of each of a batch's drafts, every read among them in one."""
    unread = [i for i, d in enumerate(drafts) if d.q is None and isinstance(d.scores, torch.Tensor)]
    if not unread:
        return list(drafts)
    pending = [drafts[i].tree.pending_parents() for i in unread]  # a device tree's parents, read with its scores
    parts = [t for i, p in zip(unread, pending) for t in (drafts[i].scores, p) if t is not None]
    wide = exact_float(parts[0].device)  # node indices exact beside the scores
    flat = torch.cat([t.reshape(-1).to(wide) for t in parts]).tolist()
    out, at = list(drafts), 0
    for i, p in zip(unread, pending):
        d, n = drafts[i], drafts[i].tree.size
        scores, at = flat[at:at + n], at + n
        if p is not None:
            d.tree.settle([int(v) for v in flat[at:at + n]])
            at += n
        out[i] = dataclasses.replace(d, scores=scores)
    return out


def prune(draft: Draft, keep: list[int]) -> Draft:
    """``draft`` cut to the nodes ``keep`` (ascending, closed under parents; node 0 first)."""
    if len(keep) == draft.tree.size:
        return draft
    index = {old: new for new, old in enumerate(keep)}
    parents = [-1] + [index[draft.tree.parents[n]] for n in keep[1:]]
    ranks = [draft.tree.ranks[n] for n in keep]
    rows = torch.tensor(keep, device=draft.tokens.device)  # [K]

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t.index_select(0, rows.to(t.device))  # a no-op move on the tokens' device

    tokens = cut(draft.tokens)
    q = draft.q
    if isinstance(q, dict):
        q = {index[n]: v for n, v in q.items() if n in index}
    elif q is not None:
        q = cut(q)
    if isinstance(draft.scores, torch.Tensor):  # left on the device (a sampled draft's): cut there, unread
        scores = cut(draft.scores)
    else:
        scores = [draft.scores[n] for n in keep] if draft.scores is not None else None
    sources = [draft.sources[n] for n in keep] if draft.sources is not None else None
    states = cut(draft.states) if draft.states is not None else None
    return Draft(shaped_tree(parents, name=f"auto-{len(keep)}", ranks=ranks), tokens, q, scores=scores,
                 sources=sources, states=states)
