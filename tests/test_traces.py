"""Episodes as MLflow traces (#30 §5): a short environment run against a real ``mlflow server`` writes the sampled
episodes as traces linked to its run, with one chat span per model turn and one tool span per tool call; with the
server gone, training still runs to its end and the traces are counted as dropped."""

from __future__ import annotations

import json
import os
import re

import pytest
from mlflow import MlflowClient
from transformers import TrainerCallback

from grpo.environments import register_environment
from grpo.environments.base import Environment, StepResult, ToolCall
from grpo.tracking.traces import DROPPED_METRIC, WRITTEN_METRIC
from grpo.tracking.tracker import MlflowCallback, MlflowTracker
from tests.browser import SCREENSHOTS, chromium_page
from tests.servers import MlflowServer
from tests.trainers import environment_trainer

pytestmark = pytest.mark.integration
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PER_BATCH = 3
STEPS = 4
LOGGING_STEPS = 2  # one generation batch per step: traces from steps 1 and 3 only, a sample per logging interval


@register_environment("trace_probe")
class TraceProbe(Environment):
    """Every model turn is one token (the empty stop string matches at once) and makes one tool call, alternately
    answered and failed; the third turn ends the episode with reward 1. So each episode's tool calls equal its
    turns, whatever the model writes (an end-of-sequence token ends it earlier)."""

    stop_strings = ("",)
    alphabet = "1"
    default_reward = 0.0

    def reset(self, **row):
        self.turn = 0
        return None

    def step(self, action):
        self.turn += 1
        call = ToolCall("probe", "ok" if self.turn % 2 else "error", 0.001)
        return StepResult("1", self.turn >= 3, 1.0 if self.turn >= 3 else None, (call,))


class EpisodeCounter(TrainerCallback):
    """Records what the trainer hands to ``on_episodes``."""

    def __init__(self) -> None:
        self.batches: list[list[dict]] = []

    def on_episodes(self, args, state, control, episodes=None, **kwargs):
        self.batches.append(list(episodes))


def train_with_traces(tmp_path, uri: str, kill: MlflowServer | None = None, steps: int = STEPS):
    trainer = environment_trainer(tmp_path, "trace_probe", **{
        "environment.trace_episodes_per_log": PER_BATCH, "grpo.max_steps": steps, "grpo.logging_steps": LOGGING_STEPS,
        "grpo.save_steps": 100})
    tracker = MlflowTracker(uri, tmp_path / "spool", flush_interval=0.2, max_backoff=1.0, http_timeout=5.0)
    run_id = tracker.start("traces", "grpo-traces-test")
    counter = EpisodeCounter()
    trainer.add_callback(MlflowCallback(tracker))
    trainer.add_callback(counter)
    if kill is not None:
        kill.stop(kill=True)
    trainer.train()
    traces = tracker._traces
    tracker.close(timeout=10)
    return trainer, tracker, run_id, counter, traces


