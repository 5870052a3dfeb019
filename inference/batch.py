"""Batch > 1: every row speculates on its own, one target pass verifies all rows' trees together.

Prompts come as transformers' ``generate`` takes them: ``input_ids [B, T]`` left-padded with an
``attention_mask [B, T]``. Each row keeps its own drafter (``Proposer.fork``: shared weights, its own
state), its own context, accepted length and stopping; a round drafts a tree per row (side by side:
the rows' model steps of one drafter run as one pass, ``Proposer.propose_steps``; an EAGLE head runs
each level of every row's tree at once over its rows' stacked caches, Medusa heads all rows' states),
pads them to one width W and runs the target once over [B, W] with a 4D mask per row: row r's nodes see the
cache slots that hold row r's tokens and their own ancestors. The target's cache is one
``DynamicCache`` of B rows whose slots need not line up: a row that accepted fewer tokens than the
longest leaves masked-out holes (``valid``), squeezed out now and then (``repack_rows``). A row's
positions count its own tokens, so every row computes what its own single-row run computes, and its
output is that prompt's single-row output (greedy: ``target.generate`` on it; sampling: the target's
distribution, row by row). Rows that stop (EOS, their budget) leave the batch; their outputs are
padded with ``pad_token_id`` as ``generate`` pads them.

Each prompt's prefill runs alone, causally and without its padding, and its cache is laid into its
row (``prefill_rows``): that is its own single-row prefill, and a padded batch's prefill would compute
every pad slot under a 4D mask. With ``tree="auto"`` each row chooses its own tree from its drafter's
confidence, under the cost of widening a *batched* pass: a row's tree of k nodes costs t(B k)/t(B) of a
plain batched step (``BatchCost``); then, since every row is padded to the widest, one width W for the
pass is chosen for the whole batch, the one with the most expected tokens (summed over the rows) per
second (``fit_widths``), padded to the cheapest width at least as wide where that saves time (on a CPU
target with prepacked linears two rows of one token can cost more than two rows of two). So the trees
narrow as the batch fills, down to plain batched decoding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from headway.heads.target.features import FeatureCapture
from headway.inference import vocab_reduce
from headway.inference.auto import cheapest_width, host_scored_rows, prune
from headway.inference.kv_cache import (CACHE_SLACK, compact_rows, hidden_where, lay_rows, new_cache, repack_rows,
                                        select_rows)
from headway.inference.layerskip import EarlyRows
from headway.inference.processors import GenerationSetup, apply_processors
from headway.inference.proposer import Draft, DraftContext, Proposer, check_draft, greedy_read, root_draft, run_rows
from headway.inference.target_forward import padded_tree_tensors, prefill, verify_width
from headway.inference.verify import verify_greedy_logits

REPACK_WASTE = 0.25  # squeeze the cache's holes out once a repack would drop this share of its slots


def check_batch(input_ids, attention_mask, pad_token_id: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [B, T] and attention_mask [B, T] (ones when None and no row is padded), or a one-line
    ValueError: a padded batch without a mask, right padding, a row with no token, shapes that differ."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2 or ids.numel() == 0:
        raise ValueError(f"a batch is input_ids [B, T] with B, T >= 1, got shape {tuple(ids.shape)}")
    if attention_mask is None:
        if pad_token_id is not None and ids.shape[0] > 1 and bool((ids[:, 0] == pad_token_id).any()):
            raise ValueError(f"rows of this batch start with the pad token ({pad_token_id}) but no attention_mask was "
                             "given: pass the tokenizer's attention_mask (padding_side='left')")
        return ids, torch.ones_like(ids)
    mask = torch.as_tensor(attention_mask).to(ids.device)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(ids.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (tokens) only")
    mask = mask.long()
    drops = (mask[:, 1:] < mask[:, :-1]).any(1)  # [B]: a 0 after a 1
    if bool(drops.any()):
        holes = (drops & (mask[:, -1] == 1)).nonzero().flatten().tolist()  # ... then a 1 again
        if holes:
            raise ValueError(f"attention_mask row(s) {holes} have a hole (a 0 between tokens); speculative "
                             "generation takes left padding only: drop the masked tokens")
        raise ValueError("attention_mask shows right padding (a 0 after a 1); speculative generation takes left-padded "
                         "batches, as generate does: set tokenizer.padding_side = 'left'")
    empty = (mask.sum(1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"row(s) {empty} of the batch hold no token (attention_mask all 0)")
    return ids, mask


class BatchCost:
    """A row's view of the cost of a batched pass, for its ``AutoTree``: with ``rows`` rows, a row whose
    tree has k nodes costs t(rows * k) / t(rows) of a plain batched step, and its share of that step is
    t(rows) / rows seconds. (A pass over B rows of k tokens costs about what one row of B k tokens does:
    the linear layers see B k rows either way, and each row attends to its own prefix.) The batched
    passes' measured times correct the shared ``OnlineCost`` (``observe_pass``)."""

    def __init__(self, online, rows: int = 1):
        self.online, self.rows = online, rows

    def seconds(self, width: int, prefix_len: int, is_chain: bool = False) -> float:
        return self.online.seconds(self.rows * width, prefix_len, self.rows == 1 and is_chain) / self.rows

    def rel(self, width: int, prefix_len: int, is_chain: bool = False) -> float:
        return self.seconds(width, prefix_len, is_chain) / self.seconds(1, prefix_len, is_chain)

    def plain_passes(self) -> float:
        return float("inf")  # t(1)'s own correction comes from the batched passes' (observe_pass)

    def observe(self, *args) -> None:
        """Rows learn nothing about time on their own: the batch's pass is observed once (observe_pass)."""

    def observe_pass(self, width: int, prefix_len: int, seconds: float) -> None:
        self.online.observe(self.rows * width, prefix_len, False, seconds)


