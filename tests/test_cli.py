"""The `headway` command as a user types it: the console script and `python -m headway` from the
installed wheel (a fresh venv, as tests/test_packaging.py builds it), on tiny models."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.wheel_utils import install_wheel

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "hello how are you today ? i like the weather and i like the food"
NEW_TOKENS = 24
COMMANDS = ("train", "generate", "bench", "convert", "push", "info")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with the headway wheel installed; dependencies come from this environment."""
    _, env_dir = install_wheel(tmp_path_factory.mktemp("cli-venv"))
    assert (env_dir / "bin" / "headway").is_file(), "the wheel installed no headway console script"
    return env_dir


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A tiny Llama folder with its tokenizer (chat template included), as a user's model folder."""
    from headway.heads.target.tiny import build_tiny_target

    folder = tmp_path_factory.mktemp("cli-target") / "tiny-llama"
    model, tokenizer = build_tiny_target("llama", seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def headway(venv_dir: Path, *args, module: bool = False, env: dict | None = None, timeout: int = 300):
    """Run `headway ARGS` (or `python -m headway ARGS`) outside the source tree, as a user would."""
    cmd = [str(venv_dir / "bin" / "python"), "-m", "headway"] if module else [str(venv_dir / "bin" / "headway")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([*cmd, *map(str, args)], cwd=venv_dir.parent, env=env, capture_output=True, text=True,
                          timeout=timeout)


def assert_one_line_error(res, *fragments):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr[-2000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def greedy_text(folder: Path, max_new_tokens: int = NEW_TOKENS, prompt: str = PROMPT) -> str:
    """The target's own greedy continuation of the chat-templated ``prompt``, decoded."""
    from headway.heads.target import load_target

    model, tok = load_target(str(folder), device="cpu")
    text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def stats_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("tau "))


@pytest.mark.slow  # builds and installs the wheel (once per module)
def test_help_reads_well_and_is_fast(installed):
    for module in (False, True):
        res = headway(installed, "--help", module=module)
        assert res.returncode == 0 and res.stdout.startswith("usage: headway "), res.stderr
        assert all(f"    {name} " in res.stdout for name in COMMANDS), res.stdout
    assert headway(installed, "--version").stdout.strip() == "headway 0.1.0"
    for sub in (["train"], ["train", "medusa"], ["train", "eagle"], ["generate"], ["bench"], ["convert"], ["push"],
                ["info"]):
        res = headway(installed, *sub, "--help")
        assert res.returncode == 0 and res.stdout.startswith(f"usage: headway {' '.join(sub)}"), (sub, res.stderr)
    medusa = headway(installed, "train", "medusa", "--help").stdout
    assert "accelerate launch" in medusa and "-m headway train medusa" in medusa and "medusa/tiny" in medusa
    assert "--heads HEADS" in headway(installed, "bench", "--help").stdout  # the benchmark's own options
    assert "vllm-medusa" in headway(installed, "convert", "--help").stdout  # formats from the converter
    # `headway --help` imports no torch (lazy subcommands)
    check = ("import sys; from headway.cli import main\n"
             "try: main(['--help'])\nexcept SystemExit: pass\nassert 'torch' not in sys.modules, 'torch was imported'")
    res = subprocess.run([str(installed / "bin" / "python"), "-c", check], cwd=installed.parent, capture_output=True,
                         text=True)
    assert res.returncode == 0, res.stderr


def test_help_imports_no_torch_in_process():
    """The default lane's check of what the slow wheel test checks from the installed wheel."""
    import sys

    check = ("import sys; from headway.cli import main\n"
             "try: main(['--help'])\nexcept SystemExit: pass\nassert 'torch' not in sys.modules, 'torch was imported'")
    res = subprocess.run([sys.executable, "-c", check], cwd=ROOT.parent, capture_output=True, text=True)
    assert res.returncode == 0 and "usage: headway" in res.stdout, res.stderr


@pytest.mark.slow  # builds and installs the wheel (once per module)
def test_info_describes_a_drafter_folder(installed, tmp_path, capsys):
    from headway.cli import main
    from headway.heads import MedusaConfig, MedusaHeads

    heads = MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=200, num_heads=2, num_layers=1,
                                     base_model_name_or_path="org/tiny-target"))
    heads.save_pretrained(tmp_path / "heads")
    res = headway(installed, "info", tmp_path / "heads", "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert (info["format"], info["drafter_type"], info["target"]) == ("headway", "medusa", "org/tiny-target")
    assert (info["num_heads"], info["num_layers"], info["hidden_size"], info["vocab_size"]) == (2, 1, 64, 200)
    assert info["weights"]["parameters"] == sum(p.numel() for p in heads.parameters())
    assert info["weights"]["bytes"] == (tmp_path / "heads" / "model.safetensors").stat().st_size
    assert info["training"] is None
    assert main(["info", str(tmp_path / "heads")]) == 0
    text = capsys.readouterr().out
    assert "Medusa-1 heads: 2 heads x 1 ResBlock" in text and "org/tiny-target" in text
    assert f"{info['weights']['parameters']:,} parameters" in text


@pytest.mark.slow  # builds and installs the wheel (once per module)
def test_bad_input_ends_with_one_line(installed, tiny_target, tmp_path, capsys):
    from headway.cli import main
    from headway.heads import MedusaConfig, MedusaHeads

    # from the wheel: argparse's own errors, and a push without credentials
    assert_one_line_error(headway(installed, "frobnicate"), "invalid choice: 'frobnicate'")
    assert_one_line_error(headway(installed, "convert", "--to", "onnx", "a", "b"), "invalid choice: 'onnx'")
    MedusaHeads(MedusaConfig(hidden_size=64, vocab_size=200, num_heads=1)).save_pretrained(tmp_path / "heads")
    empty_home = tmp_path / "hf_home"
    empty_home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    res = subprocess.run([str(installed / "bin" / "headway"), "push", str(tmp_path / "heads"), "--repo-id", "me/heads"],
                         cwd=tmp_path, env={**env, "HF_HOME": str(empty_home)}, capture_output=True, text=True,
                         timeout=300)
    assert_one_line_error(res, "credentials")
    # issue 24's cases from the console script (all of them in-process: tests/test_bad_input.py), side by side
    cases = [(["generate", "--model", tiny_target, "--prompt", "hi", "--temperature", "-1"], ["temperature"]),
             (["generate", "--model", tiny_target, "--prompt", "hi", "--device", "gpu"], ["unknown device 'gpu'"]),
             (["train", "medusa", "--config", "medusa/tiny", "train.lr=-1e-3", f"train.output_dir={tmp_path / 'out'}"],
              ["train.lr"]),
             (["bench", "--eagle", tmp_path / "heads"], ["holds a 'medusa' drafter"])]
    procs = [subprocess.Popen([str(installed / "bin" / "headway"), *map(str, argv)], cwd=tmp_path, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE) for argv, _ in cases]
    for proc, (argv, fragments) in zip(procs, cases):
        out, err = proc.communicate(timeout=300)
        assert_one_line_error(subprocess.CompletedProcess(argv, proc.returncode, out, err), *fragments)
    assert not (tmp_path / "out").exists()
    # library errors through the same entry point, in this process
    for argv, fragments in ((["info", str(tiny_target)], ["not a drafter checkpoint"]),
                            (["info", str(tmp_path / "missing")], ["missing"]),
                            (["train", "medusa", "--config", "medusa/nope"], ["'medusa/nope'", "medusa/tiny"]),
                            (["push", str(tmp_path / "heads"), "--repo-id", "just-a-name"], ["not 'namespace/name'"])):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and all(f in err[0] for f in fragments), (argv, err)


@pytest.mark.slow  # builds and installs the wheel (once per module)
def test_generate_with_prompt_lookup_from_the_wheel(installed, tiny_target):
    res = headway(installed, "generate", "--model", tiny_target, "--prompt-lookup", "--prompt", PROMPT,
                  "--max-new-tokens", NEW_TOKENS, "--device", "cpu", module=True)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == greedy_text(tiny_target) + "\n"  # streamed, and exactly the target's greedy text
    stats = stats_line(res.stderr)
    assert f"({NEW_TOKENS} new tokens in" in stats and "tokens/s" in stats and float(stats.split()[1]) >= 1.0, stats


@pytest.mark.slow
def test_train_generate_convert_info_from_the_wheel(installed, tiny_target, tmp_path):
    out = tmp_path / "heads"
    res = headway(installed, "train", "medusa", "--config", "medusa/tiny", "--model", tiny_target,
                  "train.max_steps=2", f"train.output_dir={out}", "train.trackers=[]")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and f"exported to {out}" in res.stdout

    info = json.loads(headway(installed, "info", out, "--json").stdout)
    assert info["training"]["steps"] == 2 and info["target"] == str(tiny_target)
    assert info["training"]["eval"] == json.loads((out / "eval_metrics.json").read_text())

    # generation with the trained heads prints exactly the target's greedy text
    res = headway(installed, "generate", "--model", tiny_target, "--drafter", out, "--tree", "tree-7",
                  "--prompt", PROMPT, "--max-new-tokens", NEW_TOKENS, "--device", "cpu")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == greedy_text(tiny_target) + "\n"
    assert f"({NEW_TOKENS} new tokens in" in stats_line(res.stderr)

    # convert to vLLM's Medusa layout and back: the weights survive bit for bit
    res = headway(installed, "convert", "--to", "vllm-medusa", out, tmp_path / "vllm")
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(headway(installed, "info", tmp_path / "vllm", "--json").stdout)["format"] == "vllm-medusa"
    res = headway(installed, "convert", "--to", "headway", tmp_path / "vllm", tmp_path / "back")
    assert res.returncode == 0, res.stderr[-3000:]
    a, b = load_file(str(out / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_generate_plain_and_chat_file_in_process(tiny_target, tmp_path, capsys):
    """Plain decoding and a chat file (JSON messages) through the same entry point, in this process."""
    from headway.cli import main

    expected = greedy_text(tiny_target)
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "user", "content": PROMPT}]))
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_target), "--chat-file", str(chat), "--max-new-tokens", str(NEW_TOKENS),
                 "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert stats_line(captured.err).startswith(f"tau 1.00 ({NEW_TOKENS} new tokens")
    # the target as its own draft model, under the default tree="auto": the same text
    assert main(["generate", "--model", str(tiny_target), "--draft-model", str(tiny_target), "--prompt", PROMPT,
                 "--max-new-tokens", "20", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == greedy_text(tiny_target, 20) + "\n"
    # with its own tree every round (--tree default): every draft is accepted (a chain of 4 plus the bonus)
    assert main(["generate", "--model", str(tiny_target), "--draft-model", str(tiny_target), "--prompt", PROMPT,
                 "--max-new-tokens", "20", "--device", "cpu", "--tree", "default"]) == 0
    captured = capsys.readouterr()
    assert captured.out == greedy_text(tiny_target, 20) + "\n"
    assert stats_line(captured.err).startswith("tau 5.00 (20 new tokens in 4 target passes)"), captured.err
    # the same with MKL's GEMM as loaded (the default prepacks the float32 CPU target's linears), without retrieval
    # merged into the draft model's tree (--no-lookup), with prompt lookup or the choice as the hybrid's retrieval
    # part instead of suffix decoding, and with CUDA graphs asked for or off (a CPU: no-op)
    for flag in (["--no-pack-linears"], ["--no-lookup"], ["--retrieval", "lookup"], ["--retrieval", "choice"],
                 ["--cuda-graphs"], ["--no-cuda-graphs"]):
        assert main(["generate", "--model", str(tiny_target), "--draft-model", str(tiny_target), "--prompt", PROMPT,
                     "--max-new-tokens", "20", "--device", "cpu", "--tree", "default", *flag]) == 0
        captured = capsys.readouterr()
        assert captured.out == greedy_text(tiny_target, 20) + "\n" and "tau 5.00" in captured.err, (flag, captured.err)
    # lookahead decoding: the target drafts for itself, the same text
    assert main(["generate", "--model", str(tiny_target), "--lookahead", "--prompt", PROMPT,
                 "--max-new-tokens", "20", "--device", "cpu", "--tree", "default"]) == 0
    captured = capsys.readouterr()
    assert captured.out == greedy_text(tiny_target, 20) + "\n" and "target passes" in captured.err, captured.err
    chat.write_text('[{"role": "wizard", "content": "hi"}]')
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_target), "--chat-file", str(chat)]) == 2
    assert capsys.readouterr().err.startswith(f"error: chat file {chat}: unknown role 'wizard'")


