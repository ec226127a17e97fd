"""Episodes as MLflow traces: a sample of each generation batch's episodes, written off the training thread.

The trainer hands plain records (:func:`grpo.training.episodes.episode_record`) to the MLflow callback; they are
queued here and a daemon thread writes each as one trace of the run's experiment, linked to the run (trace metadata
``mlflow.sourceRun``, so the run page's Traces tab lists them):

* an ``AGENT`` root span named after the environment: inputs the prompt, outputs the final answer (the last model
  turn) and the transcript, attributes ``environment``, ``reward``, ``stop_reason``, ``turns``, ``error`` (status
  ERROR when the environment failed, an agent that raised included), ``refused_calls``, ``policy_version``;
* one ``CHAT_MODEL`` span per model turn (an agent's model call; inputs: the prompt as the model saw it, the
  episode's text before the turn; outputs: the turn's text; the environment's reply that followed it as the
  attribute ``observation``), from the start of the batched ``generate`` call that wrote it to the end of its
  environment step (attributes ``generate_s`` and ``step_s``, and ``policy_version``, the optimizer steps of the
  weights that sampled it). An agent's call also carries what the endpoint recorded (``Episode.model_calls``):
  ``prompt_tokens``, ``completion_tokens``, ``finish_reason``, ``route``, ``max_tokens``, ``stop``, the sampling
  parameters (``temperature``, ``top_p``, ``top_k``), the ``tool_calls`` the model made, and ``restart`` for a call
  that started the episode's next sample (its prompt is its own, not the episode's text so far);
* one ``LLM`` span named ``refused call`` per call the endpoint refused (status ERROR, its HTTP ``status`` and
  message), at the time it was refused;
* one ``TOOL`` span per tool call under the turn that made it (its name, ``status`` ok / error / unknown, and the
  measured latency as the span's duration), laid out in order from the start of the turn's environment step;
* trace tags ``step``, ``reward``, ``environment``.

The times are the episode runner's (``Episode.turn_times``, the record's ``turn_times``). A record without them (one
made before they were measured) is laid out on a synthetic clock from the moment it was recorded: a model turn takes
no time, a tool span its latency.

Training never waits on MLflow: :meth:`EpisodeTraces.submit` only puts records on a bounded queue (a full queue
drops them, counted). The writer tries each trace a few times with a short pause, then drops it, counted; with the
tracking server down MLflow's own HTTP retries can hold the writer, the queue fills and further records are dropped.
:meth:`EpisodeTraces.close` waits a bounded time and counts what is left as dropped. The counts (``traces/written``,
``traces/dropped``) are logged as run metrics at close through the metric spool, which survives an outage.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

_log = logging.getLogger(__name__)

SOURCE_RUN = "mlflow.sourceRun"  # mlflow.tracing.constant.TraceMetadataKey.SOURCE_RUN
WRITTEN_METRIC = "traces/written"
DROPPED_METRIC = "traces/dropped"
_PREVIEW = 1000


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


def _number(value: Any) -> float | None:
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else float(value)


class _SpanIds:
    def __init__(self) -> None:
        self.trace_hex = os.urandom(16).hex()

    @property
    def trace_b64(self) -> str:
        return base64.b64encode(bytes.fromhex(self.trace_hex)).decode()

    @staticmethod
    def span() -> str:
        return base64.b64encode(os.urandom(8)).decode()


def episode_trace(record: dict[str, Any], experiment_id: str, run_id: str) -> tuple[Any, list[Any]]:
    """``(TraceInfo, [Span, ...])`` of one episode record (see the module docstring), root span first."""
    from mlflow.entities import Span, SpanType, TraceInfo, TraceLocation, TraceState

    ids = _SpanIds()
    trace_id = f"tr-{ids.trace_hex}"
    env = record.get("environment") or "episode"
    reward = _number(record.get("reward"))
    error = record.get("error")
    start = int(record.get("time_ns") or time.time_ns())
    root_id = ids.span()
    spans: list[dict[str, Any]] = []

    def add(name: str, span_id: str, parent: str | None, kind: str, t0: int, t1: int, *, inputs: Any = None,
            outputs: Any = None, attributes: dict[str, Any] | None = None, ok: bool = True, message: str = "") -> None:
        attrs = {"mlflow.traceRequestId": _json(trace_id), "mlflow.spanType": _json(kind)}
        if inputs is not None:
            attrs["mlflow.spanInputs"] = _json(inputs)
        if outputs is not None:
            attrs["mlflow.spanOutputs"] = _json(outputs)
        attrs.update({k: _json(v) for k, v in (attributes or {}).items()})
        spans.append({"trace_id": ids.trace_b64, "span_id": span_id, "parent_span_id": parent, "name": name,
                      "start_time_unix_nano": t0, "end_time_unix_nano": max(t1, t0), "events": [], "links": [],
                      "status": {"code": "STATUS_CODE_OK" if ok else "STATUS_CODE_ERROR", "message": message},
                      "attributes": attrs})

    calls = [c for c in record.get("model_calls") or [] if "refused" not in c]
    refused = [c for c in record.get("model_calls") or [] if "refused" in c]
    # Pair each model turn with the environment text that followed it, in transcript order, and the text before it
    # (an agent's call that restarted the sequence: the environment text before it is its whole prompt).
    turns: list[tuple[str, str | None]] = []
    prompts: list[str] = []
    seen, before = str(record.get("prompt", "")), None
    for source, text in record.get("transcript") or []:
        if source == "model":
            if len(turns) < len(calls) and calls[len(turns)].get("restart") and before is not None:
                seen = before
            turns.append((text, None))
            prompts.append(seen)
            before = None
        else:
            if turns and turns[-1][1] is None:
                turns[-1] = (turns[-1][0], text)
            before = text
        seen += text
    version = record.get("policy_version")
    calls_by_turn: dict[int, list[Sequence[Any]]] = {}
    for call in record.get("tool_calls") or []:
        calls_by_turn.setdefault(int(call[0]), []).append(call)

    timed = [[int(float(t) * 1e9) for t in times] for times in record.get("turn_times") or []]
    if timed:
        start = timed[0][0]
    clock = start
    children: list[tuple] = []
    for n, (text, observation) in enumerate(turns, start=1):
        # [generate start, generate end, step start, step end] in ns; untimed: the synthetic clock
        times = timed[n - 1] if n <= len(timed) else [clock] * 4
        clock = times[2]
        tool_spans = []
        for _, name, status, seconds in calls_by_turn.get(n, []):
            t1 = clock + int(max(float(seconds), 0.0) * 1e9)
            tool_spans.append((name or "unknown", status, clock, t1))
            clock = t1
        clock = max(clock, times[3])
        children.append((n, text, observation, times, clock, tool_spans))
    refused_at = [int(float(c.get("time") or start / 1e9) * 1e9) for c in refused]
    end = max([clock, start, *refused_at])
    start = min([start, *refused_at])  # a call refused before the first one answered (during the episode's reset)

    answer = turns[-1][0] if turns else ""
    add(env, root_id, None, SpanType.AGENT, start, end, inputs={"prompt": record.get("prompt", "")},
        outputs={"answer": answer, "transcript": record.get("transcript") or []},
        attributes={"environment": env, "reward": reward, "stop_reason": record.get("stop_reason"),
                    "turns": record.get("turns", len(turns)), "error": error, "step": record.get("step"),
                    "refused_calls": len(refused), "policy_version": version},
        ok=error is None, message=error or "")
    for n, text, observation, times, t1, tool_spans in children:
        turn_id = ids.span()
        call = {k: v for k, v in (calls[n - 1] if n <= len(calls) else {}).items() if k != "time"}
        add(f"turn {n}", turn_id, root_id, SpanType.CHAT_MODEL, times[0], t1, inputs={"prompt": prompts[n - 1]},
            outputs=text, attributes={"turn": n, "observation": observation, "generate_s": (times[1] - times[0]) / 1e9,
                                      "step_s": (times[3] - times[2]) / 1e9, "policy_version": version, **call})
        for name, status, c0, c1 in tool_spans:
            add(name, ids.span(), turn_id, SpanType.TOOL, c0, c1,
                attributes={"tool": name, "status": status, "latency_s": (c1 - c0) / 1e9},
                ok=status == "ok", message="" if status == "ok" else status)
    for entry, at in zip(refused, refused_at):
        add("refused call", ids.span(), root_id, SpanType.LLM, at, at,
            attributes={"status": entry.get("status"), "error": entry["refused"]}, ok=False, message=entry["refused"])

    info = TraceInfo(
        trace_id=trace_id, trace_location=TraceLocation.from_experiment_id(experiment_id),
        request_time=start // 1_000_000, execution_duration=(end - start) // 1_000_000,
        state=TraceState.OK if error is None else TraceState.ERROR,
        request_preview=str(record.get("prompt", ""))[:_PREVIEW], response_preview=answer[:_PREVIEW],
        trace_metadata={SOURCE_RUN: run_id, "mlflow.trace_schema.version": "3"},
        tags={"mlflow.traceName": env, "step": str(record.get("step")), "reward": str(reward),
              "environment": env},
    )
    return info, [Span.from_dict(d) for d in spans]


def write_trace(tracking_uri: str, info: Any, spans: list[Any]) -> str:
    """Write one trace as MLflow's own exporter does: spans into the tracking store when it keeps them (a SQL
    store, a server on one), the trace's info, and the span data as the trace's artifact otherwise."""
    from mlflow.entities import TraceData
    from mlflow.tracing.client import TracingClient

    client = TracingClient(tracking_uri)
    experiment_id = info.trace_location.mlflow_experiment.experiment_id
    try:
        client.log_spans(experiment_id, spans)
        in_store = True
    except NotImplementedError:
        in_store = False
    returned = client.start_trace(info)
    if not in_store or returned.tags.get("mlflow.trace.spansLocation") != "TRACKING_STORE":
        client._upload_trace_data(returned, TraceData(spans=spans))
    return returned.trace_id


WRITER_THREAD = "mlflow-trace-writer"


class _QuietWriterRetries(logging.Filter):
    """Drops urllib3's "Retrying ... connection refused" warnings of the trace writer's own requests: with the
    tracking server down the writer retries in the background, and the training's console is not the place for it
    (the traces dropped are counted and logged at close)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != WRITER_THREAD


