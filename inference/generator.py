"""``SpeculativeGenerator``: draft a tree, verify it in one target pass, keep the accepted path.

Invariant between rounds: the target's cache holds every token except the last one (the root of
the next tree). A round appends the accepted draft tokens plus one token from the target (the
bonus, or the correction after a rejection), so each target pass yields at least one token and
the output is exactly the target's: argmax-equal when greedy, identically distributed when
sampling (Leviathan et al. 2022, arXiv:2211.17192; SpecInfer, arXiv:2305.09781).

There is no prefill pass of its own when the first tree is a chain: the first round's pass runs
the prompt (all but its last token) and then the tree, drafted from the prompt's tokens alone
(``Proposer.propose_first``: retrieval and draft models draft; a drafter that reads the target's
features has none yet and proposes the root alone, so that pass yields one token, as
``generate``'s prefill does), which saves one target pass per call. A first tree that is not a
chain would need a 4D mask over the whole prompt, which on a long prompt costs more than the pass
it saves: the prompt then runs on its own first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from headway.heads.target.features import FeatureCapture
from headway.inference.cpu_gemm import is_packed
from headway.inference.proposer import (Draft, DraftContext, Proposer, as_proposer, check_draft, greedy_read,
                                        root_draft)
from headway.inference import target_graphs, vocab_reduce
from headway.inference.graphs import CaptureError, resolve_backend
from headway.inference.kv_cache import CACHE_SLACK, compact_cache, new_cache
from headway.inference.processors import apply_processors, call_max_new_tokens, prepare_generation
from headway.inference.tree import Tree, node_path
from headway.inference.target_forward import check_attention, prefill, resume_forward, tree_forward
from headway.inference.batch import cut_round
from headway.inference.inputs import (check_call, check_generation, check_prompt, check_settings, context_length,
                                      fit_context)
from headway.inference.verify import (LazyProbs, SamplingParams, probs, q_rows, verify_greedy_logits,
                                      verify_sampling, verify_sampling_tensors, verify_typical)

ACCEPTANCE = ("exact", "typical")


@dataclasses.dataclass
class GenerationStats:
    """What one ``generate`` call did. Times are seconds of wall clock."""

    new_tokens: int = 0
    target_forward_passes: int = 0  # verification passes (the prompt's pass among them: it verifies the first tree)
    prefill_passes: int = 0  # 1: the first pass ran the prompt too (its time is in time_prefill, not time_verify)
    plain_steps: int = 0  # passes that verified the root alone (no draft, or tree="auto" chose none)
    accepted_per_step: list[int] = dataclasses.field(default_factory=list)  # tokens produced by each pass
    draft_depth_per_step: list[int] = dataclasses.field(default_factory=list)  # depth of each proposed tree
    verify_width_per_step: list[int] = dataclasses.field(default_factory=list)  # tokens fed to each pass (padded)
    probes: int = 0  # tree="auto": drafters tested on the tokens made since their last try (Proposer.probe)
    time_prefill: float = 0.0
    time_draft: float = 0.0  # inside the drafter
    time_verify: float = 0.0  # the target's verification forwards
    time_bookkeeping: float = 0.0  # acceptance, cache compaction, sequence updates
    time_control: float = 0.0  # tree="auto": choosing the tree and learning from the round (in draft and bookkeeping)
    batch_passes: int = 0  # batch > 1: the batched target passes (target_forward_passes then counts each row's)
    acceptance: str = "exact"
    lossy: bool = False  # True only for acceptance="typical" with temperature > 0: output is NOT the target's

    @property
    def mean_accepted_length(self) -> float:
        """tau: new tokens per target verification pass."""
        return self.new_tokens / self.target_forward_passes if self.target_forward_passes else 0.0

    @property
    def depth_acceptance(self) -> list[float]:
        """Entry d-1: among rounds whose tree reached depth d, the fraction that accepted >= d draft tokens."""
        depth = max(self.draft_depth_per_step, default=0)
        rates = []
        for d in range(1, depth + 1):
            rounds = [a - 1 for a, t in zip(self.accepted_per_step, self.draft_depth_per_step) if t >= d]
            rates.append(sum(a >= d for a in rounds) / len(rounds))
        return rates

    @property
    def time_total(self) -> float:
        return self.time_prefill + self.time_draft + self.time_verify + self.time_bookkeeping

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(mean_accepted_length=self.mean_accepted_length, depth_acceptance=self.depth_acceptance,
                   time_total=self.time_total)
        return out


@dataclasses.dataclass
class SpeculativeOutput:
    sequences: torch.Tensor  # [B, prompt + new] long, like transformers' generate (B = 1 unless a batch was given)
    stats: GenerationStats  # a batch: the rows' counts summed (tau per row-pass), the batch's wall times
    rows: list[GenerationStats] | None = None  # a batch: each row's own counts


class SpeculativeGenerator:
    """Lossless tree-speculative generation with any drafter.

    ``device_sampling`` (class attribute; None: on CUDA only): verify sampled rounds with tensor ops on the
    device (``verify_sampling_tensors``: no read until the leaf and the next token), not the host loop that
    reads each candidate's probabilities (free on a CPU, a sync each on a GPU; the host loop also processes
    only the rows it visits, which on a CPU costs less than every row's top-p sort).

    Args:
        target_model: a transformers causal LM (sdpa or eager attention); ``generate`` takes one prompt or a
            left-padded batch with its attention_mask (headway.inference.batch).
        drafter: ``MedusaHeads``, a transformers causal LM sharing the target's tokenizer (the
            classic draft model), ``PromptLookup(...)``, or any ``headway.inference.Proposer``.
        tree: ``"auto"`` (the default: each round verify the part of the drafter's default tree that
            promises the most tokens per unit time under the target's cost curve, down to a plain
            step: headway.inference.auto), None (the drafter's default tree, every round), a shipped
            tree name, a YAML path, a list of paths of top-k ranks, a ``Tree``, or EAGLE-2 dynamic
            settings (a dict): any of these but "auto" forces its shape.
        cost_curve: the target's ``CostCurve`` for ``tree="auto"`` (None: measured once and cached
            under the headway cache; ``refresh_cost=True`` measures it again).
        acceptance: "exact" (lossless) or "typical" (Medusa's typical acceptance: LOSSY, opt-in;
            the output then no longer follows the target's distribution).
        pad_to: verification widths between 2 and pad_to-1 are padded to pad_to. None (default):
            4 (MKL's 2-3 row GEMMs on a CPU cost more than 4 rows), or 1 when the target's linears
            are prepacked (``pack_linears``: there 2-3 rows cost less than 4). Under ``tree="auto"`` one
            sequence's pass, a plain step's too, runs at the cheapest width at least as wide under the
            measured cost curve (headway.inference.auto: with prepacked linears 4-6 tokens cost less than one).
        typical_threshold, typical_alpha: Medusa's epsilon and delta for acceptance="typical".
        cuda_graphs: capture the drafter's tree levels and the target's verification pass in CUDA graphs, one per
            width, replayed every later round (headway.inference.graphs: an EAGLE drafter's single-row levels;
            headway.inference.target_graphs: a Llama-style target's pass). None (default): on a CUDA device, a
            step that fails to capture runs eagerly (logged once); True: asked for, so a drafter or target whose
            step cannot be captured is an error naming it (a no-op off CUDA); False: never. Either way greedy output
            is the target's greedy output and sampling is exact; a captured pass's logits differ from an eager one's
            by rounding only (in bf16 a near-tie may then fall the other way, as between any two kernels).
    """

    device_sampling: bool | None = None

    def __init__(self, target_model, drafter, tree="auto", acceptance: str = "exact", *, pad_to: int | None = None,
                 typical_threshold: float = 0.09, typical_alpha: float = 0.3, cost_curve=None,
                 refresh_cost: bool = False, cuda_graphs: bool | None = None):
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE}, got {acceptance!r} ('typical' is lossy)")
        check_attention(target_model)
        self.target = target_model
        self.drafter = as_proposer(drafter)
        self.drafter.bind(target_model)
        self.cuda_graphs = cuda_graphs  # as asked (None: on CUDA)
        backend, strict = resolve_backend(cuda_graphs, self.device)
        self._graph_backend = backend
        self._verify_graphs = None  # the target's pass captured per width (headway.inference.target_graphs)
        if backend is not None:
            why = self.drafter.use_graphs(backend, strict)
            if why and strict:
                raise CaptureError(f"cuda_graphs=True: {why}; pass cuda_graphs=None to capture what can be")
            why = "LayerSkip verifies from its own early layers' states" if self.drafter.shares_target_cache \
                else target_graphs.why_not(target_model)
            if why is None:
                self._verify_graphs = target_graphs.VerifyGraphs(target_model, backend, self.drafter.feature_layers,
                                                                 strict)
            elif strict:
                raise CaptureError(f"cuda_graphs=True: {why}; pass cuda_graphs=None to capture what can be")
        self.auto = isinstance(tree, str) and tree == "auto"
        self._controller, self._curve, self._refresh = None, cost_curve, refresh_cost
        # a static Tree, or what the drafter makes of the spec (auto: the drafter's default, pruned per round)
        self.tree = self.drafter.resolve_tree(None if self.auto else tree)
        if isinstance(self.tree, Tree):
            self.drafter.check_tree(self.tree)
        self.acceptance = acceptance
        self.pad_to = pad_to
        self.typical = (typical_threshold, typical_alpha)

    @property
    def device(self) -> torch.device:
        return next(self.target.parameters()).device

    def context_length(self) -> int | None:
        return context_length(self.target.config)

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens: int | None = None, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None, *, streamer=None,
                 generation_config=None, logits_processor=None, profile: bool = False, attention_mask=None,
                 **generation_kwargs) -> SpeculativeOutput:
        """Generate up to ``max_new_tokens`` tokens after ``input_ids`` ([1, T] or [T]; a batch [B, T],
        left-padded, with its ``attention_mask`` [B, T], as ``generate`` takes it: headway.inference.batch; a
        padded row's padding stays in front of its output, as there). Unless given, ``max_new_tokens`` is the
        call's own ``generation_config`` or keyword ``max_new_tokens`` / ``max_length``, else 128.

        ``temperature=0`` is greedy and equals ``target_model.generate(do_sample=False)`` token for
        token; ``temperature>0`` samples exactly from the target's distribution after the same
        temperature / top-k / top-p (unless acceptance="typical"). ``generator`` seeds every random
        draw.

        As in ``generate``, the target's ``generation_config`` is honoured, updated by
        ``generation_config`` and by keyword settings (``repetition_penalty=1.1``,
        ``no_repeat_ngram_size=3``, ``min_new_tokens=5``, ``suppress_tokens``, ``bad_words_ids``,
        ``eos_token_id`` ...): its logits processors (and those in ``logits_processor``, which must
        be pure functions of (input_ids, scores)) are applied to every tree node with that node's
        own context, and generation stops right after an EOS token (the config's unless
        ``eos_token_id`` is given; ``eos_token_id=None`` never stops). Settings that cannot be
        honoured exactly (beam search, guidance, stop strings, other sampling warpers) are refused.
        ``streamer``: a transformers streamer (e.g. ``TextStreamer(tokenizer, skip_prompt=True)``);
        it receives the prompt, then the tokens of each round as they are accepted.
        ``profile=True`` times each part of a round exactly (``stats.time_*``): on a GPU it waits for the
        device around each part. Off (the default), a round reads the device once, for its accepted
        tokens, and on a GPU the draft/verify split of the times is the host's view only (``tree="auto"``
        still waits around the verification pass whose cost it learns).
        """
        check_call(input_ids, generator, streamer)
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1 and attention_mask is not None:  # one row given flat, with its mask: a batch of one
            ids, attention_mask = ids[None], torch.as_tensor(attention_mask)
            attention_mask = attention_mask[None] if attention_mask.dim() == 1 else attention_mask
        max_new_tokens = call_max_new_tokens(max_new_tokens, ids.shape[-1], generation_config, generation_kwargs)
        padding = None  # one row's left padding, dropped while generating, returned in front as generate does
        if ids.dim() == 2 and (ids.shape[0] > 1 or attention_mask is not None):
            from headway.inference.batch import check_batch

            check_settings(max_new_tokens, temperature, top_k, top_p)  # a bad setting first, as for one prompt
            pad = self.target._prepare_generation_config(generation_config, **generation_kwargs)[0].pad_token_id
            ids, mask = check_batch(ids, attention_mask, pad if isinstance(pad, int) else None)
            if ids.shape[0] > 1:
                return self._generate_batch(ids, mask, max_new_tokens, temperature, top_k, top_p, generator, streamer,
                                            generation_config, logits_processor, profile, generation_kwargs)
            kept = int(mask[0].sum())
            padding, ids = ids[:, :ids.shape[1] - kept], ids[:, ids.shape[1] - kept:]  # (left padding only)
        prompt = check_generation(self.target.config, ids, max_new_tokens, temperature, top_k, top_p)
        device, dtype = self.device, self.target.dtype  # once: each property walks the target's parameters
        prompt = prompt.to(device)
        max_new_tokens = fit_context(self.target.config, prompt.shape[0], max_new_tokens, stacklevel=3)
        sampling = SamplingParams(temperature, top_k, top_p) if temperature > 0 else None
        setup = prepare_generation(self.target, prompt, max_new_tokens, sampling is not None, generation_config,
                                   logits_processor, **generation_kwargs)
        processors, eos = setup.processors, setup.eos_token_ids
        generator = self._random_source(generator, sampling)
        stats = GenerationStats(acceptance=self.acceptance,
                                lossy=self.acceptance == "typical" and sampling is not None)
        auto = self._auto_controller()  # measures the cost curve on first use (before any hook is in place)
        cuda = device.type == "cuda"
        sync = torch.cuda.synchronize if cuda and profile else (lambda: None)  # every part of a round timed
        sync_verify = torch.cuda.synchronize if cuda and (profile or auto is not None) else (lambda: None)
        drafter, layers = self.drafter, self.drafter.feature_layers
        context = self.context_length()
        pad_to = self.resolved_pad_to()
        if auto is not None:
            auto.pad_to = pad_to
            auto.pad_cheapest = True  # one sequence: each pass at the cheapest width at least as wide (a batch's
            # shared pass is padded by headway.inference.batch.fit_widths)
        with contextlib.ExitStack() as stack:
            # forward hooks keep only the layers the drafter reads, for the positions it has not seen
            capture = stack.enter_context(FeatureCapture(self.target, layers)) if layers else None
            t0 = time.perf_counter()
            drafter.reset()
            length = prompt.shape[0]
            capacity = length + max_new_tokens + CACHE_SLACK
            graphs = self._verify_graphs
            # written in place; a captured pass's cache persists across requests (it writes where it was captured)
            cache = graphs.cache(capacity) if graphs is not None else new_cache(self.target, capacity=capacity)
            if auto is not None:  # a captured pass runs at a power of two (unless its capture failed: eager)
                auto.graphed = graphs is not None and graphs.failed is None
            drafter.use_cache(cache)  # LayerSkip drafts with the target's own early layers, into this cache
            seq = torch.empty(length + max_new_tokens, dtype=torch.long, device=device)  # prompt + new tokens
            seq[:length] = prompt
            # a CPU's rounds write their tokens through numpy: a host list into a tensor costs a tensor and a copy
            written = seq.numpy() if device.type == "cpu" else None
            host = prompt.tolist()  # the same tokens on the host, extended by each round's one read
            features = None  # [n, F] features of the positions made since the drafter last saw any
            # no prefill of its own: the first round's pass runs the prompt (but the root) before its tree,
            # drafted from the prompt's tokens alone (a drafter that reads features proposes nothing yet)
            pending = prompt[:-1] if length > 1 else None
            stats.time_prefill = time.perf_counter() - t0
            if streamer is not None:
                streamer.put(prompt[None].cpu())  # [1, T], as generate sends it

            while stats.new_tokens < max_new_tokens:
                budget = max_new_tokens - stats.new_tokens
                captures = self._captures()  # a round that captured a graph is not timed for tree="auto"
                t0 = time.perf_counter()
                drafted = auto is None or auto.should_draft(drafter.gated)
                ctx = DraftContext(seq[:length], features, self.tree, budget - 1, sampling, generator,
                                   gate=auto.gate if auto is not None and pending is None else None, host_tokens=host,
                                   scored=auto is not None)
                if drafted and auto is not None and pending is None:  # a drafter that lost is tested first
                    drafted, probed = auto.probe_first(drafter, ctx)
                    if probed:  # it took in every feature but the root's
                        features = features[-1:]
                        ctx = dataclasses.replace(ctx, features=features)
                if drafted:
                    draft = drafter.propose(ctx) if pending is None else drafter.propose_first(ctx)
                    draft_seconds = time.perf_counter() - t0
                    if auto is not None:
                        draft = auto.select(draft, length, draft_seconds, timed=self._captures() == captures)
                        stats.time_control += time.perf_counter() - t0 - draft_seconds
                else:  # a plain step; the drafter gets these positions' features with the next ones
                    draft, draft_seconds = root_draft(seq[:length]), 0.0
                check_draft(drafter, draft)
                prompt_rows, t_prefill = None, 0.0  # the prompt's features and time when it runs on its own
                if pending is not None and not draft.tree.is_chain:
                    # a tree's 4D mask over the whole prompt loses the model's causal kernel: at 1,200 tokens the
                    # pass cost 2.96 s against 2.73 s for a prefill and then the tree (a chain: 2.58 s)
                    tp = time.perf_counter()
                    prefill(self.target, cache, pending[None])
                    prompt_rows = capture.pop()[0] if capture else None  # [P - 1, F]
                    pending, t_prefill = None, time.perf_counter() - tp
                    stats.time_prefill += t_prefill
                sync_verify()
                t1 = time.perf_counter()
                graphed = graphs.verify(cache, draft.tree, draft.tokens, length - 1) \
                    if graphs is not None and pending is None else None
                if graphed is not None:  # a captured pass (padded to its width): the features come with it
                    logits, width, graph_rows = graphed
                elif draft.states is not None:  # the first layers ran while drafting (LayerSkip): the rest only
                    logits, width = resume_forward(self.target, cache, draft.tree, draft.states, length - 1,
                                                   drafter.exit_layer, dtype)
                else:  # tree="auto": its cheapest width at least as wide (a plain step too, where padding pays)
                    run = auto.pass_width(draft.tree, length - 1) if auto is not None and pending is None else None
                    logits, width = tree_forward(self.target, cache, draft.tree, draft.tokens, length - 1,
                                                 pad_to=pad_to, max_positions=context, pending=pending, width=run,
                                                 dtype=dtype)
                sync_verify()
                t2 = time.perf_counter()
                if processors:  # each node scored as generate would score it after its own context
                    logits = apply_processors(processors, seq[:length], draft.tree, draft.tokens, logits)
                # lookahead decoding reads the target's own next tokens at the draft's nodes with the accepted path
                path, new = self._accept(draft, logits, sampling, generator, drafter if drafter.reads_outputs else None)
                compact_cache(cache, length - 1, path, width)
                if capture:  # the prompt's features, then the accepted path's: positions length-1 .. length-1+accepted
                    rows = graph_rows if graphed is not None else capture.pop()[0]  # [M + W, F]
                    m = 0 if pending is None else pending.shape[0]
                    if path[-1] == len(path) - 1:  # a chain's path: a slice of this round's rows (a captured pass's
                        accepted = rows[m:m + len(path)]  # are a copy of its buffer too: target_graphs.verify)
                    else:
                        accepted = rows.index_select(0, torch.tensor([i + m for i in path], device=device))
                    if m or prompt_rows is not None:
                        accepted = torch.cat([rows[:m] if m else prompt_rows, accepted])
                    features = accepted if drafted or features is None else torch.cat([features, accepted])
                if auto is not None:
                    tc = time.perf_counter()
                    # the prompt's pass teaches the cost curve nothing about a round's
                    timed = pending is None and self._captures() == captures
                    auto.observe(draft, path, length, drafted, t2 - t1 if timed else 0.0, width)
                    stats.time_control += time.perf_counter() - tc
                new, hit = cut_round(new, budget, eos)
                if written is not None:
                    written[length:length + len(new)] = new
                else:
                    seq[length:length + len(new)] = torch.tensor(new, dtype=torch.long, device=device)
                host += new
                length += len(new)
                stats.new_tokens += len(new)
                if streamer is not None:
                    streamer.put(torch.tensor([new]))  # [1, accepted + 1], from the host copy
                stats.target_forward_passes += 1
                stats.plain_steps += draft.tree.size == 1
                stats.accepted_per_step.append(len(new))
                stats.draft_depth_per_step.append(draft.tree.depth)
                stats.verify_width_per_step.append(width)
                sync()
                t3 = time.perf_counter()
                stats.time_draft += t1 - t0 - t_prefill
                if pending is None:
                    stats.time_verify += t2 - t1
                else:  # the prompt's pass: prefill time, though it verified the first tree too
                    stats.time_prefill += t2 - t1
                    stats.prefill_passes, pending = 1, None
                stats.time_bookkeeping += t3 - t2
                if hit:
                    break
        stats.probes = auto.probes if auto is not None else 0
        if streamer is not None:
            streamer.end()
        sequences = seq[:length][None].clone()  # [1, prompt + new]
        if padding is not None and padding.shape[1]:
            sequences = torch.cat([padding.to(device), sequences], 1)
        return SpeculativeOutput(sequences, stats)

    def _generate_batch(self, ids, mask, max_new_tokens, temperature, top_k, top_p, generator, streamer,
                        generation_config, logits_processor, profile, generation_kwargs) -> SpeculativeOutput:
        """A checked batch [B, T] of B > 1 rows and its mask (headway.inference.batch)."""
        from headway.inference.batch import generate_batch

        if streamer is not None:
            raise ValueError(f"a streamer takes one sequence, as in transformers; got a batch of {ids.shape[0]}: "
                             "generate the rows one by one to stream them")
        prompts = [check_prompt(ids[r][mask[r].bool()], self.target.config) for r in range(ids.shape[0])]
        context = self.context_length()
        longest = max(p.shape[0] for p in prompts)
        if context is not None and longest + max_new_tokens > context:
            raise ValueError(f"the longest row ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                             f"context ({context}); pass max_new_tokens <= {context - longest}")
        sampling = SamplingParams(temperature, top_k, top_p) if temperature > 0 else None
        setups = [prepare_generation(self.target, p.to(self.device), max_new_tokens, sampling is not None,
                                     generation_config, logits_processor, **generation_kwargs) for p in prompts]
        sequences, stats, rows = generate_batch(self, ids.to(self.device), mask.to(self.device), max_new_tokens,
                                                sampling, self._random_source(generator, sampling), setups,
                                                GenerationStats, profile)
        return SpeculativeOutput(sequences, stats, rows)

    def _captures(self) -> int:
        """Graphs captured so far by this generator's backend (0 without one)."""
        return getattr(self._graph_backend, "captures", 0)

    def _random_source(self, generator: torch.Generator | None, sampling) -> torch.Generator | None:
        """The caller's generator (checked to be on the target's device), or a freshly seeded one when sampling."""
        if generator is not None and generator.device.type != self.device.type:
            raise ValueError(f"generator is on {generator.device} but the target is on {self.device}: "
                             f"pass torch.Generator(device={str(self.device)!r})")
        if generator is None and sampling is not None:
            generator = torch.Generator(self.device).manual_seed(int(torch.randint(2**62, ())))
        return generator

    def resolved_pad_to(self) -> int:
        """``pad_to`` as given, else 4 (a CPU's 2-3 row GEMMs cost more than 4 rows), or 1 for packed linears."""
        return self.pad_to if self.pad_to is not None else 1 if is_packed(self.target) else 4

    def prepare(self) -> "SpeculativeGenerator":
        """Load (or measure, once, and cache) the cost curve ``tree="auto"`` needs, so the first
        ``generate`` call is not slowed by it; a no-op for a fixed tree. Returns the generator."""
        if self.auto and self._controller is None:
            self._auto_controller()
        return self

    def _auto_controller(self):
        """The tree="auto" controller (None for a fixed tree), its cost curve loaded on first use."""
        if not self.auto:
            return None
        if self._controller is None:
            from headway.inference.auto import AutoTree
            from headway.inference.cost_curve import load_cost_curve

            curve = self._curve if self._curve is not None else load_cost_curve(self.target, refresh=self._refresh)
            self._controller = AutoTree(curve)
        self._controller.reset()
        return self._controller

    def _accept(self, draft: Draft, logits: torch.Tensor, sampling: SamplingParams | None, generator,
                observer: Proposer | None = None) -> tuple[list[int], list[int]]:
        """(accepted node indices from the root, new tokens = accepted draft tokens + one from the target).
        ``observer``: a ``reads_outputs`` drafter, handed the target's greedy choice after every node (and the draft's
        tokens) from the round's one read where the verification reads once."""
        tree = draft.tree
        tail = [] if observer is None else [vocab_reduce.argmax(logits)]  # [N]: the target's choice after each node
        if sampling is None and tree.is_chain:  # the round's one read: the target's choice at each node, the tokens
            choices = tail[0] if tail else vocab_reduce.argmax(logits)  # [N]
            return self.chain_result(torch.cat([choices, draft.tokens]).tolist(), observer, draft)
        if sampling is None:  # on the device; the round's one read: the leaf, the bonus token and the draft's tokens
            leaf, bonus = verify_greedy_logits(tree, draft.tokens, logits)
            return self.greedy_result(tree, greedy_read(draft, torch.stack([leaf, bonus]), tail).tolist(), observer,
                                      draft)
        on_device = self.device_sampling if self.device_sampling is not None else logits.device.type == "cuda"
        if on_device and self.acceptance == "exact":  # the round's one read: the leaf, the next token, the tokens
            out = verify_sampling_tensors(*tree.sampling_tensors(logits.device), draft.tokens, probs(logits, sampling),
                                          q_rows(draft.q, tree.size, logits), generator)
            return self.greedy_result(tree, greedy_read(draft, out, tail).tolist(), observer, draft)
        tokens = draft.tokens.tolist()
        if observer is not None:
            observer.observe_outputs(draft, tail[0].tolist(), tokens)
        if self.acceptance == "typical":
            thr, alpha = self.typical
            path, nxt = verify_typical(tree.parents, tree.retrieve, draft.tokens, probs(logits, sampling),
                                       thr, alpha, generator)
        else:
            path, nxt = verify_sampling(tree.children, tokens, LazyProbs(logits, sampling), draft.q, generator)
        return path, [tokens[i] for i in path[1:]] + [nxt]

    @staticmethod
    def chain_result(read: list[int], observer: Proposer | None, draft: Draft) -> tuple[list[int], list[int]]:
        """A greedy chain's round from its one read: [*the target's choice after each of its N nodes, *its N tokens]
        -> (the accepted path, the new tokens). Node i is accepted while every token up to it is the choice after the
        node before it (the device form, ``verify_greedy_tensors``, takes nine ops for what this loop does on N
        ints)."""
        n = len(read) // 2
        choices, tokens = read[:n], read[n:]
        if observer is not None:
            observer.observe_outputs(draft, choices, tokens)
        k = 1  # nodes accepted (the root always)
        while k < n and tokens[k] == choices[k - 1]:
            k += 1
        return list(range(k)), tokens[1:k] + [choices[k - 1]]

    @staticmethod
    def greedy_result(tree: Tree, read: list[int], observer: Proposer | None = None,
                      draft: Draft | None = None) -> tuple[list[int], list[int]]:
        """read (``greedy_read``'s): [accepted leaf, the target's next token, *the draft's N tokens, *the target's choice
        after each node when ``observer`` reads them, *the tree's N parents while they are on the device] -> (the path
        to the leaf, the new tokens: the path's draft tokens and the next one); a device tree is settled from its
        part and ``observer.observe_outputs`` gets its part first."""
        n = tree.size
        leaf, nxt, tokens = read[0], read[1], read[2:2 + n]
        if tree.pending_parents() is not None:
            tree.settle(read[len(read) - n:])
        if observer is not None:
            observer.observe_outputs(draft, read[2 + n:2 + 2 * n], tokens)
        path = node_path(tree.parents, leaf)
        return path, [tokens[i] for i in path[1:]] + [nxt]
