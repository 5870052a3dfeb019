"""Task-diverse benchmark prompts: every group built from packaged text, and prompt files by category."""

import json

import pytest

from headway.bench import task_prompts as tp


def test_every_group_gives_chat_prompts_of_its_task():
    got = {g: tp.task_prompts(g, 3) for g in tp.GROUPS}
    for group, prompts in got.items():
        assert len(prompts) == 3, group
        for messages in prompts:
            assert messages[-1]["role"] == "user" and all(m["content"].strip() for m in messages), group
    assert all(sum(m["role"] == "user" for m in p) >= 2 and p[1]["role"] == "assistant" for p in got["multi-turn"])
    assert all("```python\n" in p[0]["content"] and "\ndef " in "\n" + p[0]["content"] for p in got["code"])
    assert all(len(p[0]["content"]) > 2000 for p in got["summarize"] + got["rag"])
    assert all("Question:" in p[0]["content"] for p in got["rag"])
    assert {p[0]["content"].split(":")[0] for p in got["translate"]} == {f"Translate this text into {lang}"
                                                                       for lang in tp.LANGUAGES}
    # no two groups share a prompt, and the documents summarized are not the RAG contexts
    texts = [m[-1]["content"] for prompts in got.values() for m in prompts]
    assert len(set(texts)) == len(texts)
    assert tp.math_problems(4, seed=0) == tp.math_problems(4, seed=0) != tp.math_problems(4, seed=1)
    assert tp.task_prompts("code", 0) == [] and len(tp.task_prompts("summarize", 100)) < 100  # as many as there are
    with pytest.raises(ValueError, match="unknown prompt group 'poetry'"):
        tp.task_prompts("poetry", 1)


def test_prompts_file_reads_mt_bench_and_chat_records_by_category(tmp_path):
    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question_id": 81, "category": "writing", "turns": ["Write a travel blog post about Hawaii.", "Rewrite it."]},
        {"question_id": 101, "category": "reasoning", "turns": ["What is 2 + 2?"]},
        {"question_id": 82, "category": "writing", "turns": ["Draft an email."]},
        {"question_id": 83, "category": "writing", "turns": []}]))
    groups = tp.prompts_file(mt)
    assert groups == {"writing": [tp.user("Write a travel blog post about Hawaii."), tp.user("Draft an email.")],
                      "reasoning": [tp.user("What is 2 + 2?")]}
    chats = tmp_path / "chats.json"
    chats.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "hello"}]},
        {"category": "code", "messages": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "sort a list"},
                                          {"role": "assistant", "content": "sorted(x)"}]}]))
    assert tp.prompts_file(chats) == {"file": [tp.user("hi there")],
                                      "code": [[{"role": "system", "content": "be brief"}, *tp.user("sort a list")]]}
    (tmp_path / "none.jsonl").write_text(json.dumps({"text": "no turns"}) + "\n")
    with pytest.raises(ValueError, match="holds no usable prompt: give MT-bench question.jsonl"):
        tp.prompts_file(tmp_path / "none.jsonl")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tp.prompts_file(tmp_path / "missing.jsonl")


def test_bench_reports_each_group_and_the_mean_of_their_speedups(tmp_path, capsys):
    from headway.bench import benchmark

    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps({"question_id": i, "category": c, "turns": [t]}) + "\n" for i, (c, t) in enumerate(
        [("writing", "hello how are you today ?"), ("math", "what is two and two ?"),
         ("long", "hello " * 1100)])))
    results = benchmark.main(["--model", "tiny-random-llama", "--methods", "lookup", "--prompts-file", str(mt),
                              "--max-new-tokens", "6", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert set(results) == {"writing", "math"} and "(long prompt 1: " in printed and "left out" in printed
    recorded = json.loads((tmp_path / "out" / "results.json").read_text())
    for name, o in recorded["overall"].items():
        assert o["speedup"] == pytest.approx(sum(results[g][name]["speedup"] for g in results) / 2)
        assert o["identical"] and set(o["group_speedup"]) == {"writing", "math"}
    assert set(recorded["overall"]["prompt lookup chain-10"]["group_tau"]) == {"writing", "math"}
    assert "overall: the mean of the speedups over 2 groups" in printed
    with pytest.raises(SystemExit):
        benchmark.main(["--groups", "chat,poetry"])
    assert "unknown --groups ['poetry']" in capsys.readouterr().err


def test_the_groups_a_run_selects(tmp_path):
    """Chat and copy prompts by their own counts, the others by per_group; a group of none dropped; a file's
    categories capped by per_group; an unknown name refused in one line."""
    got = tp.selected_groups("chat,copy,math", None, chat=2, copy=0, per_group=1)
    assert list(got) == ["chat", "math"] and len(got["chat"]) == 2 and len(got["math"]) == 1
    assert tp.selected_groups("code", None, chat=3, copy=3, per_group=0) == {}
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [f"Write {i}."]}) + "\n"
                                 for i in range(3)))
    assert [len(v) for v in tp.selected_groups("chat", str(questions), 5, 5, per_group=2).values()] == [2]
    with pytest.raises(ValueError, match=r"unknown --groups \['nope'\]; choose from"):
        tp.selected_groups("chat,nope", None, 1, 1, 1)
