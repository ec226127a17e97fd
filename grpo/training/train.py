"""The training stage: map the experiment config onto ``trl.GRPOConfig`` and run
:class:`grpo.training.trainer.GRPOTrainer`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from datasets import Dataset
from transformers import TrainerCallback

from grpo.config import ExperimentConfig
from grpo.formatting import count
from grpo.rewards import get_reward
from grpo.runs import RunDir
from grpo.training.graceful_stop import StopAtStepEnd, stop_at_step_end
from grpo.training.pace import Pace, duration
from grpo.training.policy import Policy, model_turn, name_adapter_base, save_merged_model

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
        disable_tqdm=True,  # the console line is ConsoleProgress's
        dataloader_num_workers=0,
        shuffle_dataset=cfg.sampling.shuffle,
        vllm_importance_sampling_correction=cfg.async_.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=cfg.async_.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_max=cfg.async_.vllm_importance_sampling_cap,
        off_policy_mask_threshold=cfg.async_.off_policy_mask_threshold,
        use_bias_correction_kl=cfg.async_.use_bias_correction_kl,
    )
    env = cfg.environment
    if env.is_chat:  # TRL's tool loop reads its turn limit from GRPOConfig
        kwargs["max_tool_calling_iterations"] = env.max_tool_calling_iterations
    kwargs.update(g.extra)
    from grpo.training.rollout_engines import engine_kind

    if engine_kind(cfg) == "vllm_server":
        # Async rollouts from the vLLM server: the platform's engine owns TRL's client and the server's weight-sync
        # group (grpo/training/rollout_engines.py); TRL's own vLLM path (a second client, a sync every step) stays off.
        kwargs["use_vllm"] = False
    return GRPOConfig(**kwargs)


def peft_config(cfg: ExperimentConfig):
    """``peft.LoraConfig`` for ``model.lora`` (None when it is off): what ``trl.GRPOTrainer`` takes as ``peft_config``
    (TRL's ``--use_peft --lora_r --lora_alpha --lora_dropout --lora_target_modules``)."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    from peft import LoraConfig

    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM")


class MetricsRecorder(TrainerCallback):
    """Append every ``Trainer.log`` call as one JSON line ``{"step": n, "metrics": {...}}``; tracking reads these.

    The file stays open for the whole training, line-buffered: each line is handed to the operating system as it is
    written (a crash, a cancel or a SIGKILL after ``on_log`` loses no point), without the open and close per logged
    step that cost more than the write on a fast step. :meth:`close` (at the train's end, or by the caller after a
    failed one) releases it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.names: set[str] = set()
        self._file = None

    def on_train_begin(self, args, state, control, **kwargs):
        # A resumed run re-runs the steps after its checkpoint (all of them when it was killed before the first
        # one, global_step 0): drop what the killed attempt logged for them, so the file holds each step once.
        if state.is_world_process_zero and self.path.is_file():
            self.close()
            keep = [line for line in self.path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] <= state.global_step]
            self.path.write_text("".join(line + "\n" for line in keep))

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        clean = {k: float(v) for k, v in logs.items() if isinstance(v, (int, float)) and v == v}
        self.names.update(clean)
        if self._file is None:
            self._file = self.path.open("a", buffering=1)  # line-buffered: every line reaches the OS at once
        self._file.write(json.dumps({"step": state.global_step, "metrics": clean}) + "\n")

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ConsoleProgress(TrainerCallback):
    """One short line per logged step on the console: step, reward (per reward function too), accuracy-like and
    loss figures, seconds per step and ETA. Replaces transformers' progress bar and printer, which glue the whole
    log dict (every value quoted as a string) onto the bar: one 3,000-character line when not in a terminal. The
    full metrics go to metrics.jsonl and MLflow.

    A resumed training (``resumed_from``: the checkpoint it loaded) first says where it continues, e.g.
    ``resumed from checkpoint-43: step 43 of 150``, and its pace, ETA and closing line count the steps since then
    (:class:`~grpo.training.pace.Pace`)."""

    def __init__(self, echo=print, resumed_from: Path | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.echo = echo
        self.resumed_from = resumed_from
        self.clock = clock
        self.pace: Pace | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.pace = Pace(state.global_step, self.clock)
        if self.resumed_from is not None and state.is_world_process_zero:
            self.echo(f"resumed from {self.resumed_from.name}: step {state.global_step} of {state.max_steps}")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or not state.is_world_process_zero:
            return
        if "train_runtime" in logs:  # the trainer's closing summary: its runtime is this training's, since the resume
            started = self.pace.started_step if self.pace is not None else 0
            since = f", from step {started} to {state.global_step}" if started else ""
            self.echo(f"train: {count(state.global_step - started, 'step')} in {duration(logs['train_runtime'])}"
                      f"{since}")
            return
        self.echo(progress_line(logs, state.global_step, state.max_steps, self.pace))


def progress_line(logs: dict, step: int, max_steps: int, pace: Pace | None) -> str:
    """``step 3/10 | reward 0.42 ±0.31 | exact_match 0.40 | loss 0.012 | 1.8 s/step | ETA 13s (7 steps left)``."""
    parts = [f"step {step}/{max_steps}"]
    if isinstance(logs.get("reward"), (int, float)):
        std = logs.get("reward_std")
        parts.append(f"reward {logs['reward']:.3f}" + (f" ±{std:.2f}" if isinstance(std, (int, float)) else ""))
    rewards = [k for k in logs if k.startswith("rewards/") and k.endswith("/mean")]
    if len(rewards) > 1 or (rewards and "reward" not in logs):
        parts += [f"{k.split('/')[1]} {logs[k]:.3f}" for k in rewards]
    parts += [f"{k} {logs[k]:.3f}" for k in logs if "accuracy" in k and isinstance(logs[k], (int, float))]
    if isinstance(logs.get("loss"), (int, float)):
        parts.append(f"loss {logs['loss']:.4g}")
    per_step = pace.seconds_per_step(step) if pace is not None else None
    if per_step is not None:
        parts.append(f"{per_step:.1f} s/step")
        eta = pace.eta(step, max_steps, per_step)
        if eta is not None:
            parts.append(eta)
    return " | ".join(parts)


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
    echo: Callable[[str], None] = print,
) -> TrainResult:
    """Train; ``echo`` receives the console lines (progress, warnings): a Prefect run logger in the flow."""
    with model_turn(echo):  # one training or model load at a time per process (see grpo.training.policy.MODEL_LOCK)
        return _train(cfg, policy, train_dataset, run, resume, plan_path, callbacks, echo)


def _train(cfg, policy, train_dataset, run, resume, plan_path, callbacks, echo) -> TrainResult:
    import torch

    from grpo.training.trainer import GRPOTrainer

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
        peft_config=peft_config(cfg),  # model.lora: TRL wraps the policy in a peft model, the base frozen
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    checkpoint = run.latest_checkpoint(report=lambda message: echo(f"warning: {message}")) if resume else None
    trainer.add_callback(ConsoleProgress(echo, resumed_from=checkpoint))
    stop = StopAtStepEnd()
    trainer.add_callback(stop)
    try:
        with stop_at_step_end(stop):  # Ctrl-C/SIGTERM: checkpoint at the current step, then stop
            trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    finally:
        recorder.close()
        trainer.close_reward_pool()
        trainer.close_producer(wait=False)
    seconds = time.perf_counter() - start
    if cfg.model.lora.enabled:  # model/ then holds the adapter (TRL's PeftModel saves only it), naming its base
        name_adapter_base(trainer.accelerator.unwrap_model(trainer.model), policy.source)
    # transformers' Trainer set use_cache false for training; the saved policy is for generation, where the KV cache
    # is what a user of from_pretrained + generate expects (without it every token re-runs the whole sequence).
    trainer.accelerator.unwrap_model(trainer.model).config.use_cache = True
    trainer.save_model(str(run.model_dir))
    policy.tokenizer.save_pretrained(run.model_dir)
    if cfg.model.lora.enabled and cfg.model.lora.save_merged and trainer.accelerator.is_main_process:
        save_merged_model(run.model_dir, run.merged_model_dir)
    names, curve = set(), []
    if run.metrics_file.is_file():
        for line in run.metrics_file.read_text().splitlines():
            row = json.loads(line)
            names.update(row["metrics"])
            if "reward" in row["metrics"]:
                curve.append((row["step"], row["metrics"]["reward"]))
    return TrainResult(trainer.state.global_step, seconds, str(checkpoint) if checkpoint else None, sorted(names),
                       curve)