@dataclasses.dataclass
class Row:
    """One prompt of the batch and where it stands."""

    index: int  # its row in input_ids
    proposer: Proposer  # its own fork of the generator's drafter
    setup: GenerationSetup  # its processors and EOS ids (min_new_tokens counts from its own prompt)
    seq: torch.Tensor  # [T_r + max_new] its real tokens (no padding) on the device
    host: list[int]  # the same tokens on the host
    length: int  # tokens so far; the cache holds length - 1 of them
    stats: object  # its GenerationStats
    auto: object | None = None  # its AutoTree (tree="auto"), sharing the generator's calibration and cost
    features: torch.Tensor | None = None  # [n, F] features the drafter has not been shown yet
    ranked: tuple | None = None  # tree="auto": (this round's whole draft, its nodes best first, their E(k))


def propose_rows(gen, live: list[Row], max_new_tokens: int, sampling, generator, earlier: float = 0.0
                 ) -> tuple[list[Draft], list[bool]]:
    """Each row's draft this round and whether it drafted at all, as the single-row loop drafts. The rows
    that draft run side by side (``run_rows``): their drafters' model steps of one kind run in one pass
    (EAGLE: each tree level of every row through the head at once). Each row is charged an equal share of
    the drafting time, ``earlier`` seconds (drafting work done for this round after the last one) included."""
    t0 = time.perf_counter() - earlier
    drafted, steps = [], []
    for row in live:
        did = row.auto is None or row.auto.should_draft(row.proposer.gated)
        row.ranked = None
        ctx = DraftContext(row.seq[:row.length], row.features, gen.tree, max_new_tokens - row.stats.new_tokens - 1,
                           sampling, generator, gate=row.auto.gate if row.auto is not None else None,
                           host_tokens=row.host, scored=row.auto is not None)
        if did and row.auto is not None:  # a drafter that lost is tested first (AutoTree.probe_first)
            did, probed = row.auto.probe_first(row.proposer, ctx)
            if probed:
                row.features = row.features[-1:]
                ctx = dataclasses.replace(ctx, features=row.features)
        drafted.append(did)
        if did:
            steps.append(row.proposer.propose_steps(ctx))
    made = run_rows(steps)
    seconds = (time.perf_counter() - t0) / max(1, len(steps))
    if any(row.auto is not None for row in live):  # the rows' scores (and device trees' shapes) in one read
        made = host_scored_rows(made)
    made = iter(made)
    drafts = []
    for row, did in zip(live, drafted):
        if not did:
            drafts.append(root_draft(row.seq[:row.length]))
            continue
        draft = next(made)
        row.stats.time_draft += seconds
        if row.auto is not None:
            tc = time.perf_counter()
            full = draft  # its scores read above (host_scored_rows)
            draft = row.auto.select(full, row.length, seconds)
            row.ranked = (full, *row.auto.ranked)
            row.stats.time_control += time.perf_counter() - tc
        drafts.append(check_draft(row.proposer, draft))
    return drafts, drafted


