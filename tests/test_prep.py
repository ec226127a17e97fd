"""The prep stage: every raw row ends in train/eval or in the quarantine with all the rules it broke, never lost."""

from __future__ import annotations

import json

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grpo.config import DataConfig
from grpo.errors import DataError
from grpo.pipeline.prep import RULES, load_prepared, prepare_dataset
from grpo.tasks import addition_problems


def write_jsonl(path, rows):
    """Rows are dicts (written as JSON) or raw strings (written as they are, e.g. a broken line)."""
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cfg_for(path, **kw) -> DataConfig:
    return DataConfig(source=str(path), **kw)


def quarantine_of(result) -> dict[int, list[str]]:
    return {r["source_row"]: r["rules"] for r in pq.read_table(result.paths["quarantine"]).to_pylist()}


def prepared_rows(result) -> list[dict]:
    ds = load_prepared(result.out_dir)
    return [row for split in ("train", "eval") for row in ds[split].to_list()]


def assert_reconciles(result, rows_in: int) -> None:
    s = result.stats
    written = sum(pq.read_metadata(result.paths[k]).num_rows for k in ("train", "eval"))
    quarantined = pq.read_metadata(result.paths["quarantine"]).num_rows
    assert s["rows_in"] == rows_in == written + quarantined
    assert (s["rows_valid"], s["rows_quarantined"]) == (written, quarantined)
    for split in s["splits"].values():
        assert split["rows_in"] == split["rows_valid"] + split["rows_quarantined"]


def test_quarantine_lists_every_rule_of_every_bad_row(tmp_path):
    good = [{"question": f"q{i}?", "solution": f"work #### {i}", "id": i} for i in range(8)]
    bad: list[tuple[dict | str, list[str]]] = [
        ({"question": "", "solution": "#### 1", "id": 100}, ["prompt_empty"]),
        ({"question": "  \t ", "solution": "#### 1", "id": 101}, ["prompt_empty"]),
        ({"question": "no answer key", "id": 102}, ["answer_present"]),
        ({"question": "null answer", "solution": None, "id": 103}, ["answer_present"]),
        ({"question": "list answer", "solution": ["#### 1"], "id": 104}, ["answer_type"]),
        ({"question": "p" * 41, "solution": "#### 1", "id": 105}, ["prompt_too_long"]),
        ({"question": "long answer", "solution": "#### " + "9" * 11, "id": 106}, ["answer_too_long"]),
        ({"question": "q3?", "solution": "#### 3", "id": 107}, ["duplicate_prompt"]),
        ({"question": "no match", "solution": "the answer is 4", "id": 108}, ["answer_regex"]),
        ({"question": "empty extraction", "solution": "####   ", "id": 109}, ["answer_empty"]),
        ({"question": "q5?", "solution": 5, "id": 110}, ["answer_regex", "duplicate_prompt"]),
        ({"question": ["not", "text"], "solution": {"a": 1}, "id": 111}, ["prompt_type", "answer_type"]),
        ({"question": None, "id": 112}, ["prompt_present", "answer_present"]),
        ("{broken json", ["malformed_record"]),
        ("[1, 2]", ["malformed_record"]),
        ({"question": "infinite", "solution": float("inf"), "id": 113}, ["answer_not_finite"]),
    ]
    rows = good[:4] + [r for r, _ in bad] + good[4:]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    cfg = cfg_for(path, prompt_column="question", answer_column="solution", answer_regex="#### (.*)",
                  eval_fraction=0.3)
    result = prepare_dataset(cfg, tmp_path / "out", max_prompt_chars=40, max_answer_chars=10)

    assert quarantine_of(result) == {4 + k: rules for k, (_, rules) in enumerate(bad)}
    assert_reconciles(result, len(rows))
    assert sorted(prepared_rows(result), key=lambda r: r["id"]) == [
        {"prompt": r["question"], "answer": str(r["id"]), "id": r["id"]} for r in good
    ]
    stats = result.stats
    assert stats["rules"]["answer_type"] == 2 and stats["rules"]["duplicate_prompt"] == 2
    assert set(stats["rules"]) == set(RULES) - {"environment_unknown"}  # that one: the test below
    assert stats["prompt_chars"] == {"min": 3, "mean": 3.0, "p50": 3.0, "p95": 3.0, "max": 3}
    assert json.loads(result.paths["stats"].read_text()) == stats

    reasons = {r["source_row"]: r for r in map(json.loads, result.paths["quarantine_jsonl"].read_text().splitlines())}
    assert reasons[9]["reason"] == "prompt column 'question' has 41 chars, more than max_prompt_chars=40"
    assert "max_answer_chars=10" in reasons[10]["reason"]
    assert reasons[6]["reason"] == "answer column 'solution' is missing from the row"
    assert reasons[7]["reason"] == "answer column 'solution' is null"
    assert "repeats the prompt of source row 3" in reasons[11]["reason"]
    assert "does not match answer_regex '#### (.*)'" in reasons[14]["reason"]
    assert reasons[14]["answer"] == "5" and reasons[15]["prompt"] == '["not", "text"]'
    assert reasons[17]["reason"].startswith("line 18: invalid JSON")
    assert {r["split"] for r in reasons.values()} <= {"train", "eval"}


