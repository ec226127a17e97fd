"""``python -m benchmarks tracking_overhead``: what MLflow tracking and the Prefect pipeline cost.

1. Tracking overhead. The same short GRPO training (the ``tiny`` preset, ``BENCH_STEPS`` steps, ``logging_steps=1``
   so every step logs ~25 metrics: the worst case) with MLflow tracking on versus off (no tracker), in one process.
   Tracking on is what the pipeline and ``run_experiment`` do: the config's ``tracking`` section (MLflow, a local
   SQLite store in a temp dir, system metrics on) through :func:`grpo.tracking.run_tracking.start_run_tracking`
   (params, tags), and :class:`MlflowCallback` as a trainer callback. Per-step time is the training wall time / steps
   (everything the training thread does, callbacks included, plus whatever the tracker's background threads take
   from it on a shared CPU); TRL's own ``step_time`` metric (forward/backward of ``training_step`` only, so it does not
   contain the callbacks) is reported next to it. Also: the cost of one ``log_metrics`` call in the training thread, and
   whether every point reached MLflow after ``close()`` (MLflow's metric history against ``metrics.jsonl``).
2. Pipeline overhead (informational). The whole pipeline on ``tests/micro.yaml`` settings as ``grpo run`` runs it
   (:func:`grpo.app.cli.run` in this process: the Prefect flow ``grpo-pipeline``, ephemeral Prefect API, MLflow
   tracking to SQLite) versus the same stages called directly by ``grpo.pipeline.experiment.run_experiment`` with
   tracking off. Like every benchmark it goes through the library's entry points (``grpo.*``), never a flow's
   internals (tests/test_layers.py). Prefect's temporary server starts with the first flow of the
   process; a no-op flow run first measures that start (and a second one the per-flow cost), outside the rounds.
   The MLflow part of the pipeline is timed by wrapping ``tracker_from_config`` / ``log_model`` in
   :mod:`grpo.tracking.run_tracking`, where the pipeline looks them up, and the training-progress artifact by timing
   the Prefect client's artifact updates (the train subflow's and the pipeline run's, at each logging step, the last
   step, the end of training and at most every 2 s between: flows/progress.py); the benchmark fails if the pipeline
   stops calling them.

The variants run interleaved, the order flipping every round (A B, B A, A B, ...), so machine noise and drift hit
both alike; each reported figure is the median over rounds. The warm-started tiny models are built once, before any
timing, in a temporary ``GRPO_CACHE_DIR`` shared by all rounds.

Environment: ``BENCH_STEPS`` (60), ``BENCH_ROUNDS`` (3), ``BENCH_PIPELINE_ROUNDS`` (3; 0 skips part 2),
``BENCH_PROFILE`` (1: when the overhead misses the target, one more tracked run with cProfile on the tracker's work in
the training thread and in the sender thread), ``BENCH_FLUSH_INTERVAL`` (the tracker's default, ``FLUSH_INTERVAL``) and
``BENCH_SYSTEM_METRICS`` (1) to try other tracker settings, ``BENCH_SEED_CACHE`` (1: copy an identical, already built
warm start from ``$GRPO_CACHE_DIR`` or ``.cache/grpo`` into the temporary cache instead of rebuilding it).
``--smoke``: 3 steps of 64 completions, 1 round, no warm-up runs, no profile, a short warm start; 1 pipeline round
of 4 steps (warm start 10 steps, 16 eval prompts).
"""

from __future__ import annotations

import contextlib
import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from benchmarks._sizes import TINY_SMOKE_OVERRIDES, size
from grpo.tracking.metric_keys import train_key
from grpo.tracking.tracker import FLUSH_INTERVAL

REPO = Path(__file__).resolve().parent.parent
TARGET_PCT = 2.0
_ORIGINAL_CACHE = os.environ.get("GRPO_CACHE_DIR")