logging.getLogger("urllib3.connectionpool").addFilter(_QuietWriterRetries())


class EpisodeTraces:
    """The queue and writer thread of one run's episode traces; see the module docstring."""

    def __init__(self, tracking_uri: str, experiment_id: str, run_id: str, *, max_queue: int = 64,
                 attempts: int = 3, pause: float = 1.0) -> None:
        self.tracking_uri, self.experiment_id, self.run_id = tracking_uri, experiment_id, run_id
        self.attempts, self.pause = attempts, pause
        self.written = 0
        self.dropped = 0
        self.last_step = 0
        self._queue: queue.Queue[dict | None] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name=WRITER_THREAD, daemon=True)
        self._thread.start()

    def submit(self, records: Sequence[dict[str, Any]]) -> None:
        """Queue ``records`` for writing; returns at once, never raises (a full queue drops them, counted)."""
        for record in records:
            try:
                self.last_step = max(self.last_step, int(record.get("step") or 0))
                self._queue.put_nowait(record)
            except queue.Full:
                with self._lock:
                    self.dropped += 1
            except Exception as err:  # noqa: BLE001 - tracking must never stop training
                _log.warning("tracking: could not queue an episode trace: %s", err)

    def _work(self) -> None:
        while (record := self._queue.get()) is not None:
            ok = False
            for attempt in range(self.attempts):
                try:
                    write_trace(self.tracking_uri, *episode_trace(record, self.experiment_id, self.run_id))
                    ok = True
                    break
                except Exception as err:  # noqa: BLE001 - an outage or a refusal: retry, then drop
                    if attempt + 1 == self.attempts:
                        _log.warning("tracking: episode trace dropped after %d attempts: %s", self.attempts, err)
                    elif self._stop.wait(self.pause):
                        break
            with self._lock:
                if ok:
                    self.written += 1
                else:
                    self.dropped += 1

    def close(self, timeout: float = 30.0) -> tuple[int, int]:
        """Write what is queued within ``timeout`` seconds, then stop; what is left counts as dropped. Returns
        ``(written, dropped)``."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._stop.set()
            left = 0
            while True:
                try:
                    left += self._queue.get_nowait() is not None
                except queue.Empty:
                    break
            with self._lock:
                self.dropped += left + 1  # the one being written, whose outcome never comes
        return self.written, self.dropped


class TraceLogging:
    """Episode traces for :class:`~grpo.tracking.tracker.MlflowTracker` (a mixin): ``log_episode_traces`` starts the
    writer on first use; the run lifecycle's ``close`` calls :meth:`_close_traces` before the metrics' last flush."""

    tracking_uri: str
    run_id: str | None
    experiment_id: str | None
    _traces: EpisodeTraces | None = None

    def log_episode_traces(self, records: Sequence[dict[str, Any]]) -> None:
        """Queue episode records (:func:`grpo.training.episodes.episode_record`) as traces; never raises."""
        try:
            if self.run_id is None or self.experiment_id is None or not records:
                return
            if self._traces is None:
                self._traces = EpisodeTraces(self.tracking_uri, self.experiment_id, self.run_id)
            self._traces.submit(records)
        except Exception as err:  # noqa: BLE001 - tracking must never stop training
            _log.warning("tracking: episode traces not queued: %s", err)

    def _close_traces(self, timeout: float) -> None:
        traces, self._traces = self._traces, None
        if traces is None:
            return
        written, dropped = traces.close(timeout)
        self.log_metrics({WRITTEN_METRIC: written, DROPPED_METRIC: dropped}, step=traces.last_step)


__all__ = ["DROPPED_METRIC", "EpisodeTraces", "TraceLogging", "WRITTEN_METRIC", "episode_trace", "write_trace"]
