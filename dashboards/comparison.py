"""Comparison dashboard: one self-contained HTML file comparing the MLflow runs of an experiment or of a sweep.

``build_dashboard(tracking_uri, experiment, sweep_run_id=None, out=...)`` reads the runs with
``MlflowClient.search_runs`` (all active runs of the experiment, or only the children of a sweep: the runs whose tag
``mlflow.parentRunId`` is ``sweep_run_id``) and their metric histories with ``get_metric_history``, and writes:

* reward per step for every run (and ``reward_std`` next to it when logged),
* greedy eval accuracy before/after training per run (bars): ``eval/accuracy`` at step 0 and at the last step
  (older runs: ``eval/accuracy_before``/``eval/accuracy_after``),
* a final-metrics table: run name, status, eval accuracy before and after, pass@k, final reward, steps and wall time,
  then the params with different values between the runs (the columns a page-wide table may scroll to; the run
  names stay in view), metrics with 3 decimals (``0.760``, ``0.900``: :func:`grpo.formatting.human_metric`) and params
  as people write them (``2.61e-4``: :func:`grpo.formatting.human_number`),
* panels for zero-std groups / skipped zero-advantage batches, the replay buffer, reroll, batch balance, async
  rollouts, step time and system metrics, each only when at least one run logged one of its metrics (the page lists
  the panels left out),
* for a sweep: Optuna's parameter importances over its study (bars and a table), as the sweep computed them
  (``importances``, else the parent run's ``sweep/importances.json``), or the reason there are none. A trial that
  the study pruned shows the status PRUNED (its MLflow run is FINISHED with tag ``grpo.sweep.pruned``).

plotly.js is inlined once in the page (no CDN, no other file), so the HTML opens offline. ``log_dashboard`` uploads
the file as an artifact of a run (e.g. the sweep's parent run).
"""

from __future__ import annotations

import html
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from grpo.errors import GRPOPlatformError
from grpo.formatting import count, human_metric, human_number
from grpo.tracking.metric_keys import eval_before_after, is_eval_curve, trainer_name
from grpo.tracking.store import mlflow_ui_url

ARTIFACT_PATH = "dashboard"
_MAX_RUNS = 500  # more runs than this make an unreadable page; the newest are shown
_HISTORY_WORKERS = 4


class DashboardError(GRPOPlatformError, ValueError):
    """The dashboard can not be built: unknown experiment or sweep, no runs, unreachable tracking store."""


@dataclass(frozen=True)
class Panel:
    """A figure of one subplot per metric (only the metrics some run logged); skipped when none was logged."""

    div_id: str
    title: str
    metrics: tuple[str, ...] = ()
    prefix: str | None = None  # also every metric starting with this (e.g. ``async/``)
    pattern: str | None = None  # also every metric matching this regex (full match)
    description: str = ""


# Order of the page. The reward panel comes first, then eval bars and the table (built separately), then these.
REWARD_PANEL = Panel("panel-reward", "Reward", ("reward", "reward_std"),
                     description="Mean reward per training step (left) and the mean within-group reward std (right).")
METRIC_PANELS = (
    Panel("panel-zero-adv", "Zero-std groups and skipped zero-advantage batches",
          ("frac_reward_zero_std", "skipped_zero_adv_batches"),
          description="Share of prompt groups whose completions all got the same reward (no learning signal), and "
                      "the batches skipped because every advantage was zero."),
    Panel("panel-replay", "Replay buffer", ("replay_buffer_replacements", "replay_buffer_size")),
    Panel("panel-reroll", "Reroll", ("reroll_injected", "reroll_buffered", "reroll_buffer_size", "reroll_dropped")),
    Panel("panel-balance", "Batch balance", ("balance/imbalance", "balance/imbalance_unbalanced",
                                             "balance/max_tokens", "balance/min_tokens"),
          description="Token imbalance across ranks after (and without) balancing."),
    Panel("panel-async", "Async rollouts", ("async/staleness_mean", "async/staleness_max", "async/dropped_stale",
                                            "async/queue_wait_s", "async/generate_s", "async/train_s"),
          prefix="async/"),
    Panel("panel-step-time", "Step time", ("step_time",), description="Seconds per training step."),
    Panel("panel-system", "System", ("system/cpu_utilization_percentage", "system/system_memory_usage_percentage"),
          pattern=r"system/gpu_\d+_utilization_percentage"),
)
EVAL_DIV_ID = "panel-eval"
IMPORTANCE_DIV_ID = "panel-importances"
IMPORTANCES_ARTIFACT = "sweep/importances.json"
EVAL_BEFORE, EVAL_AFTER = "eval/accuracy_before", "eval/accuracy_after"
_PASS_AT_K = re.compile(r"eval/pass_at_(\d+)_after")

