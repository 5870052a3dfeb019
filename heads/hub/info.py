"""What a drafter checkpoint is: its kind, target, sizes and training metrics (``headway info``).

``describe_checkpoint`` reads headway's own folders from their JSON files and safetensors headers
(no weights are loaded); a foreign layout (official Medusa, vLLM, EAGLE, SGLang, speculators) is
imported with the converter to say what it holds. A headway folder that ``load_drafter`` would refuse
(weights missing, truncated or of other shapes than its config's) is still described, with the reason as
``"problem"``. ``render_text`` turns the dict into the human-readable summary the command line prints.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from headway.heads.base import WEIGHTS_NAME, check_saved, read_json, resolve_folder
from headway.heads.hub.card import EVAL_METRICS_NAME, RUN_CONFIG_NAME
from headway.heads.registry import find_kind, kind_of_config
from headway.heads.values import first_line

METRICS_LOG = "metrics.jsonl"  # the training log next to the exported drafter (train/loop.py)
# Keys a foreign config may spell its sizes with, in order of preference.
_FOREIGN_KEYS = {
    "target": ("base_model_name_or_path",),
    "hidden_size": ("target_hidden_size", "hidden_size"),
    "vocab_size": ("vocab_size",),
    "draft_vocab_size": ("draft_vocab_size",),
    "num_heads": ("medusa_num_heads", "num_heads"),
    "num_layers": ("medusa_num_layers", "num_hidden_layers"),
}


def describe_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Describe a drafter folder (or Hub repo id): format, drafter, target, sizes, training, and ``"problem"``:
    why ``load_drafter`` would refuse a headway folder (one line), or None.

    Raises ``ValueError`` when the folder is not a drafter checkpoint headway can read, and
    ``FileNotFoundError`` when it does not exist.
    """
    folder = resolve_folder(path)
    config = read_json(folder, "a drafter checkpoint")
    if not isinstance(config, dict):
        raise ValueError(f"{folder / 'config.json'} holds a {type(config).__name__}, not a drafter config")
    if "drafter_type" in config:
        fmt = "headway"
    else:  # a foreign layout, or a one-line ValueError saying what the folder holds instead
        from headway.heads.formats.convert import detect_format

        fmt = detect_format(folder)
    drafter = None if fmt == "headway" else _try_import(folder, fmt)
    if fmt == "headway":
        fields = _headway_fields(config)
    elif drafter is not None:
        fields = _headway_fields(drafter.config.to_dict())
    else:
        fields = _foreign_fields(fmt, config)
    info = {"path": str(folder), "format": fmt, **fields, "weights": weights_summary(folder, strict=False)}
    if drafter is not None and not info["weights"]["tensors"]:  # pickled weights (medusa-v0.1): count the import
        info["weights"]["parameters"] = sum(p.numel() for p in drafter.parameters())
    info["training"] = training_summary(folder)
    info["problem"] = load_problem(folder) if fmt == "headway" else None
    return info


def load_problem(folder: Path) -> str | None:
    """Why ``load_drafter`` would refuse the headway folder (one line), or None; from config.json and the
    safetensors header alone (``check_saved``)."""
    try:
        check_saved(folder)
    except ValueError as exc:
        return first_line(exc, limit=1000)  # headway's own one-line message, whole
    except (RuntimeError, NotImplementedError):  # a drafter that cannot be built on the meta device: not checked
        pass
    return None


def _headway_fields(config: dict) -> dict[str, Any]:
    kind = kind_of_config(config)
    out = {"drafter_type": config["drafter_type"], "kind": kind.name if kind else None,
           "target": config.get("base_model_name_or_path"),
           "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size"),
           "draft_vocab_size": config.get("draft_vocab_size"), "headway_version": config.get("headway_version")}
    out.update({k: config.get(k) for k in (kind.info_fields if kind else ())})
    out["description"] = describe_drafter(out)
    return out


def describe_drafter(info: dict) -> str:
    """One line on what the drafter is, from the fields of ``describe_checkpoint`` (its kind's ``describe``)."""
    kind = find_kind(info.get("kind"))
    return kind.description(info) if kind else f"{info.get('drafter_type')} drafter"


def _try_import(folder: Path, fmt: str):
    """The foreign drafter read into headway's classes, or None when that needs more than the folder
    (e.g. the target's lm_head for ``medusa-v2``)."""
    from headway.heads.formats.convert import load_any

    try:
        return load_any(folder, fmt)
    except ValueError:
        return None


def _foreign_fields(fmt: str, config: dict) -> dict[str, Any]:
    """What a foreign config.json says, when the drafter cannot be imported from the folder alone."""
    out = {"drafter_type": None, "kind": None}
    for field, keys in _FOREIGN_KEYS.items():
        out[field] = next((config[k] for k in keys if config.get(k) is not None), None)
    out["architectures"] = config.get("architectures")
    out["description"] = f"a {fmt} drafter (`headway convert --target MODEL` reads it with its target)"
    return out


