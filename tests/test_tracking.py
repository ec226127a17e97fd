"""MLflow tracking against a real ``mlflow server`` (one per session) and the embedded SQLite default; no mocks."""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient
from transformers import TrainerControl, TrainerState

from grpo.config import flatten, load_config
from grpo.tracking.metric_keys import read_run_metric, train_key
from grpo.tracking.model_logging import log_model, use_tracking_uri
from grpo.tracking.store import TrackingError, resolve_tracking_uri
from grpo.tracking.tracker import MlflowCallback, MlflowTracker, log_metrics_file, tracker_from_config
from grpo.tracking.values import MAX_PARAM_VAL_LENGTH, param_value

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture
def make_tracker(tmp_path):
    """Trackers with short intervals; every one is closed at teardown (its sender thread stopped)."""
    made: list[MlflowTracker] = []

    def make(uri: str, spool: Path | None = None, **kwargs) -> MlflowTracker:
        kwargs.setdefault("flush_interval", 0.2)
        kwargs.setdefault("max_backoff", 1.0)
        kwargs.setdefault("http_timeout", 5.0)
        kwargs.setdefault("strict", True)
        tracker = MlflowTracker(uri, spool or tmp_path / "run" / "tracking_spool", **kwargs)
        made.append(tracker)
        return tracker

    yield make
    for tracker in made:
        if tracker.run_id is not None:
            tracker.close(timeout=5)


def history_steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_metrics_params_tags_artifacts_round_trip(mlflow_server, make_tracker, tmp_path):
    cfg = load_config(None)
    params = flatten(cfg)
    params["notes.long"] = "x" * (MAX_PARAM_VAL_LENGTH + 500)
    tracker = make_tracker(mlflow_server.uri, log_system_metrics=True, system_metrics_interval=0.2)
    run_id = tracker.start("roundtrip", "grpo-test", tags={"stage": "test", "git": "abc"}, params=params)

    callback = MlflowCallback(tracker)
    state, control = TrainerState(), TrainerControl()
    for step in range(1, 31):
        state.global_step = step
        callback.on_log(None, state, control, logs={
            "loss": 1.0 / step, "reward": step * 0.1, "learning_rate": 1e-4, "epoch": step / 30,
            "eval_pass@8": 0.5, "grad_norm": float("nan"), "note": "text", "flag_list": [1, 2],
        })
    tracker.log_metrics({"eval/accuracy": 0.25}, step=0)
    tracker.log_metrics({"eval/accuracy": 0.75}, step=30)

    (tmp_path / "summary.json").write_text(json.dumps({"steps": 30}))
    assert tracker.log_artifact(tmp_path / "summary.json", "results")
    assert tracker.log_dict({"a": 1, "b": [1, 2]}, "config/resolved.json")
    assert tracker.log_table({"prompt": ["1+1=", "2+2="], "completion": ["2", "4"]}, "samples/eval.json")
    assert tracker.set_tags({"status_note": "done"})
    time.sleep(0.8)  # a few system-metric samples
    assert tracker.close(timeout=20)

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "roundtrip"
    # MLflow's kind for a training experiment (the UI's view is chosen by the links' workflowType: mlflow_ui_url)
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # an experiment made before the tag (or by another tool) gets it at its next run's start
    old_exp = client.create_experiment(f"untagged-{run_id[:8]}")
    other = make_tracker(mlflow_server.uri, tmp_path / "untagged")
    other.start("late", f"untagged-{run_id[:8]}")
    assert other.close(timeout=10)
    assert client.get_experiment(old_exp).tags["mlflow.experimentKind"] == "custom_model_development"
    # the trainer's, under train/: the reward's first, the other top-level figures in train/aux
    assert [train_key(k) for k in ("reward", "loss", "learning_rate")] == [
        "train/reward", "train/aux/loss", "train/aux/learning_rate"]
    for key in ("loss", "reward", "learning_rate", "epoch", "eval_pass_at_8"):
        assert history_steps(client, run_id, train_key(key)) == list(range(1, 31)), key
    assert not {train_key("grad_norm"), train_key("note"), "reward", "loss"} & set(run.data.metrics)  # NaN, text
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "train/aux/loss")}
    assert loss[4] == pytest.approx(0.25)
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval/accuracy")} == {0: 0.25, 30: 0.75}
    assert any(k.startswith("system/cpu_utilization_percentage") for k in run.data.metrics)

    logged = run.data.params
    assert set(logged) == set(params)
    assert logged["grpo.learning_rate"] == str(cfg.grpo.learning_rate)
    assert json.loads(logged["grpo.reward_funcs"]) == cfg.grpo.reward_funcs
    assert len(logged["notes.long"]) == MAX_PARAM_VAL_LENGTH and logged["notes.long"].endswith("[truncated]")
    assert run.data.tags["stage"] == "test" and run.data.tags["status_note"] == "done"

    paths = {a.path for a in client.list_artifacts(run_id)} | {
        a.path for d in ("results", "config", "samples") for a in client.list_artifacts(run_id, d)
    }
    assert {"results/summary.json", "config/resolved.json", "samples/eval.json"} <= paths
    table = json.loads(Path(client.download_artifacts(run_id, "samples/eval.json", str(tmp_path / "dl"))).read_text())
    assert table["columns"] == ["prompt", "completion"] and len(table["data"]) == 2


