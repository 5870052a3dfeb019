"""The lossless tree-speculative runtime (trees, KV cache, drafters, verification, generator).

    from headway.inference import SpeculativeGenerator, PromptLookup
    out = SpeculativeGenerator(target_model, drafter, tree="tree-15").generate(input_ids, max_new_tokens=64)
    out.sequences, out.stats.mean_accepted_length
"""

from headway.inference.cpu_gemm import pack_linears, unpack_linears
from headway.inference.draft_model import DraftModelProposer
from headway.inference.proposer import Draft, DraftContext, Proposer, as_proposer
from headway.inference.eagle import EagleProposer
from headway.inference.expand import DynamicTree
from headway.inference.hybrid import HybridProposer
from headway.inference.generator import GenerationStats, SpeculativeGenerator, SpeculativeOutput
from headway.inference.kv_cache import compact_cache, new_cache
from headway.inference.layerskip import LayerSkipProposer
from headway.inference.lookahead import Lookahead
from headway.inference.medusa import MedusaProposer
from headway.inference.prompt_lookup import PromptLookup
from headway.inference.retrieval_choice import RetrievalChoice
from headway.inference.suffix_decoding import SuffixDecoding
from headway.inference.tree import Tree, available_trees, chain, load_tree
from headway.inference.verify import (SamplingParams, process_logits, verify_chain_sampling, verify_greedy,
                                      verify_sampling, verify_typical)

__all__ = [
    "Draft", "DraftContext", "DraftModelProposer", "Proposer", "DynamicTree", "EagleProposer", "GenerationStats", "HybridProposer", "LayerSkipProposer", "Lookahead", "MedusaProposer", "PromptLookup",
    "RetrievalChoice", "SamplingParams", "SpeculativeGenerator", "SpeculativeOutput", "SuffixDecoding", "Tree", "as_proposer", "available_trees", "chain",
    "compact_cache", "load_tree", "new_cache", "pack_linears", "process_logits", "unpack_linears", "verify_chain_sampling", "verify_greedy",
    "verify_sampling", "verify_typical",
]

# names before issue 21 split the two meanings of "Drafter" (headway.heads.Drafter is the module with Hub I/O;
# the runtime's side is a Proposer); they keep importing, with a DeprecationWarning
_RENAMED = {"Drafter": "Proposer", "MedusaDrafter": "MedusaProposer", "EagleDrafter": "EagleProposer",
            "HybridDrafter": "HybridProposer", "DraftModelDrafter": "DraftModelProposer", "as_drafter": "as_proposer"}


def __getattr__(name):
    if name in _RENAMED:
        import warnings

        warnings.warn(f"headway.inference.{name} is now headway.inference.{_RENAMED[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module 'headway.inference' has no attribute {name!r}")