_COLORS = ("#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880", "#FF97FF",
           "#FECB52", "#1F77B4", "#8C564B", "#7F7F7F", "#BCBD22", "#17BECF", "#D62728")


@dataclass
class RunData:
    run_id: str
    name: str
    label: str  # unique run name (the table's first column)
    status: str
    start_ms: int | None
    end_ms: int | None
    params: dict[str, str]
    latest: dict[str, float]
    color: str = ""
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    legend: str = ""  # what the plots call the run: the param values that set it apart (see legend_labels)

    def wall_seconds(self, now_ms: int) -> float | None:
        if self.start_ms is None:
            return None
        end = self.end_ms if self.end_ms and self.status != "RUNNING" else now_ms
        return max(0.0, (end - self.start_ms) / 1000)

    def steps(self) -> int | None:
        points = self.history.get("reward") or self.history.get("step_time")
        return max(s for s, _ in points) if points else None


# ---------------------------------------------------------------------------------------------------- reading MLflow


def _client(tracking_uri: str):
    """An ``MlflowClient`` after checking that the store is there: a server must answer ``/health`` (MLflow's own
    client would retry for minutes), a SQLite file must exist (MLflow would create an empty one)."""
    from mlflow import MlflowClient

    if tracking_uri.startswith(("http://", "https://")):
        import requests

        try:
            requests.get(tracking_uri.rstrip("/") + "/health", timeout=10).raise_for_status()
        except requests.RequestException as err:
            raise DashboardError(f"MLflow tracking server {tracking_uri} is unreachable: {err}") from None
    elif tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        if not db.is_file():
            raise DashboardError(f"no MLflow store at {db} (tracking URI {tracking_uri}); "
                                 "pass --tracking-uri or set MLFLOW_TRACKING_URI")
    return MlflowClient(tracking_uri)


def _experiment(client, name: str):
    exp = client.get_experiment_by_name(name)
    if exp is not None and exp.lifecycle_stage != "deleted":
        return exp
    names = sorted(e.name for e in client.search_experiments(max_results=1000))
    shown = ", ".join(repr(n) for n in names[:30]) + (f", ... ({len(names)} in all)" if len(names) > 30 else "")
    raise DashboardError(f"unknown MLflow experiment {name!r}; existing experiments: {shown or '(none)'}")


