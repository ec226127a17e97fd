"""Data sources through the one reader (``grpo.pipeline.data.load_data``, the prep stage's cached output): the synthetic
task, local files with column mapping, hub layouts, the errors for bad sources, and ``grpo plan`` planning over exactly
the rows a run trains on."""

from __future__ import annotations

import json

import datasets
import pyarrow.parquet as pq
import pytest

from grpo.config import load_config
from grpo.errors import ConfigError, DataError
from grpo.pipeline.cache_dirs import prep_dir_for
from grpo.pipeline.data import load_data
from grpo.pipeline.prep import load_prepared
from grpo.tasks import addition_problems, flawed_addition_demonstrations, worked_addition
from grpo.training.tiny_model import alphabet_of


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


def _check_work(prompt: str, work: str) -> int:
    """Re-derive a worked answer column by column; returns the carry it forgot (0 or 1) into the tens."""
    x, y = prompt.rstrip("=").split("+")
    *steps, result = work.split(";")
    assert len(steps) == len(x)
    carry, forgot = 0, 0
    for i, step in enumerate(steps):
        lhs, s = step.split("=")
        terms = [int(t) for t in lhs.split("+")]
        assert terms[:2] == [int(x[-1 - i]), int(y[-1 - i])] and sum(terms) == int(s)
        if i == 1 and carry and len(terms) == 2:
            forgot = 1
        else:
            assert terms[2:] == ([1] if carry else [])
        carry = int(s) // 10
    assert int(result) == int(x) + int(y) - 10 * forgot
    return forgot


def test_addition_cot_answers_show_correct_work_and_flawed_demonstrations_forget_one_carry():
    """``synthetic:addition_cot``: the answer is the column-by-column work then the sum, ~17 tokens; a flawed
    demonstration shows work that drops the carry out of the ones column, consistently with its result."""
    assert worked_addition(27, 15, 2) == "7+5=12;2+1+1=4;42"
    assert worked_addition(99, 99, 2) == "9+9=18;9+9+1=19;198"
    assert worked_addition(27, 15, 2, forget_first_carry=True) == "7+5=12;2+1=3;32"
    ds = addition_problems(2000, 50, seed=0, worked=True)
    plain = addition_problems(2000, 50, seed=0)
    assert ds["train"]["prompt"] == plain["train"]["prompt"]  # the same problems, answered with their work
    prompts, answers = list(ds["train"]["prompt"]), list(ds["train"]["answer"])
    assert all(_check_work(p, a) == 0 for p, a in zip(prompts, answers))
    assert [a.split(";")[-1] for a in answers] == list(plain["train"]["answer"])
    assert 14 <= sum(map(len, answers)) / len(answers) <= 19
    flawed = flawed_addition_demonstrations(prompts, answers, 0.6, seed=0, worked=True)
    forgot = [_check_work(p, demo) for p, demo in zip(prompts, flawed)]
    assert forgot == [int(demo != good) for demo, good in zip(flawed, answers)]
    carries = sum(int(p[1]) + int(p[4]) >= 10 for p in prompts)
    assert 0.5 < sum(forgot) / carries < 0.7
    assert alphabet_of(ds) == "+0123456789;="
    cfg = load_config("tiny", ["data.source=synthetic:addition_cot", "grpo.max_completion_length=20"])
    assert cfg.data.worked_answers and not load_config("tiny").data.worked_answers
    with pytest.raises(ConfigError, match=r"unknown synthetic task 'synthetic:subtraction'; valid: "
                                          r"'synthetic:addition', 'synthetic:addition_cot'"):
        load_config("tiny", ["data.source=synthetic:subtraction"])


