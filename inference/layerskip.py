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
dropped before verification) or skip it (a plain full step). Not in a hybrid list or a batch: both
verify other trees than the one whose early layers were written.
"""

from __future__ import annotations

import torch

from headway.heads.layerskip import LayerSkipHead
from headway.inference import vocab_reduce
from headway.inference.proposer import Draft, DraftContext, Proposer, root_only
from headway.inference.tree import Tree, chain
from headway.inference.target_forward import early_forward
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
        tree = ctx.tree if isinstance(ctx.tree, Tree) else self.default_tree()
        depth = min(tree.depth, ctx.max_depth)
        if depth < 1 or self._cache is None:
            return root_only(ctx)
        model, head, cache, e = self._target, self.head, self._cache, self.exit_layer
        start = ctx.tokens.shape[0] - 1  # the root's position; the cache holds everything before it
        token = ctx.tokens[-1:]
        states, tokens, qs, scores = [], [token], [], []
        stop, stops = False, self.min_prob > 0 and (self._on_cpu if self.early_stop is None else self.early_stop)
        for i in range(depth + 1):
            state = early_forward(model, cache, token, start + i, e)  # [1, H]
            states.append(state)
            if i == depth or stop:
                break  # the last token ran for its state only
            logits = head(state)[0].float()  # [V']
            if ctx.sampling is None:
                choice = vocab_reduce.argmax(logits)[None]
                chosen = logits.softmax(-1)[choice]
            else:
                q = probs(logits, ctx.sampling)  # [V'] the distribution the next token is drawn from
                choice = torch.multinomial(q, 1, generator=ctx.generator)
                chosen = q[choice]
                qs.append(head.widen(q))
            scores.append(chosen)
            stop = stops and float(chosen) < self.min_prob  # one read a step (a CPU's is free)
            token = head.to_target_ids(choice)  # [1]
            tokens.append(token)
        draft_tokens = torch.cat(tokens)  # [depth + 1]
        q = dict(enumerate(qs)) if qs else None  # node i's child was drawn from q[i] [V]
        # tree="auto" reads the scores of greedy drafts only (sampled ones are judged before the draw)
        score = torch.cat([scores[0].new_ones(1), torch.cat(scores).cumprod(0)])  # [n]
        return Draft(chain(len(tokens) - 1), draft_tokens, q=q, scores=score, states=torch.cat(states))

