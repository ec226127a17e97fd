"""The Prefect pipeline against a real Prefect server (the session's ``prefect server start``) and a real `mlflow
server` process."""

from __future__ import annotations

import json
import re
import time
from importlib import metadata
from pathlib import Path

import pytest
from mlflow import MlflowClient

from grpo.config import load_config
from grpo.runs import RunDir
from grpo.tracking.metric_keys import train_key
from tests.conftest import MICRO, micro_overrides
from tests.servers import MlflowServer, PrefectServer

pytestmark = pytest.mark.integration

TRAIN_METRICS = {"reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "completions/mean_length", "step_time", "num_tokens", "learning_rate",
                 "grad_norm", "rewards/exact_match/mean", "rewards/exact_match/std"}
STAGE_METRICS = {"eval/accuracy"}  # at step 0 (before training) and the last step (after)
STAGE_PARAMS = {"prep.rows_in", "prep.rows_valid", "prep.rows_quarantined", "plan.generation_rounds", "plan.epochs"}
# The full run switches every toolkit feature on, so each metric the pipeline issue names must reach MLflow.
TOOLKIT = {"grpo.beta": 0.04, "async.use_data_producer": "true", "async.async_prefetch": "true",
           "async.vllm_importance_sampling_correction": "true", "async.off_policy_mask_threshold": 0.5,
           "async.replay_buffer_size": 4, "async.reroll_start_fraction": 0.0,
           "async.skip_zero_advantage_batches": "true", "async.streaming_partial_batch": "true"}
TOOLKIT_METRICS = {"kl", "clip_ratio/region_mean", "sampling/importance_sampling_ratio/min",
                   "sampling/importance_sampling_ratio/mean", "sampling/importance_sampling_ratio/max",
                   "sampling/is_frac_clamped", "sampling/opsm_frac_masked", "replay_buffer_replacements",
                   "replay_buffer_size", "reroll_buffered", "reroll_injected", "reroll_buffer_size",
                   "skipped_zero_adv_batches", "async/staleness_mean", "async/staleness_max", "async/dropped_stale",
                   "async/queue_wait_s", "async/generate_s", "async/train_s", "streaming/chunks",
                   "streaming/reward_wait_s"}


def pipeline_config(tmp_path, uri, **extra):
    return load_config(MICRO, micro_overrides(tmp_path, **{
        "tracking.backend": "mlflow", "tracking.tracking_uri": uri, "tracking.experiment_name": "pipeline-tests",
        "grpo.max_steps": 8, "grpo.logging_steps": 2, "grpo.save_steps": 4, **extra}))


def flow_runs_by_name(parent_id: str) -> dict[str, list]:
    """The flow run ``parent_id`` and its subflow runs (only those: other tests' runs share the server), by flow
    name."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            limit=200, sort=FlowRunSort.EXPECTED_START_TIME_ASC,
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[parent_id])))
        runs += client.read_flow_runs(
            limit=200, sort=FlowRunSort.EXPECTED_START_TIME_ASC,
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent_id])))
        names = {}
        for run in runs:
            names.setdefault(client.read_flow(run.flow_id).name, []).append(run)
    return names


def stage_task_states(server: PrefectServer, pipeline_run_id: str) -> dict[str, list[str]]:
    """State names of the task runs inside one pipeline run's stage subflows, by task name (``prepare-dataset``)."""
    stages = [str(r.id) for runs in flow_runs_by_name(pipeline_run_id).values() for r in runs
              if str(r.id) != pipeline_run_id]
    tasks = server.query("task_runs/filter", {"limit": 200, "offset": 0,
                                              "task_runs": {"flow_run_id": {"any_": stages}}})
    by_name: dict[str, list[str]] = {}
    for t in tasks:
        by_name.setdefault(t["name"].rsplit("-", 1)[0], []).append(t["state"]["name"])
    return by_name


