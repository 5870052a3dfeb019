"""The public layouts drafters are written in and read from, one module per external family, and the
converter registry that dispatches between them and headway's own format (``convert``).

- ``medusa``: the Medusa layouts (official FasterDecoding v0.1, TGI's version 2, vLLM's MedusaModel);
- ``eagle``: the official EAGLE layouts (SafeAILab EAGLE-1, EAGLE-3 as SGLang and vLLM read it);
- ``speculators``: EAGLE-3 as vLLM's speculators package writes it;
- ``dflash``: DFlash drafters in speculators' ``dflash`` layout and z-lab's (``"z-lab"``);
- ``folder`` and ``llama_layer``: what they share (atomic folder writes, strict tensor checks, the
  one-layer Llama config EAGLE drafters carry).
"""
