"""The runtime side of every drafter, a ``Proposer``; the generator never knows which drafter it runs.

Each round the generator hands the drafter a ``DraftContext`` (all tokens so far, the last one
being the root; the target's features, at the layers the drafter asked for, of every position
the drafter has not been shown yet; the tree budget; the sampling settings) and gets back a
``Draft``: a tree of candidate tokens and, when the candidates were sampled, the distributions q
they were drawn from.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Generator, NamedTuple

import torch

from headway.inference import vocab_reduce
from headway.inference.tree import Tree, load_tree
from headway.inference.verify import SamplingParams, probs


@dataclasses.dataclass
class DraftContext:
    tokens: torch.Tensor  # [L] every token so far (prompt + generated) on the target's device; tokens[-1] is the root
    features: torch.Tensor | None  # [n, F] target features (the drafter's feature_layers, concatenated) of
    # positions L-1-n .. L-2, the ones made since the last round (prefill: the whole prompt but the root);
    # features[-1] is at the position that predicted the root. None when the drafter asks for no layers.
    tree: object | None  # what the drafter's resolve_tree made of the user's tree (a Tree or dynamic settings)
    max_depth: int  # nodes deeper than this are useless this round (max_new_tokens budget)
    sampling: SamplingParams | None  # None: greedy
    generator: torch.Generator | None  # the only source of randomness
    # tree="auto" with a hybrid drafter: gate(retrieval draft, its seconds, len(tokens)) says whether the model drafter
    # should draft too this round (headway.inference.auto.AutoTree.gate); None: always
    gate: object | None = None
    # the same tokens as ``tokens``, on the host (the generator keeps this mirror from the values it reads once per
    # round): a drafter reads the root or searches the context here without a device read. Read-only. None: absent
    host_tokens: list[int] | None = None
    # False: nothing reads the draft's scores this round (no tree="auto"), so a drafter may skip them (Draft.scores None)
    scored: bool = True

    @property
    def root_token(self) -> int:
        """The last token (the root of this round's tree), from the host mirror when there is one."""
        return self.host_tokens[-1] if self.host_tokens is not None else int(self.tokens[-1])

    def host_context(self) -> torch.Tensor:
        """``tokens`` as a host tensor [L]: the tensor itself on a CPU, else built from the host mirror."""
        if self.tokens.device.type == "cpu":
            return self.tokens
        if self.host_tokens is None:
            return self.tokens.cpu()
        return torch.tensor(self.host_tokens, dtype=torch.long)


@dataclasses.dataclass
class Draft:
    tree: Tree  # shape of the candidates; node 0 is the root
    tokens: torch.Tensor  # [N] long, tokens[0] is the root token
    q: torch.Tensor | dict | None = None  # q[i] [V]: the distribution node i's children were drawn from
    # (without replacement, in sibling order); a [N, V] tensor or a dict over nodes with children.
    # None: deterministic candidates (top-k ranks, copied n-grams), verified as one-hot drafts.
    scores: list[float] | torch.Tensor | None = None  # [N] the drafter's own estimate that node i is accepted (root 1.0):
    # cumulative draft probabilities, continuation frequencies; None: tree="auto" uses the acceptance seen so far.
    # Sampled drafts (q set): tree="auto" ignores them (cutting by what was drawn would bias the output)
    sources: list | None = None  # [N] which drafter of a hybrid proposed node i (None: all one drafter; a drafter that
    # chooses among its parts names the part, and a hybrid holding it names (its id, the part): hybrid.own_sources)
    # [>= N, H] a drafter that ran the target's first layers over the nodes into its cache (LayerSkip): their
    # states there, which verification resumes from (headway.inference.layerskip.resume_forward); None: a full pass
    states: torch.Tensor | None = None
    # (scores may stay on the device, a float tensor [N], until tree="auto" reads them: ``score_list``)

    def score_list(self) -> list[float] | None:
        """``scores`` on the host: one read when the drafter left them on the device."""
        return self.scores.tolist() if isinstance(self.scores, torch.Tensor) else self.scores


def exact_float(device: torch.device) -> torch.dtype:
    """The float dtype that carries token ids and node indices to the host exactly beside scores: float64 (float32
    on MPS, which has no float64: exact below 2^24, every vocabulary's size)."""
    return torch.float32 if device.type == "mps" else torch.float64


def greedy_read(draft: Draft, head: torch.Tensor, tail=()) -> torch.Tensor:
    """What a round reads once, as one long tensor: [*head (the accepted leaf and the next token), *the draft's N
    tokens, *tail (each [N] long), *the tree's N parents while they are still on the device (a ``DeviceTree``)]."""
    pending = draft.tree.pending_parents()
    return torch.cat([head, draft.tokens, *tail, *([] if pending is None else [pending])])


class Proposer:
    """Base class. Subclasses implement ``propose``; the rest has sensible defaults."""

    # target layers (transformers hidden_states ids; L = after the final norm) whose features the
    # generator captures with forward hooks and hands over in DraftContext.features; None: no features
    feature_layers: list[int] | None = None
    # True: ``propose`` asks ``DraftContext.gate`` whether its costly part drafts this round (a hybrid's
    # model drafter), so tree="auto" never skips the drafter as a whole (its cheap part drafts every round)
    gated: bool = False
    # True: after each verification the generator calls ``observe_outputs`` with the target's greedy choice
    # after every node of the verified draft (read with the accepted path; lookahead decoding's Jacobi step)
    reads_outputs: bool = False
    # True: ``propose`` runs the target's first layers over the draft, writing the target's own cache (handed over by
    # ``use_cache`` before the first round; a batch's rows: ``use_rows`` each round), and the Draft carries their
    # states (LayerSkip)
    shares_target_cache: bool = False

    def bind(self, target_model) -> None:
        """Check compatibility with the target (vocabulary, hidden size) and move to its device."""

    def use_cache(self, cache) -> None:
        """(``shares_target_cache`` drafters) the target's cache for this generate call."""

    def default_tree(self) -> Tree | None:
        """The tree used when the generator gets ``tree=None`` (None: the drafter builds its own)."""
        return None

    def resolve_tree(self, spec):
        """Turn the user's ``tree`` argument into what ``propose`` reads (default: a static Tree)."""
        return load_tree(spec) if spec is not None else self.default_tree()

    def check_tree(self, tree: Tree) -> None:
        """Raise ValueError when ``tree`` asks for more than this drafter offers."""

    def reset(self) -> None:
        """Forget any per-sequence state (a new ``generate`` call starts)."""

    def use_graphs(self, backend, strict: bool = False) -> str | None:
        """Capture the drafter's fixed-width model steps with ``backend`` (CUDA graphs, ``inference.graphs``;
        ``strict``: a step that fails to capture raises instead of running eagerly). None: done, or nothing
        worth capturing (retrieval drafters; Medusa's one product a round); else why its step cannot be
        captured (one line)."""
        return None

    def batch_rows(self, ids: torch.Tensor, mask: torch.Tensor, capacity: int, max_new_tokens: int, tree):
        """A batch [B, T] (left-padded, ``mask``) about to generate with ``tree``: an object that drafts every row
        from one shared state, handed to each row's fork by ``use_rows(state, row)`` each round and kept in step
        with the target's batch cache (``end_round``, ``select``, ``catch_up``, ``repack``: a draft model's
        ``ChainRows``); None (the default): each row drafts on its own state."""
        return None

    def use_rows(self, rows, row: int) -> None:
        """A batch's row this round: the shared state ``batch_rows`` made (or a LayerSkip round's ``EarlyRows``) and
        this row's index in it."""

    def fork(self) -> "Proposer":
        """A proposer for one more sequence beside this one (a batch's row): the same modules and settings,
        its own per-sequence state. The default copies the attributes and resets the copy, which suits a
        proposer whose ``reset`` assigns fresh state objects."""
        clone = copy.copy(self)
        clone.reset()
        return clone

    def propose(self, ctx: DraftContext) -> Draft:
        raise NotImplementedError

    def probe(self, ctx: DraftContext, rows: int) -> "Probe | None":
        """tree="auto"'s cheap test of a drafter that sat rounds out (greedy): take in ``ctx.features[:-1]``
        (as a round's catch-up would: the last feature, the root's, comes again with the next round's) and
        score the drafter's first guess after each of the last ``rows`` of those positions against the token
        that did follow (``Probe``). No target pass, no tree: a test costs about one draft level where a
        round tried costs the drafting and a wider verification. None (the default): no such test, the
        controller tries a round instead."""
        return None

    def observe_outputs(self, draft: Draft, outputs: list[int], tokens: list[int] | None = None) -> None:
        """(``reads_outputs`` drafters) the verified ``draft`` and the target's greedy token after each of
        its nodes (outputs [N], the logits processors applied), whatever the round accepted; ``tokens``: the
        draft's tokens on the host (read with them; None: read them from ``draft.tokens``)."""

    def propose_steps(self, ctx: DraftContext) -> Generator["DraftRequest", object, Draft]:
        """``propose`` for a row of a batch, as a generator: it yields the model steps it needs run
        (``DraftRequest``s), is sent each one's result and returns the Draft, so the batch runs the
        rows' steps of one drafter together (``run_rows``). The default yields none: ``propose``."""
        return self.propose(ctx)
        yield  # a generator (never reached)

    def propose_first(self, ctx: DraftContext) -> Draft:
        """The first round's draft, proposed before the target has run on the prompt (its pass runs the
        prompt and this tree at once): a drafter that reads no target features drafts as usual; one that
        does has none yet and proposes nothing (the pass then yields one token, as generate's prefill)."""
        return root_only(ctx) if self.feature_layers else self.propose(ctx)


def can_probe(proposer: Proposer) -> bool:
    """Whether ``proposer`` has a ``Proposer.probe`` of its own."""
    return type(proposer).probe is not Proposer.probe


class Probe(NamedTuple):
    """What ``Proposer.probe`` found, a pair of entries per position tested (oldest first)."""

    confidence: list[float]  # the drafter's probability of its first guess (a depth-1 node's own estimate)
    hits: list[bool]  # whether that guess was the token that followed (a greedy depth-1 node accepted)


def first_guesses(logits: torch.Tensor, to_target_ids, followed: torch.Tensor) -> Probe:
    """A ``Probe`` from a drafter's first-level logits [m, V'] (draft-vocabulary ids mapped with ``to_target_ids``)
    and the tokens that followed [m]."""
    conf, top = logits.float().softmax(-1).max(-1)  # [m], [m]
    return Probe(conf.tolist(), (to_target_ids(top) == followed).tolist())


class DraftRequest:
    """A model step a drafter's ``propose_steps`` asks for. Requests of one ``kind`` with equal ``key`` (say,
    the same drafter module) may run together: ``run_together`` takes them, one per row, and the round's
    ``state`` (a dict that lives for one ``run_rows``, for what the rows' steps share), and returns their
    results in order; ``run`` runs one alone."""

    key: object = None

    def run(self):
        raise NotImplementedError

    @classmethod
    def run_together(cls, requests: list["DraftRequest"], state: dict) -> list:
        return [r.run() for r in requests]


class RowStep(DraftRequest):
    """One token [1] of a row's chain at ``position`` through a drafter's model. In a batch, the proposer's
    ``_rows`` holds (the batch's shared rows, this row's index): the rows' steps then run as one
    ``rows.step({row: token})`` -> [B, ...], split per row by ``pick``; alone (``_rows`` None), ``run``."""

    def __init__(self, proposer, token: torch.Tensor, position: int):
        self.proposer, self.token, self.position = proposer, token, position
        self.key = proposer._rows[0] if proposer._rows is not None else proposer

    @classmethod
    def run_together(cls, requests: list["RowStep"], state: dict) -> list:
        if requests[0].proposer._rows is None:
            return [r.run() for r in requests]
        at = [r.proposer._rows[1] for r in requests]
        return cls.pick(requests, at, cls.run_rows(requests[0].key, dict(zip(at, requests))))

    @classmethod
    def run_rows(cls, rows, requests: dict[int, "RowStep"]):
        """The rows' steps {row: request} as one: ``rows.step({row: token})`` -> [B, ...]."""
        return rows.step({row: r.token for row, r in requests.items()})

    @classmethod
    def pick(cls, requests: list["RowStep"], at: list[int], out: torch.Tensor) -> list:
        """Each request's share of the rows' step ``out`` [B, ...]; ``at``: their rows."""
        return [out[a] for a in at]


@torch.no_grad()  # here, once a round, not on each generator (torch's wrapper re-enters no_grad on every resume)
def run_alone(steps: Generator[DraftRequest, object, Draft]) -> Draft:
    """Run a ``propose_steps`` generator to its Draft, each request alone."""
    try:
        request = next(steps)
        while True:
            request = steps.send(request.run())
    except StopIteration as done:
        return done.value


@torch.no_grad()
def run_rows(steps: list[Generator[DraftRequest, object, Draft]]) -> list[Draft]:
    """Run the rows' ``propose_steps`` generators side by side: each time every row that waits on a request has
    one, the requests of one kind and key run together (one model pass for the rows), and each row is sent its
    result. Returns the rows' Drafts in order."""
    drafts: list[Draft | None] = [None] * len(steps)
    waiting: dict[int, DraftRequest] = {}
    state: dict = {}

    def step(i: int, result=None, first: bool = False) -> None:
        try:
            waiting[i] = next(steps[i]) if first else steps[i].send(result)
        except StopIteration as done:
            drafts[i] = done.value

    for i in range(len(steps)):
        step(i, first=True)
    while waiting:
        groups: dict[tuple, list[int]] = {}
        for i, request in waiting.items():
            groups.setdefault((type(request), request.key), []).append(i)
        current = dict(waiting)
        waiting.clear()
        for (kind, _), rows in groups.items():
            results = kind.run_together([current[i] for i in rows], state)
            for i, result in zip(rows, results):
                step(i, result)
    return drafts


def check_draft(proposer: Proposer, draft: Draft) -> Draft:
    """``draft`` when it holds one token per tree node, else a RuntimeError naming ``proposer``."""
    if draft.tokens.shape[0] != draft.tree.size:
        raise RuntimeError(f"{type(proposer).__name__} returned {draft.tokens.shape[0]} tokens "
                           f"for a tree of {draft.tree.size} nodes")
    return draft


ROOT_ONLY = Tree([-1], name="root")


def root_only(ctx: DraftContext) -> Draft:
    """The empty draft: verification then yields exactly one token, like plain decoding."""
    return root_draft(ctx.tokens)


def root_draft(tokens: torch.Tensor) -> Draft:
    """The empty draft after ``tokens`` [L] (the last one is the root)."""
    return Draft(ROOT_ONLY, tokens[-1:].clone())


def sample_children(logits: torch.Tensor, k: int, sampling: SamplingParams | None,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Candidates for k children of each row of ``logits`` [R, V].

    Greedy: the top-k tokens (deterministic, q None). Sampling: k draws without replacement from
    q = softmax(process_logits(logits)) via Gumbel-top-k (equivalent to drawing one at a time and
    renormalising), so the verifier's "remove the rejected candidate from q" matches how they were
    drawn. Returns (tokens [R, k], q [R, V] or None).
    """
    if sampling is None:  # one child: argmax, a third of topk(1)'s time on a CPU (on exact ties it may pick another
        # of the tied tokens than topk would: a draft, never the output, can differ)
        return (vocab_reduce.argmax(logits).unsqueeze(-1) if k == 1 else vocab_reduce.topk(logits, k)[1]), None
    q = probs(logits, sampling)  # [R, V]
    u = torch.rand(q.shape, generator=generator, device=q.device).clamp_(1e-20, 1.0)
    keys = q.log() - (-u.log()).log()  # log q + Gumbel; -inf where q == 0 (such draws are ignored by the verifier)
    return keys.topk(k, dim=-1).indices, q


def as_proposer(obj) -> Proposer:
    """Wrap what the user passed: a Proposer (prompt lookup, suffix decoding, ...), a drafter module of a
    registered kind (``MedusaHeads``, an ``EagleHead``: EAGLE-1 or EAGLE-3; see
    ``headway.heads.registry``) in its kind's proposer, a transformers causal LM (a draft model), or a
    list of these (one hybrid drafter, verified in one pass)."""
    if isinstance(obj, Proposer):
        return obj
    if isinstance(obj, (list, tuple)):  # several drafters, one verification pass
        from headway.inference.hybrid import HybridProposer

        return HybridProposer(list(obj))
    from headway.heads.registry import kind_of, resolve

    kind = kind_of(obj)  # a registered drafter kind (Medusa heads, EAGLE-1/3, ...): its runtime proposer
    if kind is not None and kind.proposer is not None:
        return resolve(kind.proposer)(obj)
    from transformers import PreTrainedModel

    if isinstance(obj, PreTrainedModel) and obj.get_output_embeddings() is not None:
        from headway.inference.draft_model import DraftModelProposer

        return DraftModelProposer(obj)
    raise ValueError(f"unsupported drafter {type(obj).__name__}: pass MedusaHeads, EagleHead, a transformers causal LM sharing "
                     "the target's tokenizer, PromptLookup(...), SuffixDecoding(...), a headway.inference.Proposer, "
                     "or a list of them (one hybrid drafter)")