def test_progress_artifact_is_written_at_logs_and_the_end_and_throttled_between(prefect_in_process, monkeypatch):
    """The train flow's progress artifact: every logging step, the last step and the end of training are written, so
    the page ends on the last step whatever the timing; between them at most one update per ``min_interval_s`` (each
    is a synchronous API call in the training loop). Its clock is the test's: each step takes 2 s, which the ETA
    says for the steps left."""
    from prefect import flow
    from transformers import TrainerState

    import flows.progress

    written: list[str] = []
    real = flows.progress.update_progress_artifact

    def spy(artifact_id, **kw):
        written.append(kw["description"])
        return real(artifact_id, **kw)

    monkeypatch.setattr(flows.progress, "update_progress_artifact", spy)

    @flow
    def train_like(min_interval_s: float) -> str:
        now = [0.0]
        progress = flows.progress.PrefectProgress({"accuracy": 0.25}, min_interval_s=min_interval_s,
                                                  clock=lambda: now[0])
        state = TrainerState(max_steps=20, is_world_process_zero=True)
        progress.on_train_begin(None, state, None)
        for step in range(1, 21):
            state.global_step, now[0] = step, 2.0 * step
            progress.on_step_end(None, state, None)
            if step % 10 == 0:
                progress.on_log(None, state, None, logs={"reward": step / 40, "reward_std": 0.1})
        progress.on_train_end(None, state, None)
        return str(progress.artifact_ids[0])

    artifact_id = train_like(3600.0)
    assert written == ["step 1/20 · eval accuracy before 0.250 · ETA 38s (19 steps left)",  # the first step
                       "step 10/20 · reward 0.250 ±0.10 · eval accuracy before 0.250 · ETA 20s (10 steps left)",
                       "step 20/20 · reward 0.250 ±0.10 · eval accuracy before 0.250",  # the last step
                       "step 20/20 · reward 0.500 ±0.10 · eval accuracy before 0.250",  # its log
                       "step 20/20 · reward 0.500 ±0.10 · eval accuracy before 0.250"], written  # the end
    [artifact] = prefect_in_process.query("artifacts/filter", {"limit": 5, "offset": 0,
                                                               "artifacts": {"id": {"any_": [artifact_id]}}})
    assert artifact["data"] == 100.0 and artifact["description"] == written[-1], artifact

    written.clear()
    train_like(0.0)  # no throttle: every step, both logs and the end
    assert len(written) == 20 + 2 + 1, written


def test_a_resumed_training_says_where_it_continues_and_its_eta_counts_from_there(prefect_in_process):
    """Resumed from checkpoint-43 of 150, the console says so first, and the console line and the progress artifact
    give the ETA for the 100 steps left at the pace of the 7 steps run since the resume (2 s each, on the test's
    clock: 3m20s), not of steps an earlier process ran."""
    from prefect import flow
    from transformers import TrainerState

    from flows.progress import PrefectProgress
    from grpo.training.train import ConsoleProgress

    @flow
    def resumed() -> tuple[list[str], str]:
        now, lines = [1000.0], []
        console = ConsoleProgress(lines.append, resumed_from=Path("runs/x/checkpoints/checkpoint-43"),
                                  clock=lambda: now[0])
        progress = PrefectProgress(min_interval_s=0.0, clock=lambda: now[0])
        state = TrainerState(max_steps=150, global_step=43, is_world_process_zero=True)  # the checkpoint's state
        for callback in (console, progress):
            callback.on_train_begin(None, state, None)
        for step in range(44, 51):
            state.global_step, now[0] = step, now[0] + 2.0
            progress.on_step_end(None, state, None)
        for callback in (console, progress):
            callback.on_log(None, state, None, logs={"reward": 0.5, "loss": 0.01})
        console.on_log(None, state, None, logs={"train_runtime": 14.0})  # the trainer's closing summary
        return lines, str(progress.artifact_ids[0])

    lines, artifact_id = resumed()
    assert lines == ["resumed from checkpoint-43: step 43 of 150",
                     "step 50/150 | reward 0.500 | loss 0.01 | 2.0 s/step | ETA 3m20s (100 steps left)",
                     "train: 7 steps in 14s, from step 43 to 50"], lines
    [artifact] = prefect_in_process.query("artifacts/filter", {"limit": 5, "offset": 0,
                                                               "artifacts": {"id": {"any_": [artifact_id]}}})
    assert artifact["description"] == "step 50/150 · reward 0.500 · ETA 3m20s (100 steps left)", artifact