def test_system_metrics_follow_the_runs_first_own_metric(mlflow_server, make_tracker, tmp_path):
    """MLflow keeps a run's metric keys in the order they arrived and its Compare page plots the first one: the system
    metrics sampler's first sample (logged here as it logs it, before the evaluation that comes in a run after a few
    seconds) waits for the run's own first metric; a run that logs none of its own gets its samples at close."""
    client = MlflowClient(mlflow_server.uri)
    tracker = make_tracker(mlflow_server.uri, tmp_path / "a")
    run_id = tracker.start("system-first", "grpo-test")
    tracker.log_metrics({"system/cpu_utilization_percentage": 5.0}, step=0)
    tracker.log_metrics({"eval/accuracy": 0.2, "eval/pass_at_4": 0.5}, step=0)
    tracker.log_metrics({"system/cpu_utilization_percentage": 7.0}, step=1)
    assert tracker.close(timeout=10)
    assert list(client.get_run(run_id).data.metrics)[:2] == ["eval/accuracy", "eval/pass_at_4"]
    assert history_steps(client, run_id, "system/cpu_utilization_percentage") == [0, 1]

    alone = make_tracker(mlflow_server.uri, tmp_path / "b")
    run_id = alone.start("system-only", "grpo-test")
    alone.log_metrics({"system/cpu_utilization_percentage": 5.0}, step=0)
    assert alone.close(timeout=10)
    assert history_steps(client, run_id, "system/cpu_utilization_percentage") == [0]


def test_server_outage_buffers_and_delivers_exactly_once(make_tracker, tmp_path):
    from tests.servers import MlflowServer

    mlflow_server = MlflowServer(tmp_path / "mlflow").start()  # its own: the session's is shared by other tests
    tracker = make_tracker(mlflow_server.uri)
    run_id = tracker.start("outage", "grpo-test", params={"a": 1})
    keys = ("loss", "reward", "kl")
    step = 0

    def log_for(seconds: float) -> None:
        nonlocal step
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tracker.log_metrics({k: step * 0.5 + i for i, k in enumerate(keys)}, step=step)
            step += 1
            time.sleep(0.01)

    log_for(1.0)
    mlflow_server.stop(kill=True)  # outage: SIGKILL, possibly mid-request
    try:
        log_for(3.0)
        # Each call during the outage lands in the on-disk spool at once (the training thread never waits for the
        # server): the unsent bytes grow with every call.
        for _ in range(3):
            before = tracker.pending()
            log_for(0.0001)
            assert tracker.pending() > before, "a point logged during the outage must wait in the spool"
        assert tracker.last_error is not None
        assert tracker.flush(timeout=0.5) is False  # no server: flush gives up at its timeout and does not raise
    finally:
        mlflow_server.start()  # same port, same store
    try:
        log_for(0.5)
        assert tracker.flush(timeout=30), tracker.last_error
        assert tracker.close(timeout=10)

        client = MlflowClient(mlflow_server.uri)
        for key in keys:
            assert history_steps(client, run_id, key) == list(range(step)), key
        values = {m.step: m.value for m in client.get_metric_history(run_id, "reward")}
        assert all(values[s] == s * 0.5 + 1 for s in range(step))
    finally:
        mlflow_server.stop(kill=True)


