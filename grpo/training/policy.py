"""Build or load the policy (model + tokenizer), caching the tiny default on disk so reruns skip it.

The cache key covers everything that determines the artefact (model shape, warm start, data, alphabet, code
version), so changing a GRPO field reuses the warm-started model while changing the data rebuilds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import DatasetDict
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import ExperimentConfig
from grpo.environments.chat import config_chat_tools
from grpo.errors import ConfigError
from grpo.paths import cache_root, locked
from grpo.tasks import calculator_demonstrations, flawed_addition_demonstrations, guess_digit_demonstrations
from grpo.training.graceful_stop import stop_requested
from grpo.training.prompts import prompt_texts
from grpo.training.tiny_model import alphabet_of, build_char_tokenizer, build_tiny_qwen2
from grpo.training.warm_start import supervised_warm_start

CACHE_VERSION = 1  # bump when the tiny model/tokenizer/warm-start code changes meaning


@dataclass
class Policy:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str  # where it came from: a cache path or a hub id
    cached: bool  # True when a cached artefact was reused
    build_seconds: float
    warm_start_losses: list[float]


def tiny_cache_key(cfg: ExperimentConfig, alphabet: str) -> str:
    payload = {
        "version": CACHE_VERSION,
        "tiny": cfg.model.tiny.model_dump(),
        "warm_start": cfg.model.warm_start.model_dump(),
        "data": cfg.data.model_dump(),
        "alphabet": alphabet,
        "seed": cfg.grpo.seed,
    }
    if cfg.environment.enabled:  # the warm start demonstrates the environment's episodes
        payload["environment"] = cfg.environment.name
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# Building or loading a model, and training one, is one thread at a time per process. Sweep trials run as threads
# of one process, and transformers keeps process-global state around both: a model loaded while another thread
# loaded one came out with meta tensors ("Cannot copy out of meta tensor"), and every GRPOConfig resets accelerate's
# AcceleratorState under a trainer already running ("no attribute num_processes"). Re-entrant: training loads.
MODEL_LOCK = threading.RLock()


@contextlib.contextmanager
def model_turn(echo=print):
    """Hold :data:`MODEL_LOCK`; say so when another thread has it (a sweep trial waiting for another one)."""
    if not MODEL_LOCK.acquire(blocking=False):
        echo("waiting for another training or model load in this process to finish (one at a time per process)")
        MODEL_LOCK.acquire()
    try:
        if stop_requested():  # the process is stopping (an interrupted sweep): a waiting trial does not start
            raise KeyboardInterrupt
        yield
    finally:
        MODEL_LOCK.release()


def load_policy(cfg: ExperimentConfig, data: DatasetDict, log=print) -> Policy:
    with model_turn(log):
        return _load_policy(cfg, data, log)


def _load_policy(cfg: ExperimentConfig, data: DatasetDict, log=print) -> Policy:
    if cfg.model.is_tiny:
        return _tiny_policy(cfg, data, log)
    start = time.perf_counter()
    dtype = "auto" if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    tokenizer = load_tokenizer(cfg)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    kwargs = {"dtype": dtype}
    if cfg.model.attn_implementation:
        kwargs["attn_implementation"] = cfg.model.attn_implementation
    model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, **kwargs)
    losses: list[float] = []
    if cfg.model.warm_start.steps:
        ws = cfg.model.warm_start
        prompts, answers = warm_start_pairs(data, cfg, tokenizer)
        losses = supervised_warm_start(
            model, tokenizer, prompts, answers, ws.steps, ws.batch_size, ws.learning_rate, cfg.grpo.seed,
        )
    return Policy(model, tokenizer, cfg.model.name_or_path, False, time.perf_counter() - start, losses)


def _tiny_policy(cfg: ExperimentConfig, data: DatasetDict, log) -> Policy:
    """The warm-started tiny model of this config, from the cache or built into it. Built under the entry's lock, so
    processes that need the same model at once (ranks, sweep trials, parallel tests) build it once: the first
    builds, the others wait and load it."""
    start = time.perf_counter()
    alphabet = policy_alphabet(data, cfg)
    path = cache_root() / f"tiny-{tiny_cache_key(cfg, alphabet)}"
    if not (path / "done.json").is_file():
        with locked(path):
            if not (path / "done.json").is_file():
                return _build_tiny_policy(cfg, data, alphabet, path, start, log)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    losses = json.loads((path / "done.json").read_text())["warm_start_losses"]
    log(f"policy: reusing cached tiny model {path}")
    return Policy(model, tokenizer, str(path), True, time.perf_counter() - start, losses)


def _build_tiny_policy(cfg: ExperimentConfig, data: DatasetDict, alphabet: str, path: Path, start: float,
                       log) -> Policy:
    t, ws = cfg.model.tiny, cfg.model.warm_start
    tokenizer = build_char_tokenizer(alphabet)
    model = build_tiny_qwen2(
        tokenizer, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.intermediate_size,
        t.max_position_embeddings, cfg.grpo.seed,
    )
    n_params = sum(p.numel() for p in model.parameters())
    log(f"policy: built tiny Qwen2 ({n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}); "
        f"warm start {ws.steps} steps")
    losses = _warm_start_with_progress(model, tokenizer, data, cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "done.json").write_text(json.dumps({"warm_start_losses": losses, "parameters": n_params}))
    try:
        tmp.rename(path)  # atomic: a reader never sees a half-written model (a cache without the lock, e.g. NFS)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    # As if loaded from the cache: TRL builds the reference model (beta > 0) from the policy config's name_or_path.
    model.name_or_path = model.config._name_or_path = str(path)
    return Policy(model, tokenizer, str(path), False, time.perf_counter() - start, losses)


def warm_start_pairs(data: DatasetDict, cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase
                     ) -> tuple[list[str], list[str]]:
    """(prompt texts, demonstrated completions) for the warm start; see ``model.warm_start.carry_error_rate``.
    Conversational prompts are rendered with the chat template, as GRPO will generate from them.

    The embedded environments on their synthetic tasks are demonstrated as episodes: ``calculator`` on
    ``synthetic:addition`` mostly answers directly and rarely calls its tool (:func:`calculator_demonstrations`),
    ``guess_digit`` on ``synthetic:guess_digit`` searches sloppily (:func:`guess_digit_demonstrations`)."""
    tools = config_chat_tools(cfg.environment)  # protocol chat: TRL renders every prompt with its tools
    prompts, answers = prompt_texts(data["train"]["prompt"], tokenizer, tools), list(data["train"]["answer"])
    rate, source, env = cfg.model.warm_start.carry_error_rate, cfg.data.source, cfg.environment.name
    if env == "calculator" and source == "synthetic:addition":
        return calculator_demonstrations(prompts, answers, rate, seed=cfg.data.seed)
    if env == "guess_digit" and source == "synthetic:guess_digit":
        return prompts, guess_digit_demonstrations(answers, seed=cfg.data.seed)
    if rate > 0 and source in ("synthetic:addition", "synthetic:addition_cot"):  # the tiny task's knob; other data
        answers = flawed_addition_demonstrations(prompts, answers, rate, seed=cfg.data.seed,  # is demonstrated as given
                                                  worked=cfg.data.worked_answers)
    return prompts, answers


def policy_alphabet(data: DatasetDict, cfg: ExperimentConfig) -> str:
    """The tiny tokenizer's characters: the data's, and those of every environment the run can use (the config's
    and those a row's ``environment`` column names) and its tools, so their observations and syntax are encodable
    and writable by the policy (``Environment.alphabet``)."""
    alphabet = alphabet_of(data)
    env = cfg.environment
    if env.enabled:
        from grpo.environments import ROUTING_COLUMN, environment_alphabet

        names = {env.name, *(n for split in data.values() if ROUTING_COLUMN in split.column_names
                             for n in split[ROUTING_COLUMN] if n)}
        alphabet = "".join(sorted(set(alphabet) | set(environment_alphabet(sorted(names), env.tools))))
    return alphabet


def _warm_start_with_progress(model, tokenizer, data: DatasetDict, cfg: ExperimentConfig) -> list[float]:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    ws = cfg.model.warm_start
    prompts, answers = warm_start_pairs(data, cfg, tokenizer)
    with Progress(
        TextColumn("warm start"), BarColumn(), TextColumn("{task.completed}/{task.total} loss {task.fields[loss]:.3f}"),
        TimeRemainingColumn(), transient=True,
        disable=not Console().is_terminal,  # a bar for a terminal; in a log or pipe it left a stray blank line
    ) as progress:
        task = progress.add_task("warm", total=ws.steps, loss=float("nan"))
        return supervised_warm_start(
            model, tokenizer, prompts, answers, ws.steps, ws.batch_size, ws.learning_rate, cfg.grpo.seed,
            on_step=lambda step, loss: progress.update(task, completed=step + 1, loss=loss),
        )


def load_tokenizer(cfg: ExperimentConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer with ``model.chat_template`` in place of its own, when set."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    template = cfg.model.chat_template_text()
    if template:
        tokenizer.chat_template = template
    return tokenizer


def plan_tokenizer(cfg: ExperimentConfig) -> Any | None:
    """The tokenizer prompt lengths are counted with: None (characters) for the tiny model, the model's otherwise."""
    if cfg.model.is_tiny:
        return None
    try:
        return load_tokenizer(cfg)
    except Exception as err:  # missing files, offline hub, unknown id: all user-facing
        name = cfg.model.name_or_path
        raise ConfigError(f"model.name_or_path {name!r}: could not load its tokenizer: {err}") from None


def trained_policy(model_dir: Path) -> Policy:
    """The model a training stage saved, for evaluation: a full model, or a LoRA adapter (``model.lora``) loaded
    onto its base and merged into it, so evaluation generates with the adapted policy at the plain model's speed."""
    with MODEL_LOCK:
        dtype = "auto" if torch.cuda.is_available() else torch.float32
        if is_adapter_dir(model_dir):
            model = load_adapted(model_dir, dtype).merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return Policy(model, AutoTokenizer.from_pretrained(model_dir), str(model_dir), True, 0.0, [])


# ---------------------------------------------------------------- LoRA adapters (model.lora)


def is_adapter_dir(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds a peft adapter (what a ``model.lora`` run saves) rather than a full model."""
    return (Path(model_dir) / "adapter_config.json").is_file()


def name_adapter_base(model, source: str) -> None:
    """Name the base in the adapter's config as the absolute path of a local model folder (the tiny model's cache
    entry, a model folder given as ``model.name_or_path``) or the hub id, so the saved adapter loads from any working
    directory (peft records the base's ``name_or_path``, which may be relative)."""
    base = Path(source)
    name = str(base.resolve()) if base.is_dir() else source
    for config in model.peft_config.values():
        config.base_model_name_or_path = name


def load_adapted(model_dir: str | Path, dtype: Any = "auto"):
    """The ``peft.PeftModel`` saved in ``model_dir``: its base (named in the adapter config) with the adapter applied.
    Not peft's ``AutoPeftModelForCausalLM``: that resizes the base's embeddings to ``len(tokenizer)`` when a tokenizer
    sits beside the adapter, and the tiny model's tokenizer counts one token more than its vocabulary."""
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(str(model_dir)).base_model_name_or_path
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
    return PeftModel.from_pretrained(model, str(model_dir))


def save_merged_model(adapter_dir: Path, out_dir: Path) -> Path:
    """Write the adapter in ``adapter_dir`` merged into its base (``merge_and_unload``) as a plain transformers model
    with the tokenizer, into ``out_dir`` (replaced atomically). Loaded from disk, so the trainer's model is
    untouched."""
    with MODEL_LOCK:
        merged = load_adapted(adapter_dir, "auto").merge_and_unload()
        tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    merged.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