def test_sampled_episodes_are_traces_of_the_run(tmp_path, mlflow_server):
    trainer, tracker, run_id, counter, _ = train_with_traces(tmp_path, mlflow_server.uri)
    assert trainer.state.global_step == STEPS and counter.batches
    records = [r for batch in counter.batches for r in batch]
    assert all(len(batch) == PER_BATCH for batch in counter.batches)
    assert [{r["step"] for r in batch} for batch in counter.batches] == [{1}, {3}]  # once per logging interval

    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    traces = client.search_traces(locations=[run.info.experiment_id], run_id=run_id, max_results=100)
    assert len(traces) == len(records) == run.data.metrics[WRITTEN_METRIC]
    assert run.data.metrics[DROPPED_METRIC] == 0
    assert sorted(int(t.info.tags["step"]) for t in traces) == sorted(r["step"] for r in records)
    tool_calls = 0
    timed = False
    for trace in traces:
        assert trace.info.trace_metadata["mlflow.sourceRun"] == run_id
        spans = trace.data.spans
        [root] = [s for s in spans if s.parent_id is None]
        assert root.span_type == "AGENT" and root.name == "trace_probe"
        assert root.inputs["prompt"] and root.attributes["environment"] == "trace_probe"
        assert root.attributes["stop_reason"] in ("eos", "done", "max_tokens")
        assert float(trace.info.tags["reward"]) == root.attributes["reward"]
        chats = [s for s in spans if s.span_type == "CHAT_MODEL"]
        tools = [s for s in spans if s.span_type == "TOOL"]
        assert len(chats) == root.attributes["turns"] >= 1
        assert all(s.parent_id == root.span_id for s in chats)
        assert len(tools) == len(chats)  # one call per turn: the probe's rule
        by_turn = {s.span_id: s.attributes["turn"] for s in chats}
        for tool in tools:
            assert tool.name == "probe" and tool.parent_id in by_turn
            assert tool.attributes["status"] == ("ok" if by_turn[tool.parent_id] % 2 else "error")
        tool_calls += len(tools)
        # the runner's measured times (they were laid out on a clock where a turn took no time): a turn from its
        # batched generate call to the end of its environment step, a tool call its latency inside that step
        turns = {s.span_id: s for s in chats}
        for chat in chats:  # (times come back with float precision: ~0.3 µs)
            assert chat.attributes["generate_s"] > 0 and chat.attributes["step_s"] > 0, chat.to_dict()
            laid_out = (chat.attributes["generate_s"] + 0.001) * 1e9  # the generation, then the probe's 0.001 s
            assert chat.end_time_ns - chat.start_time_ns >= laid_out - 1e3, chat.to_dict()
            assert root.start_time_ns <= chat.start_time_ns and chat.end_time_ns <= root.end_time_ns
        for tool in tools:
            turn = turns[tool.parent_id]
            assert tool.end_time_ns - tool.start_time_ns == pytest.approx(1e6, abs=1e3)  # the probe's 0.001 s
            assert turn.start_time_ns <= tool.start_time_ns and tool.end_time_ns <= turn.end_time_ns
        timed = timed or len(chats) > 1
    assert timed
    assert tool_calls == sum(len(r["tool_calls"]) for r in records)
    json.dumps(records)  # plain data: nothing of MLflow or torch in what the trainer hands over

    # what a person sees: the trace's span tree in MLflow's UI gives each turn its time, the model's generation
    # included (a turn read 0.00ms, or just its tool calls' latency: the probe's 1.00ms)
    longest = max(traces, key=lambda t: len(t.data.spans))
    shown = trace_span_durations(mlflow_server.uri, run.info.experiment_id, longest.info.trace_id)
    assert [name for name, _ in shown] == [s.name for s in longest.data.spans], shown
    assert all(ms > 0 for _, ms in shown), shown
    turns_shown = [i for i, (name, _) in enumerate(shown) if name.startswith("turn ")]
    for at, end in zip(turns_shown, [*turns_shown[1:], len(shown)]):
        assert shown[at][1] > sum(ms for _, ms in shown[at + 1:end]), shown  # more than its tool calls


def trace_span_durations(uri: str, experiment_id: str, trace_id: str) -> list[tuple[str, float]]:
    """(span name, duration in ms) of each row of a trace's span tree in MLflow's UI, opened in Chromium from the
    experiment's Traces tab, as a person opens it (screenshot: test-output/mlflow-trace.png)."""
    with chromium_page() as page:
        page.goto(f"{uri}/#/experiments/{experiment_id}/traces?selectedEvaluationId={trace_id}",
                  wait_until="load", timeout=60_000)
        page.get_by_text("turn 1", exact=True).first.wait_for(timeout=60_000)
        lines = [line.strip() for line in page.locator("body").inner_text().splitlines()]
        page.screenshot(path=str(SCREENSHOTS / "mlflow-trace.png"))
    # the tree: each span's name, then its duration ("0.18s", "1.00ms"), after the "Spans" heading
    tree = lines[lines.index("Spans") + 1:]
    out = []
    for name, duration in zip(tree, tree[1:]):
        if m := re.fullmatch(r"([\d.]+)(ms|s)", duration):
            out.append((name, float(m.group(1)) * (1000 if m.group(2) == "s" else 1)))
    return out


def test_training_runs_to_its_end_with_the_tracking_server_down(tmp_path):
    server = MlflowServer(tmp_path / "mlflow").start()
    try:
        trainer, tracker, run_id, counter, traces = train_with_traces(tmp_path, server.uri, kill=server, steps=2)
    finally:
        server.stop(kill=True)
    assert trainer.state.global_step == 2 and counter.batches
    offered = sum(map(len, counter.batches))
    assert traces is not None and traces.written == 0 and traces.dropped == offered
    # the counts wait in the metric spool for the next start
    sent = [json.loads(line) for line in tracker.spool_file.read_text().splitlines()]
    assert any(row["m"].get(DROPPED_METRIC) == offered for row in sent)