@dataclass(frozen=True)
class Settings:
    steps: int
    rounds: int
    pipeline_rounds: int
    profile: bool
    flush_interval: float
    system_metrics: bool
    smoke: bool

    @classmethod
    def choose(cls, smoke: bool) -> Settings:
        return cls(steps=size("BENCH_STEPS", 60, 3, smoke), rounds=size("BENCH_ROUNDS", 3, 1, smoke),
                   pipeline_rounds=size("BENCH_PIPELINE_ROUNDS", 3, 1, smoke),
                   profile=size("BENCH_PROFILE", True, False, smoke),
                   flush_interval=size("BENCH_FLUSH_INTERVAL", FLUSH_INTERVAL, FLUSH_INTERVAL, smoke),
                   system_metrics=size("BENCH_SYSTEM_METRICS", True, True, smoke), smoke=smoke)


def _quiet(*_args, **_kwargs) -> None:
    pass


def _order(round_index: int, a: str, b: str) -> tuple[str, str]:
    return (a, b) if round_index % 2 == 0 else (b, a)


def _pct(new: float, base: float) -> float:
    return (new - base) / base * 100.0


# ---------------------------------------------------------------------------------------------- 1. tracking overhead


def _tracking_overhead(root: Path, opts: Settings) -> dict:
    from transformers import TrainerCallback

    from grpo.config import load_config
    from grpo.pipeline.data import load_data
    from grpo.runs import open_run_dir
    from grpo.tracking.run_tracking import start_run_tracking
    from grpo.tracking.tracker import MlflowCallback, MlflowTracker
    from grpo.tracking.values import sanitize_metric_key
    from grpo.training.policy import Policy, load_policy, tiny_cache_key
    from grpo.training.tiny_model import alphabet_of
    from grpo.training.train import train_grpo

    out = root / "train-runs"
    uri = f"sqlite:///{root / 'mlflow-train.db'}"
    cfg = load_config("tiny", [
        f"output_dir={out}", f"grpo.max_steps={opts.steps}", "grpo.logging_steps=1",
        f"grpo.save_steps={opts.steps * 10}", "evaluation.enabled=false",
        "tracking.backend=mlflow", f"tracking.tracking_uri={uri}", "tracking.experiment_name=bench-tracking-overhead",
        f"tracking.log_system_metrics={str(opts.system_metrics).lower()}",
        *(TINY_SMOKE_OVERRIDES if opts.smoke else []),
    ])
    data = load_data(cfg)
    seeded_from = _seed_cache(tiny_cache_key(cfg, alphabet_of(data)))
    t0 = time.perf_counter()
    base = load_policy(cfg, data, log=_quiet)  # builds and caches the warm start (outside every timing)
    warm_start_build_s = time.perf_counter() - t0
    MlflowTracker(uri, root / "init-spool").client.search_experiments()  # create the SQLite schema up front

    class StepClock(TrainerCallback):
        """Wall-clock time at the end of every optimizer step (same callback in both variants)."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.cpu = [0.0, 0.0]  # process CPU time (all threads) at train begin / end

        def on_train_begin(self, args, state, control, **kwargs):
            self.cpu[0] = time.process_time()

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

        def on_train_end(self, args, state, control, **kwargs):
            self.cpu[1] = time.process_time()

    class TimedCallback(MlflowCallback):
        """MlflowCallback whose ``on_log`` (the whole cost in the training thread) is timed, optionally profiled."""

        def __init__(self, tracker, profiler=None) -> None:
            super().__init__(tracker)
            self.seconds: list[float] = []
            self.profiler = profiler

        def on_log(self, args, state, control, logs=None, **kwargs):
            start = time.perf_counter()
            if self.profiler is not None:
                self.profiler.enable()
            try:
                return super().on_log(args, state, control, logs=logs, **kwargs)
            finally:
                if self.profiler is not None:
                    self.profiler.disable()
                self.seconds.append(time.perf_counter() - start)

    counter = iter(range(10_000))

    def one(tracking: bool, steps: int = opts.steps, profiler=None, sender_profiler=None) -> dict:
        run_cfg = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"max_steps": steps})})
        run = open_run_dir(run_cfg, f"{'on' if tracking else 'off'}-{next(counter)}", resume=False)
        policy = Policy(copy.deepcopy(base.model), base.tokenizer, base.source, True, 0.0, [])
        clock = StepClock()
        callbacks: list = [clock]
        tracker = None
        call_us: list[float] = []
        bg: dict[str, list[tuple[float, float]]] = {"sender": [], "system": []}
        if tracking:
            # The pipeline's own start: tracker from the config's tracking section, run with its params and tags.
            tracker = start_run_tracking(run_cfg, run)
            tracker._spool.flush_interval = opts.flush_interval  # read by the sender on every wait
            run_id = tracker.run_id
            inner = tracker.log_metrics

            def timed_log_metrics(metrics, step, _inner=inner):
                if threading.current_thread() is not threading.main_thread():
                    return _inner(metrics, step)  # the system-metrics sampler: not the training thread's cost
                s = time.perf_counter()
                _inner(metrics, step)
                call_us.append((time.perf_counter() - s) * 1e6)

            tracker.log_metrics = timed_log_metrics  # instance attribute: the callback's calls go through here
            # The background threads' own CPU time (time.thread_time inside the thread that runs them).
            tracker._spool.send = _thread_timed(tracker._spool.send, bg["sender"], sender_profiler)
            if tracker._sys_monitor is not None:
                mon = tracker._sys_monitor
                mon.collect_metrics = _thread_timed(mon.collect_metrics, bg["system"])
            cb = TimedCallback(tracker, profiler)
            callbacks.append(cb)
        result = train_grpo(run_cfg, policy, data["train"], run, resume=False, callbacks=callbacks)
        row: dict = {"steps": result.steps, "train_s": result.seconds, "per_step_s": result.seconds / result.steps,
                     "cpu_s": clock.cpu[1] - clock.cpu[0]}
        gaps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
        row["median_step_gap_s"] = statistics.median(gaps) if gaps else None
        logged = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]
        step_times = [r["metrics"]["step_time"] for r in logged if "step_time" in r["metrics"]]
        row["trl_step_time_s"] = statistics.median(step_times) if step_times else None
        row["metrics_per_log"] = statistics.median(len(r["metrics"]) for r in logged) if logged else 0
        if tracker is not None:
            t = time.perf_counter()
            sent_all = tracker.close()
            row["close_s"] = time.perf_counter() - t
            row["log_metrics_us"] = call_us
            row["on_log_us"] = [s * 1e6 for s in cb.seconds]
            for name, calls in bg.items():
                row[f"{name}_calls"] = len(calls)
                row[f"{name}_cpu_s"] = sum(c for _, c in calls)
                row[f"{name}_wall_s"] = sum(w for w, _ in calls)
            row.update(_completeness(tracker, run_id, run.metrics_file, sanitize_metric_key, sent_all))
        return row

    if not opts.smoke:
        one(True, steps=5)  # warm-up: first trainer, first MLflow run and system-metrics monitor, lazy imports
        one(False, steps=5)

    rows: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(opts.rounds):
        for variant in _order(r, "off", "on"):
            rows[variant].append(one(variant == "on"))
            print(f"[tracking_overhead] round {r + 1}/{opts.rounds} {variant}: "
                  f"{rows[variant][-1]['per_step_s'] * 1000:.1f} ms/step", file=sys.stderr)

    def med(variant: str, key: str) -> float:
        return statistics.median(row[key] for row in rows[variant])

    off, on = med("off", "per_step_s"), med("on", "per_step_s")
    overhead = _pct(on, off)
    calls = [us for row in rows["on"] for us in row["log_metrics_us"]]
    on_logs = [us for row in rows["on"] for us in row["on_log_us"]]
    complete = all(row["reward_points_match"] and row["all_points_match"] for row in rows["on"])
    result = {
        "steps": opts.steps,
        "rounds": opts.rounds,
        "flush_interval_s": opts.flush_interval,
        "system_metrics": opts.system_metrics,
        "warm_start_build_s": round(warm_start_build_s, 1),
        "warm_start_copied_from": seeded_from,
        "metrics_per_log": rows["on"][0]["metrics_per_log"],
        "off_per_step_ms": round(off * 1000, 2),
        "on_per_step_ms": round(on * 1000, 2),
        "overhead_pct": round(overhead, 2),
        "target_pct": TARGET_PCT,
        "target_met": overhead < TARGET_PCT,
        "off_per_step_ms_rounds": [round(row["per_step_s"] * 1000, 2) for row in rows["off"]],
        "on_per_step_ms_rounds": [round(row["per_step_s"] * 1000, 2) for row in rows["on"]],
        "overhead_pct_paired_median": round(statistics.median(
            _pct(a["per_step_s"], b["per_step_s"]) for a, b in zip(rows["on"], rows["off"])), 2),
        "overhead_pct_min": round(_pct(min(r["per_step_s"] for r in rows["on"]),
                                       min(r["per_step_s"] for r in rows["off"])), 2),
        # CPU seconds of the whole process (every thread) during train(): less sensitive to other jobs than wall time
        "off_cpu_ms_per_step": round(med("off", "cpu_s") / opts.steps * 1000, 1),
        "on_cpu_ms_per_step": round(med("on", "cpu_s") / opts.steps * 1000, 1),
        "cpu_overhead_pct": round(_pct(med("on", "cpu_s"), med("off", "cpu_s")), 2),
        # The tracker's own CPU (training-thread on_log + sender thread + system-metrics sampler) over the untracked
        # run's CPU: the wall-time overhead to expect when training keeps both cores busy; robust to other jobs.
        "overhead_pct_accounted": round(statistics.median(
            (sum(a["on_log_us"]) / 1e6 + a["sender_cpu_s"] + a["system_cpu_s"]) / b["cpu_s"] * 100
            for a, b in zip(rows["on"], rows["off"])), 2),
        "noise_pct_off_rounds": round(_pct(max(r["per_step_s"] for r in rows["off"]),
                                           min(r["per_step_s"] for r in rows["off"])), 1),
        "overhead_pct_median_step_gap": round(_pct(med("on", "median_step_gap_s"), med("off", "median_step_gap_s")), 2),
        "overhead_pct_trl_step_time": round(_pct(med("on", "trl_step_time_s"), med("off", "trl_step_time_s")), 2),
        "log_metrics_us_median": round(statistics.median(calls), 1),
        "log_metrics_us_p95": round(_quantile(calls, 0.95), 1),
        "log_metrics_us_max": round(max(calls), 1),
        "log_metrics_calls": len(calls),
        "callback_on_log_us_median": round(statistics.median(on_logs), 1),
        "tracker_ms_per_step_in_training_thread": round(statistics.mean(on_logs) / 1000, 3),
        "close_s_median": round(med("on", "close_s"), 3),
        # background threads, per tracked run (includes the final flush in close())
        "sender_batches": [row["sender_calls"] for row in rows["on"]],
        "sender_cpu_s": [round(row["sender_cpu_s"], 3) for row in rows["on"]],
        "sender_cpu_pct_of_train": round(statistics.median(row["sender_cpu_s"] / row["train_s"] * 100
                                                           for row in rows["on"]), 2),
        "system_metrics_cpu_s": [round(row["system_cpu_s"], 3) for row in rows["on"]],
        "all_points_arrived": complete,
        "reward_points": [row["reward_points_mlflow"] for row in rows["on"]],
        "reward_points_expected": [row["reward_points_expected"] for row in rows["on"]],
        "points_mlflow": [row["points_mlflow"] for row in rows["on"]],
        "points_expected": [row["points_expected"] for row in rows["on"]],
        "system_metric_points": [row["system_points"] for row in rows["on"]],
        "dropped_duplicates": [row["dropped_duplicates"] for row in rows["on"]],
    }
    if opts.profile and not result["target_met"]:
        result["profile"] = _profile(one)
    return result


def _seed_cache(key: str) -> str | None:
    """Copy an already built warm start with this exact cache key (same config, data and code) from the project's
    cache into the benchmark's temporary cache, instead of rebuilding it; ``BENCH_SEED_CACHE=0`` always rebuilds."""
    import shutil

    if os.environ.get("BENCH_SEED_CACHE", "1") in ("0", "", "false"):
        return None
    for root in (_ORIGINAL_CACHE, REPO / ".cache" / "grpo"):
        if root is None:
            continue
        src = Path(root) / f"tiny-{key}"
        if (src / "done.json").is_file():
            dst = Path(os.environ["GRPO_CACHE_DIR"]) / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(src, dst)
            return str(src)
    return None


