"""Verification of a draft tree against the target's logits (pure functions).

- Greedy: accept the longest path whose tokens equal the target's argmax, then the argmax bonus.
- Lossless sampling, chain: Leviathan et al. 2022 (arXiv:2211.17192) / Chen et al. 2023
  (arXiv:2302.01318): accept x ~ q with min(1, p(x)/q(x)), else sample norm(max(0, p - q)).
- Lossless sampling, tree: recursive rejection over siblings, SpecInfer (Miao et al. 2023,
  arXiv:2305.09781) / EAGLE (Li et al. 2024, arXiv:2401.15077): children are tried in rank order;
  after a rejection p <- norm(max(0, p - q)) and the rejected token is removed from q.
- Typical acceptance, Medusa (Cai et al. 2024, arXiv:2401.10774): LOSSY, opt-in only.

Trees come as ``children`` lists (node 0 is the root); ``tokens[i]`` is node i's token.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from headway.inference import vocab_reduce


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The sampling settings applied identically to target and draft distributions."""

    temperature: float = 1.0  # > 0; 0 means greedy and is handled without these params
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set with mass >= top_p; 1.0 keeps all

    def __post_init__(self):
        check_sampling_args(self.temperature, self.top_k, self.top_p)


def check_sampling_args(temperature: float, top_k: int, top_p: float) -> None:
    if not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 keeps every token), got {top_k}")
    if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def process_logits(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (as transformers' warpers); removed tokens get -inf.

    logits: [..., V] -> float32 [..., V]. The same function must shape both the target's p and the
    draft's q, or the acceptance test no longer proves anything.
    """
    if temperature <= 0:
        raise ValueError("process_logits needs temperature > 0; greedy decoding uses argmax")
    x = logits.float() / temperature
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = x.sort(dim=-1, descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = cum <= (1.0 - top_p)  # the low tail with mass <= 1 - top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        x = x.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return x


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(process_logits(logits)): [..., V] -> float32 [..., V]."""
    return process_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)


class LazyProbs:
    """Row i of ``probs(logits, params)`` computed on first access: verification visits only
    the accepted path and its siblings, so top-p sorts over the other rows are skipped."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams):
        self.logits, self.params, self._rows = logits, params, {}

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self._rows:
            self._rows[i] = probs(self.logits[i], self.params)
        return self._rows[i]


def sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution p [V]."""
    return int(draw(p, generator))


def draw(p: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token from each distribution p [..., V] -> [..., 1], as ``torch.multinomial``; a distribution that holds
    NaN or inf (a logits processor's NaN scores, or every token masked) is one line naming the cause, not torch's
    message from inside the sampler. (On CUDA torch checks it on the device, where no error comes back.)"""
    try:
        return torch.multinomial(p, 1, generator=generator)
    except RuntimeError as exc:
        if "probability tensor" not in str(exc):
            raise
        raise ValueError("the target's sampling distribution holds NaN, inf or negative values: a logits_processor "
                         "(or a generation setting) returned NaN scores or masked every token; processors must "
                         "return finite scores or -inf, leaving at least one token") from None


def _uniform(p: torch.Tensor, generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator, device=p.device))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [V]; p itself when the residual has no mass (rejection had probability 0)."""
    r = (p - q).clamp_min_(0.0)
    z = r.sum()
    return r / z if z > 0 else p


def remove_candidate(p: torch.Tensor, x: int) -> torch.Tensor:
    """p with token x removed, renormalised: the residual when the draft was the one-hot on x."""
    r = p.clone()
    r[x] = 0.0
    z = r.sum()
    return r / z if z > 0 else p


# --- greedy ----------------------------------------------------------------------------------

def verify_greedy(children: Sequence[Sequence[int]], tokens: Sequence[int],
                  argmax: Sequence[int]) -> tuple[list[int], int]:
    """Longest path of tokens equal to the target's argmax, then the argmax bonus token.

    children: [N][*] child nodes; tokens: [N] node tokens; argmax: [N] the target's argmax at each
    node. Returns (accepted node indices starting with the root 0, bonus token).
    """
    node, path = 0, [0]
    while True:
        want = argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        node = nxt
        path.append(node)


def verify_greedy_tensors(ancestors: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor,
                          argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_greedy`` as tensor ops on the device, with no read: (the accepted leaf [], bonus token []).

    ancestors: [N, N] float, 1 where column j is a non-root ancestor-or-self of row i (``Tree.greedy_tensors``);
    parents: [N] long (the root's own index 0 in place of -1); depths: [N] float; tokens, argmax: [N] long. A node
    is accepted when every node on its root-to-node path holds the token the target's argmax chose at that node's
    parent; the deepest accepted node is the leaf (the first in node order on a tie, which only duplicate siblings
    can make: there ``verify_greedy`` keeps the first matching child even when another reaches deeper; both paths
    carry the target's own greedy tokens). The path is the leaf's ancestors (``node_path`` on the host tree).
    """
    leaf = greedy_leaf(ancestors, parents, depths, tokens, argmax)
    return leaf, argmax[leaf]


def greedy_leaf(ancestors: torch.Tensor, parent_rows: torch.Tensor, depths: torch.Tensor, tokens: torch.Tensor,
                choices: torch.Tensor) -> torch.Tensor:
    """The accepted leaf [] of ``verify_greedy_tensors``, the target's choice after node i's parent being
    ``choices[parent_rows[i]]`` (choices: [R] long, one per row of the target's logits it was taken from).

    Node i's depth less N for each mismatch on its path (its non-root ancestors' row of ``ancestors`` times the
    mismatches, one ``addmv``): negative unless every node on the path matches, so the argmax is the deepest
    accepted node, the first on a tie (the root's 0 at least). Five ops where a boolean form takes nine; exact in
    float32 while N * N < 2 ** 24."""
    mismatch = (tokens != choices[parent_rows]).to(depths.dtype)  # [N] (the root's row of ancestors is all 0)
    return torch.addmv(depths, ancestors, mismatch, alpha=-float(tokens.shape[0])).argmax()


def verify_greedy_logits(tree, tokens: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``verify_greedy_tensors`` from the target's logits [N, V] at the tree's nodes (tokens [N] long): (the
    accepted leaf [], the bonus token []), no read. The argmax over the vocabulary, a CPU's costliest part
    of verifying, is taken only at the nodes with children, and then at the leaf for the bonus token, where
    that is fewer rows than N (a Medusa tree-15 needs 6 of 16; a chain needs all N, so it takes them at once)."""
    ancestors, parents, depths = tree.greedy_tensors(logits.device)
    inner = tree.inner_rows(logits.device)
    if inner is None:
        return verify_greedy_tensors(ancestors, parents, depths, tokens, vocab_reduce.argmax(logits))
    rows, parent_rows = inner  # [I] the nodes with children; [N] each node's parent's place among them
    leaf = greedy_leaf(ancestors, parent_rows, depths, tokens, vocab_reduce.argmax(logits.index_select(0, rows)))
    return leaf, vocab_reduce.argmax(logits.index_select(0, leaf[None])[0])


# --- lossless sampling -----------------------------------------------------------------------

def verify_sampling(children: Sequence[Sequence[int]], tokens: Sequence[int], p, q,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Lossless recursive rejection sampling over a tree (a chain is the one-child case).

    p: target probabilities, indexable by node -> [V] (a [N, V] tensor or ``LazyProbs``).
    q: indexable by node -> [V]: the distribution each node's children were drawn from *without
       replacement, in sibling order* (a chain: one draw), or None for deterministic candidates
       (top-k, copied n-grams): then the draft is the one-hot on the candidate, accepted with
       probability p(x).
    Returns (accepted node indices starting with the root 0, the next token drawn from the final
    residual or, after a leaf, from the target's distribution there).
    """
    node, path = 0, [0]
    while True:
        p_cur = p[node]
        kids = children[node]
        q_cur = q[node] if q is not None and kids else None
        nxt = None
        for c in kids:
            x = tokens[c]
            px = float(p_cur[x])
            if q_cur is None:  # deterministic draft: q = one-hot(x), accept with min(1, p(x) / 1)
                if _uniform(p_cur, generator) < px:
                    nxt = c
                    break
                p_cur = remove_candidate(p_cur, x)  # norm(max(0, p - one_hot(x)))
                continue
            qx = float(q_cur[x])
            if qx <= 0.0:  # not a real draw (the draft ran out of support): it proposes nothing
                continue
            if _uniform(p_cur, generator) * qx < px:  # accept with min(1, p(x) / q(x))
                nxt = c
                break
            p_cur = residual(p_cur, q_cur)
            q_cur = remove_candidate(q_cur, x)  # the next sibling was drawn from q without x
        if nxt is None:
            return path, sample(p_cur, generator)
        node = nxt
        path.append(node)


def verify_sampling_tensors(children: torch.Tensor, depth: int, tokens: torch.Tensor, p: torch.Tensor,
                            q: torch.Tensor | None, generator: torch.Generator | None = None) -> torch.Tensor:
    """``verify_sampling`` as tensor ops on the device, with no read: [2] long (the accepted leaf, the next token).

    children: [N, K] long, node i's children in sibling order, -1 padding, and the tree's depth
    (``Tree.sampling_tensors``); tokens:
    [N] long; p: [N, V] the target's processed distributions; q: [N, V] the distribution each node's children
    were drawn from (rows of childless nodes unread), or None for deterministic candidates (the one-hot rule).
    The same rule, step for step: each level tries the current node's children in order (accept with
    min(1, p(x)/q(x)); on a rejection p becomes the residual and q loses x; a child with q(x) = 0 proposes
    nothing), moves to the accepted child or stops; the next token is drawn from the final p. Every uniform is
    drawn up front ([depth, K], on p's device), so the host reads nothing until the caller reads the result
    (the path is the leaf's ancestors: ``node_path`` on the host tree).
    """
    k = children.shape[1]
    u = torch.rand((depth, k), generator=generator, device=p.device)
    node = torch.zeros((), dtype=torch.long, device=p.device)
    done = torch.zeros((), dtype=torch.bool, device=p.device)
    p_cur, q_cur = p[0], None if q is None else q[0]
    for level in range(depth):
        kids = children[node]  # [K]
        found = torch.zeros((), dtype=torch.bool, device=p.device)
        chosen = node
        for j in range(k):
            c = kids[j]
            x = tokens[c.clamp_min(0)]
            active = ~done & ~found & (c >= 0)
            px = p_cur[x]
            if q_cur is None:  # deterministic: accept with p(x); on a rejection p loses x
                accept = active & (u[level, j] < px)
                p_cur = torch.where(active & ~accept, _without(p_cur, x), p_cur)
            else:
                qx = q_cur[x]
                real = active & (qx > 0)  # a draw outside the draft's support proposes nothing
                accept = real & (u[level, j] * qx < px)
                rejected = real & ~accept
                p_cur = torch.where(rejected, _residual(p_cur, q_cur), p_cur)
                q_cur = torch.where(rejected, _without(q_cur, x), q_cur)
            chosen = torch.where(accept, c, chosen)
            found = found | accept
        node = chosen
        done = done | ~found
        p_cur = torch.where(found, p[node], p_cur)
        if q is not None:
            q_cur = torch.where(found, q[node], q_cur)
    nxt = draw(p_cur, generator)[0]
    return torch.stack([node, nxt])


def q_rows(q, n: int, like: torch.Tensor) -> torch.Tensor | None:
    """A draft's q (None, [N, V] rows, or {node: [V]} for the nodes with children) as [N, V] float32 rows on
    ``like``'s device (zeros for the nodes without)."""
    if q is None or isinstance(q, torch.Tensor):
        return q
    rows = torch.zeros((n, like.shape[-1]), dtype=torch.float32, device=like.device)
    for node, row in q.items():
        rows[node] = row
    return rows


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``residual`` without a read: norm(max(0, p - q)), or p when that has no mass."""
    r = (p - q).clamp_min(0.0)
    z = r.sum()
    return torch.where(z > 0, r / z.clamp_min(torch.finfo(r.dtype).tiny), p)


def _without(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``remove_candidate`` without a read: p with token x zeroed, renormalised (p itself when nothing is left)."""
    r = p.scatter(0, x[None], 0.0)
    z = r.sum()
    return torch.where(z > 0, r / z.clamp_min(torch.finfo(r.dtype).tiny), p)


def verify_chain_sampling(tokens: Sequence[int], p, q, generator: torch.Generator | None = None) -> tuple[int, int]:
    """The article's rule on a chain: tokens [gamma + 1] (root first), p [gamma + 1, V], q [gamma + 1, V] or None.

    Returns (number of accepted draft tokens, next token).
    """
    children = [[i + 1] for i in range(len(tokens) - 1)] + [[]]
    path, nxt = verify_sampling(children, tokens, p, q, generator)
    return len(path) - 1, nxt


# --- typical acceptance (lossy) --------------------------------------------------------------

def verify_typical(parents: Sequence[int], retrieve: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor,
                   threshold: float = 0.09, alpha: float = 0.3,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """LOSSY Medusa typical acceptance: a child x of node i passes when
    p_i(x) > min(threshold, alpha * exp(-H(p_i))); the longest passing root-to-leaf prefix wins.

    parents: [N]; retrieve: [L, D+1] root-to-leaf node indices (-1 padded); tokens: [N] long;
    p: [N, V] processed target probabilities. The output is NOT the target's distribution.
    """
    n = len(parents)
    if n == 1:
        return [0], sample(p[0], generator)
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # [N]
    limit = torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))  # [N]
    par = torch.tensor(parents[1:], device=p.device)  # [N-1]
    ok = p[par, tokens[1:]] > limit[par]  # [N-1] child passes under its parent
    ok = torch.cat([torch.ones(1, dtype=torch.bool, device=p.device), ok])  # root always passes
    idx = retrieve.to(p.device)  # [L, D+1]
    passed = torch.where(idx >= 0, ok[idx.clamp_min(0)], torch.zeros_like(idx, dtype=torch.bool))
    lengths = passed.long().cumprod(-1).sum(-1)  # [L] accepted nodes incl. root per path
    best = int(lengths.argmax())
    path = idx[best, : int(lengths[best])].tolist()
    return path, sample(p[path[-1]], generator)
