"""The classic separate draft model (Leviathan et al. 2022, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318): a small causal LM with the target's tokenizer drafts a chain of gamma tokens,
or a tree of its top-k / without-replacement samples expanded level by level with tree attention
(a static tree, or an EAGLE-2 dynamic tree; the expansion is shared with EAGLE: inference/expand.py).

Its own KV cache always ends the round holding exactly the context (prompt + accepted tokens):
draft entries are cropped off, and the next round first feeds the tokens it has not seen (the
accepted ones and the target's bonus token) in one forward. That rolls back rejected drafts with
no bookkeeping and costs the same number of draft forwards as keeping accepted entries.

A batch drafting chains (the default tree) keeps one draft cache for all its rows (``ChainRows``),
laid out as the target's batch cache is, so each chain step is one draft forward over every row.
"""

from __future__ import annotations

import torch

from headway.inference.proposer import (Draft, DraftContext, Proposer, RowStep, root_only, run_alone,
                                        sample_children)
from headway.inference.expand import (DynamicTree, Expansion, expand_dynamic, expand_static, feed_block, feed_mask,
                                      grow_dynamic, grow_static)
from headway.inference.kv_cache import crop_to, hidden_where, lay_rows, new_cache, repack_rows, select_rows, step_mask
from headway.inference.tree import Tree, chain
from headway.inference.target_forward import chain_forward, check_attention


def vocab_size(model) -> int:
    return model.config.get_text_config().vocab_size


