"""The classic separate draft model (Leviathan et al. 2022, arXiv:2211.17192; Chen et al. 2023,
arXiv:2302.01318): a small causal LM with the target's tokenizer drafts a chain of gamma tokens,
or a tree of its top-k / without-replacement samples expanded level by level with tree attention
(a static tree, or an EAGLE-2 dynamic tree; the expansion is shared with EAGLE: inference/expand.py).

Its own KV cache always ends the round holding exactly the context (prompt + accepted tokens):
draft entries are cropped off, and the next round first feeds the tokens it has not seen (the
accepted ones and the target's bonus token) in one forward. That rolls back rejected drafts with
no bookkeeping and costs the same number of draft forwards as keeping accepted entries.
"""

from __future__ import annotations

import torch

from headway.inference.proposer import Draft, DraftContext, Proposer, root_only, sample_children
from headway.inference.expand import DynamicTree, Expansion, expand_dynamic, expand_static, feed_mask
from headway.inference.kv_cache import crop_to, new_cache
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
        self._context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self._vocab: tuple[int, int] | None = None  # (real vocabulary, target's vocab_size) when the draft's logits need fitting

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
            draft = self._chain(ctx, tree, logits)
        else:
            draft = expand_static(tree, ctx.root_token, logits, feed, ctx.sampling, ctx.generator, scored=ctx.scored)
        crop_to(self._cache, length)  # drop every draft entry: the cache holds the context only
        return draft

    def _chain(self, ctx: DraftContext, tree: Tree, logits: torch.Tensor) -> Draft:
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
                logits = self.fit_vocab(chain_forward(self.model, self._cache, tok[0], length + d))
        # the chain's draft probability so far at each node, left on the device until tree="auto" reads it
        scores = torch.cat([drawn[0].new_ones(1).float(), torch.cat(drawn).float().cumprod(0)]) if drawn else \
            [1.0] if ctx.scored else None
        return Draft(tree, torch.cat(tokens), q if ctx.sampling is not None else None, scores=scores)

    def _feed(self, length: int, device: torch.device):
        """The model run for the shared expansion: nodes after the cached context and the nodes fed."""
        def feed(exp: Expansion, nodes: list[int]) -> torch.Tensor:
            dtype = self.model.dtype
            mask = feed_mask(exp, nodes, length, dtype, device)  # [1, 1, R, length + F + R]
            ids = exp.token_ids(nodes, device)[None]
            positions = exp.node_depths(nodes, device)[None] + (length - 1)
            out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=self._cache,
                             use_cache=True)
            return self.fit_vocab(out.logits[0])  # [R, V]
        return feed