def test_nothing_listening_is_unreachable_at_once(make_tracker):
    from tests.servers import free_port

    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingError, match=f"MLflow tracking server {uri} is unreachable: "):
        make_tracker(uri).start("nothing", "grpo-test")


def test_a_busy_server_at_start_is_waited_for_not_called_unreachable(make_tracker, tmp_path, caplog):
    """A server that accepts the connection but does not answer (forced: its process group stopped, as a single
    worker with its SQLite held on a loaded machine behaves) gets a warning and the run starts once it answers.
    Before, the 10-second health check raised "unreachable" and the run failed. Nothing listening is still an error
    at once (``test_nothing_listening_is_unreachable_at_once``)."""
    import logging
    import signal
    import threading

    from tests.servers import MlflowServer

    server = MlflowServer(tmp_path / "mlflow").start()  # its own: the session's is shared by other tests
    tracker = make_tracker(server.uri)  # http_timeout 5 s
    started: dict = {}

    def start() -> None:
        try:
            started["run_id"] = tracker.start("busy", "grpo-test")
        except Exception as err:  # noqa: BLE001 -- shown by the assertion below
            started["error"] = repr(err)

    os.killpg(server.proc.pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING, logger="grpo.tracking"):
            thread = threading.Thread(target=start, daemon=True)
            thread.start()
            deadline = time.monotonic() + 600  # a hung tracker's bound
            while not any("is busy" in r.getMessage() for r in caplog.records):
                assert thread.is_alive() and time.monotonic() < deadline, started
                time.sleep(0.2)
        assert thread.is_alive(), started  # still waiting for the stopped server
        os.killpg(server.proc.pid, signal.SIGCONT)
        thread.join(timeout=600)
        assert "run_id" in started, started
        [warning] = [r.getMessage() for r in caplog.records if "is busy" in r.getMessage()]
        assert warning.startswith(f"MLflow tracking server {server.uri} is busy (no answer to /health in 5 s)")
        assert MlflowClient(server.uri).get_run(started["run_id"]).info.run_name == "busy"
        assert tracker.close(timeout=30)
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)
        server.stop(kill=True)