def _completeness(tracker, run_id: str, metrics_file: Path, sanitize, sent_all: bool) -> dict:
    """After ``close()``: does MLflow hold every (key, step, value) that MetricsRecorder wrote?"""
    expected: dict[tuple[str, int], float] = {}
    for line in metrics_file.read_text().splitlines():
        row = json.loads(line)
        for key, value in row["metrics"].items():
            # first write wins, as in the tracker; MlflowCallback logs the trainer's metrics under train_key's names
            expected.setdefault((sanitize(train_key(key)), int(row["step"])), float(value))
    run = tracker.client.get_run(run_id)
    got: dict[tuple[str, int], float] = {}
    system = 0
    for key in run.data.metrics:
        history = tracker.client.get_metric_history(run_id, key)
        if key.startswith("system/"):
            system += len(history)
            continue
        for m in history:
            got[(key, int(m.step))] = float(m.value)
    reward_expected = {k: v for k, v in expected.items() if k[0] == train_key("reward")}
    reward_got = {k: v for k, v in got.items() if k[0] == train_key("reward")}
    return {
        "sent_all": sent_all,
        "status": run.info.status,
        "reward_points_expected": len(reward_expected),
        "reward_points_mlflow": len(reward_got),
        "reward_points_match": reward_expected == reward_got,
        "points_expected": len(expected),
        "points_mlflow": len(got),
        "all_points_match": expected == got,
        "system_points": system,
        "dropped_duplicates": tracker.dropped_duplicates,
    }


