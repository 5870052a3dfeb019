"""The ``headway`` command (also ``python -m headway``): one thin subcommand per library entry point.

Each subcommand parses its arguments and calls one library function, imported only when that
subcommand runs (so ``headway --help`` is fast and a missing optional piece breaks only itself).
Bad input ends with one line ``error: ...`` on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import textwrap
import time
from pathlib import Path

EXIT_USAGE = 2
TRAIN_EPILOG = """\
--config takes a YAML file or the name of a shipped config: {shipped}.

examples:
  headway train {method} --config {example} train.max_steps=20 train.output_dir=outputs/run
  headway train {method} --config my.yaml --model Qwen/Qwen2.5-0.5B-Instruct --data chat.jsonl train.lr=3e-4

This command trains in one process. For several GPUs or machines run the same command under
accelerate (the shipped accelerate configs are in {accelerate}):
  accelerate launch --config_file {accelerate}/multi-gpu.yaml -m headway train {method} --config ...
"""
GENERATE_EPILOG = """\
examples:
  headway generate --model smollm2-135m --drafter outputs/medusa --prompt "Tell me about cats."
  headway generate --model ./my-llama --prompt-lookup --chat-file chat.json --max-new-tokens 256
  headway generate --model ./my-llama --draft-model ./my-small-llama --tree chain-4 --prompt "Hi"
  headway generate --drafter outputs/eagle3 --prompt "Tell me about cats." --prompt "And dogs?"   (one batch)

The text streams to stdout; tau (new tokens per target pass), the token count and tokens/s go to
stderr. With --temperature 0 (the default) the text is exactly the target's own greedy output.
"""


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Help text wrapped without breaking names at hyphens (``vllm-medusa`` stays whole)."""

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line: ``error: ...`` and exit status 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see '{self.prog} --help')\n")


def fail(message: str) -> int:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return EXIT_USAGE


def need(module: str, what: str):
    """Import a headway module for a subcommand; a missing one is a one-line ValueError."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and module.startswith(exc.name):
            raise ValueError(f"{what} needs {module}, which this installation of headway lacks; "
                             "upgrade headway") from None
        raise  # a missing third-party package: main() names it


# --- train -------------------------------------------------------------------------------------


def run_train(args) -> int:
    from headway.configs import resolve_config
    from headway.heads.registry import resolve, training_methods

    entry = training_methods()[args.method].entry
    module = need(entry, f"headway train {args.method}") if isinstance(entry, str) else resolve(entry)

    argv = ["--config", str(resolve_config(args.config, args.method))] if args.config else []
    argv += ["--model", args.model] * bool(args.model) + ["--data", args.data] * bool(args.data)
    module.main([*argv, *args.overrides], exit_process=True)  # its own errors already end with `error: ...` and exit 2
    return 0


def add_train(sub) -> None:
    from headway.configs import CONFIG_DIR, shipped_configs
    from headway.heads.registry import training_methods

    known = training_methods()
    names = "|".join(known)
    train = sub.add_parser("train", help="train a drafter (Medusa heads or an EAGLE head) on a frozen target",
                           description="Train a drafter on a target model and export it to train.output_dir.",
                           epilog=f"Several GPUs or machines: accelerate launch [accelerate options] -m headway train "
                                  f"{names} --config ... (see 'headway train {next(iter(known))} --help').")
    methods = train.add_subparsers(dest="method", metavar="{" + names.replace("|", ",") + "}", required=True)
    for method, spec in known.items():
        p = methods.add_parser(method, help=f"train {spec.description}", description=f"Train {spec.description}.",
                               formatter_class=Formatter,
                               epilog=TRAIN_EPILOG.format(method=method, example=spec.example_config or "my.yaml",
                                                          shipped=", ".join(shipped_configs(method)) or "none",
                                                          accelerate=CONFIG_DIR / "accelerate"))
        p.add_argument("--config", metavar="YAML_OR_NAME", help="run config: a YAML file or a shipped config name")
        p.add_argument("--model", help="target: Hub id, local folder or smollm2-135m (same as model=...)")
        p.add_argument("--data", help="data: default, packaged, a local json/jsonl/parquet file or a Hub dataset "
                                      "(same as data.source=...)")
        p.add_argument("overrides", nargs="*", metavar="key=value",
                       help="config overrides, e.g. train.lr=3e-4 train.output_dir=outputs/run")
        p.set_defaults(run=run_train)


# --- generate ----------------------------------------------------------------------------------


def read_conversations(args) -> list[list[dict]]:
    """Each --prompt TEXT (one user message; several: one batch), or the --chat-file's conversation
    (``headway.chat_file``)."""
    if args.prompt is not None:
        return [[{"role": "user", "content": text}] for text in args.prompt]
    from headway.chat_file import read_chat_file

    return [read_chat_file(args.chat_file)]


def left_padded(rows: list, pad_id: int):
    """Token id rows [T_i] -> (ids [B, T], attention_mask [B, T]) padded on the left, as generate takes a batch."""
    import torch

    width = max(r.shape[0] for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[0]:], mask[i, width - r.shape[0]:] = r, 1
    return ids, mask


def prompt_ids(tokenizer, messages: list[dict], chat_template: bool):
    """[1, T] ids: the chat template with a generation prompt when the tokenizer has one."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer("\n".join(m["content"] for m in messages), return_tensors="pt").input_ids