def local_tokenizer_vocab(model) -> dict | None:
    """The vocabulary of the tokenizer saved beside a model loaded from a local folder, else None."""
    from pathlib import Path

    folder = Path(getattr(model, "name_or_path", "") or "")
    if not str(folder) or not folder.is_dir() or not any(
            (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from headway.heads.target import load_tokenizer

    return load_tokenizer(str(folder)).get_vocab()


class DraftModelProposer(Proposer):
    """A transformers causal LM sharing the target's tokenizer; default tree: a chain of ``gamma``.

    When both models were loaded from local folders that hold their tokenizers (or ``tokenizer`` /
    ``target_tokenizer`` are given), the tokenizers' vocabularies must be identical: same-sized
    vocabularies with other token ids would make every draft wrong while looking valid. The
    embedding sizes may differ only by padding past that shared vocabulary (Qwen2.5-0.5B has
    151,936 rows, 7B 152,064): the draft's logits are then cut to the real vocabulary and widened
    to the target's with -inf, so it never proposes a padding id. At bind the draft model moves to
    the target's device and dtype.
    """

    def __init__(self, model, gamma: int = 4, tokenizer=None, target_tokenizer=None):
        if gamma < 1:
            raise ValueError(f"gamma (draft tokens per round) must be >= 1, got {gamma}")
        self.model = model.eval()
        self.gamma = gamma
        self._tokenizers = (tokenizer, target_tokenizer)
        self._default = chain(gamma)
        self._cache = None
        self._cached = 0  # context tokens whose keys/values are in the cache
        self._rows: tuple[ChainRows, int] | None = None  # a batch's row this round: the batch's draft cache, its row
        self._context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._vocab: tuple[int, int] | None = None  # (real vocabulary, target's vocab_size) when the draft's logits need fitting
        self._dtype = model.dtype  # its masks' (a round reads it here, not from a walk over its parameters)

    def bind(self, target_model) -> None:
        target_vocab, draft_vocab = vocab_size(target_model), vocab_size(self.model)
        draft_tok, target_tok = self._tokenizers
        mine = draft_tok.get_vocab() if draft_tok is not None else local_tokenizer_vocab(self.model)
        theirs = target_tok.get_vocab() if target_tok is not None else local_tokenizer_vocab(target_model)
        if mine is not None and theirs is not None and mine != theirs:
            differ = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
            raise ValueError(f"the draft model's tokenizer differs from the target's (e.g. {differ}): "
                             "use a draft model trained with the target's tokenizer")
        real = max(mine.values()) + 1 if mine is not None and theirs is not None else None
        if target_vocab != draft_vocab and (real is None or real > min(target_vocab, draft_vocab)):
            raise ValueError(f"draft model vocab_size {draft_vocab} does not match the target's vocab_size {target_vocab}"
                             + (": the draft model must share the target's tokenizer and vocabulary" if real else
                                "; if both share one tokenizer and only the embedding padding differs, pass "
                                "DraftModelProposer(model, tokenizer=..., target_tokenizer=...) so the shared "
                                "vocabulary can be checked"))
        self._vocab = (real, target_vocab) if real is not None and (real < draft_vocab or draft_vocab != target_vocab) \
            else None
        param = next(self.model.parameters())
        device, dtype = next(target_model.parameters()).device, target_model.dtype
        if getattr(self.model, "is_quantized", False):  # a quantized draft keeps its own weights
            if param.device != device:
                self.model.to(device)
        elif param.device != device or (param.is_floating_point() and param.dtype != dtype):
            self.model.to(device=device, dtype=dtype)
        self._dtype = self.model.dtype

    def fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V_draft] -> [..., V_target]: ids past the shared vocabulary get -inf (identity when none)."""
        if self._vocab is None:
            return logits
        real, target_vocab = self._vocab
        out = logits.new_full((*logits.shape[:-1], target_vocab), float("-inf"))
        out[..., :real] = logits[..., :real]
        return out

    def default_tree(self) -> Tree:
        return self._default

    def check_tree(self, tree: Tree) -> None:
        if not tree.is_chain:
            check_attention(self.model)  # tree drafting needs the 4D mask too

    def resolve_tree(self, spec):
        """A static tree, or EAGLE-2 dynamic settings ``{"depth", "top_k", "total_tokens"}``."""
        if isinstance(spec, dict):
            check_attention(self.model)
            return DynamicTree.from_spec(spec)
        return super().resolve_tree(spec)

    def use_graphs(self, backend, strict: bool = False) -> str | None:
        return "the draft model's step is not captured in a graph (a transformers model over a growing cache)"

    def reset(self) -> None:
        self._cache = new_cache(self.model)
        self._cached = 0
        self._rows = None

    def use_rows(self, rows: "ChainRows", row: int) -> None:
        """A batch's row this round: its chain steps run with the other rows' over the batch's draft cache."""
        self._rows = (rows, row)

    def batch_rows(self, ids: torch.Tensor, mask: torch.Tensor, capacity: int, max_new_tokens: int,
                   tree) -> "ChainRows | None":
        """A batch [B, T] with its mask, drafting ``tree`` (a static tree or dynamic settings; None: the default):
        one draft cache for every row (``ChainRows``) when every draft fits the draft model's positions; None: each
        row drafts on its own."""
        tree = self.default_tree() if tree is None else tree
        if not isinstance(tree, (Tree, DynamicTree)):
            return None
        if self._context is not None and ids.shape[1] + max_new_tokens + tree.depth + 1 > self._context:
            return None  # a row may run past the draft's window, where a lone row stops drafting
        return ChainRows(self, ids, mask, capacity)

    def propose_steps(self, ctx: DraftContext):
        """A batch's row: its chain or tree over the batch's draft cache, each step or level a request the rows run
        together (``ChainStep``, ``TreeFeed``); drafted alone otherwise."""
        if self._rows is None:
            return self.propose(ctx)
        rows, row = self._rows
        tree, logits = self.default_tree() if ctx.tree is None else ctx.tree, rows.root_logits[row]  # [V]
        if isinstance(tree, DynamicTree):
            growth = grow_dynamic(tree, ctx.max_depth, ctx.root_token, logits)
        else:
            tree = tree.truncate(ctx.max_depth)
            if tree.size == 1:
                return root_only(ctx)
            if tree.is_chain:
                return (yield from self._chain(ctx, tree, logits))
            growth = grow_static(tree, ctx.root_token, logits, ctx.sampling, ctx.generator, scored=ctx.scored)
        try:  # each level's feed a request: the rows' levels run as one forward (ChainRows.feed)
            exp, nodes = next(growth)
            while True:
                exp, nodes = growth.send((yield TreeFeed(self, exp, nodes)))
        except StopIteration as done:
            return done.value

    @torch.no_grad()
    def propose(self, ctx: DraftContext) -> Draft:
        if self._cache is None:
            self.reset()
        length = ctx.tokens.shape[0]
        room = self._context - length if self._context else ctx.max_depth  # positions left in the draft's window
        if room < 0:
            return root_only(ctx)  # past the draft model's context: no drafting, plain decoding speed
        tree = self.default_tree() if ctx.tree is None else ctx.tree
        if isinstance(tree, Tree):
            tree = tree.truncate(min(ctx.max_depth, room))
        if self._cached >= length:  # defensive: the root must be fed to get its distribution
            crop_to(self._cache, length - 1)
            self._cached = length - 1
        logits = self.fit_vocab(chain_forward(self.model, self._cache, ctx.tokens[self._cached:], self._cached))  # [V]
        self._cached = length
        feed = self._feed(length, ctx.tokens.device)
        if isinstance(tree, DynamicTree):
            draft = expand_dynamic(tree, min(ctx.max_depth, room), ctx.root_token, logits, feed)
        elif tree.size == 1:
            return root_only(ctx)
        elif tree.is_chain:
            draft = run_alone(self._chain(ctx, tree, logits))
        else:
            draft = expand_static(tree, ctx.root_token, logits, feed, ctx.sampling, ctx.generator, scored=ctx.scored)
        crop_to(self._cache, length)  # drop every draft entry: the cache holds the context only
        return draft

    def _chain(self, ctx: DraftContext, tree: Tree, logits: torch.Tensor):
        """The chain after the root's logits [V], each step a ``ChainStep``."""
        length = ctx.tokens.shape[0]
        tokens, q, drawn = [ctx.tokens[-1:]], {}, []
        for d in range(tree.depth):
            tok, dist = sample_children(logits[None], 1, ctx.sampling, ctx.generator)  # [1, 1], [1, V]
            tokens.append(tok[0])
            if ctx.scored:  # [1], on the device
                drawn.append((dist[0] if dist is not None else logits.float().softmax(-1))[tok[0]])
            if dist is not None:
                q[d] = dist[0]
            if d + 1 < tree.depth:
                logits = yield ChainStep(self, tok[0], length + d)  # [V]
        # the chain's draft probability so far at each node, left on the device until tree="auto" reads it
        scores = torch.cat([drawn[0].new_ones(1).float(), torch.cat(drawn).float().cumprod(0)]) if drawn else \
            [1.0] if ctx.scored else None
        return Draft(tree, torch.cat(tokens), q if ctx.sampling is not None else None, scores=scores)

    def _feed(self, length: int, device: torch.device):
        """The model run for the shared expansion: nodes after the cached context and the nodes fed."""
        def feed(exp: Expansion, nodes: list[int]) -> torch.Tensor:
            mask = feed_mask(exp, nodes, length, self._dtype, device)  # [1, 1, R, length + F + R]
            ids = exp.token_ids(nodes, device)[None]
            positions = exp.positions(nodes, length - 1, device)[None]
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=self._cache,
                             use_cache=True)
            return self.fit_vocab(out.logits[0])  # [R, V]
        return feed


