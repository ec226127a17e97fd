"""Build or load the policy (model + tokenizer), caching the tiny default on disk so reruns skip it.

The cache key covers everything that determines the artefact (model shape, warm start, data, alphabet, code
version), so changing a GRPO field reuses the warm-started model while changing the data rebuilds it. The tiny
presets' own models ship with the package (:func:`shipped_policies`): their first run copies one into the cache.
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
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

import torch
from datasets import DatasetDict
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from grpo.config import ExperimentConfig
from grpo.environments.chat import config_chat_tools
from grpo.errors import ConfigError
from grpo.paths import cache_root, locked
from grpo.tasks import calculator_demonstrations, flawed_addition_demonstrations, guess_digit_demonstrations
from grpo.training.graceful_stop import stop_requested
from grpo.training.prompts import prompt_texts
from grpo.training.tiny_model import alphabet_of, build_char_tokenizer, build_tiny_qwen2, load_tokenizer_from
from grpo.training.warm_start import (
    FasterThreads,
    Report,
    WarmStartProgress,
    intra_op_threads,
    supervised_warm_start,
)

CACHE_VERSION = 1  # bump when the tiny model/tokenizer/warm-start code changes meaning (then rebuild the shipped
# models: python -m grpo.pipeline.shipped_policies)


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
    if cfg.environment.enabled:  # the warm start demonstrates the environment's episodes (an agent's: its task's)
        payload["environment"] = task_environment_name(cfg)
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
        losses = _warm_start(model, tokenizer, data, cfg, log)
    return Policy(model, tokenizer, cfg.model.name_or_path, False, time.perf_counter() - start, losses)


def tiny_policy_entry(cfg: ExperimentConfig, data: DatasetDict) -> Path:
    """The cache entry of this config's warm-started tiny model (built or not)."""
    return cache_root() / f"tiny-{tiny_cache_key(cfg, policy_alphabet(data, cfg))}"


def shipped_policies() -> Traversable:
    """The folder of the warm-started tiny models that ship with the package (``grpo/presets/policies/``): the tiny
    presets' own, one folder per cache entry (``tiny-<key>``), so a preset's first run copies its model instead of
    warm-starting one. ``python -m grpo.pipeline.shipped_policies`` rebuilds them."""
    return resources.files("grpo").joinpath("presets", "policies")


def build_tiny_policy(cfg: ExperimentConfig, data: DatasetDict, log=print, report: Report | None = None,
                      use_shipped: bool = True) -> dict[str, Any]:
    """The pipeline's ``policy`` stage for the tiny model: its cache entry, filled when missing (once per model, data
    and environment; the stages after this one load it): copied from :func:`shipped_policies` for a tiny preset,
    otherwise built and warm-started, its progress through ``log`` and ``report``
    (:class:`~grpo.training.warm_start.WarmStartProgress`). Returns ``source`` (the entry), ``origin`` (``built``,
    ``shipped``: copied now, or ``cache``: there already), ``seconds`` and the warm start's ``warm_start_steps``,
    ``loss_first`` and ``loss_last``. ``use_shipped``: False builds the model even when one ships (to rebuild
    those)."""
    start = time.perf_counter()
    path = tiny_policy_entry(cfg, data)
    with model_turn(log):
        origin, _ = _fill_entry(cfg, data, path, start, log, report, use_shipped)
    losses = json.loads((path / "done.json").read_text())["warm_start_losses"]
    return {"source": str(path), "origin": origin, "seconds": round(time.perf_counter() - start, 2),
            "warm_start_steps": len(losses), "loss_first": losses[0] if losses else None,
            "loss_last": losses[-1] if losses else None}


def _tiny_policy(cfg: ExperimentConfig, data: DatasetDict, log) -> Policy:
    """The warm-started tiny model of this config, from the cache or put into it (:func:`_fill_entry`)."""
    start = time.perf_counter()
    path = tiny_policy_entry(cfg, data)
    origin, built = _fill_entry(cfg, data, path, start, log)
    if built is not None:
        return built
    tokenizer = load_tokenizer_from(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    losses = json.loads((path / "done.json").read_text())["warm_start_losses"]
    log(f"policy: tiny model shipped with the platform, copied into {path}" if origin == "shipped"
        else f"policy: reusing cached tiny model {path}")
    return Policy(model, tokenizer, str(path), True, time.perf_counter() - start, losses)


def _fill_entry(cfg: ExperimentConfig, data: DatasetDict, path: Path, start: float, log,
                report: Report | None = None, use_shipped: bool = True) -> tuple[str, Policy | None]:
    """Fill the cache entry ``path`` when it is missing: from the shipped models, or built (then the built policy is
    returned too, so the caller need not load it). Under the entry's lock, so processes that need the same model at
    once (ranks, sweep trials, parallel tests) fill it once: the first fills, the others wait and load it."""
    if (path / "done.json").is_file():
        return "cache", None
    with locked(path):
        if (path / "done.json").is_file():
            return "cache", None
        shipped = shipped_policies().joinpath(path.name)
        if use_shipped and shipped.joinpath("done.json").is_file():
            tmp = _new_entry(path)
            for item in shipped.iterdir():
                (tmp / item.name).write_bytes(item.read_bytes())
            _publish(tmp, path)
            return "shipped", None
        return "built", _build_tiny_policy(cfg, data, path, start, log, report)


def _build_tiny_policy(cfg: ExperimentConfig, data: DatasetDict, path: Path, start: float, log,
                       report: Report | None = None) -> Policy:
    t = cfg.model.tiny
    tokenizer = build_char_tokenizer(policy_alphabet(data, cfg))
    model = build_tiny_qwen2(
        tokenizer, t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.intermediate_size,
        t.max_position_embeddings, cfg.grpo.seed,
    )
    n_params = sum(p.numel() for p in model.parameters())
    log(f"policy: building the tiny Qwen2 ({n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)}) into {path}, "
        "once for this model, data and environment: later runs reuse it")
    losses = _warm_start(model, tokenizer, data, cfg, log, report, threads=FasterThreads())
    tmp = _new_entry(path)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "done.json").write_text(json.dumps({"warm_start_losses": losses, "parameters": n_params}))
    _publish(tmp, path)
    # As if loaded from the cache: TRL builds the reference model (beta > 0) from the policy config's name_or_path.
    model.name_or_path = model.config._name_or_path = str(path)
    return Policy(model, tokenizer, str(path), False, time.perf_counter() - start, losses)