def parse_tree(spec: str | None):
    """A tree name or YAML path as is; JSON/YAML text (``[[0],[0,0]]``, ``{depth: 5, ...}``) parsed."""
    if spec is None or not spec.lstrip().startswith(("[", "{")):
        return spec
    import yaml

    from headway.heads.values import first_line

    try:
        return yaml.safe_load(spec)
    except yaml.YAMLError as exc:
        raise ValueError(f"--tree {spec!r} is not valid JSON/YAML ({first_line(exc)})") from None


LAYERSKIP_RETRIEVAL = ("--retrieval merges a retrieval drafter beside the model drafter, but a LayerSkip drafter "
                       "drafts alone (verification resumes from its own chain's states): drop --retrieval")


def build_drafter(args, target_tokenizer, device):
    """The drafter the flags ask for, or None for plain decoding. A model drafter gets retrieval beside it
    (one hybrid drafter; ``--retrieval``, suffix decoding by default) unless --no-lookup, or unless it cannot join
    a hybrid (LayerSkip: verification resumes from its own chain's early-layer states), which drafts alone."""
    from headway.inference import Lookahead, PromptLookup
    from headway.inference.hybrid import retrieval_parts

    if args.prompt_lookup:
        return PromptLookup()
    if args.lookahead:
        return Lookahead()
    model = None
    if args.drafter:
        from headway.heads import load_drafter

        model = load_drafter(args.drafter, map_location=device)
    elif args.draft_model:
        from headway.heads.target import load_target
        from headway.inference import DraftModelProposer

        draft, tokenizer = load_target(args.draft_model, device=device)
        model = DraftModelProposer(draft, tokenizer=tokenizer, target_tokenizer=target_tokenizer)
    if model is None:
        return None
    if not args.lookup:
        return model
    from headway.inference.proposer import as_proposer

    if as_proposer(model).shares_target_cache:  # LayerSkip: its chain alone (no other tree's nodes have its states)
        if args.retrieval is not None:  # (a drafter whose kind its folder did not tell before loading)
            raise ValueError(LAYERSKIP_RETRIEVAL)
        return model
    return [model, *retrieval_parts(args.retrieval or RETRIEVAL_PARTS[0])]


def count_new(row, prompt_len: int, eos, pad) -> int:
    """New tokens of one generated row [T]: up to and with its first EOS (padding after it is not generated)."""
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    new = row[prompt_len:].tolist()
    return next((i + 1 for i, t in enumerate(new) if t in stops), len(new))