def test_local_jsonl_with_column_mapping_and_answer_regex(tmp_path):
    path = tmp_path / "qa.jsonl"
    rows = [{"question": f"q{i}?", "solution": f"work #### {i}", "id": i} for i in range(20)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(None, [f"data.source={path}", "data.prompt_column=question", "data.answer_column=solution",
                             "data.answer_regex='#### (.*)'", "data.eval_fraction=0.25"])
    ds = load_data(cfg)
    assert len(ds["train"]) == 15 and len(ds["eval"]) == 5
    row = ds["train"][0]
    assert row["prompt"] == f"q{row['id']}?" and row["answer"] == str(row["id"])
    assert "question" not in ds["train"].column_names


def test_local_csv_chat_format(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text("prompt,answer\n" + "\n".join(f"what is {i}?,{i}" for i in range(10)))
    cfg = load_config(None, [f"data.source={path}", "data.prompt_format=chat", "data.system_prompt=Be brief.",
                             "model.name_or_path=some/model"])
    row = load_data(cfg)["train"][0]
    assert row["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert row["prompt"][1]["role"] == "user"


def test_missing_columns_are_named(tmp_path):
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(json.dumps({"q": str(i), "a": str(i)}) for i in range(5)))
    cfg = load_config(None, [f"data.source={path}"])
    with pytest.raises(DataError, match=r"no column\(s\) \['prompt', 'answer'\]; available: \['q', 'a'\]"):
        load_data(cfg)


def test_unreadable_or_tiny_file(tmp_path):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "b"}))
    cfg = load_config(None, [f"data.source={path}"])
    with pytest.raises(DataError, match="needs at least 2 rows"):
        load_data(cfg)
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    cfg = load_config(None, [f"data.source={broken}"])
    with pytest.raises(DataError, match="could not be read"):
        load_data(cfg)


def test_alphabet_covers_prompts_and_answers():
    ds = addition_problems(200, 20, seed=0)
    assert alphabet_of(ds) == "+0123456789="


def test_hub_sources_that_fail_name_the_source_and_the_splits(tmp_path):
    cfg = load_config(None, ["data.source=hub:no-such-org/no-such-dataset"])
    # offline (as the tests run) and not in the local hub cache: said before anything is keyed or loaded
    with pytest.raises(DataError, match=r"data.source 'hub:no-such-org/no-such-dataset': not in the local hub cache"):
        load_data(cfg)
    repo = tmp_path / "org" / "qa"  # the hub's layout in a local folder, read by the real load_dataset offline
    repo.mkdir(parents=True)
    for split in ("train", "test"):
        datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": ["1", "2"]}).to_parquet(repo / f"{split}.parquet")
    cfg = load_config(None, [f"data.source=hub:{repo}", "data.eval_split=validation"])
    with pytest.raises(DataError, match=r"no split\(s\) \['validation'\]; available: \['train', 'test'\]"):
        load_data(cfg)


def test_plan_uses_exactly_the_prepared_train_rows_a_run_trains_on(tmp_path):
    """``grpo plan`` plans over the prep stage's train rows (bad and duplicate rows quarantined, prep's split and
    order), not a second reading of the file: every prompt index of the plan points at the prompt whose length it
    recorded, and each prompt's length is unique, so a different row order or count would not match."""
    from typer.testing import CliRunner

    from grpo.app.cli import app
    from tests.conftest import MICRO, micro_overrides

    good = [{"prompt": "q" + "x" * i + "?", "answer": str(i)} for i in range(40)]
    lines = [json.dumps(r) for r in good]
    lines.insert(2, json.dumps({"prompt": "q" + "y" * 60, "answer": " "}))  # answer_empty
    lines.insert(5, "{not json")  # malformed_record
    lines.insert(9, json.dumps(good[3]))  # duplicate_prompt
    path = tmp_path / "qa.jsonl"
    path.write_text("\n".join(lines) + "\n")
    overrides = micro_overrides(tmp_path / "runs", **{"data.source": path})
    out = tmp_path / "plan"
    result = CliRunner().invoke(app, ["plan", "--config", str(MICRO), *(a for o in overrides for a in ("--set", o)),
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output

    cfg = load_config(MICRO, overrides)
    prep_dir = prep_dir_for(cfg)  # where `grpo run` (either path) reads its data from
    train = load_prepared(prep_dir)["train"]
    assert load_data(cfg)["train"].to_list() == train.to_list()
    stats = json.loads((prep_dir / "stats.json").read_text())
    assert stats["rows_in"] == 43 and stats["rows_quarantined"] == 3
    assert stats["rules"] == {"answer_empty": 1, "duplicate_prompt": 1, "malformed_record": 1}
    assert f"3 quarantined (reasons in {prep_dir / 'quarantine.jsonl'})" in result.output
    assert stats["splits"]["train"]["rows_valid"] == len(train)
    assert all("y" not in p for p in train["prompt"])

    summary = json.loads((out / "plan.json").read_text())
    assert summary["dataset_size"] == len(train) == summary["unique_prompts_used"]
    plan = pq.read_table(out / "plan.parquet", columns=["prompt_index", "prompt_tokens"]).to_pylist()
    prompts = train["prompt"]
    assert {r["prompt_index"] for r in plan} == set(range(len(train)))
    assert all(r["prompt_tokens"] == len(prompts[r["prompt_index"]]) for r in plan)  # tiny model: one token a char