def test_pipeline_run_is_one_prefect_flow_run_and_one_mlflow_run(tmp_path, prefect_in_process, mlflow_server):
    from flows.pipeline import grpo_pipeline

    cfg = pipeline_config(tmp_path, mlflow_server.uri, **TOOLKIT)
    summary = grpo_pipeline(config=cfg, run_name="full")
    assert summary["steps"] == 8 and summary["mlflow_run_id"] and summary["prefect_flow_run_id"]

    # Prefect: this pipeline run and exactly its stage subflows, each once (eval twice: before and after), completed;
    # the artifacts are this run's own (filtered by its flow runs: other tests share the server).
    flow_run_id = summary["prefect_flow_run_id"]
    runs = flow_runs_by_name(flow_run_id)
    assert {name: len(r) for name, r in runs.items()} == {"grpo-pipeline": 1, "grpo-prep": 1, "grpo-plan": 1,
                                                          "grpo-policy": 1, "grpo-train": 1, "grpo-eval": 2}, runs
    assert str(runs["grpo-pipeline"][0].id) == flow_run_id
    assert all(r.state.is_completed() for rs in runs.values() for r in rs)
    ids = [str(r.id) for rs in runs.values() for r in rs]
    keys = [a["key"] for a in prefect_in_process.query("artifacts/filter", {
        "sort": "KEY_ASC", "limit": 200, "offset": 0, "artifacts": {"flow_run_id": {"any_": ids}}})]
    assert {"dataset-prep", "dataset-stats", "sampler-plan", "plan-balance", "training-progress", "eval-before",
            "eval-after", "eval-samples-after", "mlflow-run", "grpo-run-summary"} <= set(keys)
    assert keys.count("mlflow-run") == 1 and keys.count("grpo-run-summary") == 1, keys
    # the pipeline's own flow run repeats the key facts (#15): data, plan, the outcome in a table
    own = {a["key"]: a for a in prefect_in_process.query("artifacts/filter", {"limit": 50, "offset": 0, "artifacts": {
        "flow_run_id": {"any_": [flow_run_id]}}})}
    assert {"mlflow-run", "grpo-run-summary", "run-dataset", "run-plan"} <= set(own), sorted(own)
    assert "rows in: **" in own["run-dataset"]["description"] and "train" in own["run-dataset"]["data"]
    assert "optimizer steps: 8" in own["run-plan"]["data"]
    outcome = own["grpo-run-summary"]["data"]
    assert re.search(r"\| eval accuracy \| \d\.\d{3} → \*\*\d\.\d{3}\*\* \([+-]\d\.\d{3}\) \|", outcome), outcome
    assert f"| MLflow run | `{summary['mlflow_run_id']}` |" in outcome and "| optimizer steps | 8 |" in outcome
    # the progress artifact says more than a percentage: the step, the reward, the accuracy before training
    [progress] = [a for a in prefect_in_process.query("artifacts/filter", {"limit": 50, "offset": 0, "artifacts": {
        "flow_run_id": {"any_": ids}, "key": {"any_": ["training-progress"]}}})]
    assert progress["data"] == 100.0
    assert re.fullmatch(r"step 8/8 · reward \d\.\d{3} ±\d\.\d\d · eval accuracy before \d\.\d{3}",
                        progress["description"]), progress["description"]

    # MLflow: params = the flattened config, every stage's metrics with steps, artifacts, the model, the tags.
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(summary["mlflow_run_id"])
    tracked = client.search_runs([run.info.experiment_id],
                                 filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")
    assert [r.info.run_id for r in tracked] == [summary["mlflow_run_id"]]  # one MLflow run for the whole pipeline
    assert run.data.params["grpo.learning_rate"] == str(cfg.grpo.learning_rate)
    assert run.data.params["model.tiny.hidden_size"] == "64"
    assert run.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
    for name in ("torch", "transformers", "trl", "accelerate", "datasets", "mlflow", "prefect"):
        assert run.data.tags[f"grpo.version.{name}"] == metadata.version(name), name
    missing = ({train_key(k) for k in TRAIN_METRICS | TOOLKIT_METRICS} | STAGE_METRICS) - set(run.data.metrics)
    assert not missing, missing
    # one-off figures are params, not single-point metric charts; eval before/after is one line
    assert not [k for k in run.data.metrics if k.startswith(("prep/", "plan/")) or k.endswith(("_before", "_after"))]
    assert STAGE_PARAMS <= set(run.data.params) and int(run.data.params["prep.rows_valid"]) > 0
    accuracy = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "eval/accuracy")]
    assert accuracy == [(0, summary["eval_accuracy_before"]), (8, summary["eval_accuracy_after"])]
    # the data trained on, as MLflow dataset inputs (the Datasets column said "None"): content hash and row counts
    inputs = {i.dataset.name: i for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"synthetic:addition:train", "synthetic:addition:eval"}, inputs
    train = inputs["synthetic:addition:train"]
    assert summary["data_content_hash"].startswith(train.dataset.digest)
    assert json.loads(train.dataset.profile)["num_rows"] == cfg.data.num_train
    assert [t.value for t in train.tags if t.key == "mlflow.data.context"] == ["training"]
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    history = [m.step for m in client.get_metric_history(run.info.run_id, "train/reward")]
    assert history == [2, 4, 6, 8]
    assert any(k.startswith("system/") for k in run.data.metrics)
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    artifacts |= {a.path for d in ("data", "plan", "eval") for a in client.list_artifacts(run.info.run_id, d)}
    assert {"config.yaml", "summary.json", "data/stats.json", "data/quarantine.jsonl", "plan/plan.json",
            "eval/samples_after.json"} <= artifacts, artifacts
    models = client.search_logged_models(experiment_ids=[run.info.experiment_id])
    [model] = [m for m in models if m.source_run_id == run.info.run_id]
    # the model carries the evaluation after training (not the one before) and the run's params
    assert {(m.key, m.step, m.value) for m in model.metrics if m.key == "eval/accuracy"} == {
        ("eval/accuracy", 8, summary["eval_accuracy_after"])}
    assert model.params["grpo.learning_rate"] == str(cfg.grpo.learning_rate)
    assert run.info.status == "FINISHED"