def run_generate(args) -> int:
    import torch
    from transformers import TextStreamer

    from headway.heads.base import read_config_file, resolve_folder
    from headway.heads.registry import saved_kind
    from headway.heads.target import load_target, resolve_device
    from headway.inference import SpeculativeGenerator, pack_linears
    from headway.inference.inputs import check_generation, check_settings, fit_context

    # bad input fails before any model loads: the same settings checks for plain and speculative decoding
    if args.tree and not (args.drafter or args.prompt_lookup or args.draft_model or args.lookahead):
        raise ValueError("--tree needs a drafter: add --drafter, --prompt-lookup, --lookahead or --draft-model")
    if args.retrieval is not None and not ((args.drafter or args.draft_model) and args.lookup):
        raise ValueError("--retrieval chooses the retrieval part merged beside a model drafter: it needs --drafter or "
                         "--draft-model, without --no-lookup (--prompt-lookup and --lookahead draft alone)")
    if args.retrieval is not None and args.drafter and getattr(saved_kind(args.drafter), "name", "") == "layerskip":
        raise ValueError(LAYERSKIP_RETRIEVAL)  # (its folder's config.json tells, before any model loads)
    check_settings(args.max_new_tokens, args.temperature, args.top_k, args.top_p)
    device = resolve_device(args.device)
    if args.drafter:
        read_config_file(resolve_folder(args.drafter))  # a missing folder, or one holding no headway drafter
    conversations = read_conversations(args)
    target, tokenizer = load_target(*[args.model] * bool(args.model), device=device)
    device = next(target.parameters()).device
    drafter = build_drafter(args, tokenizer, device)
    eos = target.generation_config.eos_token_id
    eos = tokenizer.eos_token_id if eos is None else eos
    pad = target.generation_config.pad_token_id
    pad = pad if pad is not None else tokenizer.pad_token_id if tokenizer.pad_token_id is not None else \
        (eos[0] if isinstance(eos, list) else eos)
    rows = [prompt_ids(tokenizer, m, not args.no_chat_template)[0] for m in conversations]
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    for row in rows:  # e.g. a prompt over the context
        check_generation(target.config, row, args.max_new_tokens, **sampling)
    ids, mask = (t.to(device) for t in left_padded(rows, pad))
    batch = ids.shape[0] > 1  # several prompts: one batch, each answer printed when all are done (no streaming)
    streamer = None if batch else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    if drafter is None:  # plain decoding: the target's own generate, cut to the context as speculation is
        args.max_new_tokens = fit_context(target.config, ids.shape[1], args.max_new_tokens)
        if args.seed is not None:
            torch.manual_seed(args.seed)
        kwargs = dict(do_sample=True, **sampling) if args.temperature > 0 else dict(do_sample=False)
        start = time.perf_counter()
        seq = target.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                              pad_token_id=pad, streamer=streamer, **kwargs)
        new = int(sum(count_new(row, ids.shape[1], eos, pad) for row in seq))
        seconds = time.perf_counter() - start
        passes, row_passes = seq.shape[1] - ids.shape[1], new  # a row's pass makes one token
    else:
        if args.pack_linears:
            pack_linears(target)  # float32 CPU only: the verification passes' GEMMs on prepacked weights
        generator = torch.Generator(device).manual_seed(args.seed) if args.seed is not None else None
        tree = "auto" if args.tree is None else None if args.tree == "default" else parse_tree(args.tree)
        # prepare: tree="auto"'s cost curve
        gen = SpeculativeGenerator(target, drafter, tree=tree, cuda_graphs=args.cuda_graphs).prepare()
        out = gen.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens, generator=generator,
                           eos_token_id=eos, streamer=streamer, **sampling)
        seq = out.sequences
        new, seconds = out.stats.new_tokens, out.stats.time_total
        row_passes = out.stats.target_forward_passes  # each row's passes (a batch's stats sum its rows')
        passes = out.stats.batch_passes if batch else row_passes
    if batch:
        for i, row in enumerate(seq):
            print(f"--- {i + 1}: {args.prompt[i]}")
            print(tokenizer.decode(row[ids.shape[1]:], skip_special_tokens=True))
    tau = new / row_passes if row_passes else 0.0  # new tokens per target pass, per row
    rows = f" over {ids.shape[0]} rows" if batch else ""
    print(f"tau {tau:.2f} ({new} new tokens{rows} in {passes} target passes), "
          f"{new / max(seconds, 1e-9):.1f} tokens/s ({seconds:.2f} s)", file=sys.stderr)
    return 0


