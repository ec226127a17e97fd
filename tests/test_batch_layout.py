"""One batch layout: the config, the sampler plan, the trainer and the plan's cache key read the same numbers."""

from __future__ import annotations

import pytest

from grpo.algo.batch_layout import BatchLayout
from grpo.config import load_config
from grpo.pipeline.cache_dirs import plan_dir_for
from grpo.pipeline.plans import plan_spec

SMALL = ["grpo.per_device_train_batch_size=32"]  # 4 prompts x 8 completions a micro-step
BASE = load_config(None, SMALL)


def make_cfg(sampling: dict | None = None, **grpo: object):
    """Bypasses ExperimentConfig's gate on world_size/SP (not switched on in this version), as tests/test_plan.py."""
    return BASE.model_copy(update={"grpo": BASE.grpo.model_copy(update=grpo),
                                   "sampling": BASE.sampling.model_copy(update=sampling or {})})


# (sampling, grpo, expected (steps_per_generation, generation_batch_size, prompts_per_rank, prompts_per_round))
CASES = [
    ({}, {}, (1, 32, 4, 4)),
    ({}, dict(gradient_accumulation_steps=2), (2, 64, 8, 8)),
    ({}, dict(steps_per_generation=2, num_iterations=2), (2, 64, 8, 8)),
    ({}, dict(generation_batch_size=96, per_device_train_batch_size=16, num_generations=4), (6, 96, 24, 24)),
    ({"world_size": 4, "sequence_parallel_degree": 2}, dict(per_device_train_batch_size=8, num_generations=4,
                                                            gradient_accumulation_steps=2), (2, 64, 4, 8)),
    ({"world_size": 2}, dict(generation_batch_size=64, per_device_train_batch_size=16), (2, 64, 4, 8)),
]


