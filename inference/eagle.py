"""EAGLE drafter (EAGLE-1/3 heads; EAGLE-2 dynamic trees, Li et al. 2024, arXiv:2406.16858).

The head drafts autoregressively with its own KV cache. Its entry at position j pairs the
target's feature f[j] with the next token x[j+1]; after a round the cache holds exactly the
context entries (positions 0 .. L-2 for L tokens), so rejected draft entries are rolled back by a
crop, and the next round feeds the target's features of the newly accepted positions (handed
over by the generator, captured with forward hooks) before growing the tree from the root:

    root:   h'[L-2] = head(x[L-1], f[L-2])         -> candidates for depth 1 (logits(h'))
    node n: h'_n    = head(token_n, h'_parent(n))   at position L-2 + depth(n), tree-masked

Trees: a static tree (name, YAML file, list of paths; top-k or sampled children with q) or
EAGLE-2 dynamic settings ``{"depth", "top_k", "total_tokens"}`` (the default).
"""

from __future__ import annotations

import copy
from typing import Generator

import torch
import torch.nn.functional as F

from headway.heads.eagle import DraftCache, EagleHead
from headway.inference.cpu_gemm import few_rows_linear
from headway.inference.proposer import (Draft, DraftContext, DraftRequest, Probe, Proposer, first_guesses,
                                        root_only, run_alone)
from headway.inference import vocab_reduce
from headway.inference.graphs import EagleStepGraphs, same_mode
from headway.inference.expand import (DynamicTree, additive_mask, feed_block, grow_dynamic, grow_dynamic_tensors,
                                      grow_static, sees_all, static_feed_mask)
from headway.inference.tree import Tree

# EAGLE-2's settings scaled to a CPU, where a verification of 8 tokens costs ~1.8-2 plain steps (~1.75 on
# prepacked weights) and of 16 ~2.3 (PERFORMANCE.md), and each dynamic draft level ~0.15 of one: 3 levels of top-4, 7
# nodes (measured against depth 4 / 8 nodes in BENCHMARKS.md: same tau, 0.92x vs 0.85x). On GPUs
# the paper's depth 6 / top_k 10 / total 60 are the usual choice.
CPU_DYNAMIC = DynamicTree(depth=3, top_k=4, total_tokens=7)
GPU_DYNAMIC = DynamicTree(depth=6, top_k=10, total_tokens=60)


def bind_head(head, target_model) -> torch.device:
    """Bind a drafter that reads the target's features (EAGLE, DFlash) to ``target_model`` (``head.bind_target``:
    ValueError naming both values on a mismatch) and move it to the target's device and dtype, once (never a
    per-step weight copy); returns the device. Its RoPE frequencies stay float32 through the move (the heads'
    ``Fp32Rope``: in bf16 they would shift relative angles by radians at long distances)."""
    head.bind_target(target_model)
    p = next(target_model.parameters())
    if next(head.parameters()).device != p.device or next(head.parameters()).dtype != p.dtype:
        head.to(p.device, p.dtype)  # the bound target tensors need no re-bind
    return p.device


