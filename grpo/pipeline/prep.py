"""The pipeline's dataset-prep stage: raw rows -> validated train/eval parquet, a quarantine, stats and a content hash.

This is the one place a source is read (synthetic task, local file or hub; chat wrapping too): ``grpo run``, the
Prefect pipeline and :func:`grpo.pipeline.data.load_data` (``grpo plan``, tests, benchmarks) all use its output. It is
the gate in front of training: every raw row ends up either in train/eval or in the quarantine with every rule it
broke, so a bad row is visible and fixable instead of being dropped silently or crashing a reward function hours
into a run. ``rows_in == rows_valid + rows_quarantined`` is checked on the written tables. The content hash
versions the prepared data (same input and settings -> same hash), so a run can record exactly which data it
trained on and caches can key on it.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import numbers
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pandas as pd
import pyarrow
import pyarrow.parquet as pq
from datasets import Dataset, DatasetDict

from grpo.config import DataConfig
from grpo.environments import ROUTING_COLUMN
from grpo.errors import DataError

if TYPE_CHECKING:
    import pandera.pandas as pa

Duplicates = Literal["drop", "keep", "error"]
SPLITS = ("train", "eval")
# Every rule a row can break, in the order a row lists them (the pandera check names), with a one-line summary.
RULES: dict[str, str] = {
    "malformed_record": "the line/item is not a JSON object",
    "prompt_present": "prompt missing or null",
    "prompt_type": "prompt is neither a string nor a list of {role, content} messages (TRL's conversational format)",
    "prompt_empty": "prompt (every message's content) empty or whitespace only",
    "prompt_too_long": "prompt (its messages' contents together) longer than max_prompt_chars",
    "answer_present": "answer missing or null",
    "answer_type": "answer is not a string or number",
    "answer_not_finite": "answer is a non-finite number (Infinity); no completion can match it",
    "answer_regex": "answer does not match answer_regex",
    "answer_empty": "answer (after answer_regex) empty or whitespace only",
    "answer_too_long": "answer (after answer_regex) longer than max_answer_chars",
    "environment_unknown": "the environment column names no registered environment (rows routed by name, #30)",
    "duplicate_prompt": "prompt repeats a kept row's prompt (duplicates='drop')",
}
# Roles a conversational prompt may use (TRL's conversational format: a list of {"role", "content"} messages).
MESSAGE_ROLES = ("system", "user", "assistant")
_QUARANTINE_SCHEMA = pyarrow.schema([
    ("source_row", pyarrow.int64()), ("split", pyarrow.string()), ("rules", pyarrow.list_(pyarrow.string())),
    ("reason", pyarrow.string()), ("prompt", pyarrow.string()), ("answer", pyarrow.string()),
])


@dataclass(frozen=True)
class PrepResult:
    """What the stage wrote: ``paths`` (train, eval, quarantine, quarantine_jsonl, stats), the stats, the hash."""

    out_dir: Path
    paths: dict[str, Path]
    stats: dict[str, Any]
    content_hash: str


@dataclass(frozen=True)
class _Limits:
    max_prompt: int
    max_answer: int
    pattern: re.Pattern[str] | None
    environments: tuple[str, ...] | None = None  # registered environment names, when the run has environments


@dataclass
class _Raw:
    """All raw rows of a source, in source order. ``records[i]`` is None when row i could not be parsed."""

    records: list[dict[str, Any] | None]
    parse_errors: list[str | None]
    split: list[str]
    source_row: list[int]
    columns: dict[str, list[str]]  # "<split> split of <source>" (or the file) -> its columns, in first-seen order


def prepare_dataset(
    cfg: DataConfig,
    out_dir: str | Path,
    *,
    max_prompt_chars: int = 4096,
    max_answer_chars: int = 512,
    duplicates: Duplicates = "drop",
    min_rows: int = 1,
    environments: Sequence[str] | None = None,
) -> PrepResult:
    """Validate ``cfg``'s source and write train/eval parquet, the quarantine, ``stats.json`` (with ``content_hash``).

    Raises :class:`DataError` for an unreadable source, missing columns, duplicates under ``duplicates='error'``,
    or a split left with fewer than ``min_rows`` valid rows (the quarantine is written first, to look at).
    ``max_prompt_chars`` measures the prompt text before chat wrapping; ``max_answer_chars`` the answer after
    ``answer_regex``. ``environments``: the registered environment names when the run trains on environments; a row
    whose ``environment`` column names another is quarantined (an empty value means the config's environment).
    See :data:`RULES` for what sends a row to the quarantine.
    """
    if max_prompt_chars < 1 or max_answer_chars < 1 or min_rows < 1:
        raise ValueError(
            f"max_prompt_chars, max_answer_chars and min_rows must be >= 1, got {max_prompt_chars}, "
            f"{max_answer_chars}, {min_rows}"
        )
    if duplicates not in ("drop", "keep", "error"):
        raise ValueError(f"duplicates must be 'drop', 'keep' or 'error', got {duplicates!r}")
    limits = _Limits(max_prompt_chars, max_answer_chars, _compile_answer_regex(cfg.answer_regex),
                     tuple(sorted(environments)) if environments is not None else None)
    pattern = limits.pattern
    out_dir = Path(out_dir)
    raw = _load_raw(cfg)
    for where, cols in raw.columns.items():
        missing = [c for c in (cfg.prompt_column, cfg.answer_column) if c not in cols]
        if missing:
            raise DataError(
                f"data: {where} has no column(s) {missing}; available: {cols} "
                "(set data.prompt_column / data.answer_column)"
            )
    # Rows that did not parse are None here; _validate gives them their own rule instead of the *_present ones.
    prompts = [_null_to_none(r.get(cfg.prompt_column)) if r else None for r in raw.records]
    answers = [_answer_value(r.get(cfg.answer_column)) if r else None for r in raw.records]
    frame = pd.DataFrame({"prompt": pd.Series(prompts, dtype=object), "answer": pd.Series(answers, dtype=object)})
    failures = _validate(frame, raw, limits)
    _check_environments(raw, failures, limits.environments)
    dup_notes = _check_duplicates(frame, failures, raw, duplicates, cfg.source)
    valid = [i for i in range(len(frame)) if i not in failures]

    paths = {name: out_dir / f"{name}.parquet" for name in (*SPLITS, "quarantine")}
    paths |= {"quarantine_jsonl": out_dir / "quarantine.jsonl", "stats": out_dir / "stats.json"}
    out_dir.mkdir(parents=True, exist_ok=True)
    paths["stats"].unlink(missing_ok=True)  # a failed re-prep must not leave the previous run loadable here
    quarantine = _quarantine_table(cfg, raw, frame, failures, dup_notes, limits)
    pq.write_table(quarantine, paths["quarantine"])
    paths["quarantine_jsonl"].write_text(
        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in quarantine.to_pylist()), encoding="utf-8"
    )
    rule_counts = Counter(rule for rules in failures.values() for rule in rules)
    counts = ", ".join(f"{rule}: {n}" for rule, n in sorted(rule_counts.items()))
    if not valid:
        raise DataError(
            f"data.source {cfg.source}: no valid rows: all {len(frame)} rows quarantined ({counts}); "
            f"see {paths['quarantine_jsonl']}"
        )

    tables = _prepared_tables(cfg, raw, frame, valid, pattern)
    for split in SPLITS:
        if tables[split].num_rows < min_rows:
            n_bad = sum(raw.split[i] == split for i in failures)
            raise DataError(
                f"data.source {cfg.source}: the {split} split has {tables[split].num_rows} valid row(s), needs at "
                f"least {min_rows} ({n_bad} quarantined; all splits: {counts}); see {paths['quarantine_jsonl']}"
            )
    digest = content_hash(tables)
    stats = _stats(cfg, raw, frame, failures, rule_counts, tables, quarantine, pattern, digest)
    stats["settings"] = {
        "max_prompt_chars": max_prompt_chars, "max_answer_chars": max_answer_chars, "duplicates": duplicates,
        "min_rows": min_rows, **cfg.model_dump(mode="json"),
    }
    for split in SPLITS:
        pq.write_table(tables[split], paths[split])
    # stats.json last: its presence marks a complete prep (load_prepared requires it).
    paths["stats"].write_text(json.dumps(stats, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return PrepResult(out_dir=out_dir, paths=paths, stats=stats, content_hash=digest)


def load_prepared(path: str | Path, *, verify: bool = True) -> DatasetDict:
    """Read a prep output directory back as ``DatasetDict(train, eval)`` (``grpo.pipeline.data.load_data`` reads
    through this).

    With ``verify`` the content hash is recomputed and compared with ``stats.json``, so data edited after prep (or
    a half-copied directory) is refused instead of trained on under the wrong version.
    """
    path = Path(path)
    stats_path = path / "stats.json"
    if not stats_path.is_file():
        raise DataError(f"{path}: not a prepared dataset (no stats.json); run the prep stage first")
    stats = json.loads(stats_path.read_text(encoding="utf-8"))
    tables = {}
    for split in SPLITS:
        file = path / f"{split}.parquet"
        if not file.is_file():
            raise DataError(f"{path}: prepared dataset has no {file.name}")
        tables[split] = pq.read_table(file).replace_schema_metadata(None)
    if verify and (actual := content_hash(tables)) != stats.get("content_hash"):
        raise DataError(
            f"{path}: content hash {actual[:12]} does not match stats.json ({str(stats.get('content_hash'))[:12]}); "
            "the prepared data was modified after prep; re-run prep"
        )
    return DatasetDict({split: Dataset(tables[split]) for split in SPLITS})


def content_hash(tables: dict[str, pyarrow.Table]) -> str:
    """sha256 over a canonical JSON serialization of train and eval (column names, then every row in order).

    Hashing values rather than parquet bytes keeps the hash independent of the parquet writer, compression,
    pyarrow version and file metadata: only the data decides it.
    """
    h = hashlib.sha256()
    for split in SPLITS:
        table = tables[split]
        h.update(_canonical({"split": split, "columns": table.column_names, "rows": table.num_rows}))
        for row in table.to_pylist():
            h.update(_canonical([row[c] for c in table.column_names]))
    return h.hexdigest()


def source_fingerprint(cfg: DataConfig) -> dict[str, Any]:
    """What identifies the source's *contents*, for cache keys: a path string alone would let an edited file be
    served from the cache of its old contents. Local files: size, mtime and a sha256 of the bytes (the hash decides;
    size and mtime make the record readable). ``hub:<local folder>``: the same for every file in the folder. Hub
    datasets: the commit the local hub cache resolves ``main`` to, or, before the first download, the hub's current
    commit (so the key is never "unknown": a key without a revision would serve one download's rows for every later
    revision). Synthetic: the config says all."""
    if cfg.synthetic:
        return {}
    if cfg.source.startswith("hub:"):
        target = cfg.source[4:]
        if Path(target).is_dir():
            files = sorted(p for p in Path(target).rglob("*") if p.is_file() and ".cache" not in p.parts)
            return {"files": {str(p.relative_to(target)): _file_fingerprint(p) for p in files}}
        return {"revision": _hub_revision(target, cfg.source)}
    return _file_fingerprint(Path(cfg.source))


def _file_fingerprint(path: Path) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": h.hexdigest()}


def _hub_revision(dataset_id: str, source: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE, HF_HUB_OFFLINE

    ref = Path(HF_HUB_CACHE) / f"datasets--{dataset_id.replace('/', '--')}" / "refs" / "main"
    if ref.is_file():
        return ref.read_text().strip()
    if HF_HUB_OFFLINE:
        raise DataError(f"data.source {source!r}: not in the local hub cache ({HF_HUB_CACHE}) and HF_HUB_OFFLINE is "
                        "set: download it once with network access, or use a local file or folder")
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(dataset_id).sha
    except Exception as err:  # network, auth, unknown id: all user-facing
        raise DataError(f"data.source {source!r}: could not reach the hub to resolve its revision: {err}") from None


# ---------------------------------------------------------------- loading raw rows


def _load_raw(cfg: DataConfig) -> _Raw:
    if cfg.synthetic or cfg.source.startswith("hub:"):
        return _from_splits(cfg, _source_splits(cfg))
    path = Path(cfg.source)
    if not path.is_file():
        raise DataError(f"data.source: file does not exist: {path}")
    try:
        rows = _read_file(path)
    except DataError:
        raise
    except Exception as err:  # pyarrow/pandas/unicode errors: all mean "this file is not what it claims"
        raise DataError(f"data.source {path}: could not be read: {err}") from None
    if len(rows) < 2:
        raise DataError(f"data.source {path}: needs at least 2 rows to split train/eval, has {len(rows)}")
    # Split raw rows (not valid rows), so fixing one bad row never reshuffles the others between train and eval.
    n_eval = min(max(math.ceil(len(rows) * cfg.eval_fraction), 1), len(rows) - 1)
    eval_rows = set(np.random.default_rng(cfg.seed).permutation(len(rows))[:n_eval].tolist())
    split = ["eval" if i in eval_rows else "train" for i in range(len(rows))]
    records = [r if isinstance(r, dict) else None for _, r in rows]
    return _Raw(
        records=records,
        parse_errors=[r if isinstance(r, str) else None for _, r in rows],
        split=split,
        source_row=[n for n, _ in rows],
        columns={str(path): _columns_of(records)},
    )


def _source_splits(cfg: DataConfig) -> dict[str, list[dict[str, Any]]]:
    if cfg.synthetic:
        ds = _synthetic(cfg)
        return {"train": ds["train"].to_list(), "eval": ds["eval"].to_list()}
    from datasets import load_dataset

    try:
        ds = load_dataset(cfg.source[4:], cfg.hub_config)
    except Exception as err:  # network, auth, unknown id: all user-facing
        raise DataError(f"data.source {cfg.source!r}: could not load from the hub: {err}") from None
    missing = [s for s in (cfg.train_split, cfg.eval_split) if s not in ds]
    if missing:
        raise DataError(f"data.source {cfg.source!r}: no split(s) {missing}; available: {list(ds)}")
    return {"train": ds[cfg.train_split].to_list(), "eval": ds[cfg.eval_split].to_list()}


def _synthetic(cfg: DataConfig) -> DatasetDict:
    from grpo.tasks import addition_problems, guess_digit_problems

    if cfg.source == "synthetic:guess_digit":
        return guess_digit_problems(cfg.num_train, cfg.num_eval, cfg.seed)
    return addition_problems(cfg.num_train, cfg.num_eval, cfg.max_operand, cfg.seed, worked=cfg.worked_answers)


def _from_splits(cfg: DataConfig, splits: dict[str, list[dict[str, Any]]]) -> _Raw:
    records = [r for split in SPLITS for r in splits[split]]
    return _Raw(
        records=records,
        parse_errors=[None] * len(records),
        split=[split for split in SPLITS for _ in splits[split]],
        source_row=[i for split in SPLITS for i in range(len(splits[split]))],
        columns={f"{split} split of {cfg.source}": _columns_of(splits[split]) for split in SPLITS},
    )


def _read_file(path: Path) -> list[tuple[int, dict[str, Any] | str]]:
    """``(source_row, record or parse error)`` for every row: JSONL line index, JSON item, CSV/parquet data row."""
    if path.suffix == ".jsonl":
        return _parse_json_lines(path.read_bytes())
    if path.suffix == ".json":
        raw = path.read_bytes()
        try:
            data = json.loads(raw.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return _parse_json_lines(raw)  # JSON lines in a .json file, as the datasets json builder accepts
        if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
            lengths = {len(v) for v in data.values()}
            if len(lengths) != 1:
                raise DataError(f"data.source {path}: columns have different lengths {sorted(lengths)}")
            data = [dict(zip(data, values)) for values in zip(*data.values())]
        if not isinstance(data, list):
            raise DataError(f"data.source {path}: expected a list of objects or an object of columns")
        return [(i, r if isinstance(r, dict) else f"item {i} is a JSON {type(r).__name__}, not an object")
                for i, r in enumerate(data)]
    if path.suffix == ".parquet":
        return list(enumerate(pq.read_table(path).to_pylist()))
    # CSV has no types: read every cell as the text it is ("007" stays "007"); an empty cell is "", not NaN.
    return list(enumerate(pd.read_csv(path, dtype=object, keep_default_na=False).to_dict("records")))


def _parse_json_lines(data: bytes) -> list[tuple[int, dict[str, Any] | str]]:
    """Decoded line by line, so one line that is not UTF-8 is one quarantined row (with its line number), not a
    rejected file."""
    rows: list[tuple[int, dict[str, Any] | str]] = []
    data = data.removeprefix(codecs.BOM_UTF8)
    for i, raw in enumerate(data.split(b"\n")):  # not splitlines(): U+2028 etc. are legal inside JSON strings
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            rows.append((i, f"line {i + 1}: not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"))
            continue
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            rows.append((i, f"line {i + 1}: invalid JSON ({err.msg}): {line[:200]}"))
            continue
        rows.append((i, obj if isinstance(obj, dict) else f"line {i + 1}: a JSON {type(obj).__name__}, not an object"))
    return rows


def _columns_of(records: list[dict[str, Any] | None]) -> list[str]:
    return list(dict.fromkeys(k for r in records if r for k in r))


def _null_to_none(value: Any) -> Any:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _answer_value(value: Any) -> Any:
    """Numbers become their text as a person writes it (``42`` and ``28.0`` -> ``"42"``, ``"28"``; ``2.5`` ->
    ``"2.5"``), as rewards compare text and a completion never says ``28.0``. Infinity stays a float, for the
    ``answer_not_finite`` rule; anything else is judged as is."""
    value = _null_to_none(value)
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        if isinstance(value, float):
            if math.isinf(value):
                return value
            if value.is_integer():
                return str(int(value))
        return str(value)
    return value


def _is_inf(value: Any) -> bool:
    return isinstance(value, float) and math.isinf(value)


def _compile_answer_regex(regex: str | None) -> re.Pattern[str] | None:
    if regex is None:
        return None
    try:
        pattern = re.compile(regex)
    except re.error as err:
        raise DataError(f"data.answer_regex {regex!r} is not a valid regex: {err}") from None
    if pattern.groups < 1:
        raise DataError(f"data.answer_regex {regex!r} needs one capture group for the answer, e.g. '#### (.*)'")
    return pattern


def _extracted(value: Any, pattern: re.Pattern[str] | None) -> str | None:
    """The answer the rewards will see, or None when there is none (not a string, or answer_regex not matching)."""
    if not isinstance(value, str):
        return None
    if pattern is None:
        return value
    m = pattern.search(value)
    return m.group(1).strip() if m else None


# ---------------------------------------------------------------- validation


def _schema(limits: _Limits) -> pa.DataFrameSchema:
    """Each rule is one named check, so lazy validation reports every rule a row breaks (names are ``RULES``).

    pandera is imported here, not at the top: it imports hypothesis (~0.2 s), and every training process and torchrun
    rank imports this module while only a prep that misses the cache validates rows."""
    import pandera.pandas as pa

    def check(name: str, ok: Callable[[Any], bool]) -> pa.Check:
        return pa.Check(lambda s: s.map(ok).astype(bool), name=name, ignore_na=False)

    max_prompt, max_answer, pattern = limits.max_prompt, limits.max_answer, limits.pattern

    def extracted(v: Any) -> str | None:
        return _extracted(v, pattern)

    # Nulls are allowed by the column and judged by the *_present checks; each check passes values another rule
    # already rejects (a list prompt is "prompt_type", not also "prompt_empty"), so the rules a row lists are its own.
    return pa.DataFrameSchema(
        {
            "prompt": pa.Column(nullable=True, checks=[
                check("prompt_present", lambda v: v is not None),
                check("prompt_type", lambda v: v is None or isinstance(v, str) or _is_messages(v)),
                check("prompt_empty", lambda v: (t := _prompt_text(v)) is None or bool(t.strip())),
                check("prompt_too_long", lambda v: (t := _prompt_text(v)) is None or len(t) <= max_prompt),
            ]),
            "answer": pa.Column(nullable=True, checks=[
                check("answer_present", lambda v: v is not None),
                check("answer_type", lambda v: v is None or isinstance(v, str) or _is_inf(v)),
                check("answer_not_finite", lambda v: not _is_inf(v)),
                check("answer_regex", lambda v: pattern is None or not isinstance(v, str) or bool(pattern.search(v))),
                check("answer_empty", lambda v: (e := extracted(v)) is None or bool(e.strip())),
                check("answer_too_long", lambda v: (e := extracted(v)) is None or len(e) <= max_answer),
            ]),
        },
        strict=True,
    )


def _validate(frame: pd.DataFrame, raw: _Raw, limits: _Limits) -> dict[int, list[str]]:
    """Row index -> every rule it breaks (rows that parsed fine are checked by the pandera schema)."""
    from pandera.errors import SchemaErrors

    failures: dict[int, list[str]] = {i: ["malformed_record"] for i, e in enumerate(raw.parse_errors) if e}
    parsed = frame.drop(index=list(failures))
    try:
        _schema(limits).validate(parsed, lazy=True)
    except SchemaErrors as err:
        for index, rule in zip(err.failure_cases["index"], err.failure_cases["check"]):
            if rule not in RULES or index is None or pd.isna(index):
                raise RuntimeError(f"prep: unexpected schema failure {rule!r} at {index!r}") from err
            failures.setdefault(int(index), []).append(rule)
    order = list(RULES)
    return {i: sorted(set(rules), key=order.index) for i, rules in sorted(failures.items())}


def _check_environments(raw: _Raw, failures: dict[int, list[str]], names: tuple[str, ...] | None) -> None:
    """Quarantine rows whose ``environment`` column names no registered environment: each would fail its episode at
    reset in every round it is drawn, so it is rejected here with the valid names instead."""
    if names is None:
        return
    order = list(RULES)
    for i, rec in enumerate(raw.records):
        value = _null_to_none(rec.get(ROUTING_COLUMN)) if rec else None
        if value is not None and value != "" and value not in names:
            failures[i] = sorted({*failures.get(i, []), "environment_unknown"}, key=order.index)


def _check_duplicates(
    frame: pd.DataFrame, failures: dict[int, list[str]], raw: _Raw, policy: Duplicates, source: str
) -> dict[int, str]:
    """Apply the duplicate-prompt policy; returns quarantined duplicate row -> which row it repeats (for the reason).

    The kept row of each prompt is its first *otherwise valid* occurrence, so a bad first copy never costs the good
    second one. Duplicates are checked across splits too, which keeps hub eval prompts out of train.
    """
    if policy == "keep":
        return {}
    import pandera.pandas as pa
    from pandera.errors import SchemaErrors

    keys = frame["prompt"].map(_prompt_key)  # text, or a conversation as canonical JSON
    keyed = pd.DataFrame({"prompt": keys[keys.notna()]})
    # Otherwise-valid rows first (stable), so pandera's "exclude_first" keeps the right copy.
    ranked = keyed.loc[sorted(keyed.index, key=lambda i: (i in failures, i))]
    schema = pa.DataFrameSchema({"prompt": pa.Column(unique=True, report_duplicates="exclude_first")})
    try:
        schema.validate(ranked[["prompt"]], lazy=True)
        return {}
    except SchemaErrors as err:
        dups = sorted({int(i) for i in err.failure_cases["index"]})
    kept: dict[str, int] = {}
    for i, prompt in ranked["prompt"].items():
        kept.setdefault(prompt, int(i))
    dup_of = {i: kept[keys[i]] for i in dups}
    if policy == "error":
        clashes = [i for i in dups if i not in failures]
        if clashes:
            shown = "; ".join(
                f"source row {raw.source_row[i]} ({raw.split[i]}) repeats source row {raw.source_row[dup_of[i]]} "
                f"({raw.split[dup_of[i]]}): {_preview(_prompt_text(frame.at[i, 'prompt']) or '')}"
                for i in clashes[:10]
            )
            more = f"; ... {len(clashes) - 10} more" if len(clashes) > 10 else ""
            raise DataError(
                f"data.source {source}: {len(clashes)} duplicate prompt(s) with duplicates='error': {shown}{more} "
                "(use duplicates='drop' to quarantine repeats or 'keep' to allow them)"
            )
        return {}
    notes = {}
    for i in dups:
        j = dup_of[i]
        fate = "kept" if j not in failures else "quarantined too"
        notes[i] = (f"repeats the prompt of source row {raw.source_row[j]} ({raw.split[j]}), which is {fate} "
                    "(duplicates='drop')")
    for i in dups:
        failures.setdefault(i, []).append("duplicate_prompt")
    return notes


def _is_messages(value: Any) -> bool:
    """A conversational prompt: a non-empty list of ``{"role", "content"}`` messages with a known role and text."""
    return isinstance(value, (list, tuple)) and _message_problem(value) is None


def _prompt_text(value: Any) -> str | None:
    """The text a prompt's limits apply to: a string itself, a conversation's contents joined; None otherwise."""
    if isinstance(value, str):
        return value
    return "\n".join(m["content"] for m in value) if _is_messages(value) else None


def _prompt_key(value: Any) -> str | None:
    """What makes two prompts the same one (duplicates): the text, or the whole conversation, roles included."""
    if isinstance(value, str):
        return value
    return json.dumps([[m["role"], m["content"]] for m in value], ensure_ascii=False) if _is_messages(value) else None


def _preview(text: str, n: int = 60) -> str:
    return repr(text if len(text) <= n else text[:n] + "...")


# ---------------------------------------------------------------- outputs


def _reason(rule: str, i: int, cfg: DataConfig, raw: _Raw, frame: pd.DataFrame, dup_notes: dict[int, str],
            limits: _Limits) -> str:
    """One human-readable sentence per rule, naming the source column and the limit that was broken."""
    rec = raw.records[i] or {}
    pc, ac = repr(cfg.prompt_column), repr(cfg.answer_column)
    prompt, answer = frame.at[i, "prompt"], frame.at[i, "answer"]
    pattern = limits.pattern
    extracted = _extracted(answer, pattern)
    label = "answer extracted by answer_regex" if pattern is not None else f"answer column {ac}"
    match rule:
        case "malformed_record":
            return str(raw.parse_errors[i])
        case "prompt_present" | "answer_present":
            col = cfg.prompt_column if rule == "prompt_present" else cfg.answer_column
            return f"{rule.split('_')[0]} column {col!r} is " + ("null" if col in rec else "missing from the row")
        case "prompt_type":
            got = type(prompt).__name__
            if isinstance(prompt, (list, tuple)):
                got = f"a list that is not a conversation ({_message_problem(prompt)})"
            return (f"prompt column {pc} must be a string or a list of {{'role', 'content'}} messages with role in "
                    f"{list(MESSAGE_ROLES)} and text content, got {got}")
        case "answer_type":
            return f"answer column {ac} must be a string or a number, got {type(answer).__name__}"
        case "answer_not_finite":
            return f"answer column {ac} is {answer!r}, not a finite number; no completion can match it"
        case "prompt_empty":
            return f"prompt column {pc} is empty or whitespace only"
        case "prompt_too_long":
            return (f"prompt column {pc} has {len(_prompt_text(prompt) or '')} chars, more than "
                    f"max_prompt_chars={limits.max_prompt}")
        case "answer_regex":
            return f"answer column {ac} does not match answer_regex {pattern.pattern!r}"  # type: ignore[union-attr]
        case "answer_empty":
            return f"{label} is empty or whitespace only"
        case "answer_too_long":
            return f"{label} has {len(extracted or '')} chars, more than max_answer_chars={limits.max_answer}"
        case "duplicate_prompt":
            return f"prompt column {pc} {dup_notes[i]}"
        case "environment_unknown":
            return (f"environment column {ROUTING_COLUMN!r} is {rec.get(ROUTING_COLUMN)!r}, not a registered "
                    f"environment; registered: {list(limits.environments or ())} (add one with @register_environment "
                    "and --env-module, or leave the value empty for the config's environment.name)")
    raise RuntimeError(f"prep: no reason text for rule {rule!r}")


def _message_problem(messages: list | tuple) -> str | None:
    """The first thing wrong with a would-be conversation (the quarantine reason), None for a valid one."""
    if not messages:
        return "no messages"
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"message {k} is a {type(m).__name__}, not an object"
        if set(m) != {"role", "content"}:
            return f"message {k} has keys {sorted(m)}, not exactly ['content', 'role']"
        if m["role"] not in MESSAGE_ROLES:
            return f"message {k} has role {m['role']!r}"
        if not isinstance(m["content"], str):
            return f"message {k}'s content is a {type(m['content']).__name__}, not text"
    return None


def _raw_text(value: Any) -> str | None:
    """A raw cell as text for the quarantine: strings as they are, anything else as JSON, missing as null."""
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _quarantine_table(cfg: DataConfig, raw: _Raw, frame: pd.DataFrame, failures: dict[int, list[str]],
                      dup_notes: dict[int, str], limits: _Limits) -> pyarrow.Table:
    rows = []
    for i in sorted(failures):
        rules, rec = failures[i], raw.records[i] or {}
        rows.append({
            "source_row": raw.source_row[i],
            "split": raw.split[i],
            "rules": rules,
            "reason": "; ".join(_reason(r, i, cfg, raw, frame, dup_notes, limits) for r in rules),
            "prompt": _raw_text(rec.get(cfg.prompt_column)),
            "answer": _raw_text(rec.get(cfg.answer_column)),
        })
    return pyarrow.Table.from_pylist(rows, schema=_QUARANTINE_SCHEMA)


def _prepared_tables(cfg: DataConfig, raw: _Raw, frame: pd.DataFrame, valid: list[int],
                     pattern: re.Pattern[str] | None) -> dict[str, pyarrow.Table]:
    """Valid rows as ``prompt``, ``answer`` and the source's other columns, in source order, one table per split.

    Built as one table and then split, so train and eval always share a schema.
    """

    def prompt_of(value: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
        if not isinstance(value, str):  # a conversation already (TRL's conversational format): as it is
            return [{"role": m["role"], "content": m["content"]} for m in value]
        if cfg.prompt_format != "chat":
            return value
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
        return [*system, {"role": "user", "content": value}]

    mapped = {cfg.prompt_column, cfg.answer_column, "prompt", "answer"}
    extras = [c for c in _columns_of(raw.records) if c not in mapped]
    columns: dict[str, list[Any]] = {
        "prompt": [prompt_of(frame.at[i, "prompt"]) for i in valid],
        "answer": [_extracted(frame.at[i, "answer"], pattern) for i in valid],
    }
    for col in extras:
        columns[col] = [raw.records[i].get(col) for i in valid]  # type: ignore[union-attr]
    arrays = {}
    for col, values in columns.items():
        try:
            arrays[col] = pyarrow.array(values)
        except (pyarrow.ArrowInvalid, pyarrow.ArrowTypeError) as err:
            raise DataError(
                f"data.source {cfg.source}: column {col!r} mixes types parquet can not store in one column ({err}); "
                "make its values one type in the source"
            ) from None
    table = pyarrow.table(arrays)
    positions = {s: [k for k, i in enumerate(valid) if raw.split[i] == s] for s in SPLITS}
    return {s: table.take(pyarrow.array(positions[s], type=pyarrow.int64())) for s in SPLITS}


def _length_stats(lengths: list[int]) -> dict[str, float] | None:
    if not lengths:
        return None
    a = np.asarray(lengths)
    return {"min": int(a.min()), "mean": round(float(a.mean()), 2), "p50": float(np.percentile(a, 50)),
            "p95": float(np.percentile(a, 95)), "max": int(a.max())}


def _stats(cfg: DataConfig, raw: _Raw, frame: pd.DataFrame, failures: dict[int, list[str]], rule_counts: Counter,
           tables: dict[str, pyarrow.Table], quarantine: pyarrow.Table, pattern: re.Pattern[str] | None,
           digest: str) -> dict[str, Any]:
    """Counts per split and rule, plus char lengths of valid prompts (before chat wrapping) and answers.

    Reconciles the *written* tables against the raw rows and raises if a row went missing: that is a bug here.
    """
    q_splits = Counter(quarantine.column("split").to_pylist())
    splits = {}
    for s in SPLITS:
        rows_in = raw.split.count(s)
        splits[s] = {"rows_in": rows_in, "rows_valid": tables[s].num_rows, "rows_quarantined": q_splits[s]}
        if rows_in != tables[s].num_rows + q_splits[s]:
            raise RuntimeError(f"prep: {s} split does not reconcile: {splits[s]}")
    total = {k: sum(v[k] for v in splits.values()) for k in ("rows_in", "rows_valid", "rows_quarantined")}
    if total["rows_in"] != len(raw.records) or total["rows_quarantined"] != len(failures):
        raise RuntimeError(f"prep: rows do not reconcile: {total}, {len(raw.records)} raw rows")
    valid = [i for i in range(len(frame)) if i not in failures]
    return {
        "source": cfg.source,
        "content_hash": digest,
        **total,
        "splits": splits,
        "rules": dict(sorted(rule_counts.items())),
        "prompt_chars": _length_stats([len(_prompt_text(frame.at[i, "prompt"]) or "") for i in valid]),
        "answer_chars": _length_stats([len(_extracted(frame.at[i, "answer"], pattern) or "") for i in valid]),
    }


def _canonical(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=_json_default)
            + "\n").encode("utf-8")


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return {"bytes": obj.hex()}
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    return str(obj)