def _thread_timed(fn, sink: list, profiler=None):
    """``fn`` recording (wall s, CPU s of the calling thread) per call; optionally cProfiled (in that thread)."""

    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.thread_time()
        if profiler is not None:
            profiler.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            if profiler is not None:
                profiler.disable()
            sink.append((time.perf_counter() - wall, time.thread_time() - cpu))

    return wrapper


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _profile(one) -> dict:
    """One more tracked run with cProfile on the tracker's work in the training thread (MlflowCallback.on_log) and,
    separately, in the sender thread (each ``log_batch``); top functions by cumulative time."""
    in_training, in_sender = cProfile.Profile(), cProfile.Profile()
    row = one(True, profiler=in_training, sender_profiler=in_sender)
    return {
        "train_s": round(row["train_s"], 2),
        "training_thread_on_log_total_ms": round(sum(row["on_log_us"]) / 1000, 2),
        "training_thread_top": _top(in_training),
        "sender_thread_cpu_s": round(row["sender_cpu_s"], 3),
        "sender_thread_batches": row["sender_calls"],
        "sender_thread_top": _top(in_sender),
    }


def _top(profiler: cProfile.Profile, n: int = 12) -> list[str]:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(n)
    lines = [" ".join(line.split()) for line in text.getvalue().splitlines()]
    return [line for line in lines if line and (line[0].isdigit() or "function calls" in line)][: n + 1]


