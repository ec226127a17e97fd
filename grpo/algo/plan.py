"""Sampler plans: the whole prompt schedule of a run, written before training.

A plan answers "which prompt does SP group g see in generation round r, and at which optimizer step" for every
round of the run, and fails early when the config does not fit the dataset (batch arithmetic that does not
divide, a dataset smaller than one round with ``drop_last``). It is the schedule of
:class:`grpo.algo.sampling.SequenceParallelRepeatRandomSampler` with TRL's step arithmetic (derived once, in
:mod:`grpo.algo.batch_layout`):

* ``steps_per_generation`` is ``grpo.steps_per_generation``, else ``generation_batch_size //
  (per_device_train_batch_size * world_size)`` when that is set, else ``gradient_accumulation_steps`` (TRL's);
* one generation round gives every rank ``per_device_train_batch_size * steps_per_generation`` completions, i.e. B
  prompts x ``num_generations`` per SP group, and serves ``steps_per_generation * num_iterations`` micro-steps;
* epoch ``e`` orders prompts with ``torch.randperm(N, seed + e)`` and cuts the order into chunks of ``B *
  num_sp_groups`` prompts, one chunk per round; SP group g takes slots ``[g*B, (g+1)*B)`` of each chunk.

The spec is plain numbers (:class:`PlanSpec`: a :class:`grpo.algo.batch_layout.BatchLayout` and the run's settings);
:mod:`grpo.pipeline.plans` builds it from a config.

``plan.parquet`` has one row per (round, SP group, slot) — per prompt, not per completion — sorted by that key, in
row groups of 2**18 rows (zstd), with the plan's numbers in the schema metadata so a reader needs nothing else.
``plan.json`` is the summary: sizes, coverage, expected prompt-token load per rank and its predicted imbalance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Sampler

from grpo.algo.batch_layout import BatchLayout
from grpo.algo.sampling import sp_group_of
from grpo.errors import ConfigError, DataError, GRPOPlatformError

__all__ = [
    "PLAN_FILE",
    "SUMMARY_FILE",
    "PlanExistsError",
    "PlanSampler",
    "PlanSpec",
    "PlanSummary",
    "read_plan_indices",
    "read_plan_meta",
    "summary_table",
    "write_plan",
]

PLAN_FILE, SUMMARY_FILE = "plan.parquet", "plan.json"
_META_KEY = b"grpo.algo.plan"
_ROWS_PER_ROW_GROUP = 1 << 18  # bounds writer and reader memory: planning 1M prompts peaks ~110 MB above imports
_MAX_BALANCED_ROUNDS = 1000  # group-level balancing is ~0.5 ms a round: predict it on an even sample of rounds
_INT16_MAX, _INT32_MAX = 2**15 - 1, 2**31 - 1

SCHEMA = pa.schema(
    [
        ("round", pa.int32()),
        ("epoch", pa.int32()),
        ("optimizer_step_start", pa.int32()),
        ("micro_step_start", pa.int64()),
        ("sp_group", pa.int16()),
        ("rank_start", pa.int16()),
        ("rank_end", pa.int16()),
        ("slot", pa.int32()),
        ("prompt_index", pa.int64()),
        ("num_generations", pa.int16()),
        ("reuse", pa.int16()),
        ("prompt_tokens", pa.int32()),
    ]
)


# Dictionary pages for the repetitive columns only: on prompt_index (near-unique) they cost memory, not bytes.
_DICTIONARY_COLUMNS = [f.name for f in SCHEMA if f.name != "prompt_index"]


class PlanExistsError(GRPOPlatformError, FileExistsError):
    """A plan is already written there; plans are inputs to runs, so replacing one must be explicit."""


# The layout's numbers a plan file records in its "spec" (what read_plan_indices and PlanSampler read), in the
# file's order.
_RECORDED_LAYOUT = ("world_size", "sequence_parallel_degree", "num_sp_groups", "num_generations",
                    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                    "num_iterations")


@dataclass(frozen=True)
class PlanSpec:
    """The dataset-independent numbers of a schedule: the batch layout (TRL's derivation, :mod:`grpo.algo.batch_layout`)
    plus the run's length and the sampler's order and balancing settings; build it with :meth:`from_layout`.

    The layout's numbers read as the spec's own (``spec.world_size``, ``spec.steps_per_generation``)."""

    layout: BatchLayout
    max_steps: int
    seed: int
    shuffle: bool
    drop_last: bool
    seqlen_balancing: bool
    balance_quadratic_coef: float | None

    def __getattr__(self, name: str) -> Any:
        # Called only for names the spec itself lacks: those of its layout (not "layout" itself, read before it is set
        # while copying or unpickling).
        if name.startswith("__") or name == "layout":
            raise AttributeError(name)
        try:
            return getattr(self.layout, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None

    @classmethod
    def from_layout(cls, layout: BatchLayout, *, max_steps: int, seed: int, shuffle: bool, drop_last: bool,
                    seqlen_balancing: bool, balance_quadratic_coef: float | None) -> PlanSpec:
        """The spec of ``layout`` and the run's settings; a ConfigError naming the config fields when the layout cannot
        work with the SP sampler."""
        if max_steps < 1:
            raise ConfigError(f"grpo.max_steps must be >= 1 optimizer steps, got {max_steps}")
        world, degree = layout.world_size, layout.sequence_parallel_degree
        if world < 1 or degree < 1 or world % degree:
            raise ConfigError(
                f"sampling.sequence_parallel_degree: sampling.world_size ({world}) must be a positive multiple of it "
                f"({degree}); valid degrees: {_divisors(max(world, 1))}"
            )
        gen = layout.num_generations
        if world > _INT16_MAX or gen > _INT16_MAX or layout.num_iterations > _INT16_MAX:
            raise ConfigError(
                f"sampling.world_size, grpo.num_generations and grpo.num_iterations must be <= {_INT16_MAX} "
                f"(got {world}, {gen}, {layout.num_iterations})"
            )
        if layout.steps_per_generation_from == "grpo.generation_batch_size" and (
            layout.generation_batch_size % layout.global_batch_size
        ):
            raise ConfigError(
                f"grpo.generation_batch_size ({layout.generation_batch_size}) must be a multiple of "
                f"grpo.per_device_train_batch_size x sampling.world_size = {layout.global_batch_size}"
            )
        pdbs, spg = layout.per_device_train_batch_size, layout.steps_per_generation
        source = layout.steps_per_generation_from
        per_rank = layout.completions_per_rank
        if not layout.whole_groups_per_rank:
            step = gen // math.gcd(gen, spg)
            raise ConfigError(
                f"grpo.num_generations: grpo.per_device_train_batch_size x steps_per_generation = {pdbs} x {spg} = "
                f"{per_rank} completions per rank and round (steps_per_generation from {source}) must be a multiple of "
                f"grpo.num_generations ({gen}) so every SP group holds whole prompts; valid num_generations: "
                f"{_divisors(per_rank, 2)}, or per_device_train_batch_size a multiple of {step} "
                f"(e.g. {[step * k for k in range(1, 5)]})"
            )
        accumulation = layout.gradient_accumulation_steps
        if max_steps * accumulation > _INT32_MAX:
            raise ConfigError(
                f"grpo.max_steps x grpo.gradient_accumulation_steps = {max_steps * accumulation} "
                f"micro-steps is more than a plan holds (<= {_INT32_MAX})"
            )
        return cls(layout=layout, max_steps=max_steps, seed=seed, shuffle=shuffle, drop_last=drop_last,
                   seqlen_balancing=seqlen_balancing, balance_quadratic_coef=balance_quadratic_coef)

    @property
    def prompts_per_sp_group(self) -> int:
        """B: prompts each SP group generates for in one round (its ranks share them)."""
        return self.layout.prompts_per_rank

    @property
    def repeat_count(self) -> int:
        """How often the sampler yields a round's slice: TRL reuses a round for every micro-step it serves."""
        return self.layout.micro_steps_per_round

    @property
    def total_micro_steps(self) -> int:
        return self.max_steps * self.layout.gradient_accumulation_steps

    @property
    def generation_rounds(self) -> int:
        return -(-self.total_micro_steps // self.layout.micro_steps_per_round)

    def rounds_per_epoch(self, dataset_size: int) -> int:
        """Chunks of one epoch's order, as the sampler cuts them; raises when ``drop_last`` would leave none."""
        if dataset_size < 1:
            raise DataError("data: the training split is empty (0 prompts); a plan needs at least one prompt")
        layout = self.layout
        chunk = layout.prompts_per_round
        if not self.drop_last:
            return -(-dataset_size // chunk)
        if dataset_size < chunk:
            fits = [b * layout.num_generations for b in range(1, dataset_size // layout.num_sp_groups + 1)]
            fits = [p for p in fits if p % layout.steps_per_generation == 0][-1:]
            hint = f" or grpo.per_device_train_batch_size <= {fits[0] // layout.steps_per_generation}" if fits else ""
            raise ConfigError(
                f"sampling.drop_last: the training split has {dataset_size} prompts, fewer than one generation round "
                f"of {chunk} prompts ({self.prompts_per_sp_group} per SP group x {layout.num_sp_groups} SP groups), so "
                f"drop_last=true would plan nothing; set sampling.drop_last=false, use more prompts{hint}"
            )
        return dataset_size // chunk

    def to_dict(self) -> dict[str, Any]:
        """The spec as a plan file records it (``plan.parquet``'s metadata): flat, the layout's numbers first."""
        settings = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "layout"}
        layout = {name: getattr(self.layout, name) for name in _RECORDED_LAYOUT}
        return layout | {"prompts_per_sp_group": self.prompts_per_sp_group} | settings

    def echo(self) -> dict[str, Any]:
        return self.to_dict() | {
            "prompts_per_round": self.layout.prompts_per_round,
            "repeat_count": self.repeat_count,
            "micro_steps_per_round": self.layout.micro_steps_per_round,
        }


@dataclass(frozen=True)
class PlanSummary:
    """What ``plan.json`` holds; ``rows == generation_rounds * prompts_per_round`` by construction."""

    plan_path: str
    rows: int
    prompt_index_sha256: str  # of the prompt_index column as little-endian int64, in file order
    optimizer_steps: int
    micro_steps: int
    generation_rounds: int
    rounds_per_epoch: int
    prompts_per_round: int
    prompts_per_epoch: int
    epochs: int
    dataset_size: int
    unique_prompts_used: int
    completions_total: int
    expected_prompt_tokens_per_rank: dict[str, float]
    predicted_imbalance: dict[str, Any]
    config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _divisors(n: int, low: int = 1) -> list[int]:
    return [d for d in range(low, n + 1) if n % d == 0]


def _as_prompt_lengths(values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise DataError(f"prompt_lengths must be a 1-D sequence of token counts, got shape {arr.shape}")
    if arr.size == 0:
        raise DataError("data: the training split is empty (0 prompts); a plan needs at least one prompt")
    if arr.dtype.kind not in "iu":
        raise DataError(f"prompt_lengths must be integer token counts, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > _INT32_MAX:
        bad = int(np.argmin(arr)) if arr.min() < 0 else int(np.argmax(arr))
        raise DataError(f"prompt_lengths must be in [0, {_INT32_MAX}], got {int(arr[bad])} at index {bad}")
    return arr.astype(np.int32, copy=False)


def _epoch_order(n: int, spec: PlanSpec, epoch: int) -> np.ndarray:
    """The sampler's order for ``epoch`` (same generator, same seed), as int64."""
    if not spec.shuffle:
        return np.arange(n, dtype=np.int64)
    return torch.randperm(n, generator=torch.Generator().manual_seed(spec.seed + epoch)).numpy()


def _sample_rounds(rounds: int) -> np.ndarray:
    return np.unique(np.linspace(0, rounds - 1, min(rounds, _MAX_BALANCED_ROUNDS)).round().astype(np.int64))


def _max_over_mean(loads: np.ndarray) -> np.ndarray:
    """Per row: heaviest / mean load (1.0 when a row carries nothing)."""
    mean = loads.mean(axis=-1)
    return np.where(mean > 0, loads.max(axis=-1) / np.where(mean > 0, mean, 1.0), 1.0)


def write_plan(
    spec: PlanSpec, prompt_lengths: Sequence[int] | np.ndarray, out_dir: Path, overwrite: bool = False
) -> PlanSummary:
    """Validate ``spec`` against the dataset, then stream ``out_dir/plan.parquet`` and write ``out_dir/plan.json``.

    Everything is checked before a byte is written; files are written under a temporary name and renamed, so an
    interrupted plan never leaves a half-written file that looks complete."""
    lengths = _as_prompt_lengths(prompt_lengths)
    n = int(lengths.size)
    rpe = spec.rounds_per_epoch(n)
    out_dir = Path(out_dir)
    plan_path, summary_path = out_dir / PLAN_FILE, out_dir / SUMMARY_FILE
    if not overwrite and (plan_path.exists() or summary_path.exists()):
        existing = plan_path if plan_path.exists() else summary_path
        raise PlanExistsError(f"plan exists: {existing}; pass overwrite=True (--overwrite) to replace it")

    rounds = spec.generation_rounds
    meta = {"spec": spec.to_dict(), "generation_rounds": rounds, "rounds_per_epoch": rpe, "dataset_size": n}
    schema = SCHEMA.with_metadata({_META_KEY: json.dumps(meta).encode()})
    stats = _LoadStats(spec, lengths)
    seen = np.zeros(n, dtype=bool)
    digest = hashlib.sha256()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = plan_path.with_name(PLAN_FILE + ".tmp")
    try:
        with pq.ParquetWriter(tmp, schema, compression="zstd", use_dictionary=_DICTIONARY_COLUMNS) as writer:
            for epoch, r0, r1, index in _blocks(spec, n, rpe):
                writer.write_table(_block_table(spec, epoch, r0, r1, index, lengths[index]), row_group_size=index.size)
                seen[index] = True
                digest.update(index.astype("<i8", copy=False).tobytes())
                stats.add(r0, r1, index)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, plan_path)

    per_round = spec.layout.prompts_per_round
    summary = PlanSummary(
        plan_path=str(plan_path),
        rows=rounds * per_round,
        prompt_index_sha256=digest.hexdigest(),
        optimizer_steps=spec.max_steps,
        micro_steps=spec.total_micro_steps,
        generation_rounds=rounds,
        rounds_per_epoch=rpe,
        prompts_per_round=per_round,
        prompts_per_epoch=rpe * per_round,
        epochs=-(-rounds // rpe),
        dataset_size=n,
        unique_prompts_used=int(seen.sum()),
        completions_total=rounds * per_round * spec.layout.num_generations,
        expected_prompt_tokens_per_rank=stats.tokens_per_rank(),
        predicted_imbalance=stats.imbalance(),
        config=spec.echo() | {"dataset_size": n},
    )
    tmp = summary_path.with_name(SUMMARY_FILE + ".tmp")
    tmp.write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    os.replace(tmp, summary_path)
    return summary


def _blocks(spec: PlanSpec, n: int, rounds_per_epoch: int) -> Iterator[tuple[int, int, int, np.ndarray]]:
    """(epoch, first round, end round, prompt indices in file order) for each row group; none crosses an epoch."""
    rounds, per_round = spec.generation_rounds, spec.layout.prompts_per_round
    block_rounds = max(1, _ROWS_PER_ROW_GROUP // per_round)
    for epoch in range(-(-rounds // rounds_per_epoch)):
        order = _epoch_order(n, spec, epoch)
        first, last = epoch * rounds_per_epoch, min(rounds, (epoch + 1) * rounds_per_epoch)
        for r0 in range(first, last, block_rounds):
            r1 = min(last, r0 + block_rounds)
            pos = np.arange((r0 - first) * per_round, (r1 - first) * per_round, dtype=np.int64)
            # The epoch's last chunk is completed from the start of the order (the sampler's wrap-around).
            yield epoch, r0, r1, order[pos % n if pos[-1] >= n else pos]


def _block_table(spec: PlanSpec, epoch: int, r0: int, r1: int, index: np.ndarray, tokens: np.ndarray) -> pa.Table:
    """Rows of rounds [r0, r1) of one epoch, sorted by (round, sp_group, slot); ``index`` holds their prompts."""
    per_round, b, rows = spec.layout.prompts_per_round, spec.prompts_per_sp_group, index.size
    degree = spec.layout.sequence_parallel_degree
    rnd = np.repeat(np.arange(r0, r1, dtype=np.int64), per_round)
    micro = rnd * spec.layout.micro_steps_per_round
    group = np.tile(np.repeat(np.arange(spec.layout.num_sp_groups, dtype=np.int16), b), r1 - r0)
    return pa.Table.from_arrays(
        [
            pa.array(rnd.astype(np.int32)),
            pa.array(np.full(rows, epoch, dtype=np.int32)),
            pa.array((micro // spec.layout.gradient_accumulation_steps).astype(np.int32)),
            pa.array(micro),
            pa.array(group),
            pa.array(group * degree),
            pa.array(group * degree + (degree - 1)),
            pa.array(np.tile(np.arange(b, dtype=np.int32), rows // b)),
            pa.array(index),
            pa.array(np.full(rows, spec.layout.num_generations, dtype=np.int16)),
            pa.array(np.full(rows, spec.layout.num_iterations, dtype=np.int16)),
            pa.array(tokens),
        ],
        schema=SCHEMA,
    )


class _LoadStats:
    """Expected prompt-token load per SP group and round, and its imbalance, accumulated block by block.

    Exact over all rounds for the plan's own order; after the trainer's group-level balancing (whole prompts moved
    between SP groups, equal counts) only on an even sample of rounds, since balancing a round costs ~0.5 ms."""

    def __init__(self, spec: PlanSpec, lengths: np.ndarray) -> None:
        self.spec = spec
        x = lengths.astype(np.float64)
        self.tokens = x * spec.layout.num_generations  # every completion of a group reads the prompt
        coef = spec.balance_quadratic_coef  # the balancer's workload: a*L + L^2 per sequence when set
        self.workload = self.tokens if coef is None else spec.layout.num_generations * (coef * x + x * x)
        self.balance = spec.seqlen_balancing and spec.layout.num_sp_groups > 1
        self.sampled = _sample_rounds(spec.generation_rounds) if self.balance else np.empty(0, np.int64)
        self.group_tokens = np.zeros(spec.layout.num_sp_groups)
        self.ratio_sum, self.ratio_max = 0.0, 1.0
        self.sampled_plan: list[float] = []
        self.sampled_balanced: list[float] = []

    def add(self, r0: int, r1: int, index: np.ndarray) -> None:
        s, per_round = self.spec, self.spec.layout.prompts_per_round
        loads = self.tokens[index].reshape(r1 - r0, s.layout.num_sp_groups, s.prompts_per_sp_group).sum(axis=2)
        self.group_tokens += loads.sum(axis=0)
        ratios = _max_over_mean(loads)
        self.ratio_sum += float(ratios.sum())
        self.ratio_max = max(self.ratio_max, float(ratios.max()))
        for r in self.sampled[(self.sampled >= r0) & (self.sampled < r1)] - r0:
            self.sampled_plan.append(float(ratios[r]))
            round_workload = self.workload[index[r * per_round : (r + 1) * per_round]]
            self.sampled_balanced.append(_balanced_ratio(round_workload, s.layout.num_sp_groups))

    def tokens_per_rank(self) -> dict[str, float]:
        rank = self.group_tokens / self.spec.layout.sequence_parallel_degree  # an SP group's ranks split its sequences
        return {
            "per_round_mean": float(rank.mean() / self.spec.generation_rounds),
            "total_mean": float(rank.mean()),
            "total_max": float(rank.max()),
        }

    def imbalance(self) -> dict[str, Any]:
        rounds, coef = self.spec.generation_rounds, self.spec.balance_quadratic_coef
        out: dict[str, Any] = {
            "load": "prompt_tokens x num_generations per SP group (its ranks share it)",
            "plan_order": {"mean_max_over_mean": self.ratio_sum / rounds, "max_max_over_mean": self.ratio_max,
                           "rounds": rounds},
            "seqlen_balanced": None,
        }
        if self.balance:
            out["seqlen_balanced"] = {
                "workload": "prompt_tokens x num_generations" if coef is None else f"num_generations x ({coef}L + L^2)",
                "mean_max_over_mean": float(np.mean(self.sampled_balanced)),
                "max_max_over_mean": float(np.max(self.sampled_balanced)),
                "plan_order_mean_max_over_mean_same_rounds": float(np.mean(self.sampled_plan)),
                "rounds_sampled": int(self.sampled.size),
            }
        return out


def _balanced_ratio(workload: np.ndarray, groups: int) -> float:
    """Max/mean SP-group load after the trainer's group-level balancing (equal prompt counts per SP group)."""
    from grpo.algo.balance import balance_groups

    parts = balance_groups(workload, groups, equal_count=True)
    return float(_max_over_mean(np.array([workload[p].sum() for p in parts])))


# ------------------------------------------------------------------------------------------------------- reading


def read_plan_meta(plan_path: str | Path) -> dict[str, Any]:
    """The numbers a plan was written with (spec, generation_rounds, rounds_per_epoch, dataset_size)."""
    try:
        metadata = pq.read_schema(plan_path).metadata or {}
    except (OSError, pa.ArrowInvalid) as err:
        raise DataError(f"plan {plan_path}: not a readable plan file: {err}") from None
    if _META_KEY not in metadata:
        raise DataError(f"plan {plan_path}: no {_META_KEY.decode()!r} metadata; not written by grpo.algo.plan")
    return json.loads(metadata[_META_KEY])


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and low <= value < high


def read_plan_indices(plan_path: str | Path, sp_group: int, start_round: int = 0) -> Iterator[int]:
    """Prompt indices for the ranks of ``sp_group`` in sampler order from ``start_round`` on: each prompt
    ``num_generations`` times in a row, each round's slice ``num_iterations * steps_per_generation`` times.

    Reads one row group at a time and skips those that end before ``start_round``, so a resumed trainer does not
    load the plan into memory."""
    meta = read_plan_meta(plan_path)
    spec, rounds = meta["spec"], meta["generation_rounds"]
    groups = spec["world_size"] // spec["sequence_parallel_degree"]
    if not _int_in(sp_group, 0, groups):
        raise ValueError(f"sp_group must be an integer in [0, {groups}) for this plan, got {sp_group!r}")
    if not _int_in(start_round, 0, rounds + 1):
        raise ValueError(f"start_round must be an integer in [0, {rounds}] for this plan, got {start_round!r}")
    # The sampler's consumer takes one index at a time: chain serves them from each round's list without resuming a
    # Python generator per index.
    return itertools.chain.from_iterable(_round_indices(Path(plan_path), spec, int(sp_group), int(start_round)))


def _round_indices(plan_path: Path, spec: dict[str, Any], sp_group: int, start_round: int) -> Iterator[list[int]]:
    gen, b = spec["num_generations"], spec["prompts_per_sp_group"]
    repeat = spec["num_iterations"] * spec["steps_per_generation"]
    pf = pq.ParquetFile(plan_path)
    round_col = pf.schema_arrow.get_field_index("round")
    for i in range(pf.num_row_groups):
        stats = pf.metadata.row_group(i).column(round_col).statistics
        if stats is not None and stats.has_min_max and stats.max < start_round:
            continue
        table = pf.read_row_group(i, columns=["round", "sp_group", "prompt_index"])
        keep = (table.column("sp_group").to_numpy() == sp_group) & (table.column("round").to_numpy() >= start_round)
        for batch in table.column("prompt_index").to_numpy()[keep].reshape(-1, b):
            yield np.tile(np.repeat(batch, gen), repeat).tolist()


class PlanSampler(Sampler[int]):
    """A rank's prompt indices read from a plan: what the SP sampler would yield, from ``start_round`` on."""

    def __init__(self, plan_path: str | Path, rank: int, sequence_parallel_degree: int, start_round: int = 0) -> None:
        self.plan_path = Path(plan_path)
        meta = read_plan_meta(self.plan_path)
        spec = meta["spec"]
        degree = spec["sequence_parallel_degree"]
        if sequence_parallel_degree != degree:
            raise ValueError(
                f"sequence_parallel_degree={sequence_parallel_degree} does not match the plan's {degree}; "
                f"re-plan with sampling.sequence_parallel_degree={sequence_parallel_degree}"
            )
        if not _int_in(rank, 0, spec["world_size"]):
            raise ValueError(f"rank must be an integer in [0, {spec['world_size']}) for this plan, got {rank!r}")
        self.sp_group = sp_group_of(int(rank), sequence_parallel_degree)
        self.start_round = start_round
        read_plan_indices(self.plan_path, self.sp_group, start_round)  # validates start_round now, not at iteration
        per_round = spec["prompts_per_sp_group"] * spec["num_generations"]
        repeat = spec["num_iterations"] * spec["steps_per_generation"]
        self._len = (meta["generation_rounds"] - start_round) * per_round * repeat

    def __iter__(self) -> Iterator[int]:
        return read_plan_indices(self.plan_path, self.sp_group, self.start_round)

    def __len__(self) -> int:
        return self._len


# ------------------------------------------------------------------------------------------------ CLI helpers


def prompt_token_lengths(prompts: list[str], tokenizer: Any | None) -> np.ndarray:
    """Prompt lengths in tokens; ``tokenizer=None`` means one token per character (the tiny model). Conversational
    prompts are rendered to text first (:func:`grpo.training.prompts.prompt_texts`)."""
    if tokenizer is None:
        return np.fromiter((len(p) for p in prompts), dtype=np.int64, count=len(prompts))
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))


def summary_table(summary: PlanSummary | dict[str, Any]) -> Any:
    """A short rich table of the numbers a user checks before launching a run (a summary or its ``plan.json``)."""
    from rich.table import Table

    if isinstance(summary, dict):
        summary = PlanSummary(**{f.name: summary[f.name] for f in dataclasses.fields(PlanSummary)})

    imb, tokens = summary.predicted_imbalance, summary.expected_prompt_tokens_per_rank

    def ratios(d: dict[str, Any]) -> str:
        return f"{d['mean_max_over_mean']:.4f} / {d['max_max_over_mean']:.4f}"

    rows = [
        ("plan", summary.plan_path),
        ("rows (prompts)", f"{summary.rows:,}"),
        ("optimizer steps / micro-steps", f"{summary.optimizer_steps:,} / {summary.micro_steps:,}"),
        ("generation rounds", f"{summary.generation_rounds:,} ({summary.rounds_per_epoch:,} per epoch)"),
        ("prompts per round", f"{summary.prompts_per_round:,}"),
        ("epochs", f"{summary.epochs}"),
        ("unique prompts used", f"{summary.unique_prompts_used:,} of {summary.dataset_size:,}"),
        ("completions", f"{summary.completions_total:,}"),
        ("prompt tokens per rank and round", f"{tokens['per_round_mean']:,.1f}"),
        ("max:mean rank load (mean / max)", ratios(imb["plan_order"])),
    ]
    if imb["seqlen_balanced"]:
        rows.append(("after seqlen balancing", ratios(imb["seqlen_balanced"])))
    table = Table(title="GRPO plan", show_header=False)
    for key, value in rows:
        table.add_row(key, value)
    return table
