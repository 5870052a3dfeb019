"""headway: train speculative-decoding drafter heads and run them losslessly.

Subpackages: ``headway.heads`` (drafter modules and their I/O), ``headway.train`` (data, losses,
the shared accelerate loop, entry points), ``headway.inference`` (the tree-speculative runtime),
``headway.bench`` (the benchmark application, above both).
"""

__version__ = "0.1.0"
