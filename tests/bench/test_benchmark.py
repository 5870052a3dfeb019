"""The benchmark as a package module: its command line, the methods it runs, repeats and packed linears
(its prompts: test_prompts.py)."""

import pytest
import torch

from headway.bench import benchmark


def test_parser_defaults_are_relative_to_the_current_directory():
    args = benchmark.build_parser().parse_args([])
    assert args.heads is None and benchmark.DEMO_HEADS == "outputs/demo/quick/heads" and args.out == "outputs/benchmark"
    assert args.methods.split(",") == list(benchmark.FAMILIES)
    # the unpruned EAGLE-2 trees are there to compare with, not run by default
    assert args.eagle_trees.split(",") == [t for t in benchmark.EAGLE_TREES if "unpruned" not in t]
    assert {"dynamic-7-unpruned", "dynamic-15-unpruned"} < set(benchmark.EAGLE_TREES)


def test_unknown_method_family_is_rejected_before_loading(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--methods", "lookup,medusa2"])
    assert "unknown --methods ['medusa2']" in capsys.readouterr().err


def test_more_chat_prompts_than_are_held_out_is_rejected_before_loading(capsys):
    with pytest.raises(SystemExit):
        benchmark.main(["--methods", "lookup", "--prompts", "201"])
    assert "--prompts 201: only 200 packaged chat prompts are held out of training" in capsys.readouterr().err


@pytest.mark.parametrize("flag, dtype", [([], None), (["--dtype", "float32"], "float32"), (["--dtype", "bfloat16"], "bfloat16")])
def test_dtype_flag_reaches_the_target_loader(monkeypatch, flag, dtype):
    import torch

    seen = {}

    def fake_load_target(name, dtype=None, **kw):
        seen["dtype"] = dtype
        raise RuntimeError("stop here")

    monkeypatch.setattr(benchmark, "load_target", fake_load_target)
    with pytest.raises(RuntimeError, match="stop here"):
        benchmark.main(["--methods", "lookup", *flag])
    assert seen["dtype"] == (getattr(torch, dtype) if dtype else None)


def test_repeats_pool_the_runs_and_report_each(tmp_path, capsys):
    """--repeats 2: the table pools both runs (twice the tokens of one) and prints each run's speedup."""
    args = ["--model", "tiny-random-llama", "--heads", "none", "--methods", "lookup", "--groups", "chat", "--prompts", "1",
            "--copy-prompts", "0", "--max-new-tokens", "6", "--out", str(tmp_path)]
    one = benchmark.main(args)
    two = benchmark.main([*args, "--repeats", "2"])
    for name, s in two["chat"].items():
        assert s["new_tokens"] == 2 * one["chat"][name]["new_tokens"]
        assert len(s["speedup_runs"]) == 2 and all(r > 0 for r in s["speedup_runs"])
        assert "speedup_runs" not in one["chat"][name]
    assert "runs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        benchmark.main([*args, "--repeats", "0"])


def test_two_drafters_of_one_version_both_run(tmp_path):
    """Two --eagle folders of the same EAGLE version: each gets its own rows (the second is labelled
    with its folder), instead of the second silently replacing the first."""
    from headway.heads import EagleHead
    from headway.heads.target import load_target

    target, _ = load_target("tiny-random-llama")
    folders = [tmp_path / "a", tmp_path / "b", tmp_path / "c" / "b"]  # the third shares the second's folder name
    for folder in folders:
        EagleHead.from_target(target, version=3).save_pretrained(folder)
    table = benchmark.methods(target, None, 0, [str(f) for f in folders], ["chain-3"], families=("eagle",))
    assert list(table) == ["plain", "eagle3 chain-3", "eagle3 (b) chain-3", f"eagle3 ({folders[2]}) chain-3"]
    assert len({id(method) for _, method in table.values()}) == 4
    runs = [tmp_path / "run1" / "eagle3", tmp_path / "run2" / "eagle3"]  # two training runs' default folder names
    for folder in runs:
        EagleHead.from_target(target, version=3).save_pretrained(folder)
    table = benchmark.methods(target, None, 0, [str(f) for f in runs], ["chain-3"], families=("eagle",))
    assert list(table)[1:] == ["eagle3 chain-3", f"eagle3 ({runs[1]}) chain-3"]
    table = benchmark.methods(target, None, 0, [str(folders[0])], ["dynamic-7", "dynamic-7-unpruned"],
                              families=("eagle",))
    trees = [method.tree for _, method in list(table.values())[1:]]
    assert [t.prune for t in trees] == [True, False] and trees[0].depth == trees[1].depth == 5
    # with lookup (the command line's default) every tree also runs as a hybrid with prompt lookup
    from headway.inference import HybridProposer

    table = benchmark.methods(target, None, 0, [str(folders[0])], ["chain-3"], families=("eagle",), lookup=True)
    assert list(table) == ["plain", "eagle3 chain-3", "eagle3 chain-3 + lookup"]
    assert isinstance(table["eagle3 chain-3 + lookup"][1].drafter, HybridProposer)
    # --hybrid-retrieval lookup,suffix: one hybrid row per retrieval drafter
    from headway.inference import SuffixDecoding

    table = benchmark.methods(target, None, 0, [str(folders[0])], ["chain-3"], families=("eagle",),
                              lookup=["lookup", "suffix", "lookup+suffix"])
    assert list(table)[1:] == ["eagle3 chain-3", "eagle3 chain-3 + lookup", "eagle3 chain-3 + suffix",
                               "eagle3 chain-3 + lookup+suffix"]
    assert isinstance(table["eagle3 chain-3 + suffix"][1].drafter.drafters[1], SuffixDecoding)
    both = table["eagle3 chain-3 + lookup+suffix"][1].drafter.drafters  # the model drafter and both retrievals
    assert [type(d).__name__ for d in both] == ["EagleProposer", "PromptLookup", "SuffixDecoding"]
    # --graphs-off: each tree also without CUDA graphs, side by side (the rows above keep the CUDA default)
    table = benchmark.methods(target, None, 0, [str(folders[0])], ["chain-3", "tree-7"], families=("eagle",),
                              graphs_off=True)
    assert list(table)[1:] == ["eagle3 chain-3", "eagle3 tree-7", "eagle3 chain-3 no graphs", "eagle3 tree-7 no graphs"]
    assert [m.cuda_graphs for _, m in list(table.values())[1:]] == [None, None, False, False]


def test_layerskip_peagle_and_dflash_run_their_chains_and_auto_with_identical_outputs(tmp_path, capsys):
    from headway.heads import EagleHead
    from headway.heads.dflash import DFlashHead
    from headway.heads.layerskip import LayerSkipHead
    from headway.heads.peagle import PEagleHead
    from headway.heads.target import load_target

    target, _ = load_target("tiny-random-llama")
    EagleHead.from_target(target, version=3).save_pretrained(tmp_path / "e")
    LayerSkipHead.from_target(target, exit_layer=1, num_draft=3).save_pretrained(tmp_path / "ls")
    PEagleHead.from_target(target, parallel_depths=3).save_pretrained(tmp_path / "pe")
    DFlashHead.from_target(target, block_size=4).save_pretrained(tmp_path / "df")
    args = ["--model", "tiny-random-llama", "--methods", "layerskip,peagle,dflash", "--layerskip", str(tmp_path / "ls"),
            "--peagle", str(tmp_path / "pe"), "--dflash", str(tmp_path / "df"),
            "--groups", "chat,copy", "--prompts", "1", "--copy-prompts", "1", "--max-new-tokens", "8",
            "--out", str(tmp_path / "out")]
    results = benchmark.main(args)
    rows = {name for per in results.values() for name in per}
    assert {"layerskip E=1 chain", "layerskip E=1 auto", "peagle K=3 chain", "peagle K=3 auto + suffix",
            "dflash B=4 chain", "dflash B=4 auto + suffix", "dflash B=4 dynamic"} <= rows
    assert all(s["identical"] for per in results.values() for s in per.values())
    with pytest.raises(SystemExit):  # an EAGLE folder passed as --layerskip: one line, before the model loads
        benchmark.main(args[:2] + ["--methods", "layerskip", "--layerskip", str(tmp_path / "e")] + args[10:])
    assert "holds a 'eagle' drafter, not a LayerSkip exit head; pass it with --eagle" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a P-EAGLE folder passed as --dflash
        benchmark.main(args[:2] + ["--methods", "dflash", "--dflash", str(tmp_path / "pe")] + args[10:])
    assert "holds a 'peagle' drafter, not a DFlash drafter; pass it with --peagle" in capsys.readouterr().err


def test_pack_linears_flag_packs_the_float32_cpu_target(tmp_path, capsys):
    """Default: the target's linears are prepacked (printed and recorded) and every output is still
    identical to plain greedy; --no-pack-linears leaves the target as loaded."""
    import json

    args = ["--model", "tiny-random-llama", "--heads", "none", "--methods", "lookup", "--groups", "chat,copy",
            "--prompts", "1", "--copy-prompts", "1", "--max-new-tokens", "8", "--out", str(tmp_path)]
    packed = benchmark.main(args)
    assert all(s["identical"] for per in packed.values() for s in per.values())
    recorded = json.loads((tmp_path / "results.json").read_text())
    assert recorded["packed_linears"] > 0 and recorded["args"]["pack_linears"] is True
    assert "linears packed" in capsys.readouterr().out
    benchmark.main([*args, "--no-pack-linears"])
    assert json.loads((tmp_path / "results.json").read_text())["packed_linears"] == 0
    assert "linears packed" not in capsys.readouterr().out


def test_methods_run_in_the_reverse_order_on_every_other_prompt(monkeypatch):
    """A method's place in the per-prompt order moves its timing (two identical generators read 8% apart),
    so the order alternates; outputs are still compared with plain's on the same prompt."""
    calls = []

    def fake_run(kind, method, target, ids, max_new_tokens, eos):
        calls.append(method)
        return ([1, 2] if method != "wrong" else [1, 3]), 0.1, None

    monkeypatch.setattr(benchmark, "run_one", fake_run)
    monkeypatch.setattr(benchmark, "prompt_ids", lambda tokenizer, messages: torch.tensor([[5, 6]]))
    monkeypatch.setattr(benchmark, "prefill_seconds", lambda target, ids: 0.01)
    table = {"plain": ("hf", "plain"), "a": ("hf", "a"), "b": ("hf", "wrong")}
    groups = {"g1": [[{}], [{}]], "g2": [[{}]]}
    raw, prefill = benchmark.run_prompts(table, None, None, groups, 8, 0, "cpu")
    assert calls == ["plain", "a", "wrong", "wrong", "a", "plain", "plain", "a", "wrong"]
    assert [r["identical"] for r in raw["g1"]["a"]] == [True, True]
    assert [r["identical"] for r in raw["g1"]["b"] + raw["g2"]["b"]] == [False, False, False]
    assert prefill == pytest.approx({"g1": 0.02, "g2": 0.01})


BASE = ["bench", "--model", "tiny-random-llama", "--groups", "chat", "--prompts", "1", "--max-new-tokens", "4",
        "--threads", "1"]


def bench_refused(argv, capsys) -> str:
    """`headway bench ARGV` in this process: exit status 2 and the one `error:` line on stderr, returned."""
    from headway.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err  # transformers may draw a weight-loading progress bar first: the error is last
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert exc.value.code == 2 and len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err
    assert "Traceback" not in err and errors[0].endswith(" (see 'headway bench --help')"), err
    return errors[0]


@pytest.mark.parametrize("flags, message", [
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--draft-layers", "-1"], "--draft-layers must be >= 0, got -1"),
    (["--prompts", "-2"], "--prompts must be >= 0, got -2"),
    (["--copy-prompts", "-1"], "--copy-prompts must be >= 0, got -1"),
    (["--per-group", "-1"], "--per-group must be >= 0, got -1"),
    (["--prompts", "0"], "no prompts to run: --groups chat selects none with --prompts 0 (chat)"),
    (["--groups", "code", "--per-group", "0"], "no prompts to run: --groups code selects none"),
    (["--methods", "eagle"], "--methods eagle needs --eagle FOLDER"),
    (["--methods", "lookup,peagle"], "--methods peagle needs --peagle FOLDER"),
    (["--methods", "dflash"], "--methods dflash needs --dflash FOLDER"),
    (["--methods", "layerskip"], "--methods layerskip needs --layerskip FOLDER"),
    (["--methods", "medusa"], "--methods medusa needs --heads FOLDER"),
    (["--methods", "draft-model", "--draft-layers", "0"], "--methods draft-model needs --draft-layers N (N >= 1)"),
])
def test_bad_counts_and_methods_without_their_drafter_are_refused_before_loading(flags, message, tmp_path,
                                                                                 monkeypatch, capsys):
    """One line naming the flag, before the target loads and before anything is written (results.json stays)."""
    monkeypatch.chdir(tmp_path)  # no quick-demo heads here (the default --heads)

    def no_load(*args, **kwargs):
        raise AssertionError("the target loaded")

    monkeypatch.setattr(benchmark, "load_target", no_load)
    err = bench_refused([*BASE, "--out", str(tmp_path / "out"), *flags], capsys)
    assert err.startswith(f"error: {message}"), err
    assert not (tmp_path / "out").exists()


def test_draft_layers_must_leave_the_target_a_layer_and_default_to_what_fits(tmp_path, capsys):
    """--draft-layers N: 0 (skip) or 1..(target layers - 1), checked once the target loads and before anything runs
    or is written; unset it is 6, cut to what the target has (tiny-random-llama: 2 layers, so 1)."""
    import json

    out = tmp_path / "out"
    for n in ("2", "99"):
        err = bench_refused([*BASE, "--methods", "draft-model", "--draft-layers", n, "--out", str(out)], capsys)
        assert err.startswith(f"error: --draft-layers {n} must be 0 (skip) or 1..1: tiny-random-llama has 2 layers")
    assert not out.exists()
    err = bench_refused([*BASE, "--methods", "hf-lookup", "--max-new-tokens", "1000000", "--out", str(out)], capsys)
    assert err.startswith("error: no prompts to run: none fits the target's context with --max-new-tokens 1000000")
    assert not out.exists()
    results = benchmark.main([*BASE[1:], "--methods", "draft-model", "--out", str(out)])
    assert "draft model: first 1 layers, chain-3" in results["chat"]
    assert json.loads((out / "results.json").read_text())["args"]["draft_layers"] == 1