def _search(client, experiment_id: str, filter_string: str = "") -> list:
    from mlflow.entities import ViewType

    runs, token = [], None
    while len(runs) < _MAX_RUNS:
        page = client.search_runs([experiment_id], filter_string=filter_string, run_view_type=ViewType.ACTIVE_ONLY,
                                  max_results=min(500, _MAX_RUNS - len(runs)), order_by=["attributes.start_time DESC"],
                                  page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    return runs[::-1]  # oldest first


def _sweep_runs(client, experiment, sweep_run_id: str) -> tuple[Any, list]:
    from mlflow.exceptions import MlflowException

    try:
        parent = client.get_run(sweep_run_id)
    except MlflowException:
        raise DashboardError(f"sweep run {sweep_run_id!r} not found in the MLflow store") from None
    if parent.info.experiment_id != experiment.experiment_id:
        raise DashboardError(f"sweep run {sweep_run_id!r} belongs to experiment id {parent.info.experiment_id}, "
                             f"not to {experiment.name!r} (id {experiment.experiment_id})")
    quoted = sweep_run_id.replace("'", "")
    return parent, _search(client, experiment.experiment_id, f"tags.`mlflow.parentRunId` = '{quoted}'")


def _panel_keys(panel: Panel, available: set[str]) -> list[str]:
    keys = [k for k in panel.metrics if k in available]
    extra = set()
    if panel.prefix:
        extra |= {k for k in available if k.startswith(panel.prefix)}
    if panel.pattern:
        extra |= {k for k in available if re.fullmatch(panel.pattern, k)}
    return keys + sorted(extra - set(keys))


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) sorted by step; of several values at one step the latest logged wins; NaN/inf dropped."""
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.value is None or not math.isfinite(m.value):
            continue
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, float(m.value))
    return [(s, by_step[s][1]) for s in sorted(by_step)]


def _collect(client, mlflow_runs: list) -> list[RunData]:
    runs = []
    counts: dict[str, int] = {}
    for r in mlflow_runs:
        name = r.info.run_name or r.info.run_id[:8]
        counts[name] = counts.get(name, 0) + 1
    mlflow_key: dict[tuple[str, str], str] = {}  # (run id, TRL name) -> the run's MLflow key (train/aux/loss)
    for i, r in enumerate(mlflow_runs):
        name = r.info.run_name or r.info.run_id[:8]
        latest = {}
        for key, value in r.data.metrics.items():
            if value is not None:
                latest[trainer_name(key)] = value
                mlflow_key[(r.info.run_id, trainer_name(key))] = key
        runs.append(RunData(
            run_id=r.info.run_id, name=name, label=name if counts[name] == 1 else f"{name} ({r.info.run_id[:6]})",
            status="PRUNED" if r.data.tags.get("grpo.sweep.pruned") == "true" else r.info.status,
            start_ms=r.info.start_time, end_ms=r.info.end_time, params=dict(r.data.params),
            latest=latest, color=_COLORS[i % len(_COLORS)]))
    wanted = set(REWARD_PANEL.metrics)
    for panel in METRIC_PANELS:
        wanted |= set(_panel_keys(panel, {k for run in runs for k in run.latest}))
    jobs = [(run, key) for run in runs for key in sorted(k for k in run.latest if k in wanted or is_eval_curve(k))]
    with ThreadPoolExecutor(max_workers=_HISTORY_WORKERS) as pool:
        results = list(pool.map(lambda job: _history(client, job[0].run_id, mlflow_key[(job[0].run_id, job[1])]),
                                jobs))
    for (run, key), points in zip(jobs, results):
        if is_eval_curve(key):  # eval/accuracy at step 0 and the last step; older runs logged eval/accuracy_before
            run.latest.update(eval_before_after(key, points))
        elif points:
            run.history[key] = points
    for run, legend in zip(runs, legend_labels(runs)):
        run.legend = legend
    return runs


_MAX_LEGEND_PARAMS = 6  # more settings than this in a label no longer fit a legend's line: unrelated runs
_NOT_SETTINGS = re.compile(r"(prep|plan|tracking)\..+|(.+\.)?output_dir")
"""Params that do not set runs apart in a legend: figures a run measured (``prep.rows_valid``,
``plan.generation_rounds``: they follow from the settings) and where it wrote (a sweep's trials write under their
sweep's folder)."""


def _plotted(run: RunData) -> bool:
    """Whether the plots show the run: it logged training curves or an evaluation (a sweep's parent run did not)."""
    return bool(run.history) or EVAL_BEFORE in run.latest or EVAL_AFTER in run.latest


def legend_labels(runs: list[RunData]) -> list[str]:
    """Plot labels: the values of the settings that differ between the runs the plots show
    (``learning_rate=1e-05, beta=0.04``), which is what tells sweep trials apart; a param is named by its last dotted
    part unless two differing params share it. A param counts as differing when the runs that logged it have two
    values (an older run without a newer param, or a sweep's parent run without the config's, does not make every
    param differ). The unique run name when nothing differs, or more than six settings do (unrelated runs of an
    experiment), and appended when two runs still share a label."""
    plotted = [r for r in runs if _plotted(r)]
    keys = [k for k in varying_params(plotted) if not _NOT_SETTINGS.fullmatch(k)] if len(plotted) > 1 else []
    if not keys or len(keys) > _MAX_LEGEND_PARAMS:
        return [r.label for r in runs]
    last = [k.rsplit(".", 1)[-1] for k in keys]
    short = [t if last.count(t) == 1 else k for k, t in zip(keys, last)]
    labels = [", ".join(f"{n}={human_number(r.params[k]) if k in r.params else '—'}" for k, n in zip(keys, short))
              for r in runs]
    return [f"{lab} ({r.label})" if labels.count(lab) > 1 else lab for lab, r in zip(labels, runs)]


# ---------------------------------------------------------------------------------------------------- figures


def _figure_html(fig, div_id: str, height: int) -> str:
    import plotly.io as pio

    return pio.to_html(fig, include_plotlyjs=False, full_html=False, div_id=div_id, default_height=f"{height}px",
                       config={"displaylogo": False, "responsive": True})


def _metric_panel(panel: Panel, runs: list[RunData]) -> tuple[str, int] | None:
    """(HTML, number of traces) of a panel, or None when no run logged any of its metrics."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    keys = _panel_keys(panel, {k for run in runs for k in run.history})
    if not keys:
        return None
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=keys, horizontal_spacing=0.07,
                        vertical_spacing=0.5 / rows if rows > 1 else 0.1)
    traces = 0
    shown: set[str] = set()
    for i, key in enumerate(keys):
        row, col = divmod(i, cols)
        for run in runs:
            points = run.history.get(key)
            if not points:
                continue
            fig.add_trace(go.Scatter(
                x=[s for s, _ in points], y=[v for _, v in points],
                mode="lines+markers" if len(points) < 60 else "lines",
                name=run.legend, legendgroup=run.run_id, showlegend=run.run_id not in shown,
                line={"color": run.color, "width": 2}, marker={"size": 5},
                hovertemplate=f"{html.escape(run.label)}<br>{html.escape(run.legend)}<br>step %{{x}}<br>{key} "
                              "%{y:.4g}<extra></extra>",
            ), row=row + 1, col=col + 1)
            shown.add(run.run_id)
            traces += 1
        fig.update_xaxes(title_text="step", row=row + 1, col=col + 1)
    height = 360 + 300 * (rows - 1)
    fig.update_layout(height=height, margin={"l": 50, "r": 20, "t": 40, "b": 50}, template="plotly_white",
                      legend={"orientation": "h", "y": -0.25 / rows, "yanchor": "top"} if len(runs) > 1 else {},
                      showlegend=True, hovermode="closest")
    return _figure_html(fig, panel.div_id, height + (40 if len(runs) > 1 else 0)), traces


def _eval_panel(runs: list[RunData]) -> tuple[str, int] | None:
    import plotly.graph_objects as go

    with_eval = [r for r in runs if EVAL_BEFORE in r.latest or EVAL_AFTER in r.latest]
    if not with_eval:
        return None
    fig = go.Figure()
    for key, label, color in ((EVAL_BEFORE, "before training", "#9DA5B4"), (EVAL_AFTER, "after training", "#2B6CB0")):
        if not any(key in r.latest for r in with_eval):
            continue
        values = [r.latest.get(key) for r in with_eval]
        fig.add_trace(go.Bar(x=[r.legend for r in with_eval], y=values, name=label, marker_color=color,
                             text=[f"{v:.3f}" if v is not None else "" for v in values], textposition="outside",
                             hovertemplate="%{x}<br>" + label + " %{y:.3f}<extra></extra>"))
    top = max((v for r in with_eval for k in (EVAL_BEFORE, EVAL_AFTER) if (v := r.latest.get(k)) is not None),
              default=1.0)
    # labels too long to sit side by side are drawn slanted below the bars: the figure grows by their height, the
    # bars keep theirs
    longest = max(len(r.legend) for r in with_eval)
    height = 380 + (int(3.4 * longest) if 7 * longest * len(with_eval) > 1100 else 0)
    fig.update_layout(barmode="group", height=height, template="plotly_white", yaxis_title="greedy accuracy",
                      yaxis_range=[0, max(1.0, top) * 1.12], margin={"l": 50, "r": 20, "t": 30, "b": 40},
                      legend={"orientation": "h", "y": 1.08, "yanchor": "bottom"})
    return _figure_html(fig, EVAL_DIV_ID, height), len(fig.data)


def _importance_panel(importances: dict) -> tuple[str, int] | None:
    """Horizontal bars of the study's parameter importances (largest on top) and the same as a table; or the note
    saying why there are none."""
    import plotly.graph_objects as go

    values = importances.get("importances") or {}
    head = (f'<p class="desc">Optuna fANOVA importances over the {importances.get("completed_trials", "?")} completed '
            f'trials of study <code>{html.escape(str(importances.get("study", "")))}</code> (all its invocations): the '
            f"share of the metric's variance each param explains.</p>")
    if not values:
        note = (importances.get("note") or "no importances").rstrip(".")
        return f'{head}<p class="note" id="importances-note">{html.escape(note)}.</p>', 0
    items = sorted(values.items(), key=lambda kv: kv[1])
    fig = go.Figure(go.Bar(x=[v for _, v in items], y=[k for k, _ in items], orientation="h", marker_color="#2B6CB0",
                           text=[f"{v:.3f}" for _, v in items], textposition="outside",
                           hovertemplate="%{y}<br>importance %{x:.4f}<extra></extra>"))
    height = 120 + 36 * len(items)
    fig.update_layout(height=height, template="plotly_white", xaxis_title="importance", xaxis_range=[0, 1.1],
                      margin={"l": 200, "r": 30, "t": 20, "b": 40})
    rows = "".join(f"<tr><td class=param>{html.escape(k)}</td><td>{v:.4f}</td></tr>" for k, v in values.items())
    table = (f'<table id="importances-table" class="metrics"><thead><tr><th>param</th><th>importance</th></tr>'
             f"</thead><tbody>{rows}</tbody></table>")
    return head + _figure_html(fig, IMPORTANCE_DIV_ID, height) + table, len(fig.data)


def _stored_importances(client, sweep_run_id: str) -> dict | None:
    """The importances the sweep logged on its parent run (``grpo dashboard --sweep`` after the sweep)."""
    import json
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(sweep_run_id, IMPORTANCES_ARTIFACT, tmp)).read_text())
    except Exception:  # a sweep from before importances, or an experiment page: no panel
        return None


# ---------------------------------------------------------------------------------------------------- table


def _fmt(value: float | str | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e9:
        value = int(value)  # MLflow keeps every metric as a float: a step count reads 20, not 20.0
    return human_number(value)


def _metric(value: float | None) -> str:
    """A metric's cell: 3 decimals, so a column's numbers line up (reward 0.760 next to accuracy 0.900)."""
    return "—" if value is None else human_metric(value)


def _fmt_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"


def varying_params(runs: list[RunData]) -> list[str]:
    """Param keys with at least two different values among the runs that logged them: the table's columns. A param
    only some runs have does not count (a sweep's parent run logs its own few params and none of the config's, which
    made every one of the config's ~120 params a column of an experiment's table)."""
    keys = sorted({k for r in runs for k in r.params})
    return [k for k in keys if len({r.params[k] for r in runs if k in r.params}) > 1]


def _pass_at_k(run: RunData) -> str:
    found = sorted((int(m.group(1)), v) for k, v in run.latest.items() if (m := _PASS_AT_K.fullmatch(k)))
    return ", ".join(f"{_metric(v)} (k={k})" for k, v in found) or "—"


def _table(runs: list[RunData], tracking_uri: str, experiment_id: str, now_ms: int) -> str:
    params = varying_params(runs) if len(runs) > 1 else []
    e = html.escape
    # the results first: a table of many params scrolls sideways, and its eval columns were past the page's edge
    head = ["run", "status", "eval accuracy before", "eval accuracy after", "pass@k after", "final reward", "steps",
            "wall time", *params]
    out = ['<table id="final-metrics" class="metrics">', "<thead><tr>"]
    out += [f'<th{" class=param" if h in params else ""}>{e(h)}</th>' for h in head]
    out.append("</tr></thead><tbody>")
    for r in runs:
        wall = r.wall_seconds(now_ms)
        cells = [f'<td class="run"><span class="swatch" style="background:{r.color}"></span>'
                 f'<a href="{e(mlflow_ui_url(tracking_uri, experiment_id, r.run_id))}" title="{e(r.run_id)}">'
                 f"{e(r.label)}</a></td>",
                 f'<td class="status status-{e(r.status.lower())}">{e(r.status)}</td>',
                 f"<td>{_metric(r.latest.get(EVAL_BEFORE))}</td>", f"<td>{_metric(r.latest.get(EVAL_AFTER))}</td>",
                 f"<td>{e(_pass_at_k(r))}</td>", f"<td>{_metric(r.latest.get('reward'))}</td>",
                 f"<td>{_fmt(r.steps())}</td>",
                 f"<td>{_fmt_seconds(wall)}{' (running)' if r.status == 'RUNNING' else ''}</td>"]
        for p in params:
            value = r.params.get(p)
            short = value if value is None else human_number(value)
            short = short if short is None or len(short) <= 40 else short[:37] + "..."
            cells.append(f'<td class="param" title="{e(value or "")}">{e(short) if short is not None else "—"}</td>')
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    if len(runs) > 1 and not params:
        out.append('<p class="note">All runs have the same params.</p>')
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------- page

_CSS = """
body { font-family: -apple-system, "Segoe UI", Roboto, Helvetica, Arial, sans-serif; margin: 0; background: #f5f6f8;
       color: #1f2933; }
header { background: #1f2933; color: #fff; padding: 16px 28px; }
header h1 { margin: 0 0 4px 0; font-size: 22px; }
header .meta { font-size: 13px; color: #cbd2d9; }
header .meta span { margin-right: 18px; }
main { max-width: 1280px; margin: 0 auto; padding: 12px 20px 40px; }
section { background: #fff; border-radius: 6px; box-shadow: 0 1px 3px rgba(0,0,0,.08); margin: 16px 0;
          padding: 12px 16px; }
section h2 { font-size: 16px; margin: 4px 0 2px 0; }
section p.desc, p.note { font-size: 13px; color: #52606d; margin: 2px 0 6px 0; }
.table-wrap { overflow-x: auto; }
table.metrics { border-collapse: collapse; font-size: 13px; width: 100%; }
table.metrics th, table.metrics td { border-bottom: 1px solid #e4e7eb; padding: 6px 8px; text-align: right;
                                     white-space: nowrap; }
table.metrics th { background: #f0f2f5; position: sticky; top: 0; }
table.metrics td.run, table.metrics th:first-child { position: sticky; left: 0; background: #fff; z-index: 1; }
table.metrics th:first-child { background: #f0f2f5; z-index: 2; }
table.metrics td.run, table.metrics th:first-child, table.metrics .param, table.metrics .status,
table.metrics th:nth-child(2) { text-align: left; }
th.param, td.param { color: #3e4c59; font-family: ui-monospace, Menlo, Consolas, monospace; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px; margin-right: 6px; }
td.run a { color: inherit; text-decoration: none; }
td.run a:hover { text-decoration: underline; }
.status-finished { color: #1e7e34; } .status-pruned { color: #6b7280; } \
.status-failed, .status-killed { color: #c0392b; } .status-running { color: #b7791f; }
"""


def _section(div_id: str, title: str, body: str, description: str = "") -> str:
    desc = f'<p class="desc">{html.escape(description)}</p>' if description else ""
    return (f'<section id="{div_id}-section" data-panel="{div_id}"><h2>{html.escape(title)}</h2>{desc}'
            f"{body}</section>")


def _run_count(runs: list[RunData]) -> str:
    """"3 runs", or "11 runs, 7 with training curves" when some (failed early, still starting) logged no reward."""
    total = count(len(runs), "run")
    curves = sum(1 for r in runs if r.history.get("reward"))
    return total if curves == len(runs) else f"{total}, {curves} with training curves"


def render(runs: list[RunData], *, title: str, subtitle: str, tracking_uri: str, experiment_id: str,
           generated: datetime, importances: dict | None = None) -> tuple[str, list[str]]:
    """The page and the div ids of the plotly figures in it (in page order)."""
    import plotly.offline

    now_ms = int(generated.timestamp() * 1000)
    sections, plot_ids, skipped = [], [], []

    def add_plot(div_id: str, title_: str, made: tuple[str, int] | None, description: str = "") -> None:
        if made is None:
            skipped.append(title_)
            return
        sections.append(_section(div_id, title_, made[0], description))
        plot_ids.append(div_id)

    add_plot(REWARD_PANEL.div_id, REWARD_PANEL.title, _metric_panel(REWARD_PANEL, runs), REWARD_PANEL.description)
    add_plot(EVAL_DIV_ID, "Eval accuracy", _eval_panel(runs),
             "Greedy accuracy on the held-out split before and after training.")
    sections.append(_section("final-metrics", "Final metrics",
                             f'<div class="table-wrap">{_table(runs, tracking_uri, experiment_id, now_ms)}</div>',
                             "Params listed are the ones whose values differ between the runs that logged them."))
    if importances is not None:
        made = _importance_panel(importances)
        sections.append(_section(IMPORTANCE_DIV_ID, "Parameter importances (Optuna)", made[0]))
        if made[1]:
            plot_ids.append(IMPORTANCE_DIV_ID)
    for panel in METRIC_PANELS:
        add_plot(panel.div_id, panel.title, _metric_panel(panel, runs), panel.description)
    if skipped:
        sections.append(f'<p class="note" id="skipped-panels">Not shown (no run logged these metrics): '
                        f"{html.escape(', '.join(skipped))}.</p>")

    e = html.escape
    stamp = generated.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    page = f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="grpo dashboard">
<title>{e(title)}</title>
<style>{_CSS}</style>
<script>window.PlotlyConfig = {{MathJaxConfig: 'local'}};</script>
<script charset="utf-8">{plotly.offline.get_plotlyjs()}</script>
</head>
<body>
<header>
<h1 id="dashboard-title">{e(title)}</h1>
<div class="meta"><span>{e(subtitle)}</span><span id="run-count">{_run_count(runs)}</span>
<span>tracking: {e(tracking_uri)}</span><span id="generated-at">generated {stamp}</span></div>
</header>
<main>
{chr(10).join(sections)}
</main>
</body>
</html>
"""
    return page, plot_ids


def build_dashboard(tracking_uri: str, experiment: str, sweep_run_id: str | None = None, *, out: Path,
                    importances: dict | None = None) -> Path:
    """Write the comparison dashboard of ``experiment`` (or of the sweep ``sweep_run_id`` in it) to ``out``.

    ``importances`` (a sweep's :func:`grpo.pipeline.sweep.param_importances`) adds the importance panel; for a sweep
    it is otherwise read from the parent run's ``sweep/importances.json`` when there is one.

    Raises :class:`DashboardError` (a ``ValueError``) for an unknown experiment (the message lists the existing
    ones), an unknown sweep run, no runs to compare, or an unreachable store. Returns ``out``.
    """
    client = _client(tracking_uri)
    exp = _experiment(client, experiment)
    if sweep_run_id:
        parent, mlflow_runs = _sweep_runs(client, exp, sweep_run_id)
        if not mlflow_runs:
            raise DashboardError(f"sweep run {sweep_run_id!r} in experiment {experiment!r} has no child runs")
        sweep_name = parent.info.run_name or sweep_run_id
        title = f"GRPO sweep {sweep_name}"
        subtitle = f"experiment {experiment} · sweep run {sweep_run_id}"
        if importances is None:
            importances = _stored_importances(client, sweep_run_id)
    else:
        mlflow_runs = _search(client, exp.experiment_id)
        if not mlflow_runs:
            raise DashboardError(f"MLflow experiment {experiment!r} has no runs")
        title = f"GRPO experiment {experiment}"
        subtitle = f"experiment {experiment} (id {exp.experiment_id})"
    runs = _collect(client, mlflow_runs)
    page, _ = render(runs, title=title, subtitle=subtitle, tracking_uri=tracking_uri,
                     experiment_id=exp.experiment_id, generated=datetime.now(timezone.utc), importances=importances)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(page, encoding="utf-8")
    tmp.replace(out)
    return out


def log_dashboard(tracker_or_client: Any, run_id: str | None, path: str | Path,
                  artifact_path: str = ARTIFACT_PATH) -> str:
    """Upload the dashboard file ``path`` as an artifact of ``run_id`` (e.g. a sweep's parent run).

    ``tracker_or_client`` is a :class:`grpo.tracking.tracker.MlflowTracker` (``run_id`` may then be None for the
    tracker's own run) or an ``MlflowClient``. Returns the artifact's path in the run, ``dashboard/<file name>``.
    Errors of the upload are raised (the caller decides whether a missing dashboard matters).
    """
    client = getattr(tracker_or_client, "client", tracker_or_client)
    run_id = run_id or getattr(tracker_or_client, "run_id", None)
    if not run_id:
        raise DashboardError("log_dashboard: no run id (pass one, or a started tracker)")
    path = Path(path)
    if not path.is_file():
        raise DashboardError(f"log_dashboard: no dashboard file at {path}")
    client.log_artifact(run_id, str(path), artifact_path)
    return f"{artifact_path}/{path.name}" if artifact_path else path.name


__all__ = ["DashboardError", "build_dashboard", "legend_labels", "log_dashboard", "render",
           "varying_params"]