# ---------------------------------------------------------------------------------------------- 2. pipeline overhead


def _pipeline_overhead(root: Path, opts: Settings) -> dict:
    import grpo.tracking.run_tracking
    from grpo.config import load_config
    from grpo.pipeline.experiment import run_experiment
    from grpo.pipeline.stages import policy_stage, prep_stage
    from grpo.runs import open_run_dir
    from grpo.tracking.tracker import MlflowTracker

    micro = REPO / "tests" / "micro.yaml"
    uri = f"sqlite:///{root / 'mlflow-pipeline.db'}"

    def overrides(kind: str, i: int) -> list[str]:
        sets = [f"output_dir={root / f'pipe-{kind}-{i}'}"]
        if opts.smoke:
            sets += ["grpo.max_steps=4", "model.warm_start.steps=10", "evaluation.num_prompts=16"]
        if kind == "prefect":
            sets += ["tracking.backend=mlflow", f"tracking.tracking_uri={uri}",
                     "tracking.experiment_name=bench-pipeline"]
        else:
            sets += ["tracking.backend=none"]
        return sets

    def config(kind: str, i: int):
        return load_config(micro, overrides(kind, i))

    # The micro warm start, built once into the shared cache before any timing.
    t0 = time.perf_counter()
    warm = config("direct", 999)
    prep_stage(warm, root / "warm-data")
    policy_stage(warm, root / "warm-data", log=_quiet)
    warm_start_build_s = time.perf_counter() - t0
    MlflowTracker(uri, root / "init-spool-pipe").client.search_experiments()

    from prefect import flow

    from grpo.app import cli

    @flow(name="bench-noop")
    def noop() -> int:
        return 0

    t = time.perf_counter()
    noop()
    first_flow_s = time.perf_counter() - t  # includes starting Prefect's temporary server
    t = time.perf_counter()
    noop()
    noop_flow_s = time.perf_counter() - t

    # Where the tracked pipeline spends its tracking time: the pipeline (like run_experiment) starts its tracker and
    # logs the model through grpo.tracking.run_tracking, so the functions are wrapped in that module's namespace.
    parts: dict[str, list[float]] = {"log_model": [], "tracker_start": [], "tracker_close": []}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            s = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[key].append(time.perf_counter() - s)
        return wrapper

    real_tracker_from_config = grpo.tracking.run_tracking.tracker_from_config

    def tracker_from_config(*args, **kwargs):
        tracker = real_tracker_from_config(*args, **kwargs)
        if tracker is not None:
            tracker.start = timed(tracker.start, "tracker_start")
            tracker.close = timed(tracker.close, "tracker_close")
        return tracker

    # The progress artifacts the train flow updates through the Prefect API (flows/progress.py says when).
    from prefect.client.orchestration import SyncPrefectClient

    progress_s: list[float] = []
    progress_calls = [0]

    def timed_progress(fn):
        def wrapper(*args, **kwargs):
            s = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                progress_s.append(time.perf_counter() - s)
                progress_calls[0] += 1
        return wrapper

    with ExitStack() as patches:  # every wrapper is undone on the way out, also when a round fails
        patches.enter_context(mock.patch.object(grpo.tracking.run_tracking, "tracker_from_config", tracker_from_config))
        patches.enter_context(mock.patch.object(grpo.tracking.run_tracking, "log_model",
                                                timed(grpo.tracking.run_tracking.log_model, "log_model")))
        patches.enter_context(mock.patch.object(SyncPrefectClient, "update_artifact",
                                                timed_progress(SyncPrefectClient.update_artifact)))
        times, train_s, flow_runs_before, flow_runs = _pipeline_rounds(opts, micro, overrides, config, cli,
                                                                       run_experiment, open_run_dir)
    # Each tracked (Prefect) round starts, closes and logs a model once; fewer means the wrappers missed the calls the
    # pipeline really makes (it moved them elsewhere) and the figures below would silently leave them out.
    for key in parts:
        if len(parts[key]) != opts.pipeline_rounds:
            raise RuntimeError(f"pipeline tracking not measured: {key} timed {len(parts[key])} times in "
                               f"{opts.pipeline_rounds} tracked pipeline runs; update the wrappers in {__name__}")
    if progress_calls[0] == 0:
        raise RuntimeError("the train flow updated no progress artifact through the Prefect client; update the "
                           "benchmark")

    prefect_s, direct_s = statistics.median(times["prefect"]), statistics.median(times["direct"])
    return {
        "rounds": opts.pipeline_rounds,
        "micro_warm_start_build_s": round(warm_start_build_s, 1),
        "prefect_pipeline_s": round(prefect_s, 2),
        "direct_run_experiment_s": round(direct_s, 2),
        "difference_s": round(prefect_s - direct_s, 2),
        "prefect_pipeline_s_rounds": [round(x, 2) for x in times["prefect"]],
        "direct_run_experiment_s_rounds": [round(x, 2) for x in times["direct"]],
        "train_s_prefect_rounds": [round(x, 2) for x in train_s["prefect"]],
        "train_s_direct_rounds": [round(x, 2) for x in train_s["direct"]],
        "prefect_server_start_s": round(first_flow_s - noop_flow_s, 2),
        "prefect_first_noop_flow_s": round(first_flow_s, 2),
        "prefect_noop_flow_s": round(noop_flow_s, 3),
        # flow runs per pipeline run (the pipeline and its subflows); each pays about prefect_noop_flow_s
        "prefect_flow_runs_per_pipeline": (None if flow_runs is None or flow_runs_before is None
                                           else (flow_runs - flow_runs_before) / opts.pipeline_rounds),
        "train_s_difference": round(statistics.median(train_s["prefect"]) - statistics.median(train_s["direct"]), 2),
        "prefect_progress_artifact_calls_per_run": progress_calls[0] // opts.pipeline_rounds,
        "prefect_progress_artifact_s_per_run": round(sum(progress_s) / opts.pipeline_rounds, 2),
        "prefect_progress_artifact_ms_per_call": round(statistics.median(progress_s) * 1000, 1) if progress_s else None,
        "mlflow_log_model_s": [round(x, 2) for x in parts["log_model"]],
        "mlflow_tracker_start_s": [round(x, 2) for x in parts["tracker_start"]],
        "mlflow_tracker_close_s": [round(x, 2) for x in parts["tracker_close"]],
    }


