"""The experiment config: one pydantic model, loaded from YAML, validated before anything is built.

Field names follow ``trl.GRPOConfig`` (section ``grpo``) and axolotl's async ``trl:`` block (section ``async``), so
settings carry over. Every rule that can be checked without a model is checked here; a bad value fails at load
with the field's dotted path and the valid values.

Presets ship inside the package (``grpo/presets/*.yaml``, read with :mod:`importlib.resources`): ``load_config`` takes
a file or a preset name. The defaults are the ``tiny`` preset's values except ``DEFAULTS_NOT_FROM_TINY``.
"""

from __future__ import annotations

import difflib
import importlib.util
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from grpo.algo.batch_layout import BatchLayout, batch_layout
from grpo.errors import ConfigError

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


class _Section(BaseModel):
    # Attribute docstrings become field descriptions: the Prefect UI shows them under each form field.
    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, populate_by_name=True, use_attribute_docstrings=True,
        allow_inf_nan=False,  # learning_rate=inf or .nan is a typo, never a setting
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """YAML's ``true`` would pass as 1 for an int field (``max_steps: true``): refuse it."""
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if annotation in (int, float, int | None, float | None):
                raise ValueError(f"expected a number, got {value!r}")
        return value


class DataConfig(_Section):
    """Where prompts and answers come from. ``synthetic:*`` tasks are generated locally (no download)."""

    source: str = Field(
        "synthetic:addition",
        description="'synthetic:addition' (answers are the sum), 'synthetic:addition_cot' (answers show the "
        "column-by-column work, ~17 tokens: a reasoning-style, generation-heavy task), a local "
        ".jsonl/.json/.parquet/.csv file, or 'hub:DATASET_ID' (downloads).",
    )
    hub_config: str | None = Field(None, description="Dataset config name for hub sources (e.g. 'main' for GSM8K).")
    train_split: str = Field("train", description="Split used for training (hub sources).")
    eval_split: str = Field("test", description="Held-out split used for evaluation (hub sources).")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Held-out fraction for single-file sources.")
    prompt_column: str = Field("prompt", description="Column holding the prompt text.")
    answer_column: str = Field("answer", description="Column holding the reference answer.")
    answer_regex: str | None = Field(
        None, description="Regex with one group extracting the final answer from the answer column (GSM8K: '#### (.*)')."
    )
    prompt_format: Literal["plain", "chat"] = Field(
        "plain", description="'chat' wraps text prompts as user messages; prompts given as message lists (TRL's "
        "conversational format) are used as they are, with either value.")
    system_prompt: str | None = Field(None, description="System message prepended in chat format.")
    max_prompt_chars: int = Field(4096, ge=1, description="Prep: longer prompts (before chat wrapping) are quarantined.")
    max_answer_chars: int = Field(512, ge=1, description="Prep: longer answers (after answer_regex) are quarantined.")
    duplicates: Literal["drop", "keep", "error"] = Field(
        "drop", description="Prep: repeated prompts: quarantine all but the first valid copy, allow, or fail."
    )
    min_rows: int = Field(1, ge=1, description="Prep: fewest valid rows each split must keep.")
    num_train: int = Field(5000, ge=1, description="Synthetic task: training problems.")
    num_eval: int = Field(500, ge=1, description="Synthetic task: held-out problems.")
    max_operand: int = Field(99, ge=1, le=9999, description="Synthetic task: operands are 0..max_operand.")
    seed: int = Field(0, description="Synthetic task / split seed.")

    @model_validator(mode="after")
    def _source_exists(self) -> DataConfig:
        from grpo.tasks import TASKS

        s = self.source
        synthetic = ", ".join(f"'synthetic:{t}'" for t in TASKS)
        if s.startswith("synthetic:"):
            if s.removeprefix("synthetic:") not in TASKS:
                raise ValueError(f"source: unknown synthetic task {s!r}; valid: {synthetic}")
        elif s.startswith("hub:"):
            if len(s) <= 4:
                raise ValueError("source: 'hub:' needs a dataset id, e.g. 'hub:openai/gsm8k'")
        else:
            path = Path(s)
            if path.suffix not in {".jsonl", ".json", ".parquet", ".csv"}:
                raise ValueError(
                    f"source: {s!r} is not a valid source; valid are {synthetic}, 'hub:<id>' or a "
                    ".jsonl/.json/.parquet/.csv file"
                )
            if not path.is_file():
                raise ValueError(f"source: file does not exist: {s}")
        if self.synthetic and self.num_train + self.num_eval > (self.max_operand + 1) ** 2:
            raise ValueError(
                f"num_train: num_train + num_eval = {self.num_train + self.num_eval} exceeds the "
                f"{(self.max_operand + 1) ** 2} distinct problems with max_operand={self.max_operand}"
            )
        return self

    @property
    def synthetic(self) -> bool:
        return self.source.startswith("synthetic:")

    @property
    def worked_answers(self) -> bool:
        """``synthetic:addition_cot``: answers show their work."""
        return self.source == "synthetic:addition_cot"


