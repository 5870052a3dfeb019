"""LayerSkip self-speculation (Elhoushi et al., 2024, arXiv:2404.16710): the target drafts with its own
first ``E`` layers and a trained exit head (``headway.heads.layerskip``), then verifies with the rest.

A round, with the target's cache holding the P tokens before the root:
- drafting runs the root, then each drafted token, through the target's layers 0..E-1, one token at a
  time, **writing those layers' keys and values into the target's own cache**; the exit head turns
  each layer-E state into the next draft token. The last drafted token goes through the early layers
  too, for its state only. Each node's layer-E state is kept (``Draft.states``).
- verification (``resume_forward``) runs only layers E..L-1 over the chain's saved states, reading
  the early layers' entries the drafting wrote (so the first E layers never run twice), then the final
  norm and lm_head. After it every layer holds P + n entries, and the generator's compaction keeps the
  accepted ones as for any pass.

Everything runs through the target's public modules (``embed_tokens``, each decoder layer with its
``position_embeddings``, ``rotary_emb``, ``norm``, the output embeddings), with the same 4D additive
mask and explicit positions a full pass gets (TRANSFORMERS.md), so a verified node's logits equal a
full causal pass over its path: greedy output equals ``generate``, sampling is exact (a chain of
draws from the exit head's q). Llama-style decoders only (Llama, Qwen2, Mistral, SmolLM2).

The draft is a chain; ``tree="auto"`` may cut it (a shorter chain: the extra early entries are
dropped before verification) or skip it (a plain full step). Not in a hybrid list: it verifies other
trees than the one whose early layers were written.

A batch (``EarlyRows``): the rows' chains run through the early layers together, one token of every
row a step over the batch's one cache (a row that stopped drafting, or did not draft this round, steps
on its last token: entries its verification treats as padding), and verification resumes every row
from its saved states in one pass over the late layers (``EarlyRows.resume``).
"""

from __future__ import annotations

import torch

from headway.heads.layerskip import LayerSkipHead
from headway.heads.target.features import decoder_layers
from headway.inference import vocab_reduce
from headway.inference.cpu_gemm import few_rows_linear
from headway.inference.kv_cache import step_mask
from headway.inference.proposer import Draft, DraftContext, Proposer, RowStep, root_only, run_alone
from headway.inference.tree import Tree, chain
from headway.inference.target_forward import early_forward, run_layers, trim_layers
from headway.inference.verify import probs


DEFAULT_MIN_PROB = 0.3  # stop drafting after a token the exit head gives less than this