def test_prep_and_plan_are_cached_across_runs(tmp_path, prefect_in_process, mlflow_server):
    from flows.pipeline import grpo_pipeline

    # data.seed unique to this test: no earlier run in this session prepared (or planned) this data
    unique = {"data.seed": 1717}
    first = grpo_pipeline(config=pipeline_config(tmp_path, mlflow_server.uri, **unique), run_name="cache-a")
    second = grpo_pipeline(
        config=pipeline_config(tmp_path, mlflow_server.uri, **unique, **{"grpo.learning_rate": 3e-4}),
        run_name="cache-b")
    a, b = RunDir(tmp_path / "cache-a").inputs(), RunDir(tmp_path / "cache-b").inputs()
    assert a["data_dir"] == b["data_dir"] and a["plan_path"] == b["plan_path"]  # only a training field changed
    # Each run's own task runs: the first computed prep and plan, the second took both from Prefect's cache.
    assert stage_task_states(prefect_in_process, first["prefect_flow_run_id"]) == {
        "prepare-dataset": ["Completed"], "write-plan": ["Completed"]}
    assert stage_task_states(prefect_in_process, second["prefect_flow_run_id"]) == {
        "prepare-dataset": ["Cached"], "write-plan": ["Cached"]}
    assert first["mlflow_run_id"] != second["mlflow_run_id"]


