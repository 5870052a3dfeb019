"""Target features through forward hooks: only the layers a drafter asks for, never all of them.

Layer ids follow transformers' ``output_hidden_states`` numbering: ``i`` in ``0..L-1`` is the
hidden state ENTERING decoder layer ``i`` (0 is the embedding output), and ``L`` (the number of
layers) is the output of the final norm, so that ``lm_head(feature) == logits``. Medusa and
EAGLE-1 read ``[L]``; EAGLE-3 reads low/mid/high layers such as ``[2, L // 2, L - 3]``.

``output_hidden_states=True`` keeps every layer (about 11 GB for a 70B model and an 8k prompt);
a hook keeps only what is asked. The captured tensors are the very ones the model computes, so a
tree pass captures, per node, exactly what a causal run over the node's path would.
"""

from __future__ import annotations

import torch


def _text_config(model):
    config = model.config
    return getattr(config, "get_text_config", lambda: config)()


def num_layers(model) -> int:
    """Decoder layers of a causal LM (the largest valid feature layer id)."""
    return _text_config(model).num_hidden_layers


def check_depth(model, layers: int, drafter: str) -> None:
    """Raise ValueError when ``model`` has not the ``layers`` decoder layers ``drafter`` (its description, e.g.
    "this EAGLE drafter was built for") was made for."""
    depth = num_layers(model)
    if depth != layers:
        raise ValueError(f"{drafter} a target with {layers} layers, but the target has {depth}; "
                         "train or load a drafter made for this target")


def _decoder(model):
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if base is None:
        base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    return base


def decoder_layers(model) -> torch.nn.ModuleList:
    base = _decoder(model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: headway reads features from "
                     "models whose decoder keeps them in .layers or .h (Llama, Qwen2, Mistral, GPT-2, ...)")


def final_norm(model) -> torch.nn.Module:
    base = _decoder(model)
    for name in ("norm", "ln_f", "final_layernorm", "final_layer_norm"):
        module = getattr(base, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ValueError(f"cannot find the final norm of {type(model).__name__}; feature layer "
                     f"{num_layers(model)} (after the final norm) is not available for it")


def check_feature_layers(layers, depth: int | None, source: str = "feature_layers") -> list[int]:
    """Validate layer ids against a target with ``depth`` decoder layers (None: not known yet, ids >= 0 only);
    returns them as ints."""
    layers = [int(i) for i in layers]
    if not layers:
        known = f"0..{depth}" if depth is not None else "0 = embeddings, i = the input of layer i"
        raise ValueError(f"{source} is empty: name at least one target layer ({known})")
    if depth is None and any(i < 0 for i in layers):
        raise ValueError(f"{source} {layers} has negative ids: 0 = embeddings, i = the input of layer i, L = after "
                         "the final norm of a target of L layers")
    bad = [] if depth is None else [i for i in layers if not 0 <= i <= depth]
    if bad:
        raise ValueError(f"{source} {layers} has ids {bad} outside the target's depth: valid ids are 0..{depth} "
                         f"(0 = embeddings, i = the input of layer i, {depth} = after the final norm)")
    if len(set(layers)) != len(layers):
        raise ValueError(f"{source} {layers} names a layer twice")
    return layers


class FeatureCapture:
    """Context manager that records the hidden states of ``layers`` on every forward of ``model``.

        with FeatureCapture(target, [2, 15, 27]) as cap:
            target(input_ids=...)
            feats = cap.pop()   # [B, T, 3 * H], in the order of ``layers``

    Each forward overwrites the previous capture; ``pop`` returns it and clears it.
    """

    def __init__(self, model, layers):
        self.model = model
        self.layers = check_feature_layers(layers, num_layers(model))
        self._handles: list = []
        self._seen: dict[int, torch.Tensor] = {}

    def __enter__(self) -> "FeatureCapture":
        depth = num_layers(self.model)
        blocks = decoder_layers(self.model)
        for i in self.layers:
            if i == depth:
                self._handles.append(final_norm(self.model).register_forward_hook(self._after(i)))
            else:
                self._handles.append(blocks[i].register_forward_pre_hook(self._before(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._seen.clear()

    def _before(self, i: int):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self._seen[i] = x.detach()
        return hook

    def _after(self, i: int):
        def hook(module, args, output):
            self._seen[i] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    def pop(self) -> torch.Tensor:
        """[B, T, len(layers) * H]: the captured layers of the last forward, concatenated."""
        missing = [i for i in self.layers if i not in self._seen]
        if missing:
            raise RuntimeError(f"no features captured for layers {missing}: run a forward inside the capture")
        out = torch.cat([self._seen[i] for i in self.layers], dim=-1) if len(self.layers) > 1 \
            else self._seen[self.layers[0]]
        self._seen.clear()
        return out


@torch.no_grad()
def capture_features(model, input_ids: torch.Tensor, layers, attention_mask: torch.Tensor | None = None,
                     with_logits: bool = False):
    """One frozen forward: ``[B, T]`` ids -> features ``[B, T, len(layers) * H]`` (and logits if asked).

    Without ``with_logits`` only the decoder runs (no vocabulary projection)."""
    with FeatureCapture(model, layers) as cap:
        if with_logits:
            out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            return cap.pop(), out.logits
        _decoder(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return cap.pop()
