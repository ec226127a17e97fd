"""``python -m benchmarks cuda_trainer``: the trainers on one CUDA GPU in bf16, side by side, with a Qwen2-0.5B-sized
model -- stock ``trl.GRPOTrainer`` against ours, sync against async, single-turn and multi-turn.

The CPU benchmarks (``trl_parity``, ``async_overlap``) time a 0.5M-parameter model; this one times the same code paths
where they are meant to run, so that the speed features, the async producer and the episode loop have GPU figures.
Eight variants, one after the other in one invocation, each in its own process (its own CUDA context: its timings and
peak memory are its own):

- ``trl``: stock ``trl.GRPOTrainer`` (transformers' generate, no vLLM), built as ``trl_parity`` builds it;
- ``ours``: our trainer as ``grpo run`` builds it (``run_experiment``), the default speed features on (zero-advantage
  compaction, the shared-prompt forward);
- ``ours_features_off``: ``ours`` with both default speed features off (``async.shared_prompt_forward``,
  ``async.compact_zero_advantage``), so the ours/TRL ratio splits into the features' share and the rest;
- ``env_sync``: ``ours`` on multi-turn episodes of the built-in ``guess_digit`` environment (``tiny-guess-digit``
  preset, reward ``env_reward``), the episode runner in the trainer sampling with the policy on the GPU; each row of
  a turn's batch stops at its stop string (a digit), EOS or its episode's budget while the others go on;
- ``trl_sparse`` / ``ours_sparse``: ``trl`` / ``ours`` with a sparse reward (``bench_sparse_digit_share``): the
  groups of one prompt in four score 1 for every completion and of another in four 0, as groups that are all right or
  all wrong do on real maths data, the rest the dense digit share. Their advantages are zero, so the ratio shows what
  zero-advantage compaction saves where it applies;
- ``ours_async`` / ``env_async``: ``ours`` / ``env_sync`` plus ``async.use_data_producer``, prefetch 1,
  ``max_staleness`` 1 and the IS correction (``async_overlap``'s settings). Without vLLM the rollout engine is
  ``cpu_process`` (``grpo.training.async_producer.AsyncRolloutProducer``): a generator process that loads the policy
  in fp32 on the CPU and samples there (half the cores); it has no CUDA option. So these time a GPU trainer fed by a
  CPU generator, its weights sent through a pipe every step. They run last: they are the slow ones.

Same data (the synthetic addition task; the guess-digit rows for ``env_*``), seed and sizes for every variant. The
model is built from Qwen2-0.5B's config (hidden 896, 24 layers, 14 heads, 2 KV heads, vocabulary 151,936, tied
embeddings) with random weights, and a word-level tokenizer built here with exactly the model's vocabulary (the
tiny model's character tokens plus filler words), so every id the model can sample decodes; one filler in eight ends
in a digit. Nothing is downloaded. A random model rarely ends early, so completions run to ``max_completion_length``
and the work per step is the same for every variant. The single-turn reward is the share of digits in a completion
(``bench_digit_share``): dense, so no group has zero advantage and compaction skips nothing -- the speed figures hold
without its savings. In ``guess_digit`` every digit ends a turn: an episode is up to four turns of ~8 tokens.

Reported per variant: ``step_s`` (median optimizer-step wall time, the first ``BENCH_SKIP`` steps skipped),
``completion_tokens_per_s`` (sampled tokens per step -- TRL's ``completions/mean_length`` times the completions -- over
``step_s``), for the ``env_*`` variants ``generated_over_kept`` (the median over steps of the logged
``env/generated_over_kept``: model tokens generated per token kept in the episodes; goal <= 1.05), ``peak_cuda_gib``
(``torch.cuda.max_memory_allocated``), ``wall_s`` (the process, start-up included); then
``ratio_step_ours_over_trl`` (split into ``ratio_step_ours_over_features_off`` and
``ratio_step_features_off_over_trl``), ``ratio_step_sparse_ours_over_trl``, ``ratio_step_async_over_sync`` and
``ratio_step_env_async_over_sync`` (below 1: the first is faster), and ``c_compiler`` (Triton, which TRL's fused LM head
runs on CUDA, builds its launcher with it). A variant that fails or outlives its time is reported with its ``error`` and
the steps it finished, and the others still run. The JSON is printed as the last line and, with ``BENCH_OUT`` (or
``python -m benchmarks.cuda_trainer --out FILE``), also written to that file.

Environment (default / ``--smoke``): BENCH_STEPS (8 / 2) optimizer steps of the sync variants, BENCH_ASYNC_STEPS (4 / 2)
of the async ones, BENCH_SKIP (2 / 0), BENCH_PROMPTS (8 / 2) x BENCH_GENERATIONS (4 / 2) completions per step,
BENCH_COMPLETION_LENGTH (128 / 8) tokens, BENCH_ENV_COMPLETION_LENGTH (48 / 12) tokens per episode, BENCH_VARIANTS (all,
comma-separated), BENCH_ISOLATE (1 / 0: each variant in its own process, or all in this one), BENCH_VARIANT_TIMEOUT_S
(180) and BENCH_TOTAL_TIMEOUT_S (450: variants not started by then are reported as not run) seconds, both for isolated
variants. About 5-6 minutes on one H100 before the sparse variants, 7.5 at most; ``--quick`` (:data:`QUICK`) fits in 8
minutes with start-up, for a GPU lent by the minute. Without CUDA it stops at once (exit 2, one line). ``--smoke`` runs
the same code on the CPU in fp32 with a 2-layer model of hidden size 64 (vocabulary 512), the variants in this process:
seconds, and figures that say nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import string
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks._sizes import size
from benchmarks.async_overlap import ASYNC

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
# Qwen2-0.5B's shape; --smoke: 2 layers of 64.
QWEN2_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 2048}
SMOKE_MODEL = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 512, "max_position_embeddings": 256}
# Every character of the built-in tasks and environments (prompts, answers, tool and environment replies).
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " "
DIGIT_EVERY = 8  # one filler word in eight ends in a digit: guess_digit's turns end there
REWARD = "bench_digit_share"
SPARSE_REWARD = "bench_sparse_digit_share"
# name: (preset, extra overrides), in the order they run: the GPU-bound ones first, the CPU generator's last.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "trl": ("tiny", []),
    "ours": ("tiny", []),
    "ours_features_off": ("tiny", ["async.shared_prompt_forward=false", "async.compact_zero_advantage=false"]),
    "trl_sparse": ("tiny", [f"grpo.reward_funcs=[{SPARSE_REWARD}]"]),
    "ours_sparse": ("tiny", [f"grpo.reward_funcs=[{SPARSE_REWARD}]"]),
    "env_sync": ("tiny-guess-digit", []),
    "ours_async": ("tiny", ASYNC),
    "env_async": ("tiny-guess-digit", ASYNC),
}
RATIOS = {"ratio_step_ours_over_trl": ("ours", "trl"),
          "ratio_step_ours_over_features_off": ("ours", "ours_features_off"),
          "ratio_step_features_off_over_trl": ("ours_features_off", "trl"),
          "ratio_step_sparse_ours_over_trl": ("ours_sparse", "trl_sparse"),
          "ratio_step_async_over_sync": ("ours_async", "ours"),
          "ratio_step_env_async_over_sync": ("env_async", "env_sync")}


QUICK = {"BENCH_VARIANTS": "trl,ours,ours_features_off,trl_sparse,ours_sparse,env_sync", "BENCH_STEPS": "6",
         "BENCH_SKIP": "2", "BENCH_VARIANT_TIMEOUT_S": "100", "BENCH_TOTAL_TIMEOUT_S": "390"}
"""``--quick``: the sync variants that answer "ours against TRL" (dense and sparse reward, features off, one
environment), fewer steps, and time-outs that end the whole run within 8 minutes with start-up (the model build and
every variant's own start included); a ``BENCH_*`` variable set by hand still wins."""


def sizes(smoke: bool) -> dict[str, Any]:
    """The run's sizes (module docstring), checked: a bad ``BENCH_*`` value raises ``ValueError``."""
    s = {"steps": size("BENCH_STEPS", 8, 2, smoke), "async_steps": size("BENCH_ASYNC_STEPS", 4, 2, smoke),
         "skip": size("BENCH_SKIP", 2, 0, smoke), "prompts": size("BENCH_PROMPTS", 8, 2, smoke),
         "generations": size("BENCH_GENERATIONS", 4, 2, smoke),
         "completion_length": size("BENCH_COMPLETION_LENGTH", 128, 8, smoke),
         "env_completion_length": size("BENCH_ENV_COMPLETION_LENGTH", 48, 12, smoke),
         "variants": [v for v in size("BENCH_VARIANTS", ",".join(VARIANTS), ",".join(VARIANTS), smoke).split(",")
                      if v],
         "variant_timeout_s": size("BENCH_VARIANT_TIMEOUT_S", 180.0, 180.0, smoke),
         "total_timeout_s": size("BENCH_TOTAL_TIMEOUT_S", 450.0, 450.0, smoke),
         "isolate": size("BENCH_ISOLATE", True, False, smoke)}
    unknown = sorted(set(s["variants"]) - set(VARIANTS))
    if unknown:
        raise ValueError(f"BENCH_VARIANTS: unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if min(s["steps"], s["async_steps"], s["prompts"], s["completion_length"], s["env_completion_length"]) < 1 \
            or s["generations"] < 2 or s["skip"] < 0:
        raise ValueError("BENCH_STEPS, BENCH_ASYNC_STEPS, BENCH_PROMPTS and the lengths must be >= 1, "
                         "BENCH_GENERATIONS >= 2, BENCH_SKIP >= 0")
    return s


def digit_share(completions: list[str], **kwargs: Any) -> list[float]:
    """Share of a completion's characters that are digits: a dense reward for a random model's text."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def sparse_digit_share(completions: list[str], prompts: list[Any], **kwargs: Any) -> list[float]:
    """:func:`digit_share`, except for the groups of one prompt in four (1 for every completion) and of another in
    four (0): a prompt's text decides, so every completion of a group gets the same."""
    def kind(prompt: Any) -> int:
        return zlib.crc32(str(prompt).encode()) % 4

    return [1.0 if kind(p) == 0 else 0.0 if kind(p) == 1 else share
            for p, share in zip(prompts, digit_share(completions))]


def register_bench_reward() -> None:
    from grpo.rewards import available_rewards, register_reward

    for name, func in ((REWARD, digit_share), (SPARSE_REWARD, sparse_digit_share)):
        if name not in available_rewards():
            register_reward(name)(func)


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The tiny model's character tokenizer over :data:`ALPHABET`, its vocabulary filled up to ``vocab_size`` with
    letter words (every :data:`DIGIT_EVERY`-th ending in a digit), so that every id decodes to text. Encoding still
    splits text into characters."""
    from tokenizers import models

    from grpo.training.tiny_model import build_char_tokenizer

    tokenizer = build_char_tokenizer(ALPHABET)
    vocab = tokenizer.get_vocab()
    i = 0
    while len(vocab) < vocab_size:
        word, n = "", i
        while True:  # i in base 26, letters
            word, n = chr(97 + n % 26) + word, n // 26
            if n == 0:
                break
        word += str(i // DIGIT_EVERY % 10) if i % DIGIT_EVERY == 0 else ""
        vocab.setdefault(word, len(vocab))
        i += 1
    tokenizer.backend_tokenizer.model = models.WordLevel(vocab=vocab, unk_token=None)
    if len(tokenizer) != vocab_size:
        raise ValueError(f"tokenizer of {len(tokenizer)} tokens for a vocabulary of {vocab_size}")
    return tokenizer


def build_model_dir(path: Path, dims: dict[str, int], bf16: bool, seed: int = 0) -> Path:
    """A Qwen2 of ``dims`` with random weights and its tokenizer, saved to ``path`` as a model folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer(dims["vocab_size"])
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
           "eos_token_id": tokenizer.eos_token_id}
    config = Qwen2Config(**dims, tie_word_embeddings=True, **ids)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    for name, value in ids.items():
        setattr(model.generation_config, name, value)
    model.to(torch.bfloat16 if bf16 else torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def overrides(name: str, s: dict[str, Any], work: Path, cuda: bool) -> list[str]:
    """The ``--set`` overrides of a variant: the model folder, the sizes, bf16 on CUDA, no tracking, evaluation,
    checkpoints or warm start."""
    env = name.startswith("env_")
    steps = s["async_steps"] if name.endswith("async") else s["steps"]
    reward = [] if env or name.endswith("_sparse") else [f"grpo.reward_funcs=[{REWARD}]"]
    precision = ["model.dtype=bfloat16", "grpo.bf16=true", "model.attn_implementation=sdpa"] if cuda else []
    return [f"output_dir={work / 'runs'}", f"model.name_or_path={work / 'model'}", "model.warm_start.steps=0",
            f"grpo.max_steps={steps}", "grpo.logging_steps=1", f"grpo.save_steps={steps * 10}",
            f"grpo.per_device_train_batch_size={s['prompts'] * s['generations']}",
            f"grpo.num_generations={s['generations']}",
            f"grpo.max_completion_length={s['env_completion_length' if env else 'completion_length']}",
            "data.num_train=512", "data.num_eval=16", "tracking.backend=none", "evaluation.enabled=false",
            *precision, *reward, *VARIANTS[name][1]]


def _step_clock(name: str, record_file: Path, cuda: bool):
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        """Wall time of every optimizer step (step end to step end), the completion lengths the trainer logs and
        the peak CUDA memory, written to ``record_file`` after every step (a timed-out variant keeps its steps)."""

        def __init__(self) -> None:
            self.record: dict[str, Any] = {"variant": name, "step_s": [], "mean_length": [], "generated_over_kept": [],
                                           "peak_cuda_gib": None}
            self._last = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.record["step_s"].append(now - self._last)
            self._last = now
            if cuda:
                import torch

                self.record["peak_cuda_gib"] = torch.cuda.max_memory_allocated() / 2**30
            record_file.write_text(json.dumps(self.record))
            print(f"cuda_trainer {name}: step {state.global_step}/{state.max_steps} "
                  f"{self.record['step_s'][-1]:.2f} s", file=sys.stderr, flush=True)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.record["mean_length"].append(float(logs["completions/mean_length"]))
            if logs and "env/generated_over_kept" in logs:
                self.record["generated_over_kept"].append(float(logs["env/generated_over_kept"]))

    return StepClock()


def run_variant(name: str, work: Path, smoke: bool) -> None:
    """One variant in this process; its figures go to ``work/NAME.json``."""
    import torch

    from grpo.config import load_config

    register_bench_reward()
    cuda = torch.cuda.is_available()
    s = sizes(smoke)
    cfg = load_config(VARIANTS[name][0], overrides(name, s, work, cuda))
    clock = _step_clock(name, work / f"{name}.json", cuda)
    clock.record["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # this variant's peak, also when the variants share a process
    log = lambda line: print(f"cuda_trainer {name}: {line}", file=sys.stderr, flush=True)  # noqa: E731
    if name.startswith("trl"):
        import trl

        from benchmarks.trl_parity import build_trainer
        from grpo.pipeline.data import load_data
        from grpo.training.policy import load_policy

        data = load_data(cfg)
        policy = load_policy(cfg, data, log=log)
        build_trainer(trl.GRPOTrainer, cfg, policy, data["train"], work / "runs" / name, use_cpu=not cuda,
                      callbacks=[clock]).train()
    else:
        from grpo.pipeline.experiment import run_experiment
        from grpo.runs import open_run_dir

        run_experiment(cfg, open_run_dir(cfg, name, resume=False), log=log, callbacks=[clock])


def _in_subprocess(name: str, work: Path, smoke: bool, timeout: float) -> str | None:
    """Run a variant in its own process (a process group, killed whole on time-out); its error, or None."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "benchmarks.cuda_trainer", "--variant", name, "--work", str(work),
           *(["--smoke"] if smoke else [])]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=sys.stderr, start_new_session=True)
    error = None
    try:
        if proc.wait(timeout=timeout) != 0:
            error = f"exit code {proc.returncode} (its output is in the log)"
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    finally:
        try:  # whatever the variant left (its generator process, the forkserver) goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return error


def _in_process(name: str, work: Path, smoke: bool) -> str | None:
    try:
        run_variant(name, work, smoke)
    except Exception as err:  # noqa: BLE001 - reported with the variant; the others still run
        traceback.print_exc()
        return f"{type(err).__name__}: {err}"
    return None


def run_and_read(name: str, work: Path, smoke: bool, isolate: bool, timeout: float) -> dict[str, Any]:
    """A variant's record (``work/NAME.json``) with its wall time and error (None when it finished)."""
    start = time.perf_counter()
    error = _in_subprocess(name, work, smoke, timeout) if isolate else _in_process(name, work, smoke)
    record_file = work / f"{name}.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {"step_s": [], "mean_length": []}
    return {**record, "wall_s": time.perf_counter() - start, "error": error}


def summarize(record: dict[str, Any], skip: int, completions_per_step: int) -> dict[str, Any]:
    times, lengths = record["step_s"], record["mean_length"]
    steady = times[skip:] or times[-1:]
    step_s = statistics.median(steady) if steady else None
    length = statistics.median(lengths[skip:] or lengths[-1:]) if lengths else None
    tokens = completions_per_step * length / step_s if step_s and length is not None else None
    waste = record.get("generated_over_kept") or []
    return {"steps_done": len(times), "step_s": step_s, "completion_tokens_per_s": tokens,
            "completion_mean_length": length,
            "generated_over_kept": statistics.median(waste[skip:] or waste[-1:]) if waste else None,
            "peak_cuda_gib": record.get("peak_cuda_gib"),
            "wall_s": round(record["wall_s"], 1), "device": record.get("device"), "error": record["error"]}


def main(smoke: bool = False) -> dict:
    """``python -m benchmarks cuda_trainer [--smoke]``: see the module docstring."""
    from importlib.metadata import version

    s = sizes(smoke)
    if smoke:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the same code on the CPU, whatever this machine has
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    cuda = torch.cuda.is_available()
    if not smoke and not cuda:
        print("cuda_trainer: no CUDA device: it times the trainers on a GPU (--smoke runs its code on the CPU); "
              "nothing was run", file=sys.stderr)
        raise SystemExit(2)
    work = Path(tempfile.mkdtemp(prefix="bench-cuda-trainer-"))
    os.environ.setdefault("GRPO_CACHE_DIR", str(work / "cache"))  # the variants share the prepared data
    dims = SMOKE_MODEL if smoke else QWEN2_05B
    start = time.perf_counter()
    build_model_dir(work / "model", dims, bf16=cuda)
    build_s = time.perf_counter() - start
    per_step = s["prompts"] * s["generations"]
    deadline = time.monotonic() + s["total_timeout_s"]
    results = {}
    for name in [v for v in VARIANTS if v in s["variants"]]:
        left = min(s["variant_timeout_s"], deadline - time.monotonic())
        record = (run_and_read(name, work, smoke, s["isolate"], left) if left >= 1 else
                  {"step_s": [], "mean_length": [], "wall_s": 0.0, "error": "not run: BENCH_TOTAL_TIMEOUT_S spent"})
        results[name] = summarize(record, s["skip"], per_step)
    ratios = {}
    for key, (a, b) in RATIOS.items():
        x, y = (results.get(n, {}).get("step_s") for n in (a, b))
        ratios[key] = round(x / y, 3) if x and y else None
    report = {"device": next((r["device"] for r in results.values() if r["device"]), None),
              "dtype": "bfloat16" if cuda else "float32", "model": dims, "model_build_s": round(build_s, 1),
              **{k: v for k, v in s.items() if k != "variants"}, "completions_per_step": per_step,
              "async_engine": "cpu_process (transformers generate, fp32, on the CPU)",
              # Triton builds its CUDA launcher with a C compiler; TRL's fused LM head runs Triton kernels on CUDA
              "c_compiler": os.environ.get("CC") or next(filter(None, map(shutil.which, ("cc", "gcc", "clang"))), None),
              "versions": {d: version(d) for d in ("torch", "transformers", "trl", "accelerate", "datasets")},
              "work_dir": str(work), "variants": results, **ratios}
    out = os.environ.get("BENCH_OUT")
    if out:
        Path(out).write_text(json.dumps({"benchmark": "cuda_trainer", **report, "smoke": smoke}, sort_keys=True))
    return report


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="python -m benchmarks.cuda_trainer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--quick", action="store_true", help="the sync variants in under 8 minutes (QUICK)")
    p.add_argument("--out", help="also write the JSON to this file (BENCH_OUT)")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # internal: one variant in this process
    p.add_argument("--work", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:
        from grpo.console import quiet_library_noise

        quiet_library_noise()
        run_variant(a.variant, Path(a.work), a.smoke)
    else:
        from benchmarks.__main__ import main as run_benchmark

        if a.out:
            os.environ["BENCH_OUT"] = a.out
        if a.quick:
            for key, value in QUICK.items():
                os.environ.setdefault(key, value)
        sys.exit(run_benchmark(["cuda_trainer", *(["--smoke"] if a.smoke else [])]))