def test_resume_same_run_no_gaps_no_duplicates(mlflow_server, make_tracker, tmp_path):
    uri, spool = mlflow_server.uri, tmp_path / "resumed" / "tracking_spool"
    params = {"grpo.learning_rate": 1e-4, "grpo.reward_funcs": ["exact_match"]}
    client = MlflowClient(uri)

    # First attempt: steps 0-9 reach MLflow, 10-14 are still in the spool when the process "dies" (the sender only
    # sends on flush here, and the tracker is abandoned without close).
    first = make_tracker(uri, spool, flush_interval=3600, batch_trigger=10**9)
    run_id = first.start("resume", "grpo-test", params=params)
    for s in range(10):
        first.log_metrics({"loss": 10 - s, "reward": s}, step=s)
    assert first.flush(timeout=10)
    first._spool._stop.set()  # the sender thread "dies" with the process: it exits without sending anything new
    first._spool._wake.set()
    first._spool._thread.join(timeout=10)
    for s in range(10, 15):
        first.log_metrics({"loss": 10 - s, "reward": s}, step=s)
    assert history_steps(client, run_id, "loss") == list(range(10))
    first.run_id = None  # abandoned: never closed
    with (spool / "metrics.jsonl").open("ab") as f:
        f.write(b'{"s": 15, "t": 17000000')  # the process died mid-write: a torn last line
    assert MlflowTracker.saved_run_id(spool) == run_id

    # Resume from the checkpoint at step 8: steps 8-14 are logged again by the trainer and must not duplicate.
    second = make_tracker(uri, spool)
    assert second.start("resume", "grpo-test", params=params, run_id=run_id) == run_id
    assert history_steps(client, run_id, "loss") == list(range(15)), "the unsent spool is sent first"
    for s in range(8, 20):
        second.log_metrics({"loss": 10 - s, "reward": s}, step=s)
    assert second.dropped_duplicates == 2 * 7
    assert second.close(timeout=10)

    # A clean second resume (run FINISHED) reopens it and continues.
    third = make_tracker(uri, spool)
    third.start("resume", "grpo-test", params=params, run_id=run_id)
    assert client.get_run(run_id).info.status == "RUNNING"
    for s in range(18, 25):
        third.log_metrics({"loss": 10 - s, "reward": s}, step=s)
    assert third.close(timeout=10)

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in ("loss", "reward"):
        assert history_steps(client, run_id, key) == list(range(25)), key
    assert {m.step: m.value for m in client.get_metric_history(run_id, "reward")} == {s: float(s) for s in range(25)}
    assert run.data.params["grpo.reward_funcs"] == param_value(["exact_match"])
    with pytest.raises(TrackingError):
        make_tracker(uri, tmp_path / "other").start("x", "grpo-test", run_id="0" * 32)


def test_log_model_transformers_flavour_offline(mlflow_server, make_tracker, tmp_path):
    import mlflow.transformers

    from grpo.training.tiny_model import build_char_tokenizer, build_tiny_qwen2

    tokenizer = build_char_tokenizer("0123456789+= ")
    model = build_tiny_qwen2(tokenizer, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=32, seed=0)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    tracker = make_tracker(mlflow_server.uri)
    run_id = tracker.start("with-model", "grpo-test", params={"grpo.learning_rate": 3e-4, "grpo.beta": 0.0})
    # as the recipe logs them: eval before training at step 0, training, eval after at the last step (still in the
    # spool when the model is logged: log_model sends it first)
    tracker.log_metrics({"eval/accuracy": 0.25, "eval/pass_at_4": 0.5}, step=0)
    tracker.log_metrics({"train/reward": 0.4}, step=3)
    tracker.log_metrics({"eval/accuracy": 0.75, "eval/pass_at_4": 0.9}, step=3)
    info = log_model(tracker, model_dir, model_dir, step=3)
    assert tracker.close(timeout=10)

    client = MlflowClient(mlflow_server.uri)
    outputs = client.get_run(run_id).outputs.model_outputs
    assert [o.model_id for o in outputs] == [info.model_id]
    logged = client.get_logged_model(info.model_id)
    assert logged.source_run_id == run_id and str(logged.status) in ("READY", "LoggedModelStatus.READY")
    assert logged.name == "with-model"  # the run's name: every run's model was "model" in the Models list
    # the model's page shows the evaluation after training (step 3), not the one before, and the run's params
    linked = {m.key: (m.step, m.value) for m in logged.metrics}
    assert linked["eval/accuracy"] == (3, 0.75) and linked["eval/pass_at_4"] == (3, 0.9), linked
    assert logged.params == {"grpo.learning_rate": "0.0003", "grpo.beta": "0.0"}
    # linking logged nothing twice in the run
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "eval/accuracy")] == [(0, 0.25), (3, 0.75)]
    files = {a.path for a in client.list_logged_model_artifacts(info.model_id)}
    assert {"MLmodel", "model", "components"} <= files, files

    with use_tracking_uri(mlflow_server.uri):
        pipe = mlflow.transformers.load_model(f"runs:/{run_id}/with-model")  # named after its run
    out = pipe("1+2=", max_new_tokens=2, do_sample=False)
    assert out[0]["generated_text"].startswith("1+2=")


