"""The training stage: map the experiment config onto ``trl.GRPOConfig`` and run :class:`grpo.trainer.GRPOTrainer`."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset
from transformers import TrainerCallback

from grpo.config import ExperimentConfig
from grpo.policy import Policy
from grpo.rewards import get_reward
from grpo.runs import RunDir

# Fields of the ``grpo`` section that are not GRPOConfig arguments (handled by the platform itself).
_PLATFORM_ONLY = {"reward_funcs", "num_generations_chunks", "extra"}


def grpo_args(cfg: ExperimentConfig, output_dir: Path, use_cpu: bool = True):
    """``trl.GRPOConfig`` for this experiment: same names, plus run-directory and reporting settings."""
    from trl import GRPOConfig

    g = cfg.grpo
    kwargs = {k: v for k, v in g.model_dump().items() if k not in _PLATFORM_ONLY}
    kwargs.update(
        output_dir=str(output_dir),
        report_to=list(g.report_to),  # loggers beside the platform's MLflow tracking (MLflow itself refused at load)
        save_strategy="steps",
        logging_strategy="steps",
        use_cpu=use_cpu,
        disable_tqdm=False,
        dataloader_num_workers=0,
        shuffle_dataset=cfg.sampling.shuffle,
        vllm_importance_sampling_correction=cfg.async_.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=cfg.async_.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_max=cfg.async_.vllm_importance_sampling_cap,
        off_policy_mask_threshold=cfg.async_.off_policy_mask_threshold,
        use_bias_correction_kl=cfg.async_.use_bias_correction_kl,
    )
    kwargs.update(g.extra)
    return GRPOConfig(**kwargs)


class MetricsRecorder(TrainerCallback):
    """Append every ``Trainer.log`` call as one JSON line ``{"step": n, "metrics": {...}}``; tracking reads these."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.names: set[str] = set()

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run re-runs the steps after its checkpoint (all of them when it was killed before the first
        # one, global_step 0): drop what the killed attempt logged for them, so the file holds each step once.
        if state.is_world_process_zero and self.path.is_file():
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= state.global_step]
            self.path.write_text("".join(line + "\n" for line in keep))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        clean = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and v == v}
        self.names.update(clean)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": state.global_step, "metrics": clean}) + "\n")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    resumed_from: str | None
    metric_names: list[str]
    reward_curve: list[tuple[int, float]]


def train_grpo(
    cfg: ExperimentConfig, policy: Policy, train_dataset: Dataset, run: RunDir, resume: bool,
    plan_path: Path | None = None,
    callbacks=(),
) -> TrainResult:
    from grpo.trainer import GRPOTrainer

    import torch

    use_cpu = not torch.cuda.is_available()
    args = grpo_args(cfg, run.checkpoints, use_cpu=use_cpu)
    recorder = MetricsRecorder(run.metrics_file)
    start = time.perf_counter()  # trainer construction included: async start-up is part of the cost
    trainer = GRPOTrainer(
        model=policy.model,
        processing_class=policy.tokenizer,
        reward_funcs=[get_reward(name) for name in cfg.grpo.reward_funcs],
        args=args,
        train_dataset=train_dataset,
        callbacks=[recorder, *callbacks],
        experiment=cfg,
        plan_path=plan_path,
    )
    checkpoint = run.latest_checkpoint(report=_warn) if resume else None
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    finally:
        trainer.close_reward_pool()
        trainer.close_producer(wait=False)
    seconds = time.perf_counter() - start
    trainer.save_model(str(run.model_dir))
    policy.tokenizer.save_pretrained(run.model_dir)
    names, curve = set(), []
    if run.metrics_file.is_file():
        for line in run.metrics_file.read_text().splitlines():
            row = json.loads(line)
            names.update(row["metrics"])
            if "reward" in row["metrics"]:
                curve.append((row["step"], row["metrics"]["reward"]))
    return TrainResult(trainer.state.global_step, seconds, str(checkpoint) if checkpoint else None, sorted(names), curve)
