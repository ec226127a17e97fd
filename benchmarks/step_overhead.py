"""``python -m benchmarks step_overhead``: our trainer's per-step host overhead against stock ``trl.GRPOTrainer``.

On a fast GPU the model's work per step shrinks to milliseconds and what is left is the host: Python around the
model, tokenisation, callbacks, metric gathering and every point where the host waits for the device. A CPU run of
a real-sized model hides all of it under slow matrix maths, so this benchmark shrinks the model instead (1 layer,
hidden 16: the model's share of a step is small) and times the same config three ways, alternating in one process
(TRL, ours with the speed features off, ours with them on, then again) so machine noise hits all alike:

- ``trl``: stock ``trl.GRPOTrainer``, built as ``trl_parity`` builds it;
- ``ours_features_off``: ours as ``grpo run`` trains (the recipe's trainer, its sampler plan and the run's callbacks;
  no tracking or evaluation) with ``async.shared_prompt_forward`` and ``async.compact_zero_advantage`` off, so the
  step does what TRL's does: the ratio is our overhead alone;
- ``ours``: the same with the defaults (both speed features on).

Every variant logs every step (``grpo.logging_steps=1``), as ``cuda_trainer`` does.

A step's time is the time between two optimizer steps' ends (generation, scoring, loss and every callback included),
as wall time and as the training thread's CPU time; each variant's figure is the median over its steps, the first
``BENCH_SKIP`` of each round skipped. Torch runs on ``BENCH_THREADS`` (1) intra-op threads: at this size more threads
only add their own overhead, and one thread makes the CPU time a count of the host's work that a busy machine
changes little (the wall figure is the one to quote on an idle machine). Then
each variant trains ``BENCH_SYNC_STEPS`` more steps under :class:`benchmarks._syncs.SyncCounter`, which counts the
calls that would make the host wait for the device on CUDA (``.item()``, ``.tolist()``, ``bool(t)``, copies to the
CPU, ``nonzero``, ``unique``, boolean-mask indexing), and reports them per step with their top origins
(``file:line``).

Environment (default / ``--smoke``): BENCH_STEPS (30 / 3) steps per round, BENCH_ROUNDS (3 / 1), BENCH_SKIP (3 / 0),
BENCH_SYNC_STEPS (5 / 2), BENCH_BATCH (64 / 16) completions per step (8 per prompt), BENCH_THREADS (1 / 1).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks._sizes import size
from benchmarks._syncs import SyncCounter

HOST_BOUND_MODEL = ["model.tiny.hidden_size=16", "model.tiny.num_hidden_layers=1", "model.tiny.num_attention_heads=2",
                    "model.tiny.intermediate_size=32", "model.warm_start.steps=200"]
"""A model so small that the host's work is most of a step: what a fast GPU leaves of a real model's step."""
FEATURES_OFF = ["async.shared_prompt_forward=false", "async.compact_zero_advantage=false"]


class StepClock:
    """A trainer callback recording the wall and CPU time of each optimizer step's end; with a ``counter`` it counts
    device-waiting calls from the first step's start to the last step's end (not the run's set-up around them)."""

    def __init__(self, counter: SyncCounter | None = None) -> None:
        from transformers import TrainerCallback

        clock = self

        class _Callback(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                clock.tick()
                if counter is not None:
                    counter.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                clock.tick()

            def on_train_end(self, args, state, control, **kwargs):
                if counter is not None:
                    counter.__exit__(None, None, None)

        self.ends: list[tuple[float, float]] = []
        self.callback = _Callback()

    def tick(self) -> None:
        self.ends.append((time.perf_counter(), time.thread_time()))

    def step_seconds(self, skip: int) -> list[tuple[float, float]]:
        """(wall, this thread's CPU) seconds of each step after the first ``skip``."""
        return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(self.ends, self.ends[1:])][skip:]


def main(smoke: bool = False) -> dict:
    steps = size("BENCH_STEPS", 30, 3, smoke)
    rounds = size("BENCH_ROUNDS", 3, 1, smoke)
    skip = size("BENCH_SKIP", 3, 0, smoke)
    sync_steps = size("BENCH_SYNC_STEPS", 5, 2, smoke)
    batch = size("BENCH_BATCH", 64, 16, smoke)
    threads = size("BENCH_THREADS", 1, 1, smoke)
    if steps <= skip:
        raise ValueError(f"BENCH_STEPS ({steps}) must be larger than BENCH_SKIP ({skip})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import trl

    from benchmarks.trl_parity import build_trainer
    from grpo.config import load_config
    from grpo.pipeline.data import load_data
    from grpo.pipeline.experiment import run_experiment
    from grpo.runs import open_run_dir
    from grpo.training.policy import load_policy

    torch.set_num_threads(threads)
    out = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    common = [f"output_dir={out}", f"grpo.per_device_train_batch_size={batch}", "grpo.logging_steps=1",
              "evaluation.enabled=false", "tracking.backend=none", *HOST_BOUND_MODEL]
    base = {"trl": common, "ours_features_off": [*common, *FEATURES_OFF], "ours": common}
    cfg0 = load_config("tiny", common)
    data = load_data(cfg0)
    policy = load_policy(cfg0, data, log=lambda *_: None)  # builds (or reads) the warm start every variant starts from
    runs = iter(range(10**6))

    def train(name: str, n: int, counter: SyncCounter | None = None) -> list[tuple[float, float]]:
        cfg = load_config("tiny", [*base[name], f"grpo.max_steps={n}", f"grpo.save_steps={n * 10}"])
        clock = StepClock(counter)
        if name == "trl":
            build_trainer(trl.GRPOTrainer, cfg, policy, data["train"], out / name, callbacks=[clock.callback]).train()
        else:  # as `grpo run` trains: the recipe, its plan and the run's callbacks
            run_experiment(cfg, open_run_dir(cfg, f"{name}-{next(runs)}", resume=False), log=lambda *_: None,
                           callbacks=[clock.callback])
        return clock.step_seconds(skip if counter is None else 0)

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in base}
    for _ in range(rounds):
        for name in base:
            times[name].extend(train(name, steps))
    step_s = {name: statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu_s = {name: statistics.median(c for _, c in t) for name, t in times.items()}
    syncs = {}
    for name in base:
        counter = SyncCounter()
        train(name, sync_steps, counter=counter)
        syncs[name] = counter.report(sync_steps)
    result: dict = {"steps": steps, "rounds": rounds, "skip": skip, "completions_per_step": batch, "threads": threads,
                    "model": "tiny, 1 layer, hidden 16"}
    for name in base:
        result[f"{name}_step_ms"] = round(step_s[name] * 1000, 2)
        result[f"{name}_step_cpu_ms"] = round(cpu_s[name] * 1000, 2)
    for name, label in (("ours_features_off", "features_off"), ("ours", "ours")):
        result[f"ratio_step_{label}_over_trl"] = round(step_s[name] / step_s["trl"], 3)
        result[f"ratio_cpu_{label}_over_trl"] = round(cpu_s[name] / cpu_s["trl"], 3)
    for name in base:
        result[f"{name}_syncs_per_step"] = syncs[name]["syncs_per_step"]
    result["syncs"] = syncs
    shutil.rmtree(out, ignore_errors=True)
    return result