def test_rows_routed_to_an_unregistered_environment_are_quarantined_with_the_registered_names(tmp_path):
    """A run on environments checks the ``environment`` column against the registered names: a typo would fail its
    episode in every round it is drawn, so it is quarantined at prep with the valid names; an empty value means the
    config's environment. Without environments the column is an ordinary extra column."""
    routes = ["calculator", None, "", "calculater", "guess_digit", 7, "calculator", None, "guess_digit", "", None, None]
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "environment": env} for i, env in enumerate(routes)]
    path = write_jsonl(tmp_path / "routed.jsonl", rows)
    result = prepare_dataset(cfg_for(path, eval_fraction=0.3), tmp_path / "out",
                             environments=["guess_digit", "calculator"])
    assert quarantine_of(result) == {3: ["environment_unknown"], 5: ["environment_unknown"]}
    assert_reconciles(result, len(rows))
    assert result.stats["rules"] == {"environment_unknown": 2}
    reasons = {r["source_row"]: r["reason"] for r in map(json.loads, result.paths["quarantine_jsonl"].read_text()
                                                          .splitlines())}
    assert reasons[3] == ("environment column 'environment' is 'calculater', not a registered environment; "
                          "registered: ['calculator', 'guess_digit'] (add one with @register_environment and "
                          "--env-module, or leave the value empty for the config's environment.name)")
    kept = {r["prompt"]: r["environment"] for r in prepared_rows(result)}
    assert kept == {f"{i}+1=": env for i, env in enumerate(routes) if i not in (3, 5)}

    del rows[5]  # an int among strings: parquet can not hold the column without the check
    plain = prepare_dataset(cfg_for(write_jsonl(tmp_path / "plain.jsonl", rows), eval_fraction=0.3), tmp_path / "p")
    assert plain.stats["rows_quarantined"] == 0 and len(prepared_rows(plain)) == len(rows)  # no environments: kept


