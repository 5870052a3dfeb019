"""The lossless tree-speculative runtime (trees, KV cache, drafters, verification, generator)."""
