"""Data sources: the synthetic task, local files with column mapping, and the errors for bad sources."""

from __future__ import annotations

import json

import pytest

from grpo.config import load_config
from grpo.data import alphabet_of, load_task_data
from grpo.errors import DataError
from grpo.tasks import addition_problems, flawed_addition_demonstrations


def test_synthetic_addition_is_deterministic_disjoint_and_fixed_width():
    a = addition_problems(300, 50, max_operand=99, seed=3)
    b = addition_problems(300, 50, max_operand=99, seed=3)
    assert a["train"]["prompt"] == b["train"]["prompt"]
    assert not set(a["train"]["prompt"]) & set(a["eval"]["prompt"])
    assert {len(p) for p in a["train"]["prompt"]} == {6}
    for prompt, answer in zip(a["train"]["prompt"], a["train"]["answer"]):
        x, y = prompt.rstrip("=").split("+")
        assert int(x) + int(y) == int(answer)
    assert addition_problems(300, 50, seed=4)["train"]["prompt"] != a["train"]["prompt"]


def test_flawed_demonstrations_only_touch_carrying_problems():
    ds = addition_problems(2000, 10, seed=0)["train"]
    prompts, answers = list(ds["prompt"]), list(ds["answer"])
    flawed = flawed_addition_demonstrations(prompts, answers, 0.6, seed=0)
    changed = carries = 0
    for p, good, demo in zip(prompts, answers, flawed):
        x, y = (int(v) for v in p.rstrip("=").split("+"))
        carry = x % 10 + y % 10 >= 10
        carries += carry
        if demo != good:
            changed += 1
            assert carry and int(demo) == int(good) - 10
    assert 0.5 < changed / carries < 0.7
    assert flawed_addition_demonstrations(prompts, answers, 0.0) == answers


def test_local_jsonl_with_column_mapping_and_answer_regex(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"q{i}?", "solution": f"work #### {i}", "id": i} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(None, [f"data.source={path}", "data.prompt_column=question", "data.answer_column=solution",
                             "data.answer_regex='#### (.*)'", "data.eval_fraction=0.25"])
    ds = load_task_data(cfg.data)
    assert len(ds["train"]) == 15 and len(ds["eval"]) == 5
    row = ds["train"][0]
    assert row["prompt"] == f"q{row['id']}?" and row["answer"] == str(row["id"])
    assert "question" not in ds["train"].column_names


def test_local_csv_chat_format(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text("prompt,answer\n" + "\n".join(f"what is {i}?,{i}" for i in range(10)))
    cfg = load_config(None, [f"data.source={path}", "data.prompt_format=chat", "data.system_prompt=Be brief.",
                             "model.name_or_path=some/model"])
    row = load_task_data(cfg.data)["train"][0]
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert row["prompt"][1]["role"] == "user"


def test_missing_columns_are_named(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"q": str(i), "a": str(i)}) for i in range(5)))
    cfg = load_config(None, [f"data.source={path}"])
    with pytest.raises(DataError, match=r"no column\(s\) \['prompt', 'answer'\]; available: \['q', 'a'\]"):
        load_task_data(cfg.data)


def test_unreadable_or_tiny_file(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "b"}))
    cfg = load_config(None, [f"data.source={path}"])
    with pytest.raises(DataError, match="needs at least 2 rows"):
        load_task_data(cfg.data)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    cfg = load_config(None, [f"data.source={broken}"])
    with pytest.raises(DataError, match="could not be read"):
        load_task_data(cfg.data)


def test_alphabet_covers_prompts_and_answers():
    ds = addition_problems(200, 20, seed=0)
    assert alphabet_of(ds) == "+0123456789="