@pytest.mark.parametrize("name, content, problem", [
    ("chat.json", '[{"role": "user", "content": "hi"}', "is not valid JSON: Expecting ',' delimiter (line 1, column 35)"),
    ("chat.json", '{"prompt": "hi"}', "holds an object, not a list: expected a JSON list of {role, "
                                      "content} messages (one too: [{...}])"),
    ("chat.json", "", "is empty: write the prompt in it"),
    ("chat.txt", " \n", "is empty: write the prompt in it"),
    ("chat.json", '[{"role": "user"}]', "holds message 1 without content"),
    ("chat.json", '[{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}]',
     "holds message 2 without content"),
    ("chat.json", "[]", "holds no messages"),
    ("chat.txt", b"x" * 128 + b"\x80\x81", "is not UTF-8 text (byte 128)"),
])
def test_a_bad_chat_file_is_one_line_naming_the_file(name, content, problem, tmp_path, capsys):
    """--chat-file: a *.json file with a syntax error, an object that is neither a message nor a record, an empty
    file, a message without content, a binary file: one line naming the file and the problem, before any model
    loads."""
    from headway.cli import main

    chat = tmp_path / name
    chat.write_bytes(content if isinstance(content, bytes) else content.encode())
    assert main(["generate", "--model", "no-such-model", "--chat-file", str(chat), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: chat file {chat} {problem}") and err.count("\n") == 1, err


def test_a_text_chat_file_that_looks_like_json_is_one_user_message(tiny_target, tmp_path, capsys):
    """Only a *.json file must be valid JSON: any other file's text is the user message, as it is."""
    from headway.cli import main

    chat = tmp_path / "chat.txt"
    chat.write_text("[not json] " + PROMPT)
    assert main(["generate", "--model", str(tiny_target), "--chat-file", str(chat), "--max-new-tokens", "6",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out == greedy_text(tiny_target, 6, "[not json] " + PROMPT) + "\n"


@pytest.mark.parametrize("argv, shown, where", [
    (["info", "FOLDER", "extra"], "extra", "headway info"),
    (["convert", "a", "b", "c", "--to", "headway"], "c", "headway convert"),
    (["generate", "--prompt", "hi", "stray", "--bogus"], "stray --bogus", "headway generate"),
    (["train", "medusa", "--config", "medusa/tiny", "train.lr=1e-3", "--bogus"], "--bogus", "headway train medusa"),
])
def test_unrecognized_arguments_are_each_named_with_the_subcommands_help(argv, shown, where, capsys):
    from headway.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"error: unrecognized arguments: {shown} (see '{where} --help')\n"


def test_a_model_drafter_gets_suffix_decoding_beside_it_by_default():
    """headway generate --drafter/--draft-model: a hybrid with the retrieval part --retrieval names (suffix decoding
    by default, as headway bench's --hybrid-retrieval); the command line spells the parts out (its --help imports no
    torch) and they are the runtime's."""
    from headway import cli
    from headway.inference import DraftModelProposer, PromptLookup, RetrievalChoice, SuffixDecoding
    from headway.inference.hybrid import DEFAULT_RETRIEVAL, RETRIEVAL_PARTS

    assert cli.RETRIEVAL_PARTS == RETRIEVAL_PARTS and cli.RETRIEVAL_PARTS[0] == DEFAULT_RETRIEVAL == "suffix"
    parser = cli.build_parser()
    model = DraftModelProposer.__new__(DraftModelProposer)  # stands for the loaded draft model (not called)
    want = {"suffix": [SuffixDecoding], "lookup": [PromptLookup], "lookup+suffix": [PromptLookup, SuffixDecoding],
            "choice": [RetrievalChoice]}
    for extra, kinds in [([], want["suffix"])] + [(["--retrieval", k], v) for k, v in want.items()]:
        args = parser.parse_args(["generate", "--draft-model", "m", "--prompt", "hi", *extra])
        assert args.retrieval == (extra[1] if extra else None)  # None: the default, suffix decoding
        from unittest import mock

        with mock.patch("headway.heads.target.load_target", return_value=(None, None)), \
                mock.patch("headway.inference.DraftModelProposer", return_value=model):
            drafter = cli.build_drafter(args, None, "cpu")
        assert drafter[0] is model and [type(d) for d in drafter[1:]] == kinds, extra
        assert all(not d.cross_request for d in drafter[1:] if isinstance(d, SuffixDecoding))
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--draft-model", "m", "--prompt", "hi", "--retrieval", "trie"])


@pytest.mark.parametrize("how", [["--draft-model", "m", "--no-lookup"], ["--prompt-lookup"], ["--lookahead"], []])
def test_retrieval_where_it_would_be_ignored_is_refused(how, capsys):
    """--retrieval only shapes the hybrid a model drafter runs in: with --no-lookup, a drafter that drafts alone, or
    no drafter, it would be ignored, so it is a one-line error before any model loads."""
    from headway.cli import main

    assert main(["generate", "--prompt", "hi", "--retrieval", "lookup", *how]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --retrieval chooses the retrieval part") and err.count("\n") == 1, err


def test_a_layerskip_drafter_drafts_alone_one_prompt_or_a_batch(tiny_target, tmp_path, capsys):
    """`headway generate --drafter <LayerSkip folder>`: LayerSkip cannot join a hybrid, so it drafts alone (no
    retrieval part: it once failed with the hybrid's error unless --no-lookup), one prompt or several as one batch,
    each answer the target's own greedy answer; --retrieval with it is a one-line error before any model loads."""
    from headway.cli import main
    from headway.heads.layerskip import LayerSkipHead
    from headway.heads.target import load_target

    model, _ = load_target(str(tiny_target), device="cpu")
    LayerSkipHead.from_target(model, exit_layer=1, num_draft=3).save_pretrained(tmp_path / "ls")
    prompts = [PROMPT, "the food"]
    for chosen in (prompts[:1], prompts):
        capsys.readouterr()
        flags = [arg for p in chosen for arg in ("--prompt", p)]
        assert main(["generate", "--model", str(tiny_target), "--drafter", str(tmp_path / "ls"), *flags,
                     "--max-new-tokens", "12", "--device", "cpu"]) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        if len(chosen) == 1:
            assert out == greedy_text(tiny_target, 12) + "\n"
        else:
            want = (f"--- {i + 1}: {p}\n{greedy_text(tiny_target, 12, p)}\n" for i, p in enumerate(chosen))
            assert out == "".join(want)
    capsys.readouterr()
    assert main(["generate", "--model", str(tiny_target), "--drafter", str(tmp_path / "ls"), "--prompt", PROMPT,
                 "--retrieval", "lookup", "--device", "cpu"]) == 2
    err = capsys.readouterr().err  # before any model loads: the folder's config names its kind
    assert err.startswith("error: --retrieval merges a retrieval drafter") and err.count("\n") == 1, err


def test_generate_several_prompts_as_one_batch(tiny_target, capsys):
    """Repeated --prompt: one left-padded batch, each answer the target's own greedy answer to that prompt alone,
    plain and speculative."""
    from headway.cli import main

    prompts = [PROMPT, "the food", "i like the weather and the weather likes me ? yes"]
    expected = "".join(f"--- {i + 1}: {p}\n{greedy_text(tiny_target, 12, p)}\n" for i, p in enumerate(prompts))
    flags = [arg for p in prompts for arg in ("--prompt", p)]
    for how in ([], ["--prompt-lookup", "--tree", "default"], ["--draft-model", str(tiny_target), "--tree", "default"]):
        capsys.readouterr()
        assert main(["generate", "--model", str(tiny_target), *flags, *how, "--max-new-tokens", "12",
                     "--device", "cpu"]) == 0
        captured = capsys.readouterr()
        assert captured.out == expected, how
        line = stats_line(captured.err)
        assert " over 3 rows in " in line, captured.err
        tau = float(line.split()[1])  # per row: 1 for plain decoding; the target as its own draft model accepts all
        assert tau == 1.0 if not how else tau > 1.0 if how[0] == "--prompt-lookup" else tau >= 4.0, (how, line)


def test_readme_commands_parse_as_typed():
    """Every `headway ...` line in README.md is a valid command line for the installed parser."""
    import shlex

    from headway.cli import build_parser
    from headway.bench.benchmark import build_parser as bench_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    lines, fenced = [], False
    for ln in readme.splitlines():
        if ln.startswith("```"):
            fenced = not fenced
        elif fenced and ln.startswith("headway "):
            lines.append(ln.split("  #")[0].strip())
    assert len(lines) >= 8, lines
    for line in lines:
        argv = shlex.split(line)[1:]
        if "FORMAT" in argv or "FOLDER" in argv:  # a usage pattern, not a command
            continue
        if argv[0] == "bench":
            bench_parser().parse_args(argv[1:])
        else:
            build_parser().parse_args(argv)


def test_convert_for_the_official_readers_in_process(tiny_target, tmp_path, capsys):
    """--with-embeddings stores the target's embedding in an sglang export; medusa-v0.1 refuses heads whose
    ResBlocks differ unless --allow-official-misread."""
    import warnings

    from headway.cli import main
    from headway.heads import EagleHead, MedusaHeads
    from headway.heads.target import load_target

    target, _ = load_target(str(tiny_target))
    EagleHead.from_target(target, version=3).save_pretrained(tmp_path / "eagle3")
    heads = MedusaHeads.from_target(target, num_heads=2, num_layers=2)
    with torch.no_grad():
        for p in heads.blocks.parameters():
            p.normal_(0, 0.02)
    heads.save_pretrained(tmp_path / "medusa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tiny target's layers have no exact engine counterpart
        assert main(["convert", "--to", "sglang", str(tmp_path / "eagle3"), str(tmp_path / "s"), "--with-embeddings"]) == 2
        assert "name the target (target=..., --target MODEL)" in capsys.readouterr().err
        assert main(["convert", "--to", "sglang", str(tmp_path / "eagle3"), str(tmp_path / "s"), "--with-embeddings",
                     "--target", str(tiny_target)]) == 0
    assert torch.equal(load_file(str(tmp_path / "s" / "model.safetensors"))["embed_tokens.weight"],
                       target.get_input_embeddings().weight)
    assert main(["convert", "--to", "medusa-v0.1", str(tmp_path / "medusa"), str(tmp_path / "v01")]) == 2
    assert "--allow-official-misread" in capsys.readouterr().err and not (tmp_path / "v01").exists()
    assert main(["convert", "--to", "medusa-v0.1", str(tmp_path / "medusa"), str(tmp_path / "v01"),
                 "--allow-official-misread"]) == 0


def test_convert_passes_the_feature_layers_a_format_lacks(monkeypatch, capsys):
    """--feature-layers I,J,K reaches the reader as headway ids (the errors for folders without them name the flag)."""
    from headway.cli import main
    from headway.heads.formats import convert

    seen = {}
    monkeypatch.setattr(convert, "convert", lambda src, dst, **kw: seen.update(kw) or dst)
    assert main(["convert", "--to", "headway", "src", "dst", "--feature-layers", "2,15,27"]) == 0
    assert seen["feature_layers"] == [2, 15, 27] and "wrote dst (headway)" in capsys.readouterr().out
    seen.clear()
    assert main(["convert", "--to", "headway", "src", "dst"]) == 0 and "feature_layers" not in seen


def test_convert_names_a_bad_output_folder_before_the_target_loads(tmp_path, capsys):
    from headway.cli import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    assert main(["convert", "--to", "headway", str(tmp_path / "src"), str(tmp_path / "out"),
                 "--target", str(tmp_path / "no-such-target")]) == 2
    err = capsys.readouterr().err
    assert "is not empty" in err and "no-such-target" not in err and "Traceback" not in err