def _new_entry(path: Path) -> Path:
    """A fresh folder beside cache entry ``path`` to write it in, then :func:`_publish` it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=path.name + ".", dir=path.parent))


def _publish(tmp: Path, path: Path) -> None:
    try:
        tmp.rename(path)  # atomic: a reader never sees a half-written model (a cache without the lock, e.g. NFS)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def warm_start_pairs(data: DatasetDict, cfg: ExperimentConfig, tokenizer: PreTrainedTokenizerBase
                     ) -> tuple[list[str], list[str]]:
    """(prompt texts, demonstrated completions) for the warm start; see ``model.warm_start.carry_error_rate``.
    Conversational prompts are rendered with the chat template, as GRPO will generate from them.

    The embedded environments on their synthetic tasks are demonstrated as episodes: ``calculator`` on
    ``synthetic:addition`` mostly answers directly and rarely calls its tool (:func:`calculator_demonstrations`),
    ``guess_digit`` on ``synthetic:guess_digit`` searches sloppily (:func:`guess_digit_demonstrations`)."""
    tools = config_chat_tools(cfg.environment)  # protocol chat: TRL renders every prompt with its tools
    prompts, answers = prompt_texts(data["train"]["prompt"], tokenizer, tools), list(data["train"]["answer"])
    rate, source, env = cfg.model.warm_start.carry_error_rate, cfg.data.source, task_environment_name(cfg)
    if env == "calculator" and source == "synthetic:addition":
        return calculator_demonstrations(prompts, answers, rate, seed=cfg.data.seed)
    if env == "guess_digit" and source == "synthetic:guess_digit":
        return prompts, guess_digit_demonstrations(answers, seed=cfg.data.seed)
    if rate > 0 and source in ("synthetic:addition", "synthetic:addition_cot"):  # the tiny task's knob; other data
        answers = flawed_addition_demonstrations(prompts, answers, rate, seed=cfg.data.seed,  # is demonstrated as given
                                                  worked=cfg.data.worked_answers)
    return prompts, answers


def task_environment_name(cfg: ExperimentConfig) -> str | None:
    """The environment whose task the run plays: ``environment.name``, or the one an agent names as its task
    (``calculator_agent`` plays calculator's: same alphabet, same warm start)."""
    env = cfg.environment
    if env.agent is None:
        return env.name
    from grpo.environments.agents import task_environment

    return task_environment(env.agent) or env.name


def policy_alphabet(data: DatasetDict, cfg: ExperimentConfig) -> str:
    """The tiny tokenizer's characters: the data's, and those of every environment the run can use (the config's
    and those a row's ``environment`` column names) and its tools, so their observations and syntax are encodable
    and writable by the policy (``Environment.alphabet``)."""
    alphabet = alphabet_of(data)
    env = cfg.environment
    if env.enabled:
        from grpo.environments import ROUTING_COLUMN, environment_alphabet

        names = {env.name, task_environment_name(cfg), *(n for split in data.values()
                                                          if ROUTING_COLUMN in split.column_names
                                                          for n in split[ROUTING_COLUMN] if n)}
        alphabet = "".join(sorted(set(alphabet) | set(environment_alphabet(sorted(names), env.tools))))
    return alphabet


def _warm_start(model, tokenizer, data: DatasetDict, cfg: ExperimentConfig, log, report: Report | None = None,
                threads: FasterThreads | None = None) -> list[float]:
    """``model.warm_start`` on ``model``, its start and progress said through ``log`` and ``report``; ``threads``
    picks torch's intra-op threads meanwhile (None: the process's)."""
    ws = cfg.model.warm_start
    if ws.steps <= 0:
        return []
    prompts, answers = warm_start_pairs(data, cfg, tokenizer)
    log(f"warm start: {ws.steps} supervised steps of {ws.batch_size} demonstrations "
        f"(of {len(prompts)}), learning rate {ws.learning_rate:g}")
    progress = WarmStartProgress(ws.steps, log, report)

    def on_step(step: int, loss: float) -> None:
        if threads is not None:
            threads(step, loss)
        progress(step, loss)

    with intra_op_threads(None):  # the process's threads again after
        progress.start()
        if threads is not None:
            threads.start()
        return supervised_warm_start(model, tokenizer, prompts, answers, ws.steps, ws.batch_size, ws.learning_rate,
                                     cfg.grpo.seed, on_step=on_step)


def load_tokenizer(cfg: ExperimentConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer with ``model.chat_template`` in place of its own, when set."""
    tokenizer = load_tokenizer_from(cfg.model.name_or_path)
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
        return Policy(model, load_tokenizer_from(model_dir), str(model_dir), True, 0.0, [])


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
    sits beside the adapter, and a tokenizer may count more tokens than the model's vocabulary."""
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
        tokenizer = load_tokenizer_from(adapter_dir)
    out_dir = Path(out_dir)
    tmp = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    merged.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