class ChainStep(RowStep):
    """The draft model over a row's latest chain token [1] at ``position``: the logits after it [V] (over the
    target's vocabulary). A batch's rows' steps run as one forward over the batch's draft cache (``ChainRows``)."""

    def run(self) -> torch.Tensor:
        p = self.proposer
        return p.fit_vocab(chain_forward(p.model, p._cache, self.token, self.position))


class TreeFeed(RowStep):
    """A level of a row's tree: ``nodes`` of the expansion ``exp`` through the draft model after the row's context
    -> their logits [R, V]. A batch's rows' levels run as one forward over the batch's draft cache (``ChainRows``)."""

    def __init__(self, proposer: DraftModelProposer, exp: Expansion, nodes: list[int]):
        super().__init__(proposer, None, 0)
        self.exp, self.nodes = exp, nodes

    def run(self) -> torch.Tensor:
        raise RuntimeError("TreeFeed runs in a batch's rows only (a lone row feeds its levels in propose)")

    @classmethod
    def run_rows(cls, rows: "ChainRows", requests: dict[int, "TreeFeed"]) -> dict[int, torch.Tensor]:
        return rows.feed({row: (r.exp, r.nodes) for row, r in requests.items()})


class ChainRows:
    """A batch's draft model over one cache of B rows, laid out as the target's batch cache
    (``headway.inference.batch``): the same slots and holes, plus a last column holding each row's root.
    Its rows draft chains (``step``) or trees (``feed``: each level's nodes of every row in one forward).

    Built from the prompts (each run alone, causally, its whole prompt laid into its row: the target's
    prompt slots, then the root), which gives every row's root logits. A round's chain steps (``step``) each
    append one slot to every row (a row not drafting steps on its last token, never seen by its others) and
    are cropped at the round's end (``end_round``). After verification, once the target's cache has kept each
    row's accepted path (the old root and its accepted tokens) and dropped the rows that left, ``catch_up``
    feeds every row's accepted tokens and its new root in one forward: the old root's slot is the target's
    first kept slot, the accepted tokens take the target's next ones (a row that kept fewer leaves the same
    holes), the new root the last column, and its logits are the next round's. ``select`` and ``repack`` follow
    the target cache's row removals and repacks, which then keep the two layouts equal.
    valid: [B, S + 1] bool, the target's validity mask and the root column.
    """

    def __init__(self, proposer: DraftModelProposer, ids: torch.Tensor, mask: torch.Tensor, capacity: int):
        self.proposer, model = proposer, proposer.model
        self.cache = new_cache(model, capacity=capacity)
        caches, logits = [], []
        for r in range(ids.shape[0]):
            prompt = ids[r][mask[r].bool()]  # [T_r]
            caches.append(new_cache(model, capacity=prompt.shape[0]))
            logits.append(chain_forward(model, caches[-1], prompt, 0))  # [V_draft]
        lay_rows(self.cache, caches, ids.shape[1])
        self.root_logits = proposer.fit_vocab(torch.stack(logits))  # [B, V]
        self.valid = mask.bool().clone()  # [B, T]: the target's T - 1 prompt slots and the root column
        self.tokens = ids[:, -1].clone()  # [B] each row's latest token (its root, then its chain's)
        self.starts = mask.sum(1) - 1  # [B] each row's root position
        self.chain = torch.zeros(ids.shape[0], 0, dtype=torch.bool, device=ids.device)
        self.end_round()

    def step(self, tokens: dict[int, torch.Tensor]) -> torch.Tensor:
        """Rows' next chain tokens {row: [1] long} (the other rows repeat theirs) -> every row's logits [B, V]."""
        for row, token in tokens.items():
            self.tokens[row] = token[0]
        self.steps += 1
        seen = torch.cat([self.valid, self.chain], 1)  # [B, S + C]: a chain step sees the context and its chain
        mask = step_mask(seen, 1, self.proposer._dtype)  # [B, 1, 1, S + C + 1]
        out = self.proposer.model(input_ids=self.tokens[:, None], position_ids=(self.starts + self.steps)[:, None],
                                  attention_mask=mask, cache=self.cache, use_cache=True)
        self.chain = torch.cat([self.chain, self.chain.new_ones(self.chain.shape[0], 1)], 1)
        return self.proposer.fit_vocab(out.logits[:, 0])

    def feed(self, parts: dict[int, tuple[Expansion, list[int]]]) -> dict[int, torch.Tensor]:
        """Rows' next tree level {row: (its expansion, the nodes to feed)} in one forward of R columns a row (R the
        most nodes; a row feeding fewer, or none, pads with columns that see only themselves) -> {row: the nodes'
        logits [R_b, V]}. A node sees its row's context, its fed ancestors and itself (``feed_block``)."""
        model, device = self.proposer.model, self.valid.device
        (b, s), c = self.valid.shape, self.chain.shape[1]
        r = max(len(nodes) for _, nodes in parts.values())
        seen = torch.zeros(b, r, s + c + r, dtype=torch.bool, device=device)  # [B, R, S + C + R]
        seen[:, torch.arange(r, device=device), s + c + torch.arange(r, device=device)] = True  # each column itself
        ids = self.tokens[:, None].repeat(1, r)  # [B, R]
        positions = self.starts[:, None].repeat(1, r)  # [B, R]
        for row, (exp, nodes) in parts.items():
            n, fed = len(nodes), self.fed_cols[row]
            sees = ~feed_block(exp, nodes, device)  # [n, F + n]: the row's fed nodes (feed order), then these
            seen[row, :n, :s] = self.valid[row]
            if fed:
                seen[row, :n, s + torch.tensor(fed, device=device)] = sees[:, :len(fed)]
            seen[row, :n, s + c:s + c + n] = sees[:, len(fed):]
            ids[row, :n] = exp.token_ids(nodes, device)
            positions[row, :n] += exp.node_depths(nodes, device)
            self.fed_cols[row] = fed + list(range(c, c + n))
        out = model(input_ids=ids, position_ids=positions, attention_mask=hidden_where(~seen, model.dtype)[:, None],
                    cache=self.cache, use_cache=True)
        self.chain = torch.cat([self.chain, self.chain.new_zeros(b, r)], 1)  # no chain step sees a tree's columns
        logits = self.proposer.fit_vocab(out.logits)  # [B, R, V]
        return {row: logits[row, :len(nodes)] for row, (_, nodes) in parts.items()}

    def end_round(self) -> None:
        """Drop the round's chain steps and tree levels: the cache holds the context again."""
        if self.chain.shape[1]:
            self.cache.crop(-self.chain.shape[1])
        self.steps = 0  # chain steps this round
        self.chain = torch.zeros(self.valid.shape[0], 0, dtype=torch.bool, device=self.valid.device)  # [B, C]: the
        # round's columns a row's chain steps see (its own steps'; not a tree level's)
        self.fed_cols: list[list[int]] = [[] for _ in range(self.valid.shape[0])]  # each row's fed tree nodes' columns

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` [B'] long, in that order (the target's ``batch_select_indices``)."""
        select_rows(self.cache, index)
        self.valid, self.tokens = self.valid.index_select(0, index), self.tokens.index_select(0, index)
        self.starts, self.root_logits = self.starts.index_select(0, index), self.root_logits.index_select(0, index)
        self.chain = self.chain.index_select(0, index)
        self.end_round()

    def repack(self) -> None:
        """Squeeze the holes out as the target's ``repack_rows`` does (each row's valid slots moved to the end: the
        same layout, the root column last)."""
        self.valid = repack_rows(self.cache, self.valid)

    def catch_up(self, news: list[list[int]], lengths: list[int]) -> None:
        """Each row's round made ``news[r]`` (its accepted tokens, then the new root; the target kept its old root
        and the accepted ones), its length now ``lengths[r]``: feed them in one forward [B, K] (K the longest),
        the accepted tokens into the columns the target filled, the new root into the last."""
        b, s = self.valid.shape
        k = max(map(len, news))
        device, dtype = self.valid.device, self.proposer._dtype
        tokens = torch.tensor([new[:-1] + [new[-1]] * (k - len(new) + 1) for new in news], device=device)  # [B, K]
        positions = torch.tensor([list(range(n - len(new), n - 1)) + [n - 1] * (k - len(new) + 1)
                                  for new, n in zip(news, lengths)], device=device)  # [B, K]
        filled = torch.tensor([[j < len(new) - 1 or j == k - 1 for j in range(k)] for new in news], device=device)
        # [B, K, K]: a column sees the filled columns up to itself, a hole itself only
        seen = (filled[:, None, :] & torch.ones(k, k, dtype=torch.bool, device=device).tril()) | \
            torch.eye(k, dtype=torch.bool, device=device)
        mask = torch.cat([self.valid[:, None, :].expand(b, k, s), seen], dim=2)  # [B, K, S + K]
        out = self.proposer.model(input_ids=tokens, position_ids=positions, cache=self.cache, use_cache=True,
                                  attention_mask=hidden_where(~mask, dtype)[:, None])
        self.root_logits = self.proposer.fit_vocab(out.logits[:, -1])  # [B, V]
        self.valid = torch.cat([self.valid, filled], dim=1)
        self.tokens = tokens[:, -1].clone()
        self.starts = torch.tensor(lengths, device=device) - 1