# headway.inference.hybrid's RETRIEVAL_PARTS, its DEFAULT_RETRIEVAL first (spelled out: --help imports no torch)
RETRIEVAL_PARTS = ("suffix", "lookup", "lookup+suffix", "choice")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with a drafter (lossless speculative decoding)",
                       description="Generate text from a target model, speculatively with a drafter.",
                       formatter_class=Formatter, epilog=GENERATE_EPILOG)
    p.add_argument("--model", help="target: Hub id, local folder or smollm2-135m (default: smollm2-135m)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--drafter", metavar="FOLDER_OR_HUB_ID", help="a headway drafter (any kind: Medusa, EAGLE, "
                                                                        "P-EAGLE, DFlash, LayerSkip)")
    how.add_argument("--prompt-lookup", action="store_true", help="draft by copying n-grams from the context")
    how.add_argument("--lookahead", action="store_true",
                     help="lookahead decoding: the target drafts for itself (a Jacobi window and an n-gram pool)")
    how.add_argument("--draft-model", metavar="MODEL", help="a small causal LM sharing the target's tokenizer")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=True,
                   help="with --drafter or --draft-model: merge retrieval's copied branch (--retrieval) into the "
                        "drafter's tree each round (one hybrid drafter, one verification pass)")
    p.add_argument("--retrieval", choices=RETRIEVAL_PARTS,
                   help="the hybrid's retrieval part: suffix (the default: suffix decoding over the prompt and the "
                        "answer so far), lookup (prompt lookup), lookup+suffix (both), choice (one of the two each "
                        "round, the one that would have been accepted more so far)")
    p.add_argument("--tree", help="auto (the default: each round verify the part of the drafter's tree that pays "
                                  "under the target's measured cost curve, down to a plain step), default (the "
                                  "drafter's own tree, every round), a shipped tree name (chain-4, tree-15, ...), a "
                                  "tree YAML file, a list of top-k paths like '[[0],[0,0],[1]]', or EAGLE-2 settings "
                                  "like '{depth: 5, top_k: 8, total_tokens: 60}'")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", action="append", help="a user message; repeat it for several prompts, generated as "
                                                        "one batch (left padded) and printed when all are done")
    text.add_argument("--chat-file", metavar="FILE",
                      help="a JSON list of {role, content} messages, or a text file (one user message)")
    p.add_argument("--no-chat-template", action="store_true", help="feed the text as is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    p.add_argument("--pack-linears", action=argparse.BooleanOptionalAction, default=True,
                   help="with a drafter on a float32 CPU target: prepack the target's linear weights for the "
                        "multi-row verification passes (~10%% faster rounds, twice the linear weights' memory; "
                        "no-op elsewhere)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="on a CUDA device the drafter's levels and the target's pass run as CUDA graphs (the default: "
                        "where they can be captured); --cuda-graphs makes a part that cannot be captured an error, "
                        "--no-cuda-graphs turns them off; no-op elsewhere")
    p.add_argument("--seed", type=int, help="seed for sampling")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.set_defaults(run=run_generate)


# --- bench / convert / push / info -------------------------------------------------------------


def run_bench(args) -> int:
    bench = need("headway.bench.benchmark", "headway bench")
    bench.main(args.args, parser_class=functools.partial(Parser, prog="headway bench"))  # one-line usage errors too
    return 0


class FormatChoices:
    """``choices`` for --to/--from that import the converter only when asked (validation, help).
    Without a converter every name passes here and ``run_convert`` reports the missing module."""

    def formats(self) -> tuple[str, ...] | None:
        try:
            return tuple(need("headway.heads.formats.convert", "headway convert").FORMATS)
        except ValueError:
            return None

    def __contains__(self, name) -> bool:
        return (formats := self.formats()) is None or name in formats

    def __iter__(self):
        return iter(self.formats() or ("(none: this installation has no converter)",))


def run_convert(args) -> int:
    convert = need("headway.heads.formats.convert", "headway convert")
    options = {k: getattr(args, k) for k in ("vocab_size", "num_target_layers", "speculative_tokens", "feature_layers")
               if getattr(args, k) is not None}
    out = convert.convert(args.src, args.dst, to=args.to, fmt_from=args.fmt_from, overwrite=args.overwrite,
                          target=args.target, widen_vocab=args.widen_vocab, with_embeddings=args.with_embeddings,
                          allow_official_misread=args.allow_official_misread, **options)
    print(f"wrote {out} ({args.to})")
    return 0


def run_push(args) -> int:
    hub = need("headway.heads.hub", "headway push")
    url = hub.push(args.folder, args.repo_id, private=args.private, revision=args.revision)
    print(f"pushed {args.folder} to {url}")
    return 0


def run_info(args) -> int:
    info = need("headway.heads.hub.info", "headway info")
    found = info.describe_checkpoint(args.path)
    sys.stdout.write(json.dumps(found, indent=2) + "\n" if args.json else info.render_text(found))
    return 1 if found.get("problem") else 0  # described, but it would not load


def add_others(sub) -> None:
    p = sub.add_parser("bench", add_help=False, help="benchmark tau, tokens/s and speedup of the drafters",
                       description="Run headway's benchmark (all options pass through; see headway bench --help).")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's options")
    p.set_defaults(run=run_bench)

    formats = FormatChoices()
    p = sub.add_parser("convert", help="convert a drafter between headway and other formats",
                       description="Convert a drafter checkpoint between headway's format and those serving engines "
                                   "and the original projects use.")
    p.add_argument("--to", required=True, choices=formats, metavar="FORMAT", help="output format: %(choices)s")
    p.add_argument("--from", dest="fmt_from", choices=formats, metavar="FORMAT",
                   help="input format (default: detected from the folder)")
    p.add_argument("src", help="the drafter folder to convert")
    p.add_argument("dst", help="the output folder")
    p.add_argument("--target", metavar="MODEL",
                   help="the target model (name or folder): copies or checks its lm_head for Medusa heads that share "
                        "it, and fills in the vocabulary size or depth a format lacks")
    p.add_argument("--vocab-size", type=int, help="the target's vocabulary size, for formats that do not record it")
    p.add_argument("--num-target-layers", type=int, help="the target's depth, for EAGLE formats that do not record it")
    p.add_argument("--feature-layers", type=lambda v: [int(i) for i in v.split(",")], metavar="I,J,K",
                   help="the target layers an EAGLE/DFlash drafter reads (headway ids), for formats that do not record "
                        "them")
    p.add_argument("--speculative-tokens", type=int, help="draft tokens per step written into a speculators config")
    p.add_argument("--widen-vocab", action="store_true",
                   help="EAGLE-1 with a reduced draft vocabulary to a full-vocabulary format: widen its rows")
    p.add_argument("--with-embeddings", action="store_true",
                   help="sglang: copy the target's embedding (needs --target) into the export, for the official "
                        "EAGLE-3 runtime when the target is saved as one file")
    p.add_argument("--allow-official-misread", action="store_true",
                   help="medusa-v0.1: write heads of several ResBlocks although the official Medusa code computes "
                        "every block with the last one's weights (wrong outputs there)")
    p.add_argument("--overwrite", action="store_true", help="replace dst if it exists")
    p.set_defaults(run=run_convert)

    p = sub.add_parser("push", help="upload a drafter folder to the Hugging Face Hub",
                       description="Upload a drafter folder (config, weights, model card, metrics) to the Hub. "
                                   "Credentials come from HF_TOKEN or `hf auth login`.")
    p.add_argument("folder", help="a drafter folder exported by headway")
    p.add_argument("--repo-id", required=True, metavar="NAMESPACE/NAME", help="the Hub repository, e.g. me/my-heads")
    p.add_argument("--private", action="store_true", help="create the repository as private")
    p.add_argument("--revision", help="branch to push to (default: main)")
    p.set_defaults(run=run_push)

    p = sub.add_parser("info", help="describe a drafter checkpoint: kind, target, sizes, training metrics",
                       description="Describe a drafter checkpoint (a folder or a Hub id) without loading its weights; "
                                   "exit status 1 when it would not load (the problem is printed first).")
    p.add_argument("path", help="a drafter folder or Hub repo id")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(run=run_info)


def build_parser() -> Parser:
    from headway import __version__

    parser = Parser(prog="headway", description="Train speculative-decoding drafters (Medusa, EAGLE) and run them "
                                                "losslessly: the output is exactly the target model's.",
                    epilog="Run 'headway COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"headway {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_train(sub)
    add_generate(sub)
    add_others(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``headway`` console script; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if argv[:1] == ["bench"]:  # the benchmark parses its own options (a REMAINDER cannot start with one)
        args = argparse.Namespace(command="bench", run=run_bench, args=argv[1:])
    else:
        args, extra = parser.parse_known_args(argv)
        if hasattr(args, "overrides"):  # key=value overrides may stand anywhere, also after --model or --data
            args.overrides += [e for e in extra if not e.startswith("-")]  # (argparse stops a positional list at the
            extra = [e for e in extra if e.startswith("-")]  # first option and leaves what follows as unrecognized)
        if extra:  # every one named, and the subcommand's own help
            where = " ".join(filter(None, ("headway", args.command, getattr(args, "method", None))))
            parser.exit(EXIT_USAGE, f"error: unrecognized arguments: {' '.join(extra)} (see '{where} --help')\n")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError) as exc:
        return fail(str(exc))
    except OSError as exc:  # Hub and network errors (missing credentials, no connection, ...)
        return fail(f"{type(exc).__name__}: {exc}")
    except ModuleNotFoundError as exc:  # an optional package this subcommand needs
        return fail(f"headway {args.command} needs the package {exc.name!r}, which is not installed: "
                    f"pip install {(exc.name or '').split('.')[0]}")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