def _pipeline_rounds(opts: Settings, micro: Path, overrides, config, cli, run_experiment, open_run_dir):
    """The timed rounds of part 2: ``grpo run`` (the Prefect pipeline, tracked) and run_experiment (untracked),
    interleaved."""
    import logging

    flow_runs_before = _count_flow_runs()
    times: dict[str, list[float]] = {"prefect": [], "direct": []}
    train_s: dict[str, list[float]] = {"prefect": [], "direct": []}
    quiet_loggers = [logging.getLogger(n) for n in ("prefect", "prefect.flow_runs", "prefect.task_runs")]
    for r in range(opts.pipeline_rounds):
        for kind in _order(r, "direct", "prefect"):
            cfg = config(kind, r)
            t = time.perf_counter()
            if kind == "prefect":
                levels = [lg.level for lg in quiet_loggers]
                for lg in quiet_loggers:
                    lg.setLevel(logging.WARNING)
                try:
                    with contextlib.redirect_stdout(sys.stderr):  # its console lines; stdout ends with the result
                        cli.run(config=micro, set_=overrides(kind, r), run_name=f"prefect-{r}")
                finally:
                    for lg, level in zip(quiet_loggers, levels):
                        lg.setLevel(level)
                summary = json.loads((Path(cfg.output_dir) / f"prefect-{r}" / "summary.json").read_text())
            else:
                summary = run_experiment(cfg, open_run_dir(cfg, f"direct-{r}", False), log=_quiet)
            times[kind].append(time.perf_counter() - t)
            train_s[kind].append(summary["train_seconds"])
            print(f"[tracking_overhead] pipeline round {r + 1}/{opts.pipeline_rounds} {kind}: {times[kind][-1]:.1f}s",
                  file=sys.stderr)

    return times, train_s, flow_runs_before, _count_flow_runs()