class LayerSkipProposer(Proposer):
    """Drafts a chain of up to ``num_draft`` tokens (the head's default) with the target's first
    ``exit_layer`` layers and the exit head; see the module docstring. Drafting stops after a token whose
    probability under the exit head is below ``min_prob`` (each early step costs E/L of a target step:
    an unlikely token's successors are not worth drafting). The stop follows the drawn token, so it never
    changes what was proposed at a position, only whether the next one is: sampling stays exact.

    The stop reads the probability on the host each step: free on a CPU, a device sync on a GPU, so
    ``early_stop`` (None) stops early on a CPU only; on a GPU the chain runs its whole depth without a
    read, whatever ``min_prob`` (``tree="auto"`` still cuts it by the same scores before verification).
    True / False force it."""

    shares_target_cache = True  # it writes the target's early layers: the generator resumes verification

    def __init__(self, head: LayerSkipHead, num_draft: int | None = None, min_prob: float = DEFAULT_MIN_PROB,
                 early_stop: bool | None = None):
        self.head = head.eval()
        self.exit_layer = head.config.exit_layer
        self.num_draft = num_draft or head.config.num_draft
        if self.num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {self.num_draft}")
        if not 0.0 <= min_prob < 1.0:
            raise ValueError(f"min_prob must be in [0, 1), got {min_prob}")
        self.min_prob = min_prob
        self.early_stop = early_stop  # None: on a CPU only (a read per drafted token)
        self._on_cpu = True
        self._target = None
        self._cache = None
        self._rows: tuple[EarlyRows, int] | None = None  # a batch's row: the round's shared steps and its row

    def use_graphs(self, backend, strict: bool = False) -> str | None:
        return "LayerSkip's early layers are not captured in a graph (they write the target's growing cache)"

    def bind(self, target_model) -> None:
        self.head.check_target(target_model)
        device = next(target_model.parameters()).device
        self.head.to(device=device, dtype=target_model.dtype)
        self._target = target_model
        self._on_cpu = device.type == "cpu"

    def use_cache(self, cache) -> None:
        """The target's cache of this generate call (the generator hands it over before the first round)."""
        self._cache = cache

    def use_rows(self, rows: "EarlyRows", row: int) -> None:
        """A batch's row this round: its early steps run with the other rows' (``EarlyRows``), as row ``row``."""
        self._rows = (rows, row)

    def reset(self) -> None:
        self._rows = None

    def default_tree(self) -> Tree:
        return chain(self.num_draft)

    def check_tree(self, tree: Tree) -> None:
        if not tree.is_chain:
            raise ValueError(f"LayerSkip drafts a chain (its early layers run one token after another), got the "
                             f"tree {tree.name or tree.size}; pass a chain (chain-3, chain-4, ...) or tree=None")

    def propose_first(self, ctx: DraftContext) -> Draft:
        """Nothing: the target's cache is empty until the prompt's pass, and the early layers draft from it."""
        return root_only(ctx)

    def propose(self, ctx: DraftContext) -> Draft:
        return run_alone(self.propose_steps(ctx))

    def propose_steps(self, ctx: DraftContext):
        """The chain, each token's early layers a request (``EarlyStep``) that a batch runs with its other rows'."""
        tree = ctx.tree if isinstance(ctx.tree, Tree) else self.default_tree()
        depth = min(tree.depth, ctx.max_depth)
        if depth < 1 or (self._cache is None and self._rows is None):
            return root_only(ctx)
        start = ctx.tokens.shape[0] - 1  # the root's position; the cache holds everything before it
        token = ctx.tokens[-1:]
        states, tokens, qs, scores = [], [token], [], []
        stop, stops = False, self.min_prob > 0 and (self._on_cpu if self.early_stop is None else self.early_stop)
        scored = ctx.scored or stops  # a greedy chain's probabilities: for tree="auto" and the early stop only
        for i in range(depth + 1):
            last = i == depth or stop  # the last token runs for its state only
            state, logits = yield EarlyStep(self, token, start + i, logits=not last)  # [1, H], [V'] | None
            states.append(state)
            if last:
                break
            logits = logits.float()
            if ctx.sampling is None:
                choice = vocab_reduce.argmax(logits)[None]
                chosen = logits.softmax(-1)[choice] if scored else None
            else:
                q = probs(logits, ctx.sampling)  # [V'] the distribution the next token is drawn from
                choice = torch.multinomial(q, 1, generator=ctx.generator)
                chosen = q[choice]
                qs.append(self.head.widen(q))
            if chosen is not None:
                scores.append(chosen)
            stop = stops and float(chosen) < self.min_prob  # one read a step (a CPU's is free)
            token = self.head.to_target_ids(choice)  # [1]
            tokens.append(token)
        draft_tokens = torch.cat(tokens)  # [depth + 1]
        q = dict(enumerate(qs)) if qs else None  # node i's child was drawn from q[i] [V]
        # tree="auto" reads the scores of greedy drafts only (sampled ones are judged before the draw)
        score = torch.cat([scores[0].new_ones(1), torch.cat(scores).cumprod(0)]) if scores else None  # [n]
        return Draft(chain(len(tokens) - 1), draft_tokens, q=q, scores=score, states=torch.cat(states))