def test_csv_keeps_text_and_chat_format(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text('prompt,answer,level\nwhat is 7?,007,easy\n"a, quoted?",1.10,hard\nempty answer?,,easy\n'
                    + "".join(f"q{i},{i},easy\n" for i in range(5)))
    cfg = cfg_for(path, prompt_format="chat", system_prompt="Be brief.", eval_fraction=0.4)
    result = prepare_dataset(cfg, tmp_path / "out")
    assert quarantine_of(result) == {2: ["answer_empty"]}
    assert_reconciles(result, 8)
    rows = {r["prompt"][1]["content"]: r for r in prepared_rows(result)}
    assert rows["what is 7?"]["answer"] == "007" and rows["a, quoted?"]["answer"] == "1.10"
    assert rows["what is 7?"]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert rows["what is 7?"]["level"] == "easy"
    assert result.stats["splits"]["eval"]["rows_in"] == 4  # ceil(8 * 0.4), split over raw rows


def test_conversational_prompts_pass_through_and_bad_conversations_are_quarantined(tmp_path):
    """TRL's conversational format: a prompt that is a list of {role, content} messages is kept as it is (with or
    without prompt_format chat); limits apply to its text, duplicates compare whole conversations, and anything
    else shaped like a list is quarantined with what is wrong with it."""
    def conv(*turns):
        return [{"role": r, "content": c} for r, c in turns]

    good = [{"prompt": conv(("system", "Be brief."), ("user", f"q{i}?")), "answer": str(i), "level": i % 2}
            for i in range(6)]
    bad = [
        ({"prompt": conv(("narrator", "once")), "answer": "1"}, ["prompt_type"], "message 0 has role 'narrator'"),
        ({"prompt": [{"role": "user"}], "answer": "1"}, ["prompt_type"], "message 0 has keys ['role']"),
        ({"prompt": [], "answer": "1"}, ["prompt_type"], "no messages"),
        ({"prompt": conv(("user", 7)), "answer": "1"}, ["prompt_type"], "message 0's content is a int"),
        ({"prompt": conv(("system", " "), ("user", "")), "answer": "1"}, ["prompt_empty"], "empty"),
        ({"prompt": conv(("user", "x" * 30), ("assistant", "y" * 11)), "answer": "1"}, ["prompt_too_long"],
         "has 42 chars, more than max_prompt_chars=40"),  # 30 + newline + 11
        ({"prompt": conv(("system", "Be brief."), ("user", "q2?")), "answer": "2"}, ["duplicate_prompt"],
         "repeats the prompt of source row 2"),
    ]
    rows = good + [r for r, _, _ in bad]
    path = write_jsonl(tmp_path / "conv.jsonl", rows)
    result = prepare_dataset(cfg_for(path, prompt_format="chat", system_prompt="ignored for conversations",
                                     eval_fraction=0.25), tmp_path / "out", max_prompt_chars=40)
    assert quarantine_of(result) == {6 + k: rules for k, (_, rules, _) in enumerate(bad)}
    assert_reconciles(result, len(rows))
    reasons = {r["source_row"]: r["reason"] for r in map(json.loads, result.paths["quarantine_jsonl"].read_text()
                                                          .splitlines())}
    for k, (_, _, why) in enumerate(bad):
        assert why in reasons[6 + k], (why, reasons[6 + k])
    assert "role in ['system', 'user', 'assistant']" in reasons[6]
    assert sorted(prepared_rows(result), key=lambda r: r["answer"]) == sorted(good, key=lambda r: r["answer"])
    assert result.stats["prompt_chars"]["max"] == len("Be brief.\nq0?")

    # text and conversation prompts in one file: refused with the column named (parquet stores one type per column)
    mixed = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "q1?", "answer": "1"}, *good])
    with pytest.raises(DataError, match="column 'prompt' mixes types"):
        prepare_dataset(cfg_for(mixed), tmp_path / "out-mixed")


def test_parquet_numbers_become_text_and_extras_keep_types(tmp_path):
    path = tmp_path / "qa.parquet"
    pq.write_table(pa.table({"q": ["one", "two", "three", "four"], "a": [1, None, 3, 40], "w": [0.5, 1.0, 1.5, 2.0]}),
                   path)
    result = prepare_dataset(cfg_for(path, prompt_column="q", answer_column="a", eval_fraction=0.25),
                             tmp_path / "out")
    assert quarantine_of(result) == {1: ["answer_present"]}
    assert_reconciles(result, 4)
    assert sorted((r["prompt"], r["answer"], r["w"]) for r in prepared_rows(result)) == [
        ("four", "40", 2.0), ("one", "1", 0.5), ("three", "3", 1.5)]


def test_missing_columns_are_named_with_the_available_ones(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"q": str(i), "a": str(i)} for i in range(5)])
    with pytest.raises(DataError, match=r"no column\(s\) \['prompt', 'answer'\]; available: \['q', 'a'\]"):
        prepare_dataset(cfg_for(path), tmp_path / "out")


def test_no_valid_row_names_the_rules_and_counts(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "", "answer": "1"}, {"prompt": "a", "answer": None},
                                                {"prompt": "b"}, {"prompt": " ", "answer": []}])
    with pytest.raises(DataError, match=r"no valid rows: all 4 rows quarantined \(answer_present: 2, "
                                        r"answer_type: 1, prompt_empty: 2\); see .*quarantine.jsonl"):
        prepare_dataset(cfg_for(path), tmp_path / "out")
    assert len((tmp_path / "out" / "quarantine.jsonl").read_text().splitlines()) == 4
    assert not (tmp_path / "out" / "stats.json").exists()