class EagleProposer(Proposer):
    """Wraps an ``EagleHead``; default tree: EAGLE-2 dynamic (CPU- or GPU-sized).

    ``tensor_rounds``: True grows a dynamic tree with tensor ops and no read, its shape read with the round's
    verification (``grow_dynamic_tensors``; a batch's rows level by level in one head pass too); False takes the host
    version, which reads once per level and skips pruned rows (the same tree); None (the default) is True
    on CUDA, where a read is a sync, and False elsewhere: on a CPU a read costs nothing and the host
    version's own work measured less (scripts/runtime_probe.py, BENCHMARKS.md). ``chain_path``: a greedy chain
    whose scores nobody reads is drafted by ``_grow_chain`` (no tree bookkeeping); False: as any static tree."""

    tensor_rounds: bool | None = None
    chain_path: bool = True

    def __init__(self, head: EagleHead):
        self.head = head.eval()
        self.feature_layers = list(head.config.feature_layers)
        self._cache = DraftCache()
        self._seen = 0  # context entries in the draft cache (positions 0 .. seen-1)
        self._device = torch.device("cpu")
        self._graphs: EagleStepGraphs | None = None  # a tree level's step captured per width (CUDA graphs)

    def bind(self, target_model) -> None:
        self._device = bind_head(self.head, target_model)

    def default_tree(self):
        return GPU_DYNAMIC if self._device.type == "cuda" else CPU_DYNAMIC

    def resolve_tree(self, spec):
        if isinstance(spec, dict):
            return DynamicTree.from_spec(spec)
        if isinstance(spec, DynamicTree):
            return spec
        return super().resolve_tree(spec)

    def check_tree(self, tree: Tree) -> None:
        tree.validate(top_k=self.head.config.output_size)

    def use_graphs(self, backend, strict: bool = False) -> str | None:
        """Capture each single-row tree level (a static tree's, a dynamic tree's) per width with ``backend``
        (``inference.graphs``); the catch-up, the root's projection and a batch's stacked levels stay eager."""
        self._graphs = EagleStepGraphs(self.head, backend, strict)
        self._cache = DraftCache()
        return None

    def reset(self) -> None:
        # the captured levels write into the cache's buffers: a new request keeps them (while it may write them)
        keep = self._graphs is not None and same_mode(self._cache._keys)
        self._cache = DraftCache.reusing(self._cache) if keep else DraftCache()
        if self._graphs is not None:
            self._graphs.check()
        self._seen = 0

    def fork(self) -> "EagleProposer":
        clone = copy.copy(self)
        clone._graphs, clone._cache = None, DraftCache()  # a batch row: its own buffers, its levels stacked
        clone.reset()
        return clone

    def _widen(self, q: torch.Tensor) -> torch.Tensor:
        # [V'] draft-vocabulary distribution -> [V] over target ids
        return self.head.widen(q)

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        return run_alone(self.propose_steps(ctx))

    def _catch_up(self, ctx: DraftContext) -> torch.Tensor | None:
        """Feed the positions whose features are new to the draft cache; the root's output h' [H] (the
        predicted feature after the root), or None when there is no feature yet (a one-token prompt)."""
        return self._take_in(ctx.tokens, ctx.features)[-1] if self._new_positions(ctx) else None

    def _new_positions(self, ctx: DraftContext) -> int:
        """How many context positions ``ctx.features`` brings (checked against the context's length)."""
        length = ctx.tokens.shape[0]
        new = 0 if ctx.features is None else ctx.features.shape[0]
        if self._seen + new != length - 1:
            raise RuntimeError(f"EAGLE drafter saw features of {self._seen} positions and got {new} more, "
                               f"but the context has {length - 1} before the root")
        return new

    def _take_in(self, tokens: torch.Tensor, features: torch.Tensor, outputs: int = 1,
                 after: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Drop the previous round's tree entries and feed the next n context positions (``features`` [n, F],
        each paired with the token after it in ``tokens`` [L]) to the draft cache; the last ``outputs``
        positions' h' [outputs, H]. Only those run the whole layer: the others just write their keys/values
        (a long prompt's catch-up costs a quarter of the full layer over it). ``after``: (ids [s], hidden [s, H])
        run at the s positions after the context in the same causal pass (P-EAGLE's mask slots), their h' returned
        after the context's and their entries cropped off: [outputs + s, H]."""
        head, n = self.head, features.shape[0]
        self._cache.crop(self._seen)
        ids = tokens[self._seen + 1:self._seen + 1 + n]  # [n]: x[j+1] paired with f[j]
        hidden = head.input_hidden(features)  # [n, H]
        s = 0 if after is None else after[0].shape[0]
        if s:
            ids, hidden = torch.cat([ids, after[0]]), torch.cat([hidden, after[1]])  # [n + s], [n + s, H]
        positions = torch.arange(self._seen, self._seen + n + s, device=self._device)[None]
        h = head.extend(ids[None], hidden[None], positions, self._cache, outputs + s)  # [1, outputs + s, H]
        self._seen += n
        if s:
            self._cache.crop(self._seen)
        return h[0]

    @torch.no_grad()
    def probe(self, ctx: DraftContext, rows: int) -> Probe | None:
        """The catch-up over all but the root's feature, the last ``rows`` positions run through the whole layer
        and scored: entry j's guess is x[j+2], known for every j <= L-3 (``Proposer.probe``)."""
        head, length = self.head, ctx.tokens.shape[0]
        n = 0 if ctx.features is None else ctx.features.shape[0] - 1  # positions seen .. L-3
        if n < 1 or rows < 1 or self._seen + n + 1 != length - 1:
            return None
        m = min(rows, n)
        h = self._take_in(ctx.tokens, ctx.features[:-1], outputs=m)  # [m, H]
        return first_guesses(few_rows_linear(*head.projection(h)), head.to_target_ids, ctx.tokens[length - m:])

    def propose_steps(self, ctx: DraftContext) -> Generator[DraftRequest, object, Draft]:
        """The static tree or a dynamic one (grown with tensor ops, ``grow_dynamic_tensors``, or on the host,
        ``grow_dynamic``: ``tensor_rounds``), each model step a request (``CatchUp``, ``Project``, ``Feed``) that a
        batch runs with its other rows' (``StackedRows``)."""
        root_h = (yield CatchUp(self, ctx.tokens, ctx.features)) if self._new_positions(ctx) else None
        tree = self.default_tree() if ctx.tree is None else ctx.tree
        if not isinstance(tree, DynamicTree):
            tree = tree.truncate(ctx.max_depth)
        if root_h is None or (isinstance(tree, Tree) and tree.size == 1):
            return root_only(ctx)
        head, device, length = self.head, self._device, ctx.tokens.shape[0]
        root_rows = root_h[None]  # [1, H]
        root_logits = (yield Project(head, root_rows))[0]  # [V']
        tensor_rounds = self.tensor_rounds if self.tensor_rounds is not None else device.type == "cuda"
        if isinstance(tree, DynamicTree) and tensor_rounds:
            draft = yield from self._grow_tensors(tree, ctx, root_h, root_logits)
            self._cache.crop(self._seen)
            return draft
        if self.chain_path and isinstance(tree, Tree) and tree.is_chain and ctx.sampling is None and not ctx.scored:
            draft = yield from self._grow_chain(tree, ctx, root_h, root_logits)
            self._cache.crop(self._seen)
            return draft
        if isinstance(tree, DynamicTree):
            growth = grow_dynamic(tree, ctx.max_depth, ctx.root_token, root_logits, head.to_target_ids)
        else:
            growth = grow_static(tree, ctx.root_token, root_logits, ctx.sampling, ctx.generator, head.to_target_ids,
                                 self._widen, ctx.scored)
        outputs = {0: (root_rows, 0)}  # node -> (the outputs h' [R, H] of its feed, its row): what its children read
        try:
            exp, nodes = next(growth)
            while True:
                open = sees_all(exp, nodes)
                request = Feed(self, exp.token_ids(nodes, device), exp.positions(nodes, length - 2, device),
                               parent_outputs(outputs, [exp.parents[n] for n in nodes]), feed_block(exp, nodes, device),
                               open, None if open else static_feed_mask(exp, nodes, device, root_h.dtype))
                out, logits = yield request  # [R, H], [R, V']
                outputs.update((n, (out, r)) for r, n in enumerate(nodes))
                exp, nodes = growth.send(logits)
        except StopIteration as done:
            draft = done.value
        self._cache.crop(self._seen)
        return draft

    def _grow_tensors(self, tree: DynamicTree, ctx: DraftContext, root_h: torch.Tensor, root_logits: torch.Tensor):
        """A dynamic tree grown with tensor ops (no read: its shape is read with the verification), each level a
        ``Feed``: every row reads its parent's output among the previous feed's rows (the root's for the first)."""
        growth = grow_dynamic_tensors(tree, ctx.max_depth, ctx.root_token, root_logits, self.head.to_target_ids)
        last, start = root_h[None], ctx.tokens.shape[0] - 2  # the previous feed's outputs [R, H]; the root's position
        try:
            step = next(growth)
            while True:
                tokens, parent_rows, depth, allowed = step
                positions = torch.full((tokens.shape[0],), start + depth, dtype=torch.long, device=self._device)
                last, logits = yield Feed(self, tokens, positions, last[parent_rows.clamp(min=0)], ~allowed)
                step = growth.send(logits)
        except StopIteration as done:
            return done.value

    def _grow_chain(self, tree: Tree, ctx: DraftContext, root_h: torch.Tensor, root_logits: torch.Tensor):
        """A greedy chain whose scores nobody reads: each level the argmax after the last, fed with the output that
        scored it. ``grow_static``'s draft for a chain without its per-level gathers (the token picked is the next
        level's whole feed), its tokens gathered once at the end."""
        head, device, depth = self.head, self._device, tree.size - 1
        length = ctx.tokens.shape[0]
        positions = torch.arange(length - 1, length - 2 + depth, device=device)  # [D - 1]: levels 1 .. D-1 fed
        logits, out, picked = root_logits[None], root_h[None], []  # [1, V'], [1, H]
        for d in range(1, depth + 1):
            token = head.to_target_ids(vocab_reduce.argmax(logits))  # [1]
            picked.append(token)
            if d < depth:  # seeing the context and the d - 1 levels before it: no mask
                blocked = tree.cached(("chain_block", d, device), lambda: torch.zeros(1, d, dtype=torch.bool,
                                                                                        device=device))
                out, logits = yield Feed(self, token, positions[d - 1:d], out, blocked, open=True)
        return Draft(tree, torch.cat([ctx.tokens[-1:], *picked]))

    def _level_graphed(self, tokens, hidden, positions, blocked):
        """A single-row tree level through the captured step (``EagleStepGraphs.level``); None: run it eagerly."""
        if self._graphs is None:
            return None
        return self._graphs.level(self._cache, tokens, hidden, positions, blocked, self._seen)


def parent_outputs(outputs: dict, parents: list[int]) -> torch.Tensor:
    """The outputs h' [R, H] of ``parents`` (``outputs``: node -> (a feed's outputs [R', H], its row)): one feed's
    outputs as they are where the parents are its rows in order (a chain's level), a slice or a gather of them where
    they are some of its rows, else stacked row by row."""
    fed, found = outputs[parents[0]][0], [outputs[p] for p in parents]
    if all(out is fed for out, _ in found):  # one feed's rows (every level of a static or dynamic tree): one op
        rows = [row for _, row in found]
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return fed if len(rows) == fed.shape[0] else fed[rows[0]:rows[0] + len(rows)]
        return fed.index_select(0, torch.tensor(rows, device=fed.device))
    return torch.stack([out[row] for out, row in found])


class CatchUp(DraftRequest):
    """A row's catch-up (``EagleProposer._take_in``): its new context positions into its draft cache. Result: the
    root's h' [H]. A batch's rows that each bring a few positions run as one head pass (``catch_up_rows``); a long
    catch-up (a prompt's) runs alone, where only its last position runs the whole layer."""

    MAX_BATCHED = 16  # positions

    def __init__(self, proposer: EagleProposer, tokens: torch.Tensor, features: torch.Tensor, slots: int | None = None):
        self.key, self.proposer, self.tokens, self.features = proposer.head, proposer, tokens, features
        self.slots = slots  # P-EAGLE's s mask slots after the context, in the same pass: the result is then [1 + s, H]

    def run(self) -> torch.Tensor:
        p = self.proposer
        after = p.head.slot_inputs(self.slots, p._device) if self.slots else None
        out = p._take_in(self.tokens, self.features, after=after)  # [1 + slots, H]
        return out[-1] if self.slots is None else out

    @classmethod
    def run_together(cls, requests: list["CatchUp"], state: dict) -> list[torch.Tensor]:
        short = [r for r in requests if r.features.shape[0] <= cls.MAX_BATCHED and r.proposer._seen > 0]
        done = dict(zip(map(id, short), catch_up_rows(short))) if len(short) > 1 else {}
        return [(done[id(r)][0] if r.slots is None else done[id(r)]) if id(r) in done else r.run() for r in requests]


def catch_up_rows(requests: list[CatchUp]) -> list[torch.Tensor]:
    """Several rows' catch-ups as one head pass: the rows' draft caches stacked (``DraftCache.stacked``), each row's
    n_b new positions (then its s_b mask slots, P-EAGLE's) after all slots, seeing its own context's slots (a prefix
    validity mask) and its new positions causally (a padding position sees only itself); then each row's new
    keys/values (not the slots') appended to its own cache. Each row's roll-back to its context comes first, as
    ``_take_in``'s. Returns each row's root h' and its slots' [1 + s_b, H]."""
    head, rows = requests[0].key, [r.proposer for r in requests]
    for p in rows:
        p._cache.crop(p._seen)
    news = [r.features.shape[0] for r in requests]
    sizes = [n + (r.slots or 0) for n, r in zip(news, requests)]
    b, width = len(rows), max(sizes)
    cache, valid = DraftCache.stacked([p._cache for p in rows], room=width)  # [B, S] valid slots
    s, device = valid.shape[1], valid.device
    hidden = [head.input_hidden(r.features) for r in requests]  # [n_b, H] each
    slots = max(r.slots or 0 for r in requests)
    if slots:  # [s] the mask token, [s, H] its learnt input: every row's slots, once
        slot_ids, slot_hidden = head.slot_inputs(slots, device)
    dtype = hidden[0].dtype
    mask = torch.full((b, 1, width, s + width), torch.finfo(dtype).min, dtype=dtype, device=device)
    mask[:, 0, :, :s].masked_fill_(valid[:, None], 0.0)
    tokens = torch.zeros(b, width, dtype=torch.long, device=device)
    positions = torch.zeros(b, width, dtype=torch.long, device=device)
    stacked = hidden[0].new_zeros(b, width, hidden[0].shape[-1])
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril_()
    for row, (r, p, n, m) in enumerate(zip(requests, rows, sizes, news)):
        tokens[row, :m] = r.tokens[p._seen + 1:p._seen + 1 + m]  # x[j+1] paired with f[j]
        stacked[row, :m] = hidden[row]
        if n > m:
            tokens[row, m:n], stacked[row, m:n] = slot_ids[:n - m], slot_hidden[:n - m]
        positions[row, :n] = torch.arange(p._seen, p._seen + n, device=device)
        mask[row, 0, :n, s:s + n].masked_fill_(causal[:n, :n], 0.0)
        mask[row, 0, torch.arange(n, width), s + torch.arange(n, width)] = 0.0  # padding: itself only
    out = head(tokens, stacked, positions, attention_mask=mask, cache=cache)  # [B, W, H]
    for row, (p, m) in enumerate(zip(rows, news)):
        p._cache.append_row(cache, row, s, m)
        p._seen += m
    return [out[row, m - 1:n] for row, (m, n) in enumerate(zip(news, sizes))]


class Project(DraftRequest):
    """The vocabulary projection of h [R, H] -> logits [R, V']; a batch's rows' in one product."""

    def __init__(self, head: EagleHead, h: torch.Tensor):
        self.key, self.h = head, h

    def run(self) -> torch.Tensor:
        return few_rows_linear(*self.key.projection(self.h))

    @classmethod
    def run_together(cls, requests: list["Project"], state: dict) -> list[torch.Tensor]:
        h = torch.cat([r.h for r in requests])  # [sum R, H]
        return list(few_rows_linear(*requests[0].key.projection(h)).split([r.h.shape[0] for r in requests]))


class Feed(DraftRequest):
    """One level of a row's tree through the head: tokens [R] long at positions [R] long, each reading its
    parent's output hidden [R, H], seeing the row's context, its fed ancestors and itself (blocked [R, F + R]
    bool: True where it must not look, over the row's fed nodes in feed order and these). ``open``: nothing is
    blocked (one node whose fed nodes are all its ancestors: a chain's level), so the step needs no mask.
    ``block``: ``blocked`` as an additive mask [1, 1, R, F + R] built once (a static tree's level), or None.
    Result: (the outputs h' [R, H], their logits [R, V'])."""

    def __init__(self, proposer: EagleProposer, tokens, positions, hidden, blocked, open: bool = False,
                 block: torch.Tensor | None = None):
        self.key, self.proposer = proposer.head, proposer
        self.tokens, self.positions, self.hidden, self.blocked = tokens, positions, hidden, blocked
        self.open, self.block = open, block

    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        p, head = self.proposer, self.proposer.head
        graphed = p._level_graphed(self.tokens, self.hidden, self.positions, self.blocked)
        if graphed is not None:
            return graphed
        mask = None if self.open else F.pad(self.block, (p._seen, 0)) if self.block is not None else \
            additive_mask(self.blocked, p._seen, self.hidden.dtype)  # [1, 1, R, seen + F + R]
        out = head(self.tokens[None], self.hidden[None], self.positions[None], attention_mask=mask,
                   cache=p._cache)[0]  # [R, H]
        return out, few_rows_linear(*head.projection(out))

    @classmethod
    def run_together(cls, requests: list["Feed"], state: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        rows = state.get((cls, requests[0].key))
        if rows is None and len(requests) > 1:  # the round's first level: the rows that draft with this head
            rows = state[(cls, requests[0].key)] = StackedRows([r.proposer for r in requests])
        if rows is None:
            return [r.run() for r in requests]
        # a row outside the round's stack (not among the first level's rows) has its levels in its own cache
        stacked = [r for r in requests if id(r.proposer) in rows.index]
        done = dict(zip(map(id, stacked), rows.feed(stacked))) if stacked else {}
        return [done[id(r)] if id(r) in done else r.run() for r in requests]


class StackedRows:
    """One round's tree levels of several rows of a batch through one head, in one forward per level: the
    rows' draft caches stacked into one of B rows (``DraftCache.stacked``; a row's own cache is left as it
    was, holding only context), each level's nodes padded to the widest row's R. Row b's nodes see the
    slots of its own context, its own fed ancestors and themselves; a padding node sees only itself."""

    def __init__(self, proposers: list[EagleProposer]):
        self.head = proposers[0].head
        self.index = {id(p): b for b, p in enumerate(proposers)}
        self.cache, valid = DraftCache.stacked([p._cache for p in proposers], room=64)
        self.prefix = additive_mask(~valid, 0, self.head_dtype())[0, 0]  # [B, S]
        self.columns: list[list[int]] = [[] for _ in proposers]  # each row's fed nodes' cache slots, feed order
        self.fed = 0  # tree slots appended so far (every row's, padding included)

    def head_dtype(self) -> torch.dtype:
        return next(self.head.parameters()).dtype

    def feed(self, requests: list[Feed]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        b, (s, f) = len(self.columns), (self.prefix.shape[1], self.fed)
        width, dtype = max(r.tokens.shape[0] for r in requests), self.prefix.dtype
        device = self.prefix.device
        mask = torch.full((b, 1, width, s + f + width), torch.finfo(dtype).min, dtype=dtype, device=device)
        mask[:, 0, :, :s] = self.prefix[:, None]
        j = torch.arange(width, device=device)
        mask[:, 0, j, s + f + j] = 0.0  # every node sees itself (a padding node nothing else)
        tokens = torch.zeros(b, width, dtype=torch.long, device=device)
        positions = torch.zeros(b, width, dtype=torch.long, device=device)
        hidden = requests[0].hidden.new_zeros(b, width, requests[0].hidden.shape[-1])
        at = []
        for r in requests:
            row, n = self.index[id(r.proposer)], r.tokens.shape[0]
            cols = self.columns[row] + list(range(s + f, s + f + n))  # the row's fed nodes, then these
            if r.blocked.shape != (n, len(cols)):
                raise RuntimeError(f"a feed of {n} nodes after {len(self.columns[row])} masks {tuple(r.blocked.shape)}")
            block = additive_mask(r.blocked, 0, dtype)[0, 0]  # [n, F_row + n]
            mask[row, 0, :n].index_copy_(1, torch.tensor(cols, device=device), block)
            tokens[row, :n], positions[row, :n], hidden[row, :n] = r.tokens, r.positions, r.hidden
            self.columns[row] = cols
            at.append((row, n))
        self.fed += width
        out = self.head(tokens, hidden, positions, attention_mask=mask, cache=self.cache)  # [B, W, H]
        real = torch.cat([out[row, :n] for row, n in at])  # [sum R, H]
        logits = few_rows_linear(*self.head.projection(real))
        sizes = [n for _, n in at]
        return list(zip(real.split(sizes), logits.split(sizes)))