class EarlyStep(RowStep):
    """One token [1] of a row's chain at ``position`` through the target's first layers, into the target's cache.
    Result: (its layer-E state [1, H], the exit head's logits after it [V'], or None where ``logits`` is False).
    A batch's rows' steps run as one pass over the batch's cache (``EarlyRows``), their exit heads as one product."""

    def __init__(self, proposer: LayerSkipProposer, token: torch.Tensor, position: int, logits: bool):
        super().__init__(proposer, token, position)
        self.logits = logits

    def run(self):
        p = self.proposer
        state = early_forward(p._target, p._cache, self.token, self.position, p.exit_layer)  # [1, H]
        return state, p.head(state)[0] if self.logits else None

    @classmethod
    def pick(cls, requests: list["EarlyStep"], at: list[int], out: torch.Tensor) -> list:
        heads = [i for i, r in enumerate(requests) if r.logits]
        logits = {}
        if heads:
            states = out[torch.tensor([at[i] for i in heads], device=out.device)]
            head = requests[0].proposer.head
            states = states.to(head.lm_head.weight.dtype)
            logits = dict(zip(heads, few_rows_linear(*head.projection(states))))  # [R, V'] rows
        return [(out[a:a + 1], logits.get(i)) for i, a in enumerate(at)]


class EarlyRows:
    """A batch's round of LayerSkip drafting: every row's chain through the target's first ``exit_layer``
    layers, one token of every row a step (``step``), into the batch's one cache (B rows of S slots, ``valid``
    [B, S] bool marking each row's own), then the late layers over the rows' saved states (``resume``).

    Step d writes slot S + d of every row: a row's d-th chain token at its root's position + d, seeing its
    own slots and its chain so far (a row that asks for no step, having stopped drafting or not drafted
    this round, steps on its last token, the root at first: its root's state is the one verification
    needs, the rest padding its tree never sees). roots, starts: [B] long, each row's root token and position.
    """

    def __init__(self, model, cache, exit_layer: int, valid: torch.Tensor, roots: torch.Tensor, starts: torch.Tensor):
        self.model, self.cache, self.exit_layer = model, cache, exit_layer
        self.valid, self.tokens, self.starts = valid, roots.clone(), starts
        self.states: list[torch.Tensor] = []  # [B, H] per step

    @property
    def steps(self) -> int:
        return len(self.states)

    def step(self, tokens: dict[int, torch.Tensor]) -> torch.Tensor:
        """Rows' next tokens {row: [1] long} (the other rows repeat theirs) -> every row's layer-E state [B, H]."""
        for row, token in tokens.items():
            self.tokens[row] = token[0]
        d = self.steps
        mask = step_mask(self.valid, d + 1, self.model.dtype)  # [B, 1, 1, S + d + 1]
        hidden = self.model.get_decoder().embed_tokens(self.tokens[:, None])  # [B, 1, H]
        out = run_layers(self.model, self.cache, hidden, (self.starts + d)[:, None], range(self.exit_layer), mask)
        self.states.append(out[:, 0])
        return self.states[-1]

    def resume(self, width: int, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The batch's verification from the saved states: each row's first ``width`` chain slots (its tree padded to
        ``width``, at most ``steps``) through the late layers, positions [B, W] and mask [B, 1, W, S + W] as a full
        pass takes them (``headway.inference.batch.batch_inputs``). Returns the logits [B, W, V]."""
        s = self.valid.shape[1]
        trim_layers(self.cache, range(self.exit_layer), s + width)  # steps past the widest tree kept: dropped
        hidden = torch.stack(self.states[:width], 1).to(self.model.dtype)  # [B, W, H]
        hidden = run_layers(self.model, self.cache, hidden, positions, range(self.exit_layer,
                                                                             len(decoder_layers(self.model))), mask)
        return self.model.get_output_embeddings()(self.model.get_decoder().norm(hidden))