def fit_widths(live: list[Row], drafts: list[Draft], cost: BatchCost, pad_to: int, prefix_len: int,
               cheapest: bool = True) -> tuple[list[Draft], int]:
    """tree="auto": one width for the whole pass. Every row is padded to the widest row's tree, so a row's own
    choice can cost the others; this verifies at most W nodes per row, W (1 being a plain batched step) the
    one whose expected new tokens, summed over the rows, per second of a [B, W] pass are the most. A row's W
    nodes are its best W (closed under parents; sampled children a prefix of their draw order), so its draft
    stays what its controller would have cut. Returns the drafts and the pass's width: W padded to the cheapest
    width at least as wide (``auto.cheapest_width``: on a CPU target with prepacked linears a pass over B W
    tokens may cost less wider, say 2 rows of 2 tokens against 2 of 1; ``cheapest`` False: ``pad_to`` alone),
    each W priced at its padded width."""
    rows = len(live)

    def seconds(width: int) -> float:
        return cost.online.seconds(rows * width, prefix_len)

    def padded(w: int) -> int:
        return cheapest_width(verify_width(w, pad_to), seconds) if cheapest else verify_width(w, pad_to)

    widest = max(d.tree.size for d in drafts)
    if widest == 1:
        return drafts, padded(1)

    def rate(w: int) -> float:
        tokens = sum(row.ranked[2][min(w, len(row.ranked[2])) - 1] if row.ranked else 1.0 for row in live)
        return tokens / seconds(padded(w))

    best = max(range(1, widest + 1), key=rate)
    out = []
    for row, draft in zip(live, drafts):
        if draft.tree.size > best and row.ranked is not None:
            full, order, _ = row.ranked
            draft = prune(full, sorted(order[:best]))
        out.append(draft)
    return out, padded(best)


def batch_inputs(drafts: list[Draft], lengths: list[int], valid: torch.Tensor, pad_to: int, dtype,
                 width: int | None = None):
    """One pass over every row's tree: (tokens [B, W], positions [B, W], additive mask [B, 1, W, S + W], W).

    Row r's tree is padded to W nodes, the widest tree's (padded to ``pad_to``) or ``width`` where that is
    wider (a padding node sees the prefix and itself); its nodes see the slots ``valid[r]`` marks as its own
    and their ancestors; positions are the row's own (its length minus one, the root's, plus the node's
    depth). valid: [B, S] bool.
    """
    device = valid.device
    width = max(width or 1, *(verify_width(d.tree.size, pad_to) for d in drafts))
    rows, slots = valid.shape
    tokens = torch.empty(rows, width, dtype=torch.long, device=device)
    positions = torch.empty(rows, width, dtype=torch.long, device=device)
    mask = torch.empty(rows, 1, width, slots + width, dtype=dtype, device=device)
    mask[:, 0, :, :slots] = hidden_where(~valid, dtype)[:, None, :]  # [B, W, S]
    for r, (draft, length) in enumerate(zip(drafts, lengths)):
        n = draft.tree.size
        tree_mask, depths = padded_tree_tensors(draft.tree, width, device, dtype)  # [W, W], [W]
        mask[r, 0, :, slots:] = tree_mask
        tokens[r, :n] = draft.tokens
        tokens[r, n:] = draft.tokens[0]
        positions[r] = depths + (length - 1)
    return tokens, positions, mask, width