def test_a_split_left_without_valid_rows_is_an_error(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": "" if i else "0"} for i in range(4)]
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    with pytest.raises(DataError, match=r"the (train|eval) split has 0 valid row\(s\), needs at least 1 "
                                        r"\(\d quarantined; all splits: answer_empty: 3\)"):
        prepare_dataset(cfg_for(path, eval_fraction=0.25), tmp_path / "out")
    full = write_jsonl(tmp_path / "full.jsonl", [{"prompt": f"p{i}", "answer": "1"} for i in range(4)])
    with pytest.raises(DataError, match=r"the train split has 3 valid row\(s\), needs at least 5"):
        prepare_dataset(cfg_for(full, eval_fraction=0.25), tmp_path / "out", min_rows=5)


@pytest.mark.parametrize("policy", ["drop", "keep", "error"])
def test_duplicate_policies(tmp_path, policy):
    rows = [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}, {"prompt": "a", "answer": "2"},
            {"prompt": "b", "answer": "3"}, {"prompt": "c", "answer": "4"}]
    rows += [{"prompt": f"x{i}", "answer": "x"} for i in range(5)]  # both splits keep valid rows, whatever the seed
    path = write_jsonl(tmp_path / "qa.jsonl", rows)
    cfg = cfg_for(path, eval_fraction=0.5)
    if policy == "error":
        with pytest.raises(DataError, match=r"1 duplicate prompt\(s\) with duplicates='error': source row 2 \(\w+\) "
                                            r"repeats source row 0 \(\w+\): 'a'"):
            prepare_dataset(cfg, tmp_path / "out", duplicates=policy)
        return
    result = prepare_dataset(cfg, tmp_path / "out", duplicates=policy)
    assert_reconciles(result, 10)
    answers = sorted(r["answer"] for r in prepared_rows(result) if r["answer"] != "x")
    if policy == "drop":
        # The first *valid* "b" (row 3) is kept: row 1 is quarantined for its null answer, not row 3 as a repeat.
        assert quarantine_of(result) == {1: ["answer_present", "duplicate_prompt"], 2: ["duplicate_prompt"]}
        assert answers == ["1", "3", "4"]
    else:
        assert quarantine_of(result) == {1: ["answer_present"]}
        assert answers == ["1", "2", "3", "4"]


def test_duplicates_across_hub_splits_leave_eval(tmp_path):
    """A dataset in the Hub's layout (a config with train/test parquet splits), read by the real ``load_dataset``
    offline from a local folder, as a ``hub:`` source."""
    repo = tmp_path / "org" / "qa"
    (repo / "main").mkdir(parents=True)
    for split, rows in (("train", {"question": ["a", "b"], "answer": ["#### 1", "#### 2"]}),
                        ("test", {"question": ["b", "c"], "answer": ["#### 2", "#### 3"]})):
        datasets.Dataset.from_dict(rows).to_parquet(repo / "main" / f"{split}-00000-of-00001.parquet")
    (repo / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n"
                                    "  - split: train\n    path: main/train-*.parquet\n"
                                    "  - split: test\n    path: main/test-*.parquet\n---\n")
    cfg = DataConfig(source=f"hub:{repo}", hub_config="main", prompt_column="question", answer_regex="#### (.*)")
    result = prepare_dataset(cfg, tmp_path / "out")
    q = pq.read_table(result.paths["quarantine"]).to_pylist()
    assert [(r["split"], r["source_row"], r["rules"]) for r in q] == [("eval", 0, ["duplicate_prompt"])]
    ds = load_prepared(result.out_dir)
    assert ds["train"]["prompt"] == ["a", "b"] and ds["eval"].to_list() == [{"prompt": "c", "answer": "3"}]


