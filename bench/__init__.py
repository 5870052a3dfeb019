"""The benchmark application, above the runtime: task-diverse prompts built from installed text
(``task_prompts``, ``prompts``) and every drafting method side by side with plain decoding and
transformers' assisted generation (``benchmark``; ``headway bench``, ``scripts/benchmark.py``).

It combines the training data (held-out splits) with the runtime, so it stands on both ``train``
and ``inference``; neither of them imports it.
"""