def test_a_run_context_is_found_by_its_run_directory_only_while_registered(tmp_path, monkeypatch):
    """#29: the one registry behind the flows' hand-offs. A context registered for a run directory is found from any
    spelling of that directory, a nested registration is undone on the way out, another directory (or none
    registered) gets a context of its own; a trial's context shares its sweep's flow-run list and nothing else."""
    from grpo.pipeline.run_context import RunContext

    monkeypatch.chdir(tmp_path)
    outer, inner, hook = RunContext(), RunContext(), object()
    with outer.registered("runs/a"):
        assert RunContext.for_run_dir(tmp_path / "runs" / "a") is outer
        with inner.registered(tmp_path / "runs" / "a"):
            assert RunContext.for_run_dir("runs/a") is inner
        assert RunContext.for_run_dir("runs/./a") is outer
        own = RunContext.for_run_dir("runs/b")
        assert own is not outer and own is not inner and own.flow_runs == [] and own.callbacks == []
    assert RunContext.for_run_dir("runs/a") is not outer
    trial = outer.for_trial([hook])
    assert trial.flow_runs is outer.flow_runs and trial.callbacks == [hook] and outer.callbacks == []
    assert trial.tracker is None and trial.tracking_callbacks() == []


def test_the_callers_run_context_reaches_the_train_subflow(tmp_path, prefect_in_process, mlflow_server):
    """#29: a caller in this process hands the pipeline flow live objects in a RunContext registered under the run
    directory (the flow's parameters stay JSON): its trainer callback runs in the ``grpo-train`` subflow beside the
    tracker's (the run's train/ metrics reach MLflow), the pipeline's flow run id lands in the caller's list, and
    afterwards the context holds no tracker and the registry no context."""
    from transformers import TrainerCallback

    from flows.pipeline import grpo_pipeline
    from grpo.pipeline.run_context import RunContext

    class Steps(TrainerCallback):
        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.seen.append(state.global_step)

    steps = Steps()
    context = RunContext(callbacks=[steps])
    cfg = pipeline_config(tmp_path, mlflow_server.uri, **{"grpo.max_steps": 2, "grpo.save_steps": 2})
    with context.registered(tmp_path / "handed"):
        summary = grpo_pipeline(config=cfg, run_name="handed")
    assert steps.seen == [1, 2]
    assert context.flow_runs == [summary["prefect_flow_run_id"]]
    history = MlflowClient(mlflow_server.uri).get_metric_history(summary["mlflow_run_id"], "train/reward")
    assert [m.step for m in history] == [2]
    assert context.tracker is None and RunContext.for_run_dir(tmp_path / "handed") is not context


NOISE = [
    re.compile(r"^\s*(\d+\s+)?\d+\s+[A-Z][A-Z_]{3,}(\s|$)"),  # dill's bytecode disassembly (`159 0 RESUME`)
    re.compile(r"LOAD_GLOBAL|RETURN_VALUE|FutureWarning|Writing model shards|Loading weights|mtime may not be reliable"
               r"|Skip logging GPU metrics|Unable to find license information|Creating initial MLflow database"),
    re.compile(r"'(loss|reward)': '"),  # transformers' quoted-dict progress line
]


def assert_readable_console(out: str, steps: int) -> None:
    """What a user reads: one compact line per logged step, stages named after themselves, no library noise."""
    lines = out.splitlines()
    noisy = [line for line in lines if any(p.search(line) for p in NOISE)]
    assert not noisy, "\n".join(noisy[:10])
    assert max(map(len, lines)) < 300, max(lines, key=len)
    assert any(re.search(rf"Flow run 'train' - step {steps}/{steps} \| reward \d\.\d{{3}}", line)
               for line in lines), out
    assert any(" - data: " in line and "rows valid" in line for line in lines), out