@pytest.mark.parametrize("sampling, grpo, expected", CASES)
def test_layout_numbers_agree_with_config_and_plan(sampling, grpo, expected):
    cfg = make_cfg(sampling, **grpo)
    layout = cfg.batch_layout
    assert (layout.steps_per_generation, layout.generation_batch_size, layout.prompts_per_rank,
            layout.prompts_per_round) == expected
    assert cfg.generation_batch_size == layout.generation_batch_size
    spec = plan_spec(cfg)
    for name in ("world_size", "sequence_parallel_degree", "num_sp_groups", "num_generations",
                 "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                 "num_iterations", "prompts_per_round", "micro_steps_per_round"):
        assert getattr(spec, name) == getattr(layout, name), name
    assert spec.prompts_per_sp_group == layout.prompts_per_rank
    assert spec.repeat_count == layout.micro_steps_per_round


class _TrainerView:
    """The trainer's own layout properties over TRL's resolved arguments, without building a model."""

    from grpo.training.trainer import GRPOTrainer as _T

    batch_layout = _T.batch_layout
    prompts_per_rank_per_generation = _T.prompts_per_rank_per_generation

    def __init__(self, cfg, args, num_processes: int = 1) -> None:
        self.experiment, self.args = cfg, args
        self.num_generations, self.num_iterations = args.num_generations, args.num_iterations
        self.accelerator = type("Acc", (), {"num_processes": num_processes})()


@pytest.mark.parametrize("sampling, grpo, expected", [c for c in CASES if not c[0]])  # one process here
def test_trainer_reads_the_same_layout_from_trl_args(tmp_path, sampling, grpo, expected):
    from grpo.training.train import grpo_args

    cfg = load_config(None, SMALL + [f"grpo.{k}={v}" for k, v in grpo.items()])
    args = grpo_args(cfg, tmp_path)
    trainer = _TrainerView(cfg, args)
    assert trainer.batch_layout.cache_key_payload() == cfg.batch_layout.cache_key_payload()
    assert (args.steps_per_generation, args.generation_batch_size) == expected[:2]
    assert trainer.prompts_per_rank_per_generation == cfg.batch_layout.prompts_per_rank == expected[2]


def test_trainer_refuses_partial_groups_with_the_same_message(tmp_path):
    from grpo.training.train import grpo_args

    cfg = load_config(None, ["grpo.per_device_train_batch_size=8", "grpo.num_generations=4"])
    args = grpo_args(cfg, tmp_path)
    args.per_device_train_batch_size = 6  # what a hand-built TRL config could hold
    with pytest.raises(ValueError, match=r"per_device_train_batch_size \(6\) x steps_per_generation \(1\) must be "
                                         r"divisible by grpo.num_generations \(4\)"):
        _ = _TrainerView(cfg, args).prompts_per_rank_per_generation


def test_plan_key_follows_the_layout_not_unrelated_fields():
    base = load_config(None, SMALL)
    key = plan_dir_for(base, "data")
    # Fields the plan does not read leave the key alone.
    for change in (["grpo.learning_rate=3e-4"], ["grpo.beta=0.04"], ["evaluation.enabled=false"], ["name=other"],
                   ["grpo.num_generations_chunks=2"], ["model.warm_start.steps=5"]):
        assert plan_dir_for(load_config(None, SMALL + change), "data") == key, change
    # Layout fields change it: per-device batch, group size, world, iterations.
    for change in (["grpo.per_device_train_batch_size=16"], ["grpo.num_generations=4"],
                   ["grpo.gradient_accumulation_steps=2"], ["grpo.num_iterations=2"], ["sampling.world_size=2"]):
        assert plan_dir_for(load_config(None, SMALL + change), "data") != key, change
    # So do the run length, the order and the data.
    assert plan_dir_for(load_config(None, [*SMALL, "grpo.max_steps=7"]), "data") != key
    assert plan_dir_for(load_config(None, [*SMALL, "grpo.seed=1"]), "data") != key
    assert plan_dir_for(load_config(None, [*SMALL, "sampling.shuffle=false"]), "data") != key
    assert plan_dir_for(base, "other-data") != key
    # One layout, one key, however it was spelled: generation_batch_size 64 = steps_per_generation 2 here.
    by_gbs = load_config(None, [*SMALL, "grpo.generation_batch_size=64"])
    by_spg = load_config(None, [*SMALL, "grpo.steps_per_generation=2"])
    assert by_gbs.batch_layout.cache_key_payload() == by_spg.batch_layout.cache_key_payload()
    assert plan_dir_for(by_gbs, "data") == plan_dir_for(by_spg, "data") != key


def test_derive_follows_trl_precedence():
    common = dict(world_size=2, per_device_train_batch_size=4, gradient_accumulation_steps=3, num_generations=2)
    assert BatchLayout.derive(**common).steps_per_generation == 3
    assert BatchLayout.derive(**common, steps_per_generation=5).generation_batch_size == 40
    by_gbs = BatchLayout.derive(**common, generation_batch_size=16)
    assert (by_gbs.steps_per_generation, by_gbs.steps_per_generation_from) == (2, "grpo.generation_batch_size")
    assert BatchLayout.derive(**common).steps_per_generation_from == "grpo.gradient_accumulation_steps"


def test_plan_spec_holds_the_layout_and_declares_none_of_its_numbers():
    """One batch arithmetic: the plan's spec is the config's layout plus the run's settings; it neither re-declares
    the layout's fields nor re-derives its sizes (it reads them through the layout)."""
    import dataclasses

    from grpo.algo.plan import PlanSpec

    cfg = make_cfg({"world_size": 4, "sequence_parallel_degree": 2}, per_device_train_batch_size=8, num_generations=4,
                   gradient_accumulation_steps=2)
    spec = plan_spec(cfg)
    assert spec.layout == cfg.batch_layout
    layout_names = {f.name for f in dataclasses.fields(BatchLayout)} | {
        name for name, value in vars(BatchLayout).items() if isinstance(value, property)}
    own_fields = {f.name for f in dataclasses.fields(PlanSpec)} - {"layout"}
    own_properties = {name for name, value in vars(PlanSpec).items() if isinstance(value, property)}
    assert own_fields.isdisjoint(layout_names) and own_properties.isdisjoint(layout_names)
    assert spec.prompts_per_round == cfg.batch_layout.prompts_per_round  # read through, as plan files name them