def _count_flow_runs() -> int | None:
    try:
        from prefect import get_client

        with get_client(sync_client=True) as client:
            return client.count_flow_runs()
    except Exception:  # informational only
        return None


def main(smoke: bool = False) -> dict:
    settings = Settings.choose(smoke)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect gives its temporary server 20 s to start, which a busy 2-core machine can miss (its start is timed apart).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    root = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    os.environ["GRPO_CACHE_DIR"] = str(root / "cache")  # shared by all rounds; warm starts built before timing
    if not os.environ.get("PREFECT_API_URL"):
        os.environ.setdefault("PREFECT_HOME", str(root / "prefect"))  # a fresh ephemeral Prefect database
    started = time.perf_counter()
    load_before = [round(x, 2) for x in os.getloadavg()]
    tracking = _tracking_overhead(root, settings)
    pipeline = _pipeline_overhead(root, settings) if settings.pipeline_rounds > 0 else None
    return {
        "tracking": tracking,
        "pipeline": pipeline,
        "target_met": tracking["target_met"],
        "overhead_pct": tracking["overhead_pct"],
        "total_s": round(time.perf_counter() - started, 1),
        # 1/5/15-minute load averages (2 cores here): other jobs on the machine inflate every timing
        "loadavg_start": load_before,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "workdir": str(root),
    }
