"""Loading prompts and answers: the synthetic default, local files, or (GPU preset) a hub dataset.

Every source ends as a ``DatasetDict`` with ``train`` and ``eval`` splits and the columns ``prompt`` and
``answer``, which is what the rewards and TRL expect. Validation with pandera and quarantine belong to the pipeline's
prep stage; here a source that cannot be read at all fails with a :class:`DataError` naming it.
"""

from __future__ import annotations

import re
from pathlib import Path

from datasets import Dataset, DatasetDict, load_dataset

from grpo.config import DataConfig
from grpo.errors import DataError
from grpo.tasks import addition_problems

_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


def load_task_data(cfg: DataConfig) -> DatasetDict:
    """Train/eval splits with ``prompt`` and ``answer`` columns for the configured source."""
    if cfg.synthetic:
        return addition_problems(cfg.num_train, cfg.num_eval, cfg.max_operand, cfg.seed)
    if cfg.source.startswith("hub:"):
        name = cfg.source[4:]
        try:
            raw = load_dataset(name, cfg.hub_config)
        except Exception as err:  # network, auth, unknown id: all user-facing
            raise DataError(f"data.source {cfg.source!r}: could not load from the hub: {err}") from None
        missing = [s for s in (cfg.train_split, cfg.eval_split) if s not in raw]
        if missing:
            raise DataError(f"data.source {cfg.source!r}: no split(s) {missing}; available: {list(raw)}")
        splits = DatasetDict(train=raw[cfg.train_split], eval=raw[cfg.eval_split])
    else:
        path = Path(cfg.source)
        if not path.is_file():
            raise DataError(f"data.source: file does not exist: {path}")
        try:
            full = load_dataset(_FILE_BUILDERS[path.suffix], data_files=str(path), split="train")
        except Exception as err:
            raise DataError(f"data.source {path}: could not be read: {err}") from None
        if len(full) < 2:
            raise DataError(f"data.source {path}: needs at least 2 rows to split train/eval, has {len(full)}")
        parts = full.train_test_split(test_size=cfg.eval_fraction, seed=cfg.seed)
        splits = DatasetDict(train=parts["train"], eval=parts["test"])
    return DatasetDict({name: _to_prompt_answer(ds, cfg, name) for name, ds in splits.items()})


def _to_prompt_answer(ds: Dataset, cfg: DataConfig, split: str) -> Dataset:
    missing = [c for c in (cfg.prompt_column, cfg.answer_column) if c not in ds.column_names]
    if missing:
        raise DataError(
            f"data: {split} split has no column(s) {missing}; available: {ds.column_names} "
            f"(set data.prompt_column / data.answer_column)"
        )
    pattern = re.compile(cfg.answer_regex) if cfg.answer_regex else None

    def convert(row: dict) -> dict:
        answer = str(row[cfg.answer_column])
        if pattern is not None:
            m = pattern.search(answer)
            answer = m.group(1).strip() if m else ""
        prompt = str(row[cfg.prompt_column])
        if cfg.prompt_format == "chat":
            messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
            prompt = [*messages, {"role": "user", "content": prompt}]
        return {"prompt": prompt, "answer": answer}

    keep = [c for c in ds.column_names if c not in (cfg.prompt_column, cfg.answer_column, "prompt", "answer")]
    return ds.map(convert, remove_columns=[c for c in ds.column_names if c not in keep])


def alphabet_of(ds: DatasetDict) -> str:
    """Every character that occurs in prompts or answers: the tiny tokenizer's vocabulary."""
    chars: set[str] = set()
    for split in ds.values():
        for col in ("prompt", "answer"):
            for text in split[col]:
                chars.update(text if isinstance(text, str) else "".join(m["content"] for m in text))
    return "".join(sorted(chars))