def prefill_rows(target, cache, ids: torch.Tensor, mask: torch.Tensor, capture) -> tuple[torch.Tensor, list]:
    """Run each row's prompt but its last token into ``cache`` (B rows of T - 1 slots, each row's tokens in its
    last slots, as left padding puts them); returns (valid [B, T - 1] bool: the slots holding real tokens, each
    row's features of its prompt positions [n_r, F], or None).

    Each row runs alone, causally, without its padding: a padded batch's prefill computes every pad slot and
    loses the causal kernel to a 4D mask (8 task prompts of 37-365 tokens: 11.3 s padded), and a row's cache is
    then exactly its own single-row prefill's.
    """
    b, t = ids.shape
    valid = mask[:, :-1].bool()
    features = [None] * b
    if t == 1:
        return valid, features
    rows = []
    for r in range(b):
        prompt = ids[r][mask[r].bool()]  # [T_r]
        row_cache = new_cache(target, capacity=prompt.shape[0])
        if prompt.shape[0] > 1:
            prefill(target, row_cache, prompt[None, :-1])
            features[r] = capture.pop()[0] if capture is not None else None  # [T_r - 1, F]
        rows.append(row_cache)
    lay_rows(cache, rows, t - 1)
    return valid, features


def generate_batch(gen, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, sampling, generator, setups,
                   stats_type, profile: bool = False):
    """The batched loop behind ``SpeculativeGenerator.generate`` for B > 1 (see the module docstring).

    ids, mask: [B, T] left-padded; setups: each row's GenerationSetup (it runs under generate's no_grad). Returns (sequences
    [B, T + longest], aggregate stats, per-row stats)."""
    device, b, t = gen.device, ids.shape[0], ids.shape[1]
    pad_to = gen.resolved_pad_to()
    auto = gen._auto_controller()
    cost = BatchCost(auto.cost) if auto is not None else None
    rows = []
    for r in range(b):
        prompt = ids[r][mask[r].bool()]
        seq = torch.empty(prompt.shape[0] + max_new_tokens, dtype=torch.long, device=device)
        seq[:prompt.shape[0]] = prompt
        stats = stats_type(acceptance=gen.acceptance, lossy=gen.acceptance == "typical" and sampling is not None)
        row_auto = auto.fork(cost, pad_to) if auto is not None else None
        rows.append(Row(r, gen.drafter.fork(), setups[r], seq, prompt.tolist(), prompt.shape[0], stats, row_auto))
    total = stats_type(acceptance=gen.acceptance, lossy=rows[0].stats.lossy)
    capacity = t + max_new_tokens + CACHE_SLACK
    catch_up = 0.0  # seconds of the drafter's catch-up after the last verification (the next round's drafting)
    layers = gen.drafter.feature_layers
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda and (profile or auto is not None) else (lambda: None)
    with FeatureCapture(gen.target, layers) if layers else contextlib.nullcontext() as capture:
        t0 = time.perf_counter()
        # a draft model drafting chains: one draft cache for all rows, laid out as the target's (None: rows draft alone)
        chains = gen.drafter.batch_rows(ids, mask, capacity, max_new_tokens, gen.tree)
        cache = new_cache(gen.target, capacity=capacity)
        valid, prompt_features = prefill_rows(gen.target, cache, ids, mask, capture)
        for row, feats in zip(rows, prompt_features):
            row.features = feats
        total.time_prefill = time.perf_counter() - t0
        live = list(rows)  # the rows still generating, in the cache's row order
        while live:
            t0 = time.perf_counter()
            if cost is not None:
                cost.rows = len(live)
            early = None
            if gen.drafter.shares_target_cache:  # LayerSkip: the rows draft with the target's first layers, here
                early = EarlyRows(gen.target, cache, gen.drafter.exit_layer, valid,
                                  torch.tensor([row.host[-1] for row in live], device=device),
                                  torch.tensor([row.length - 1 for row in live], device=device))
                for i, row in enumerate(live):
                    row.proposer.use_rows(early, i)
            if chains is not None:
                for i, row in enumerate(live):
                    row.proposer.use_rows(chains, i)
            drafts, drafted = propose_rows(gen, live, max_new_tokens, sampling, generator, catch_up)
            if chains is not None:
                chains.end_round()
            # verification resumes from the early layers' states, over no more slots than they wrote: unpadded
            resumed = early is not None and early.steps > 0
            width_pad = 1 if resumed else pad_to
            run = None  # tree="auto": the pass's width (at least the widest tree's)
            if cost is not None:
                drafts, run = fit_widths(live, drafts, cost, width_pad, valid.shape[1], cheapest=not resumed)
            tokens, positions, attn, width = batch_inputs(drafts, [row.length for row in live], valid, width_pad,
                                                          gen.target.dtype, run)
            sync()
            t1 = time.perf_counter()
            if resumed:
                logits = early.resume(width, positions, attn)
            else:
                logits = gen.target(input_ids=tokens, position_ids=positions, attention_mask=attn, cache=cache,
                                    use_cache=True, logits_to_keep=width).logits
            sync()
            t2 = time.perf_counter()
            if cost is not None:
                cost.observe_pass(width, valid.shape[1], t2 - t1)
            captured = capture.pop() if capture else None  # [B, W, F]
            paths, news = accept_rows(gen, live, drafts, logits, sampling, generator)
            slots = valid.shape[1]
            leaving = [_advance(row, draft, path, new, did, max_new_tokens, width)
                       for row, draft, path, new, did in zip(live, drafts, paths, news, drafted)]
            for i, row in enumerate(live):
                if captured is not None and not leaving[i]:
                    rows_f = captured[i].index_select(0, torch.tensor(paths[i], device=device))  # [accepted, F]
                    row.features = rows_f if drafted[i] or row.features is None else torch.cat([row.features, rows_f])
            keep = [path if not leave else [] for path, leave in zip(paths, leaving)]
            kept = compact_rows(cache, slots, keep, width)
            grown = torch.tensor([[j < len(k) for j in range(kept)] for k in keep], dtype=torch.bool, device=device)
            valid = torch.cat([valid, grown.view(len(live), kept)], dim=1)
            stay = [i for i, leave in enumerate(leaving) if not leave]
            if any(leaving):
                index = torch.tensor(stay, dtype=torch.long, device=device)
                if stay:
                    select_rows(cache, index)
                    if chains is not None:
                        chains.select(index)
                valid = valid.index_select(0, index)
                live = [live[i] for i in stay]
            tc = time.perf_counter()
            if live and chains is not None:  # the draft cache takes in what the target's kept, and the new roots
                chains.catch_up([live[j].host[-len(paths[i]):] for j, i in enumerate(stay)], [r.length for r in live])
            catch_up = time.perf_counter() - tc
            if live and valid.shape[1] - int(valid.sum(1).max()) > REPACK_WASTE * valid.shape[1]:
                valid = repack_rows(cache, valid)  # the slots no row needs are over REPACK_WASTE of the cache
                if chains is not None:
                    chains.repack()
            t3 = time.perf_counter()
            total.time_draft += t1 - t0 + catch_up
            total.time_verify += t2 - t1
            total.time_bookkeeping += t3 - t2 - catch_up
            total.batch_passes += 1
    for row in rows:
        row.stats.probes = row.auto.probes if row.auto is not None else 0
        for name in ("new_tokens", "target_forward_passes", "plain_steps", "probes", "time_control"):
            setattr(total, name, getattr(total, name) + getattr(row.stats, name))
        total.accepted_per_step += row.stats.accepted_per_step
        total.draft_depth_per_step += row.stats.draft_depth_per_step
        total.verify_width_per_step += row.stats.verify_width_per_step
    pad = setups[0].pad_token_id if setups[0].pad_token_id is not None else 0  # rows never stop early without one
    longest = max(row.stats.new_tokens for row in rows)
    out = torch.full((b, t + longest), pad, dtype=torch.long, device=device)
    out[:, :t] = ids
    for row in rows:
        n = row.stats.new_tokens
        out[row.index, t:t + n] = row.seq[row.length - n:row.length]
    return out, total, [row.stats for row in rows]


