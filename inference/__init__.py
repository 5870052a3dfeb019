"""The lossless tree-speculative runtime (trees, KV cache, drafters, verification, generator).

    from headway.inference import SpeculativeGenerator, PromptLookup
    out = SpeculativeGenerator(target_model, drafter, tree="tree-15").generate(input_ids, max_new_tokens=64)
    out.sequences, out.stats.mean_accepted_length
"""

from headway.inference.cpu_gemm import pack_linears, unpack_linears
from headway.inference.draft_model import DraftModelDrafter
from headway.inference.drafter import Draft, DraftContext, Drafter, as_drafter
from headway.inference.eagle import EagleDrafter
from headway.inference.expand import DynamicTree
from headway.inference.hybrid import HybridDrafter
from headway.inference.generator import GenerationStats, SpeculativeGenerator, SpeculativeOutput
from headway.inference.kv_cache import compact_cache, new_cache
from headway.inference.medusa import MedusaDrafter
from headway.inference.prompt_lookup import PromptLookup
from headway.inference.suffix_decoding import SuffixDecoding
from headway.inference.tree import Tree, available_trees, chain, load_tree
from headway.inference.verify import (SamplingParams, process_logits, verify_chain_sampling, verify_greedy,
                                      verify_sampling, verify_typical)

__all__ = [
    "Draft", "DraftContext", "DraftModelDrafter", "Drafter", "DynamicTree", "EagleDrafter", "GenerationStats", "HybridDrafter", "MedusaDrafter", "PromptLookup",
    "SamplingParams", "SpeculativeGenerator", "SpeculativeOutput", "SuffixDecoding", "Tree", "as_drafter", "available_trees", "chain",
    "compact_cache", "load_tree", "new_cache", "pack_linears", "process_logits", "unpack_linears", "verify_chain_sampling", "verify_greedy",
    "verify_sampling", "verify_typical",
]