def weights_summary(folder: Path, strict: bool = True) -> dict[str, Any]:
    """Tensor count, parameter count (floating-point tensors) and dtypes of the safetensors files, read
    from their headers only, and the bytes of every weight file (pickled ones are sized, never opened).
    A file whose header cannot be read is a one-line ValueError, or with ``strict=False`` counts no tensors."""
    files = [folder / WEIGHTS_NAME] if (folder / WEIGHTS_NAME).is_file() else sorted(folder.glob("*.safetensors"))
    files += sorted(f for f in folder.iterdir() if f.suffix in (".pt", ".bin") and f.is_file())
    tensors, params, dtypes = 0, 0, {}
    for file in (f for f in files if f.suffix == ".safetensors"):
        try:
            with safe_open(str(file), "pt") as f:
                for key in f.keys():
                    piece = f.get_slice(key)
                    numel = 1
                    for dim in piece.get_shape():
                        numel *= dim
                    dtype = piece.get_dtype()
                    tensors += 1
                    dtypes[dtype] = dtypes.get(dtype, 0) + numel
                    if dtype.startswith(("F", "BF")):
                        params += numel
        except (SafetensorError, OSError) as exc:
            if not strict:
                continue
            raise ValueError(f"{file} is corrupt or truncated ({first_line(exc)}); "
                             "re-export or re-download it") from None
    return {"files": [f.name for f in files], "bytes": sum(f.stat().st_size for f in files),
            "tensors": tensors, "parameters": params, "dtypes": dtypes}


def training_summary(folder: Path) -> dict[str, Any] | None:
    """What the run that wrote ``folder`` recorded: steps, last training loss, final held-out metrics,
    and the run's main settings. None when the folder holds no training records."""
    out: dict[str, Any] = {}
    if (folder / EVAL_METRICS_NAME).is_file():
        out["eval"] = _read_json_file(folder / EVAL_METRICS_NAME)
    if (folder / METRICS_LOG).is_file():
        records = []
        for line in (folder / METRICS_LOG).read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
        train = [r for r in records if "loss" in r]
        out["steps"] = max((r.get("step", 0) for r in records), default=0)
        if train:
            out["final_train_loss"] = train[-1]["loss"]
            out["tokens_per_s"] = train[-1].get("tokens_per_s")
    if (folder / RUN_CONFIG_NAME).is_file():
        run = _read_json_file(folder / RUN_CONFIG_NAME)
        train_cfg = run.get("train", {}) if isinstance(run, dict) else {}
        out["run"] = {"model": run.get("model"), "features": run.get("features"),
                      "data": (run.get("data") or {}).get("source"), "num_processes": run.get("num_processes"),
                      **{k: train_cfg.get(k) for k in ("lr", "batch_size", "grad_accum", "epochs", "max_steps")}}
    return out or None


def _read_json_file(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def render_text(info: dict[str, Any]) -> str:
    """The human-readable summary of ``describe_checkpoint``'s dict."""
    kind = info.get("kind") or info.get("drafter_type") or "unknown"
    lines = [info["path"]]
    if info.get("problem"):  # first, where it is seen: this folder does not load
        lines.append(f"  PROBLEM     this folder does not load: {info['problem']}")
    lines += [f"  format      {info['format']}" + (f" ({kind})" if info["format"] == "headway" else ""),
              f"  drafter     {info['description']}",
              f"  target      {info.get('target') or 'not recorded'}"
              f" (hidden size {info.get('hidden_size')}, vocabulary {info.get('vocab_size')})"]
    w = info["weights"]
    tensors = f" in {w['tensors']} tensors ({', '.join(sorted(w['dtypes']))})" if w["tensors"] else ""
    lines.append(f"  weights     {w['parameters']:,} parameters{tensors}, "
                 f"{_size(w['bytes'])} in {', '.join(w['files']) or 'no weight file'}")
    train = info.get("training")
    if not train:
        lines.append("  training    no records in this folder")
        return "\n".join(lines) + "\n"
    if "run" in train:
        r = train["run"]
        lines.append(f"  run         model {r['model']}, data {r['data']}, features {r['features']}, "
                     f"lr {r['lr']}, batch {r['batch_size']} x {r['grad_accum']} accum x {r['num_processes']} process(es)")
    if "steps" in train:
        loss = f", final training loss {train['final_train_loss']:.4f}" if "final_train_loss" in train else ""
        lines.append(f"  trained     {train['steps']} optimizer steps{loss}")
    groups: dict[str, list[str]] = {}  # "head0/top1" -> head0: ["top1 0.0674", ...]
    for name, value in sorted((train.get("eval") or {}).items()):
        group, _, metric = name.rpartition("/")
        groups.setdefault(group, []).append(f"{metric} {value:.4f}" if isinstance(value, float) else f"{metric} {value}")
    for group, values in groups.items():
        lines.append(f"  held-out    {group + ':' if group else ''} {'  '.join(values)}".rstrip())
    return "\n".join(lines) + "\n"