class TinyModelConfig(_Section):
    """Shape of the locally built character-level Qwen2 (used when ``model.name_or_path`` is ``tiny``)."""

    hidden_size: int = Field(128, ge=8)
    """Width of the tiny Qwen2."""
    num_hidden_layers: int = Field(3, ge=1)
    """Transformer layers."""
    num_attention_heads: int = Field(4, ge=1)
    """Attention heads (must divide hidden_size)."""
    intermediate_size: int = Field(256, ge=8)
    """MLP width."""
    max_position_embeddings: int = Field(64, ge=8)
    """Longest prompt + completion in tokens."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size: {self.hidden_size} must be divisible by num_attention_heads ({self.num_attention_heads})"
            )
        return self


class WarmStartConfig(_Section):
    """Supervised steps on (prompt, answer) before GRPO, so groups have reward variance to learn from."""

    steps: int = Field(1000, ge=0, description="0 disables the warm start.")
    learning_rate: float = Field(1e-3, gt=0)
    """AdamW learning rate of the warm start."""
    batch_size: int = Field(64, ge=1)
    """Demonstrations per warm-start step."""
    carry_error_rate: float = Field(
        0.0, ge=0, le=1,
        description="synthetic:addition only (other sources are demonstrated as given): fraction of carrying "
        "problems whose demonstration forgets the carry (imperfect SFT data for GRPO to correct).",
    )


class LoraSection(_Section):
    """LoRA adapters (``peft.LoraConfig``, TRL's ``--use_peft --lora_r ...``), passed to ``trl.GRPOTrainer`` as
    ``peft_config``: the base weights stay frozen and only the adapter trains. The warm start
    (``model.warm_start``) is supervised training of the full model *before* GRPO; the adapter is added after it."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model (TRL's --use_peft)."""
    r: int = Field(16, ge=1, description="Adapter rank (TRL's --lora_r, peft's r).")
    alpha: int = Field(32, ge=1, description="Adapter scale numerator: updates are scaled by alpha / r "
                       "(TRL's --lora_alpha, peft's lora_alpha).")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapter's input (TRL's --lora_dropout, peft's lora_dropout). "
        "0 keeps GRPO's ratio pi_theta / pi_old exactly 1 on fresh rollouts, as with the dropout-free base model.")
    target_modules: str | list[str] = Field(
        "all-linear", description="Modules that get an adapter: 'all-linear' (every linear layer but the output "
        "layer; for Qwen2 q/k/v/o_proj and gate/up/down_proj), a list of module names (e.g. [q_proj, v_proj]), or a "
        "regex over full module names (TRL's --lora_target_modules, peft's target_modules). Never the embeddings "
        "or lm_head: TRL computes log-probs from lm_head.weight directly.")
    save_merged: bool = Field(
        False, description="Also write the adapter merged into its base as a plain transformers model (the run's "
        "model-merged/ folder) and, with tracking.log_model, log it to MLflow as 'merged_model'. The run's model/ "
        "folder always holds the adapter.")

    @field_validator("target_modules")
    @classmethod
    def _targets(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if not names or any(not n.strip() for n in names):
            raise ValueError("give 'all-linear', a non-empty list of module names (e.g. [q_proj, v_proj]) or a regex")
        if isinstance(value, list) and "all-linear" in value:
            if len(value) > 1:
                raise ValueError("'all-linear' stands alone: give 'all-linear' or a list of module names, not both")
            return "all-linear"
        for name in names:
            if name.split(".")[-1] in LORA_REFUSED_TARGETS:
                raise ValueError(f"{name!r} can not carry an adapter: {LORA_REFUSED_TARGETS[name.split('.')[-1]]}; "
                                 "valid: 'all-linear' or linear layers such as q_proj, k_proj, v_proj, o_proj, "
                                 "gate_proj, up_proj, down_proj")
        return value


# Modules model.lora.target_modules refuses, and why.
LORA_REFUSED_TARGETS = {
    "lm_head": "TRL computes the log-probs from lm_head.weight directly, so its adapter would never train",
    "embed_tokens": "the output layer shares (ties) its weight in the tiny model and many others, and TRL's log-probs "
    "read lm_head.weight directly",
}


class ModelConfig(_Section):
    name_or_path: str = Field(
        "tiny", description="'tiny' builds a local character-level Qwen2; anything else is a hub id or local path."
    )
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Weights dtype when loading the policy."""
    attn_implementation: str | None = Field(None, description="e.g. 'sdpa', 'flash_attention_2' (GPU).")
    chat_template: str | None = Field(
        None, description="A Jinja chat template, inline or as a path to a .jinja file, used instead of the "
        "tokenizer's own (TRL's chat_template_path); saved with the trained model.")
    tiny: TinyModelConfig = TinyModelConfig()
    """Shape of the local tiny model (used when name_or_path is 'tiny')."""
    warm_start: WarmStartConfig = WarmStartConfig()
    """Supervised warm start before GRPO."""
    lora: LoraSection = LoraSection()
    """LoRA adapters (peft.LoraConfig via TRL's peft_config): train only the adapter; off by default."""

    @model_validator(mode="after")
    def _lora_needs_a_saved_base(self) -> ModelConfig:
        if self.lora.enabled and self.warm_start.steps and not self.is_tiny:
            raise ValueError(
                f"lora.enabled with warm_start.steps ({self.warm_start.steps}) > 0 for {self.name_or_path!r}: the "
                "warm start trains the full weights in memory, which are saved nowhere, so the adapter could not be "
                "loaded onto its real base; set model.warm_start.steps: 0 (or warm-start separately, save that "
                "model and point name_or_path at it)"
            )
        return self

    @property
    def is_tiny(self) -> bool:
        return self.name_or_path == "tiny"

    @property
    def chat_template_file(self) -> Path | None:
        """The file ``chat_template`` names (a value ending in ``.jinja``), or None when it is the template itself."""
        if self.chat_template and self.chat_template.endswith(".jinja"):
            return Path(self.chat_template).expanduser()
        return None

    def chat_template_text(self) -> str | None:
        """The chat template to use instead of the tokenizer's: the file's contents or the inline text (or None)."""
        path = self.chat_template_file
        return path.read_text(encoding="utf-8") if path is not None else self.chat_template


class SamplingConfig(_Section):
    """How prompts are laid out over ranks (sequence-parallel repeat sampler) and balanced after generation."""

    world_size: int = Field(1, ge=1, description="Number of training processes (accelerate/torchrun).")
    sequence_parallel_degree: int = Field(1, ge=1, description="Ranks sharing one prompt's sequences.")
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded; the same order on every restart)."""
    drop_last: bool = False
    """Drop the last incomplete round of an epoch instead of padding it with repeated prompts."""
    seqlen_balancing: bool = Field(False, description="Assign whole groups to DP ranks by balanced token load.")
    balance_quadratic_coef: float | None = Field(
        None, ge=0, description="Workload a*L + L^2 per sequence instead of L tokens (attention cost)."
    )

    @model_validator(mode="after")
    def _sp_divides(self) -> SamplingConfig:
        if self.world_size % self.sequence_parallel_degree:
            raise ValueError(
                f"sequence_parallel_degree: world_size ({self.world_size}) must be divisible by sequence_parallel_degree "
                f"({self.sequence_parallel_degree}); valid degrees: "
                f"{[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
            )
        return self


def _trl_help(schema: dict[str, Any]) -> None:
    """Describe fields from ``trl.GRPOConfig``'s own help text where we have none (for the Prefect form)."""
    import dataclasses

    from trl import GRPOConfig

    help_text = {f.name: f.metadata.get("help") for f in dataclasses.fields(GRPOConfig)}
    for name, prop in schema.get("properties", {}).items():
        text = " ".join((help_text.get(name) or "").split())
        if text and "description" not in prop:
            sentences = text.split(". ")
            short = sentences[0]
            for more in sentences[1:]:
                if len(short) + len(more) > 220:
                    break
                short += ". " + more
            prop["description"] = short.rstrip(".") + " (TRL)"


def _reward_enum(schema: dict[str, Any]) -> None:
    """Registered reward names as a closed choice (built-ins, entry points, ``GRPO_REWARD_MODULES``)."""
    from grpo.rewards import available_rewards

    target = schema.get("items", schema)
    target["enum"] = sorted(available_rewards())


LRScheduler = Literal[
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "cosine_with_min_lr", "polynomial",
    "inverse_sqrt", "warmup_stable_decay",
]


class GRPOSection(_Section):
    """GRPO training; every name is the ``trl.GRPOConfig`` field of the same name."""

    model_config = ConfigDict(**_Section.model_config, json_schema_extra=_trl_help)

    learning_rate: float = Field(1e-4, gt=0)
    max_steps: int = Field(500, ge=1, description="Optimizer steps.")
    per_device_train_batch_size: int = Field(256, ge=1, description="Completions per device per micro-step.")
    gradient_accumulation_steps: int = Field(1, ge=1)
    num_generations: int = Field(8, ge=2, description="Completions per prompt (the group size).")
    generation_batch_size: int | None = Field(None, ge=1, description="Completions generated at once (all ranks).")
    steps_per_generation: int | None = Field(None, ge=1)
    """Micro-steps served by one generation round (TRL's default: gradient_accumulation_steps)."""
    num_iterations: int = Field(1, ge=1, description="Optimisation passes per generation batch (mu).")
    beta: float = Field(0.0, ge=0, description="KL coefficient; 0 skips the reference model.")
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = Field(None, gt=0)
    delta: float | None = Field(None, gt=0)
    loss_type: LossType = "dapo"
    scale_rewards: ScaleRewards = "group"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    mask_truncated_completions: bool = False
    max_completion_length: int = Field(4, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0)
    reward_funcs: list[str] = Field(
        ["exact_match"], min_length=1, description="Registered reward names.", json_schema_extra=_reward_enum
    )
    reward_weights: list[float] | None = None
    """One weight per reward function (default: all 1)."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    num_generations_chunks: int = Field(1, ge=1, description="Backward per chunk of each group's completions.")
    lr_scheduler_type: LRScheduler = "constant"
    """Learning-rate schedule (transformers' SchedulerType)."""
    warmup_steps: float = Field(0, ge=0, description="Warmup steps, or a ratio of max_steps when in [0, 1).")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    logging_steps: int = Field(10, ge=1)
    save_steps: int = Field(100, ge=1, description="Checkpoint every N steps (resume point).")
    save_total_limit: int | None = Field(2, ge=1)
    seed: int = 0
    bf16: bool = False
    gradient_checkpointing: bool = False
    use_vllm: bool = False
    vllm_mode: Literal["server", "colocate"] = "colocate"
    vllm_server_host: str = "127.0.0.1"
    vllm_server_port: int = 8000
    vllm_gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    log_completions: bool = False
    report_to: list[str] = Field(
        default_factory=list,
        description="TRL/transformers loggers beside the platform's MLflow tracking, e.g. ['tensorboard'] or "
        "['wandb'] (installed integrations only; MLflow itself is tracking.backend).",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict, description="Any other trl.GRPOConfig field, passed through unchanged."
    )

    @model_validator(mode="after")
    def _extra_are_trl_fields(self) -> GRPOSection:
        if not self.extra:
            return self
        import dataclasses

        from trl import GRPOConfig

        trl_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
        for key in self.extra:
            if key in TRL_SECRET_FIELDS:
                raise ValueError(
                    f"extra: {key!r} is a secret, and a config is stored in plain text (the run directory's "
                    f"config.yaml, the Prefect flow-run parameters); set the {TRL_SECRET_FIELDS[key]} environment "
                    "variable instead (huggingface_hub reads it)"
                )
            if key in TRL_FIELDS_SET_BY_PLATFORM:
                raise ValueError(
                    f"extra: {key!r} is set from {TRL_FIELDS_SET_BY_PLATFORM[key]}; set that instead (a value here "
                    "would silently override it)"
                )
            if key in type(self).model_fields:
                raise ValueError(f"extra: {key!r} is a regular field here; set grpo.{key} instead")
            if key not in trl_fields:
                close = difflib.get_close_matches(key, sorted(trl_fields), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(f"extra: {key!r} is not a trl.GRPOConfig field{hint}")
        return self

    @model_validator(mode="after")
    def _report_to_installed(self) -> GRPOSection:
        if not self.report_to:
            return self
        from transformers.integrations.integration_utils import (
            INTEGRATION_TO_CALLBACK,
            get_available_reporting_integrations,
        )

        for name in self.report_to:
            if name in ("mlflow", "dagshub", "all"):
                raise ValueError(
                    f"report_to: {name!r} would make TRL log a second MLflow run beside the platform's: MLflow "
                    "tracking is tracking.backend: mlflow; list the other loggers by name (e.g. ['tensorboard'])"
                )
            if name == "none":
                raise ValueError("report_to: use an empty list [] for no extra loggers, not 'none'")
            if name not in INTEGRATION_TO_CALLBACK:
                valid = sorted(set(INTEGRATION_TO_CALLBACK) - {"mlflow", "dagshub"})
                raise ValueError(f"report_to: unknown logger {name!r}; valid: {', '.join(valid)}")
            if name not in get_available_reporting_integrations():
                raise ValueError(f"report_to: {name!r} is not installed in this environment (pip install {name})")
        return self


# trl.GRPOConfig fields that hold secrets, with the environment variable the library reads instead. Refused in
# grpo.extra: a config is written to config.yaml, shown as Prefect flow-run parameters and logged to MLflow.
TRL_SECRET_FIELDS = {"hub_token": "HF_TOKEN"}

# trl.GRPOConfig fields the platform sets itself (grpo.training.train.grpo_args), with where their value comes from. grpo.extra
# may not set them: kwargs from extra are applied last and would silently win over the platform's field.
TRL_FIELDS_SET_BY_PLATFORM: dict[str, str] = {
    "output_dir": "the run directory (output_dir + run name)",
    "use_cpu": "the machine (CPU when no CUDA device is present)",
    "report_to": "grpo.report_to",
    "shuffle_dataset": "sampling.shuffle",
    "vllm_importance_sampling_correction": "async.vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode": "async.vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max": "async.vllm_importance_sampling_cap",
    "off_policy_mask_threshold": "async.off_policy_mask_threshold",
    "use_bias_correction_kl": "async.use_bias_correction_kl",
}


class AsyncSection(_Section):
    """Async GRPO and the fast-async toolkit; names as in axolotl's ``trl:`` block."""

    use_data_producer: bool = False
    """Generate rollouts in a separate producer: a CPU generator process, or with grpo.use_vllm and
    grpo.vllm_mode: server a vLLM server on its own GPU (TRL's client)."""
    async_prefetch: bool = False
    """Let the producer run ahead of training: the next rounds are generated while this one trains."""
    prefetch_depth: int = Field(1, ge=1)
    """Generation rounds produced ahead of the trainer."""
    vllm_sync_interval: int = Field(1, ge=1)
    """Push the trainer's weights to the generator every N optimizer steps."""
    max_staleness: int = Field(1, ge=0, description="Rollouts older than this many policy versions are regenerated.")
    generator_threads: int | None = Field(
        None, ge=1, description="CPU generator process (async without vLLM): the cores it computes on; the trainer "
        "process then uses the other cores' worth of intra-op threads for the run, so the two never compete for a "
        "core. Unset: half the cores available to the process.")
    streaming_partial_batch: bool = Field(
        False, description="Score prompt groups in a background thread while the log-prob passes run."
    )
    streaming_min_groups: int = Field(1, ge=1, description="Prompt groups per streamed scoring chunk.")
    vllm_importance_sampling_correction: bool = False
    """Reweight tokens by pi_trainer / pi_generator to correct for stale or mismatched rollouts."""
    vllm_importance_sampling_mode: ISMode = "token_truncate"
    """token_/sequence_ level; *_truncate clamps the ratio at the cap, *_mask gives weight 0 above it."""
    vllm_importance_sampling_cap: float = Field(2.0, gt=0)
    """Upper bound C of the importance-sampling ratio."""
    off_policy_mask_threshold: float | None = Field(None, ge=0)
    """Drop negative-advantage sequences whose mean sampling KL exceeds this (OPSM); unset disables."""
    use_bias_correction_kl: bool = False
    """Importance-weight the KL term for off-policy rollouts (TRL's bias-corrected KL)."""
    reward_num_workers: int = Field(1, ge=1)
    """Reward worker processes; 1 scores in the trainer process."""
    reward_timeout: float | None = Field(
        600.0, gt=0,
        description="Seconds the reward worker pool waits for one generation batch's rewards; a reward still running "
        "then gives NaN for its samples and its worker is replaced. The default (10 minutes) is far above what a "
        "normal reward takes; raise it for slow rewards (a large reward model, sandboxed code), null waits forever. "
        "Applies with reward_num_workers > 1 only: in-process scoring can not be interrupted.",
    )
    replay_buffer_size: int = Field(0, ge=0)
    """High-signal groups kept to replace zero-signal groups of later batches; 0 disables."""
    replay_recompute_logps: bool = True
    """Recompute old log-probs and advantages of replayed groups for the current policy."""
    reroll_start_fraction: float = Field(1.0, ge=0, le=1, description="1.0 disables deferred re-roll.")
    reroll_max_groups: int = Field(1, ge=1, description="Re-roll prompt groups injected per generation batch.")
    reroll_buffer_size: int = Field(256, ge=1, description="Failed prompts kept for re-roll; the oldest are dropped.")
    skip_zero_advantage_batches: bool = False
    """Skip forward/backward of micro-batches whose advantages are all zero (ranks agree)."""
    compact_zero_advantage: bool = True
    """Run each micro-batch's forward/backward on its non-zero-advantage completions only, the loss kept on the full
    batch's normaliser (exact, every loss type); with grpo.beta > 0, an entropy option or a MoE router aux loss it
    computes every completion."""
    shared_prompt_forward: bool = True
    """Run each group's prompt through the model once per log-prob forward and its completions on the prompt's cached
    keys/values, instead of prompt + completion per completion (exact, MoE router aux loss included; the full forward
    with gradient checkpointing, multimodal inputs or a model whose cache holds a recurrent state: Mamba / linear
    attention)."""


class EvaluationConfig(_Section):
    enabled: bool = True
    """Evaluate greedy accuracy (and pass@k) on the held-out split."""
    before_training: bool = True
    """Also evaluate the starting policy, so the run reports its gain."""
    num_prompts: int | None = Field(None, ge=1, description="Evaluate on the first N held-out prompts (all if unset).")
    batch_size: int = Field(256, ge=1)
    """Prompts per generation batch during evaluation."""
    pass_k: int = Field(8, ge=0, description="k for pass@k with sampling; 0 skips it.")
    pass_k_temperature: float = Field(1.0, gt=0)
    """Sampling temperature for pass@k."""
    correctness_reward: str = Field(
        "exact_match", description="Reward whose full marks (>= 1) count as correct.", json_schema_extra=_reward_enum
    )


class TrackingConfig(_Section):
    backend: Literal["none", "mlflow"] = "none"
    """'mlflow' tracks params, metrics, artifacts and the model; 'none' writes only the run directory."""
    experiment_name: str = "grpo"
    """MLflow experiment the run is logged under."""
    tracking_uri: str | None = Field(None, description="Defaults to MLFLOW_TRACKING_URI or a local SQLite store.")
    log_system_metrics: bool = True
    """CPU/memory/GPU metrics in MLflow."""
    log_model: bool = True
    """Log the trained model with MLflow's transformers flavour."""


class ExperimentConfig(_Section):
    """One GRPO experiment: data → model → sampling → GRPO training → evaluation, tracked."""

    name: str = Field("tiny", description="Experiment name; default prefix of run names.")
    output_dir: str = Field("runs", description="Run directories are created under this folder.")
    data: DataConfig = DataConfig()
    """Dataset source, columns and validation (prep stage)."""
    model: ModelConfig = ModelConfig()
    """Policy model and warm start."""
    sampling: SamplingConfig = SamplingConfig()
    """Prompt layout over ranks and sequence-length balancing."""
    grpo: GRPOSection = GRPOSection()
    """GRPO training; names are trl.GRPOConfig's."""
    async_: AsyncSection = Field(AsyncSection(), alias="async")
    """Async generation and the fast-async toolkit; names are axolotl's."""
    evaluation: EvaluationConfig = EvaluationConfig()
    """Held-out evaluation before and after training."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow tracking."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ExperimentConfig:
        from grpo.rewards import available_rewards

        g, s, a = self.grpo, self.sampling, self.async_
        known = available_rewards()
        for field, names in (("grpo.reward_funcs", g.reward_funcs), ("evaluation.correctness_reward", [self.evaluation.correctness_reward])):
            for name in names:
                if name not in known:
                    raise ValueError(f"{field}: unknown reward {name!r}; registered rewards: {', '.join(known)}")
        if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
            raise ValueError(
                f"grpo.reward_weights has {len(g.reward_weights)} values but grpo.reward_funcs has {len(g.reward_funcs)}"
            )
        if g.generation_batch_size is not None and g.steps_per_generation is not None:
            raise ValueError("grpo.generation_batch_size and grpo.steps_per_generation can not both be set; set one")
        layout = self.batch_layout
        global_batch = layout.global_batch_size
        if g.generation_batch_size is not None and g.generation_batch_size % global_batch:
            raise ValueError(
                f"grpo.generation_batch_size ({g.generation_batch_size}) must be divisible by the global batch "
                f"per_device_train_batch_size x sampling.world_size = {global_batch}"
            )
        gen_batch = layout.generation_batch_size
        if gen_batch % g.num_generations:
            raise ValueError(
                f"generation batch ({gen_batch} completions) must be divisible by grpo.num_generations "
                f"({g.num_generations}); valid num_generations: {[n for n in range(2, gen_batch + 1) if gen_batch % n == 0]}"
            )
        if g.num_generations % g.num_generations_chunks:
            raise ValueError(
                f"grpo.num_generations ({g.num_generations}) must be divisible by grpo.num_generations_chunks "
                f"({g.num_generations_chunks}); valid: {[c for c in range(1, g.num_generations + 1) if g.num_generations % c == 0]}"
            )
        if g.num_generations_chunks > g.per_device_train_batch_size:
            raise ValueError(
                f"grpo.num_generations_chunks ({g.num_generations_chunks}) can not exceed "
                f"grpo.per_device_train_batch_size ({g.per_device_train_batch_size}), the rows it splits"
            )
        self._loss_layout_rules()
        if self.model.lora.enabled and g.extra.get("sync_ref_model"):
            raise ValueError("grpo.extra.sync_ref_model with model.lora.enabled: with an adapter the reference model is "
                             "the base with the adapter disabled (TRL keeps no copy to sync); drop sync_ref_model")
        if g.epsilon_high is not None and g.epsilon_high < g.epsilon:
            raise ValueError(f"grpo.epsilon_high ({g.epsilon_high}) must be >= grpo.epsilon ({g.epsilon})")
        if g.loss_type == "luspo" and g.importance_sampling_level != "sequence":
            raise ValueError("grpo.loss_type 'luspo' requires grpo.importance_sampling_level: sequence")
        if (a.use_data_producer or a.async_prefetch) and g.use_vllm:
            self._async_vllm_rules()
        if g.use_vllm and importlib.util.find_spec("vllm") is None:
            raise ValueError("grpo.use_vllm: vllm is not installed; install the 'gpu' extra (pip install -e '.[gpu]')")
        if self.model.is_tiny and self.data.prompt_format == "chat":
            raise ValueError("model.name_or_path 'tiny' has no chat template; use data.prompt_format: plain")
        if self.model.is_tiny and self.model.chat_template:
            raise ValueError("model.chat_template: the 'tiny' model's character tokenizer takes plain prompts only; "
                             "set it for a model folder or hub model")
        if self.model.chat_template_file is not None and not self.model.chat_template_file.is_file():
            raise ValueError(f"model.chat_template: no file {self.model.chat_template!r} (a path must end in .jinja "
                             "and exist; anything else is taken as the template itself)")
        if self.model.is_tiny and self.model.tiny.max_position_embeddings < g.max_completion_length + 8:
            raise ValueError(
                f"model.tiny.max_position_embeddings ({self.model.tiny.max_position_embeddings}) is too small for "
                f"grpo.max_completion_length ({g.max_completion_length}) plus a prompt"
            )
        producer = a.use_data_producer or a.async_prefetch or g.use_vllm
        for name, on in (("vllm_importance_sampling_correction", a.vllm_importance_sampling_correction),
                         ("off_policy_mask_threshold", a.off_policy_mask_threshold is not None)):
            if on and not producer:
                raise ValueError(
                    f"async.{name} corrects for a generator whose weights lag the trainer's: it needs "
                    "async.use_data_producer (or async_prefetch) or grpo.use_vllm"
                )
        if a.async_prefetch and a.vllm_sync_interval > a.max_staleness:
            raise ValueError(
                f"async.vllm_sync_interval ({a.vllm_sync_interval}) > async.max_staleness ({a.max_staleness}): the "
                f"generator's weights are refreshed only every {a.vllm_sync_interval} steps, so prefetched rollouts "
                f"come from policies up to that many versions old and those older than max_staleness are dropped and "
                f"generated again (the prefetch is wasted): set async.vllm_sync_interval <= async.max_staleness"
            )
        if a.replay_buffer_size and g.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "async.replay_buffer_size needs grpo.multi_objective_aggregation 'sum_then_normalize': replayed groups' "
                "advantages are recomputed from their summed rewards"
            )
        if s.sequence_parallel_degree > 1:
            raise ValueError(
                f"sampling.sequence_parallel_degree={s.sequence_parallel_degree}: sequence-parallel attention "
                "(ring/Ulysses) is not available in this backend (trl.GRPOTrainer rejects cp/sp > 1; CPU has no "
                "kernels); use 1. The sampler layout for it is in grpo/algo/sampling.py"
            )
        if s.world_size > 1:
            per_rank = layout.completions_per_rank
            if not layout.whole_groups_per_rank:
                raise ValueError(
                    f"with sampling.world_size > 1 each rank generates whole groups: per_device_train_batch_size x "
                    f"steps_per_generation = {per_rank} must be divisible by grpo.num_generations ({g.num_generations})"
                )
        return self

    def _async_vllm_rules(self) -> None:
        """Async rollouts with ``grpo.use_vllm``: only a vLLM server on its own GPU can generate while the trainer
        trains (grpo/training/rollout_engines.py)."""
        g, s = self.grpo, self.sampling
        if g.vllm_mode == "colocate":
            raise ValueError(
                "async.use_data_producer (or async_prefetch) with grpo.use_vllm and grpo.vllm_mode 'colocate': a "
                "colocated vLLM shares the trainer's GPU and generates inside the training step, so it can not run "
                "ahead of training: set grpo.vllm_mode: server (trl vllm-serve on its own GPU), or turn async off "
                "(TRL's synchronous colocated generation)"
            )
        if s.world_size > 1:
            raise ValueError(
                f"async.use_data_producer (or async_prefetch) with grpo.use_vllm in server mode and "
                f"sampling.world_size ({s.world_size}) > 1: one trainer process owns the vLLM server's weight-sync "
                "group and the rollouts' policy versions, and async generation for several processes is not "
                "implemented: use sampling.world_size: 1, or turn async off (TRL's synchronous server mode)"
            )

    def _loss_layout_rules(self) -> None:
        """Loss options that must mean the same whatever the micro-batch layout (chunks, token-budget balancing).

        ``num_generations_chunks`` is exact for every loss type and TRL's static entropy options (chunk weights,
        one entropy mask per micro-batch, see ``GRPOTrainer._chunked_loss``). Token-budget micro-batches are exact
        where the loss is a mean over sequences or normalised by the generation batch's token count (weights
        ``rows / per_device_train_batch_size``, see ``GRPOTrainer.compute_policy_loss``); what depends on which
        completions share a micro-batch can not be reweighted and is refused here.
        """
        g, s = self.grpo, self.sampling
        entropy_coef = g.extra.get("entropy_coef", 0.0)
        adaptive = bool(g.extra.get("use_adaptive_entropy", False))
        quantile = g.extra.get("top_entropy_quantile", 1.0)
        if adaptive and g.num_generations_chunks > 1:
            raise ValueError(
                f"grpo.extra.use_adaptive_entropy with grpo.num_generations_chunks ({g.num_generations_chunks}) > 1: "
                "TRL's adaptive entropy controller updates entropy_coef on every loss call at the optimizer-step "
                "boundary, so with chunks it would update once per chunk instead of once per step: use "
                "num_generations_chunks: 1, or a static grpo.extra.entropy_coef (exact with chunks)"
            )
        if not (s.seqlen_balancing and s.world_size > 1):
            return
        if g.loss_type == "bnpo":
            raise ValueError(
                "grpo.loss_type 'bnpo' with sampling.seqlen_balancing: bnpo divides each micro-batch's loss by that "
                "micro-batch's own token count, so every completion's weight depends on which completions share its "
                "micro-batch and rank; balancing regroups them into token budgets, and no per-micro-batch weight "
                "gives back the unbalanced gradient: use loss_type 'dapo' (normalised by the generation batch's "
                "token count, unchanged by balancing), 'grpo' or 'dr_grpo' (exact), or turn seqlen_balancing off"
            )
        if entropy_coef != 0.0 or adaptive:
            raise ValueError(
                "grpo.extra.entropy_coef / use_adaptive_entropy with sampling.seqlen_balancing: TRL's entropy bonus "
                "is a token mean per micro-batch, so each token's weight depends on which completions share its "
                "micro-batch and rank; balancing regroups them into token budgets and changes the bonus' gradient: "
                "turn seqlen_balancing off, or drop the entropy bonus"
            )
        steps = self.batch_layout.steps_per_generation
        if quantile < 1.0 and steps > 1:
            raise ValueError(
                f"grpo.extra.top_entropy_quantile ({quantile}) with sampling.seqlen_balancing and {steps} micro-batches "
                "per generation batch (steps_per_generation): TRL takes the entropy quantile over each micro-batch "
                "(all ranks), so the masked tokens depend on which completions share a micro-batch; balancing "
                "regroups them into token budgets: use steps_per_generation 1 (then the quantile is over the whole "
                "generation batch, which balancing only redistributes), or turn seqlen_balancing off"
            )

    @property
    def batch_layout(self) -> BatchLayout:
        """World size, per-device batch, steps per generation, prompts per rank and round (TRL's derivation)."""
        return batch_layout(self)

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per generation round across all ranks (TRL's derivation)."""
        return self.batch_layout.generation_batch_size


# ---------------------------------------------------------------- loading


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if p != "__root__")
        if e["type"] == "extra_forbidden":
            parts.append(f"{loc}: unknown field{_suggest(e['loc'])}")
        elif e["type"] == "missing":
            parts.append(f"{loc}: required field missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            head, sep, rest = msg.partition(": ")
            if sep and loc and head.isidentifier():  # "source: ..." raised inside section "data" -> "data.source: ..."
                loc, msg = f"{loc}.{head}", rest
            got = e.get("input")
            shown = f" (got {got!r})" if got is not None and not isinstance(got, dict) and e["type"] != "value_error" else ""
            parts.append(f"{loc}: {msg}{shown}" if loc else msg)
    return "; ".join(parts)


def _suggest(loc: tuple) -> str:
    model: type[BaseModel] = ExperimentConfig
    for part in loc[:-1]:
        fields = {f.alias or n: f for n, f in model.model_fields.items()}
        field = fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return ""
        model = field.annotation
    names = [f.alias or n for n, f in model.model_fields.items()]
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f"; valid fields: {', '.join(names)}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """``grpo.learning_rate=3e-4`` -> (["grpo", "learning_rate"], 0.0003); values are parsed as YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected key=value, e.g. grpo.learning_rate=3e-4")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set {item!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _is_section(path: list[str]) -> bool:
    model: type[BaseModel] = ExperimentConfig
    for part in path:
        field = {f.alias or n: f for n, f in model.model_fields.items()}.get(part)
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return False
        model = field.annotation
    return True


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Set each ``key=value``. A mapping given for a whole section is merged into it field by field; an empty one
    (``grpo={}``) is refused, since replacing the section would silently reset all its fields to defaults."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part} is not a section")
            node = child
        if isinstance(value, dict) and _is_section(path):
            if not value:
                raise ConfigError(f"--set {item!r}: an empty mapping would reset section {'.'.join(path)} to its "
                                  f"defaults; set fields one by one ({'.'.join(path)}.FIELD=VALUE)")
            current = node.get(path[-1])
            node[path[-1]] = {**current, **value} if isinstance(current, dict) else value
        else:
            node[path[-1]] = value
    return data


def config_from_dict(data: dict, source: str = "config") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_validation_error(err)}") from None


def read_text_file(path: Path) -> str:
    """A config file's text; a file that is not UTF-8 is a :class:`ConfigError` naming the line, not a traceback."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (line {line}: byte {data[err.start]:#04x}); save it as UTF-8") from None


# ---------------------------------------------------------------- presets (package data: grpo/presets/)

# Where ExperimentConfig() differs from the tiny preset, and why (tests/test_config.py checks every other field).
DEFAULTS_NOT_FROM_TINY: dict[str, str] = {
    "model.warm_start.carry_error_rate": "0: imperfect demonstrations are the tiny experiment's choice, and any other "
    "value is refused for non-synthetic data",
    "evaluation.num_prompts": "null (every held-out prompt) for any dataset; tiny caps it at its 500",
    "tracking.backend": "'none': a bare config writes only its run directory; tiny tracks into MLflow",
    "tracking.experiment_name": "'grpo' for any experiment; tiny logs under 'grpo-tiny'",
}

PRESETS_PACKAGE = "grpo"
PRESETS_FOLDER = "presets"
DEFAULT_PRESET = "tiny"  # the starting values of run forms (grpo serve, the pipeline flow's config parameter)


def _preset_dir(kind: str = "") -> Traversable:
    folder = resources.files(PRESETS_PACKAGE).joinpath(PRESETS_FOLDER)
    return folder.joinpath(kind) if kind else folder


def presets(kind: str = "") -> list[str]:
    """Names of the presets shipped with the package: experiment configs (``tiny``, ``qwen2.5-0.5b-gsm8k``) in
    ``grpo/presets/``, or with ``kind="spaces"`` the sweep search spaces in ``grpo/presets/spaces/``."""
    folder = _preset_dir(kind)
    if not folder.is_dir():
        return []
    return sorted(f.name[: -len(".yaml")] for f in folder.iterdir() if f.is_file() and f.name.endswith(".yaml"))


def preset_file(name: str, kind: str = "") -> Traversable:
    """The packaged YAML of preset ``name`` (read it with ``.read_text()``; it need not be a file on disk)."""
    if name not in presets(kind):
        what = "space preset" if kind == "spaces" else "preset"
        raise ConfigError(f"unknown {what} {name!r}; valid: {', '.join(presets(kind))}")
    return _preset_dir(kind).joinpath(f"{name}.yaml")


def _looks_like_name(value: str) -> bool:
    return "/" not in value and "\\" not in value and not value.endswith((".yaml", ".yml", ".json"))


def _config_source(path: str | Path) -> tuple[str, str]:
    """(YAML text, name for messages) of a config file, else of the preset of that name."""
    file = Path(path)
    if file.is_file():
        return read_text_file(file), str(file)
    name = str(path)
    if name in presets():
        return preset_file(name).read_text(encoding="utf-8"), f"preset {name}"
    hint = f"; or a preset name: {', '.join(presets())}" if _looks_like_name(name) else ""
    raise ConfigError(f"config file not found: {file}{hint}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                settings: dict | None = None) -> ExperimentConfig:
    """Read YAML from a file or a preset (a name from :func:`presets`, e.g. ``tiny``; a file of that name wins), or
    the built-in defaults when ``path`` is None; merge ``settings`` (a nested mapping, what a run form's fields set),
    apply ``--set`` overrides, validate."""
    data: dict = {}
    source = "defaults"
    if path is not None:
        text, source = _config_source(path)
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ConfigError(f"{source}: YAML syntax error{where}: {problem}") from None
        if loaded is None:
            raise ConfigError(f"{source}: the file is empty (no sections); write the settings to change, or start "
                              f"from a preset such as `--config tiny` ({', '.join(presets())})")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: top level must be a mapping of sections (data, model, grpo, ...)")
        data = loaded
    data = apply_overrides(merge_settings(data, settings or {}), overrides or [])
    return config_from_dict(data, source)


def merge_settings(data: dict, settings: dict) -> dict:
    """``data`` with the fields of ``settings`` set one by one, section into section (a partial section changes only
    the fields it names)."""
    for key, value in settings.items():
        current = data.get(key)
        if isinstance(value, dict) and isinstance(current, dict):
            data[key] = merge_settings(dict(current), value)
        else:
            data[key] = value
    return data


def _is_preset(config: ExperimentConfig, preset: str) -> bool:
    try:
        return config == load_config(preset)
    except ConfigError:  # the preset needs an override to load here (qwen2.5-0.5b-gsm8k without vllm)
        return False


def resolve_config(config: ExperimentConfig | dict | None, preset: str | None = None,
                   overrides: list[str] | None = None, settings: dict | None = None) -> ExperimentConfig:
    """What a form submits: a preset (replacing ``config``; neither means :data:`DEFAULT_PRESET`), then the fields the
    form sets (``settings``, a nested mapping) and ``key=value`` overrides on top.

    A deployment that names a preset keeps it among its parameters; a run of it that also brings a config of its own
    (an edited form, an API call, a sweep trial) would silently train the preset instead, so a config that is neither
    the form's default (:data:`DEFAULT_PRESET`) nor the preset itself is refused next to a preset. A mapping (a flow
    run's JSON parameter) is validated as a config first."""
    if isinstance(config, dict):
        config = config_from_dict(config, "config")
    if preset is not None:
        if preset not in presets():
            raise ConfigError(f"preset: unknown preset {preset!r}; valid: {', '.join(presets())}")
        chosen = load_config(preset, overrides, settings)
        if config is not None and config not in (load_config(DEFAULT_PRESET), chosen) and not _is_preset(config, preset):
            raise ConfigError(
                f"preset: {preset!r} replaces the whole config, but a changed config was given too; set preset to "
                "null to run that config, or keep the preset and change fields with the form's fields or overrides "
                "(key=value)"
            )
        return chosen
    if config is None:
        return load_config(DEFAULT_PRESET, overrides, settings)
    if overrides or settings:
        data = apply_overrides(merge_settings(config.model_dump(mode="json", by_alias=True), settings or {}),
                               overrides or [])
        return config_from_dict(data, "overrides" if not settings else "run form")
    return config


def to_yaml(config: ExperimentConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)


def flatten(config: ExperimentConfig) -> dict[str, Any]:
    """Dotted keys for every field (e.g. ``grpo.learning_rate``): MLflow params and sweep spaces use these."""
    out: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", config.model_dump(mode="json", by_alias=True))
    return out
