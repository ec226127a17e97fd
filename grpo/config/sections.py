"""The config's schema: one pydantic model per YAML section (``data``, ``model``, ``sampling``, ``grpo``, ``async``,
``evaluation``, ``tracking``), each with the checks that need only its own fields, and :class:`ExperimentConfig`, which
holds them, runs the rules across them when it loads and derives the batch layout once (:mod:`grpo.algo.batch_layout`).

Field names are what TRL's and axolotl's users type (``trl.GRPOConfig``, axolotl's ``trl:`` block); attribute
docstrings and ``description`` texts become the Prefect form's help under each field. Checks that read TRL or the reward
registry are in :mod:`grpo.config.trl_and_rewards`; rules across sections in :mod:`grpo.config.rules`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from grpo.algo.batch_layout import BatchLayout
from grpo.config.rules import check_rules
from grpo.config.trl_and_rewards import (
    agent_enum,
    check_extra_fields,
    check_report_to,
    environment_enum,
    reward_enum,
    tool_enum,
    trl_help,
)

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]
ScaleRewards = Literal["group", "batch", "none"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
EnvironmentProtocol = Literal["text", "chat"]


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
        "column-by-column work, ~17 tokens: a reasoning-style, generation-heavy task), 'synthetic:guess_digit' "
        "(a hidden digit per row, for the guess_digit environment), a local "
        ".jsonl/.json/.parquet/.csv file, or 'hub:DATASET_ID' (downloads).",
    )
    hub_config: str | None = Field(None, description="Dataset config name for hub sources (e.g. 'main' for GSM8K).")
    train_split: str = Field("train", description="Split used for training (hub sources).")
    eval_split: str = Field("test", description="Held-out split used for evaluation (hub sources).")
    eval_fraction: float = Field(0.1, gt=0, lt=1, description="Held-out fraction for single-file sources.")
    prompt_column: str = Field("prompt", description="Column holding the prompt text.")
    answer_column: str = Field("answer", description="Column holding the reference answer.")
    answer_regex: str | None = Field(
        None,
        description="Regex with one group extracting the final answer from the answer column (GSM8K: '#### (.*)').",
    )
    prompt_format: Literal["plain", "chat"] = Field(
        "plain", description="'chat' wraps text prompts as user messages; prompts given as message lists (TRL's "
        "conversational format) are used as they are, with either value.")
    system_prompt: str | None = Field(None, description="System message prepended in chat format.")
    max_prompt_chars: int = Field(
        4096, ge=1, description="Prep: longer prompts (before chat wrapping) are quarantined.")
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
        if s == "synthetic:guess_digit":
            from grpo.tasks import GUESS_DIGIT_IDS

            if self.num_train + self.num_eval > GUESS_DIGIT_IDS:
                raise ValueError(f"num_train: num_train + num_eval = {self.num_train + self.num_eval} exceeds the "
                                 f"{GUESS_DIGIT_IDS} distinct synthetic:guess_digit rows")
        elif self.synthetic and self.num_train + self.num_eval > (self.max_operand + 1) ** 2:
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
        "model-merged/ folder) and, with tracking.log_model, log it to MLflow as '<run name>-merged'. The run's model/ "
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
                f"sequence_parallel_degree: world_size ({self.world_size}) must be divisible by "
                f"sequence_parallel_degree ({self.sequence_parallel_degree}); valid degrees: "
                f"{[d for d in range(1, self.world_size + 1) if self.world_size % d == 0]}"
            )
        return self

LRScheduler = Literal[
    "constant", "constant_with_warmup", "linear", "cosine", "cosine_with_restarts", "cosine_with_min_lr", "polynomial",
    "inverse_sqrt", "warmup_stable_decay",
]


class GRPOSection(_Section):
    """GRPO training; every name is the ``trl.GRPOConfig`` field of the same name."""

    model_config = ConfigDict(**_Section.model_config, json_schema_extra=trl_help)

    learning_rate: float = Field(1e-4, gt=0)
    max_steps: int = Field(150, ge=1, description="Optimizer steps.")
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
        ["exact_match"], min_length=1, description="Registered reward names.", json_schema_extra=reward_enum
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
    save_steps: int = Field(50, ge=1, description="Checkpoint every N steps (resume point).")
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
        if self.extra:
            check_extra_fields(self.extra, type(self).model_fields)
        return self

    @model_validator(mode="after")
    def _report_to_installed(self) -> GRPOSection:
        if self.report_to:
            check_report_to(self.report_to)
        return self


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


class EnvironmentSection(_Section):
    """Multi-turn rollouts: the policy acts in a registered environment turn by turn, calling its tools
    (``grpo environments`` lists them). Without a name every rollout is one completion scored by the rewards."""

    name: str | None = Field(
        None,
        description="Registered environment each episode runs in (built-ins: calculator, guess_digit; openenv: one "
        "behind an OpenEnv server; tool_use: protocol chat with only `tools`). Empty: single-turn completions. A "
        "dataset column `environment` routes each row to the environment it names.",
        json_schema_extra=environment_enum,
    )
    agent: str | None = Field(
        None,
        description="Registered agent each episode runs (an openai-SDK function given a client bound to its episode; "
        "built-in: calculator_agent): its calls are sampled, recorded and trained on. Sets name to 'agent' (the "
        "environment that runs agents) and kwargs.agent.",
        json_schema_extra=agent_enum,
    )
    kwargs: dict[str, Any] = Field(
        {}, description="Keyword arguments of the environment, e.g. {tool: off} for calculator (TRL's "
        "environment_factory arguments)."
    )
    tools: list[str] = Field(
        [], description="Registered tools offered to the model besides the environment's own (TRL's tools=).",
        json_schema_extra=tool_enum,
    )
    protocol: EnvironmentProtocol = Field(
        "text",
        description="'text': any tokenizer; a stop string ends a model turn and the environment's reply is appended "
        "as tokens. 'chat': TRL's tool-calling loop, for chat models whose template TRL recognises (Qwen2.5/3, "
        "Llama 3.1/3.2, ...).",
    )
    max_tool_calling_iterations: int = Field(
        3, ge=0, description="Environment replies per episode (TRL's name); an episode has at most this + 1 model "
        "turns, then it is truncated and counted."
    )
    step_timeout: float | None = Field(
        60.0, gt=0, description="Seconds an environment's reset or step may take; past it the episode scores NaN "
        "(left out of its group's statistics) and training goes on. Empty: no limit."
    )
    max_concurrency: int = Field(16, ge=1, description="Environment steps run at once (a bounded thread pool).")
    trace_episodes_per_log: int = Field(
        4, ge=0, description="Episodes written to MLflow as traces per logging interval (the first ones of the "
        "interval's first generation batch, main process): an agent span with one span per model turn and per tool "
        "call, written off the training thread. 0: none."
    )

    @model_validator(mode="before")
    @classmethod
    def _agent_runs_in_agent_environment(cls, data: Any) -> Any:
        """``agent: x`` is ``name: agent`` with ``kwargs.agent: x`` (and the other way round), so every rollout
        path builds the agent's episodes as it builds any environment's."""
        if not isinstance(data, dict):
            return data
        agent, name, kwargs = data.get("agent"), data.get("name"), dict(data.get("kwargs") or {})
        if agent is None and name == "agent" and isinstance(kwargs.get("agent"), str):
            agent = kwargs["agent"]
        if agent is None:
            return data
        if name not in (None, "agent"):
            raise ValueError(f"environment.agent {agent!r} runs in the environment 'agent'; environment.name is "
                             f"{name!r}: leave it empty")
        if kwargs.get("agent", agent) != agent:
            raise ValueError(f"environment.agent is {agent!r} but environment.kwargs.agent is {kwargs['agent']!r}; "
                             "set environment.agent only")
        return {**data, "agent": agent, "name": "agent", "kwargs": {"agent": agent, **kwargs}}

    @property
    def enabled(self) -> bool:
        return self.name is not None

    @property
    def is_chat(self) -> bool:
        """A named environment whose episodes TRL's tool loop runs (protocol chat)."""
        return self.enabled and self.protocol == "chat"

    @property
    def is_text(self) -> bool:
        """A named environment whose episodes the platform's episode runner runs (protocol text)."""
        return self.enabled and self.protocol == "text"

    @property
    def max_turns(self) -> int:
        """Model turns per episode: one, then one after each environment reply."""
        return self.max_tool_calling_iterations + 1


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
        "exact_match", description="Reward whose full marks (>= 1) count as correct (with an environment: the "
        "environment's own reward instead).", json_schema_extra=reward_enum
    )
    environment_variants: dict[str, dict[str, Any]] = Field(
        {}, description="With an environment: more greedy evaluations, each with the environment's kwargs "
        "overridden, by name, e.g. {tool_off: {tool: off}} for calculator reports eval/env/tool_off/accuracy, "
        "turns_mean, tool_call_rate before and after training."
    )

    @field_validator("environment_variants")
    @classmethod
    def _variant_names(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name in value:  # a metric name's part: eval/env/<name>/accuracy
            if not name.isidentifier():
                raise ValueError(f"environment_variants: {name!r} is not a valid variant name; use letters, digits "
                                 "and _ (it becomes part of the metric name eval/env/<name>/accuracy)")
        return value


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
    environment: EnvironmentSection = EnvironmentSection()
    """Multi-turn rollouts in a registered environment, with tools."""
    evaluation: EvaluationConfig = EvaluationConfig()
    """Held-out evaluation before and after training."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow tracking."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ExperimentConfig:
        check_rules(self)
        return self

    @property
    def batch_layout(self) -> BatchLayout:
        """World size, per-device batch, steps per generation, prompts per rank and round (TRL's derivation)."""
        # The layout of this config: its ``grpo`` batch fields and ``sampling`` world.
        g, s = self.grpo, self.sampling
        return BatchLayout.derive(
            world_size=s.world_size,
            sequence_parallel_degree=s.sequence_parallel_degree,
            per_device_train_batch_size=g.per_device_train_batch_size,
            gradient_accumulation_steps=g.gradient_accumulation_steps,
            num_generations=g.num_generations,
            num_iterations=g.num_iterations,
            generation_batch_size=g.generation_batch_size,
            steps_per_generation=g.steps_per_generation,
        )

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per generation round across all ranks (TRL's derivation)."""
        return self.batch_layout.generation_batch_size