def accept_rows(gen, live: list[Row], drafts: list[Draft], logits: torch.Tensor, sampling, generator):
    """(each row's accepted path, its new tokens) from the batched pass's logits [B, W, V]. Greedy rows (their
    logits processors, if any, applied first) are verified on the device and read in one go for the whole batch;
    sampled rows each through the generator's own acceptance."""
    paths, news = [None] * len(live), [None] * len(live)
    on_device = []
    for i, (row, draft) in enumerate(zip(live, drafts)):
        n = draft.tree.size
        row_logits = logits[i, :n]  # [N, V]
        if row.setup.processors:
            row_logits = apply_processors(row.setup.processors, row.seq[:row.length], draft.tree, draft.tokens,
                                          row_logits)
        observer = row.proposer if row.proposer.reads_outputs else None  # lookahead: the target's next tokens
        if sampling is None:
            leaf, bonus = verify_greedy_logits(draft.tree, draft.tokens, row_logits)
            tail = [] if observer is None else [vocab_reduce.argmax(row_logits)]  # [N]
            on_device.append((i, observer, greedy_read(draft, torch.stack([leaf, bonus]), tail)))
        else:
            paths[i], news[i] = gen._accept(draft, row_logits, sampling, generator, observer)
    if on_device:  # the round's one read for every greedy row
        flat = torch.cat([x for _, _, x in on_device]).tolist()
        at = 0
        for i, observer, x in on_device:
            paths[i], news[i] = gen.greedy_result(drafts[i].tree, flat[at:at + x.shape[0]], observer, drafts[i])
            at += x.shape[0]
    return paths, news


def _advance(row: Row, draft: Draft, path: list[int], new: list[int], drafted: bool, max_new_tokens: int,
             width: int) -> bool:
    """Append the round's new tokens to the row (cut at its budget and at EOS); True: the row is done."""
    if row.auto is not None:
        row.auto.observe(draft, path, row.length, drafted, 0.0, width)
    new, hit = cut_round(new, max_new_tokens - row.stats.new_tokens, row.setup.eos_token_ids)
    row.seq[row.length:row.length + len(new)] = torch.tensor(new, dtype=torch.long, device=row.seq.device)
    row.host += new
    row.length += len(new)
    stats = row.stats
    stats.new_tokens += len(new)
    stats.target_forward_passes += 1
    stats.plain_steps += draft.tree.size == 1
    stats.accepted_per_step.append(len(new))
    stats.draft_depth_per_step.append(draft.tree.depth)
    stats.verify_width_per_step.append(width)
    return hit or stats.new_tokens >= max_new_tokens


def cut_round(new: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """A round's new tokens cut to the budget and right after the first EOS; (tokens, whether EOS came)."""
    new = new[:budget]
    hit = next((i for i, tok in enumerate(new) if tok in eos), None)
    return (new, False) if hit is None else (new[:hit + 1], True)