def test_mlflow_outage_mid_run_loses_no_metric(tmp_path):
    """The tracking server dies after step 3 and comes back later: training goes on (its points wait in the spool)
    and every point reaches MLflow, those logged during the outage too. The recipe runs in a thread of this process
    (the tracker is what is tested, not the CLI: the console is checked by the killed-resume test)."""
    import threading

    from grpo.pipeline.experiment import run_experiment
    from grpo.runs import open_run_dir

    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        cfg = load_config(MICRO, micro_overrides(tmp_path, **{
            "tracking.backend": "mlflow", "tracking.tracking_uri": server.uri, "tracking.experiment_name": "outage",
            "tracking.log_system_metrics": "false", "evaluation.enabled": "false", "grpo.max_steps": 30,
            "grpo.save_steps": 1000, "grpo.logging_steps": 1}))
        run = open_run_dir(cfg, "outage", resume=False)
        result: dict = {}

        def train() -> None:
            try:
                result["summary"] = run_experiment(cfg, run, log=lambda *_: None)
            except BaseException as err:  # noqa: BLE001 - reported below
                result["error"] = err

        thread = threading.Thread(target=train)
        thread.start()

        def lines() -> int:
            return len(run.metrics_file.read_text().splitlines()) if run.metrics_file.is_file() else 0

        def wait_for_lines(n: int) -> None:
            deadline = time.monotonic() + 400
            while lines() < n:
                assert thread.is_alive(), f"training ended first: {result}"  # e.g. finished before the outage
                assert time.monotonic() < deadline, "timed out"
                time.sleep(0.2)

        wait_for_lines(3)
        server.stop(kill=True)
        down_at = lines()
        wait_for_lines(down_at + 3)  # training goes on while the server is down
        during = lines() - down_at
        server.start()
        thread.join(600)
        assert not thread.is_alive() and "error" not in result, result
        summary = result["summary"]
        logged = [json.loads(line) for line in run.metrics_file.read_text().splitlines()]
        expected = [row["step"] for row in logged if "reward" in row["metrics"]]
        got = [m.step for m in MlflowClient(server.uri).get_metric_history(summary["mlflow_run_id"], "train/reward")]
        assert got == expected and len(expected) == 30
        assert during >= 3  # and the steps logged during the outage reached MLflow too (all 30 did)
        assert MlflowClient(server.uri).get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
    finally:
        server.stop(kill=True)


def _fail_once(name: str, marker: Path, after_calls: int = 0):
    """A reward that raises exactly once, on call ``after_calls + 1`` (a transient fault), then scores normally."""
    from grpo.rewards import exact_match, register_reward

    calls = {"n": 0}

    def reward(completions, answer, **kwargs):
        calls["n"] += 1
        if calls["n"] > after_calls and not marker.exists():
            marker.write_text("failed once")
            raise RuntimeError(f"{name}: transient failure")
        return exact_match(completions, answer)

    return register_reward(name)(reward)


def test_eval_retries_and_a_retried_pipeline_resumes_training(tmp_path, prefect_in_process, mlflow_server):
    """A transient fault in evaluation is absorbed by the eval flow's retry; a fault that kills training fails the
    pipeline attempt, and Prefect's retry of the flow run resumes from the last checkpoint into the same MLflow run."""
    from flows.pipeline import grpo_pipeline

    _fail_once("flaky_eval_reward", tmp_path / "eval-failed")
    _fail_once("flaky_train_reward", tmp_path / "train-failed", after_calls=5)  # step 6; checkpoint at step 4
    cfg = pipeline_config(tmp_path, mlflow_server.uri, **{
        "grpo.reward_funcs": "[flaky_train_reward]", "evaluation.correctness_reward": "flaky_eval_reward",
        "evaluation.pass_k": 0})
    summary = grpo_pipeline.with_options(retries=1, retry_delay_seconds=0)(config=cfg, run_name="retried")

    assert (tmp_path / "eval-failed").exists() and (tmp_path / "train-failed").exists()
    assert summary["steps"] == 8 and summary["resumed_from"].endswith("checkpoint-4"), summary
    runs = flow_runs_by_name(summary["prefect_flow_run_id"])
    [pipeline] = [r for r in runs["grpo-pipeline"] if str(r.id) == summary["prefect_flow_run_id"]]
    assert pipeline.run_count == 2 and pipeline.state.is_completed()
    assert any(r.run_count == 2 and r.state.is_completed() for r in runs["grpo-eval"])  # retried, then passed
    client = MlflowClient(mlflow_server.uri)
    assert [m.step for m in client.get_metric_history(summary["mlflow_run_id"], "train/reward")] == [2, 4, 6, 8]
    assert client.get_run(summary["mlflow_run_id"]).info.status == "FINISHED"