def test_embedded_sqlite_default(make_tracker, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = resolve_tracking_uri(None, tmp_path)
    assert uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://example.invalid:5000")
    assert resolve_tracking_uri(None, tmp_path) == "http://example.invalid:5000"
    assert resolve_tracking_uri("sqlite:////x/y.db", tmp_path) == "sqlite:////x/y.db"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")

    assert tracker_from_config(load_config(None), tmp_path / "run") is None  # backend: none

    tracker = make_tracker(uri)
    run_id = tracker.start("local", "grpo-local", params={"model.name_or_path": "tiny"})
    for s in range(5):
        tracker.log_metrics({"loss": 1.0 / (s + 1)}, step=s)
    recorded = tmp_path / "metrics.jsonl"  # grpo.training.train.MetricsRecorder's format, replayed twice: no duplicates
    recorded.write_text("".join(json.dumps({"step": s, "metrics": {"loss": 1 / s}}) + "\n" for s in (2, 4, 6)))
    assert log_metrics_file(tracker, recorded, prefix="train/") == 3
    assert log_metrics_file(tracker, recorded, prefix="train/") == 3
    wide = {f"probe/{i}": float(i) for i in range(1500)}  # one step with more points than one log_batch takes
    tracker.log_metrics(wide, step=3)
    (tmp_path / "note.txt").write_text("hello")
    assert tracker.log_artifact(tmp_path / "note.txt")
    assert tracker.flush(timeout=10)
    # A send to the in-process SQL store pauses the garbage collector; it leaves it as it found it, on or off.
    assert gc.isenabled()
    tracker.log_metrics({"loss": 0.1}, step=5)
    gc.disable()
    try:
        assert tracker.close(timeout=10)
        assert not gc.isenabled()
    finally:
        gc.enable()

    assert (tmp_path / "mlflow.db").is_file()
    client = MlflowClient(uri)
    assert history_steps(client, run_id, "loss") == list(range(6))
    assert history_steps(client, run_id, "train/aux/loss") == [2, 4, 6]
    # a sweep's --metric reads a trainer figure under either naming (runs logged before train/aux/ have train/loss)
    assert read_run_metric(client, run_id, "train/loss") == read_run_metric(client, run_id, "train/aux/loss") == 1 / 6
    run = client.get_run(run_id)
    assert sum(k.startswith("probe/") for k in run.data.metrics) == 1500 and run.data.metrics["probe/1499"] == 1499.0
    # Resending a batch whose reply was lost is harmless: the SQL store ignores an exact (key, step, ts, value) repeat.
    point = client.get_metric_history(run_id, "loss")[0]
    client.log_batch(run_id, metrics=[point])
    assert len(client.get_metric_history(run_id, "loss")) == 6
    assert client.get_run(run_id).data.params == {"model.name_or_path": "tiny"}
    assert (tmp_path / "mlartifacts" / "grpo-local" / run_id / "artifacts" / "note.txt").is_file()


def test_batches_respect_mlflow_limit_and_line_boundaries():
    lines = [(10, ["a"] * 600), (20, ["b"] * 300), (30, ["c"] * 2500), (40, []), (50, ["d"] * 5)]
    from grpo.tracking.spool import Spool

    out = list(Spool.batches(lines, 1000))
    assert all(len(batch) <= 1000 for _, batch in out)
    assert [(end, len(batch)) for end, batch in out] == [(20, 900), (None, 1000), (None, 1000), (50, 505)]
    assert sum(len(b) for _, b in out) == 3405


def test_keys_and_param_values():
    from grpo.tracking.values import sanitize_metric_key

    assert sanitize_metric_key("eval/pass@8") == "eval/pass_at_8"
    assert sanitize_metric_key("/rewards//exact match (mean)/") == "rewards/exact match _mean_"
    assert sanitize_metric_key("../x") == "x"
    assert (param_value(None) == "None" and param_value(0.5) == "0.5"
            and param_value({"b": 1, "a": [1]}) == '{"a":[1],"b":1}')