def test_content_hash_is_deterministic_and_tracks_the_data(tmp_path):
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(30)]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    first = prepare_dataset(cfg_for(path), tmp_path / "one")
    again = prepare_dataset(cfg_for(path), tmp_path / "two")
    assert first.content_hash == again.content_hash == first.stats["content_hash"]
    assert len(first.content_hash) == 64
    assert load_prepared(first.out_dir)["eval"].to_list() == load_prepared(again.out_dir)["eval"].to_list()

    changed = write_jsonl(tmp_path / "b.jsonl", [*rows[:-1], {"prompt": "p29", "answer": "twenty-nine"}])
    assert prepare_dataset(cfg_for(changed), tmp_path / "three").content_hash != first.content_hash
    other_split = prepare_dataset(cfg_for(path, seed=1), tmp_path / "four")
    assert other_split.content_hash != first.content_hash
    assert other_split.stats["splits"]["eval"]["rows_in"] == first.stats["splits"]["eval"]["rows_in"] == 3

    table = pq.read_table(first.paths["train"])
    pq.write_table(table.set_column(1, "answer", pa.array(["0"] * table.num_rows)), first.paths["train"])
    with pytest.raises(DataError, match="modified after prep"):
        load_prepared(first.out_dir)
    assert load_prepared(first.out_dir, verify=False)["train"].num_rows == table.num_rows


def test_synthetic_source_preps_clean_and_matches_the_generator(tmp_path):
    cfg = DataConfig(num_train=300, num_eval=40, seed=2)
    result = prepare_dataset(cfg, tmp_path / "out")
    assert result.stats["rows_quarantined"] == 0 and result.stats["rules"] == {}
    assert_reconciles(result, 340)
    ds, expected = load_prepared(result.out_dir), addition_problems(300, 40, seed=2)
    for split in ("train", "eval"):
        assert ds[split].to_list() == expected[split].to_list()


def test_bad_arguments_and_unusable_sources(tmp_path):
    path = write_jsonl(tmp_path / "qa.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    with pytest.raises(ValueError, match="duplicates must be 'drop', 'keep' or 'error'"):
        prepare_dataset(cfg_for(path), tmp_path / "out", duplicates="first")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_prompt_chars"):
        prepare_dataset(cfg_for(path), tmp_path / "out", max_prompt_chars=0)
    with pytest.raises(DataError, match="needs one capture group"):
        prepare_dataset(cfg_for(path, answer_regex="####"), tmp_path / "out")
    one = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "a", "answer": "1"}])
    with pytest.raises(DataError, match="needs at least 2 rows"):
        prepare_dataset(cfg_for(one), tmp_path / "out")
    broken = tmp_path / "broken.parquet"
    broken.write_text("not parquet")
    with pytest.raises(DataError, match="could not be read"):
        prepare_dataset(cfg_for(broken), tmp_path / "out")
    with pytest.raises(DataError, match="no stats.json"):
        load_prepared(tmp_path / "nowhere")


cells = st.one_of(st.none(), st.text(max_size=6), st.sampled_from(["a", "a", " ", "#### 1"]), st.integers(-5, 5),
                  st.lists(st.integers(), max_size=2))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(st.fixed_dictionaries({"prompt": cells}, optional={"answer": cells}), min_size=2, max_size=15),
       policy=st.sampled_from(["drop", "keep"]))
def test_every_raw_row_is_prepared_or_quarantined_exactly_once(tmp_path_factory, rows, policy):
    tagged = [{**r, "row": i} for i, r in enumerate(rows)]
    path = write_jsonl(tmp_path_factory.mktemp("in") / "qa.jsonl", tagged)
    out = tmp_path_factory.mktemp("out")
    try:
        result = prepare_dataset(cfg_for(path, eval_fraction=0.3), out, max_prompt_chars=4, duplicates=policy)
    except DataError as err:
        msg = str(err)
        if "no column(s) ['answer']" in msg:
            assert not any("answer" in r for r in rows)
        elif "no valid rows" in msg:  # the quarantine written before the error holds every row
            assert sorted(pq.read_table(out / "quarantine.parquet")["source_row"].to_pylist()) == list(range(len(rows)))
        else:
            assert "split has 0 valid" in msg
        return
    assert_reconciles(result, len(rows))
    seen = sorted([r["row"] for r in prepared_rows(result)] + list(quarantine_of(result)))
    assert seen == list(range(len(rows)))
