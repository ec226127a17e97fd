"""The comparison dashboard against a real `mlflow server`: runs with realistic metric histories -> one HTML file."""

from __future__ import annotations

import json
import math
import re
import time
import uuid

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from typer.testing import CliRunner

from dashboards.comparison import DashboardError, build_dashboard, log_dashboard

pytestmark = pytest.mark.integration

STEPS = 20
# name -> (learning_rate, extra metric families, final status)
SWEEP_RUNS = {
    "lr-1e-5": (1e-5, ("replay",), "FINISHED"),
    "lr-3e-5": (3e-5, ("reroll", "balance"), "FINISHED"),
    "lr-1e-4": (1e-4, ("async",), "FAILED"),
}
# Panels the sweep dashboard must draw (no run logs system metrics, so that panel is left out).
SWEEP_PLOTS = ["panel-reward", "panel-eval", "panel-zero-adv", "panel-replay", "panel-reroll", "panel-balance",
               "panel-async", "panel-step-time"]


def _metrics(i: int, lr: float, families: tuple[str, ...], t0: int) -> list[Metric]:
    """A GRPO-looking history: reward rising with noise, shrinking reward_std, zero-std groups, step time."""
    out = []
    for step in range(1, STEPS + 1):
        ts = t0 + step * 1000
        progress = 1 - math.exp(-step * lr * 4e3)
        values = {
            "reward": 0.2 + 0.6 * progress + 0.03 * math.sin(step + i),
            "reward_std": 0.4 - 0.2 * progress,
            "frac_reward_zero_std": 0.1 + 0.3 * progress,
            "skipped_zero_adv_batches": float(step // 7),
            "step_time": 1.5 + 0.1 * math.cos(step) + 0.2 * i,
            "learning_rate": lr * (1 - step / STEPS),
        }
        if "replay" in families:
            values |= {"replay_buffer_size": float(min(step * 2, 16)), "replay_buffer_replacements": float(step // 3)}
        if "reroll" in families:
            values |= {"reroll_injected": float(step % 3), "reroll_buffered": float(step % 4),
                       "reroll_buffer_size": float(min(step, 8))}
        if "balance" in families:
            values |= {"balance/imbalance": 1.05 + 0.02 * math.sin(step), "balance/max_tokens": 900.0 + step,
                       "balance/imbalance_unbalanced": 1.4 + 0.05 * math.cos(step)}
        if "async" in families:
            values |= {"async/staleness_mean": 0.5 + 0.1 * (step % 2), "async/staleness_max": float(1 + step % 2),
                       "async/queue_wait_s": 0.05, "async/generate_s": 1.1, "async/train_s": 0.7}
        out += [Metric(f"train/{k}", v, ts, step) for k, v in values.items()]  # the trainer's keys in MLflow
    acc_before = 0.30
    acc_after = acc_before + 0.1 * (i + 1)
    if i < 2:  # eval/accuracy at step 0 (before training) and at the last step (after): one line per run
        out += [Metric("eval/accuracy", acc_before, t0, 0), Metric("eval/pass_at_8", 0.5, t0, 0),
                Metric("eval/accuracy", acc_after, t0 + 30_000, STEPS),
                Metric("eval/pass_at_8", min(1.0, acc_after + 0.2), t0 + 30_000, STEPS)]
    else:  # the naming of runs logged before that: one single-point metric each, still read
        out += [Metric("eval/accuracy_before", acc_before, t0, 0), Metric("eval/pass_at_8_before", 0.5, t0, 0),
                Metric("eval/accuracy_after", acc_after, t0 + 30_000, STEPS),
                Metric("eval/pass_at_8_after", min(1.0, acc_after + 0.2), t0 + 30_000, STEPS)]
    return out


def make_experiment(uri: str) -> dict:
    """An experiment with a sweep parent, its three child runs and one unrelated baseline run; returns ids/names."""
    client = MlflowClient(uri)
    name = f"dashboard-{uuid.uuid4().hex[:8]}"
    exp_id = client.create_experiment(name)
    t0 = int(time.time() * 1000) - 3_600_000
    parent = client.create_run(exp_id, run_name="sweep-lr", tags={"grpo.sweep": "lr"}, start_time=t0)
    # the sweep's own params (grpo/pipeline/sweep.py), none of the config's
    client.log_batch(parent.info.run_id, params=[Param("sweep.sampler", "grid"), Param("sweep.trials", "3")])
    children = {}
    for i, (run_name, (lr, families, status)) in enumerate(SWEEP_RUNS.items()):
        run = client.create_run(exp_id, run_name=run_name, start_time=t0 + i * 60_000,
                                tags={"mlflow.parentRunId": parent.info.run_id})
        params = {"grpo.learning_rate": str(lr), "grpo.num_generations": "4" if i < 2 else "8",
                  "model.name": "tiny", "seed": "0", "grpo.max_grad_norm": "0.0002612293709960431"}
        client.log_batch(run.info.run_id, metrics=_metrics(i, lr, families, t0),
                         params=[Param(k, v) for k, v in params.items()], tags=[RunTag("grpo.run_dir", f"/r/{i}")])
        client.set_terminated(run.info.run_id, status, end_time=t0 + i * 60_000 + 754_000)
        children[run_name] = run.info.run_id
    client.set_terminated(parent.info.run_id, "FINISHED", end_time=t0 + 900_000)
    baseline = client.create_run(exp_id, run_name="baseline-other", start_time=t0)
    # logged before the train/ prefix (grpo.tracking.metric_keys): still read
    client.log_batch(baseline.info.run_id, metrics=[Metric("reward", 0.1, t0, s) for s in (1, 2)],
                     params=[Param("grpo.learning_rate", "5e-6")])
    return {"experiment": name, "experiment_id": exp_id, "sweep": parent.info.run_id, "children": children,
            "baseline": baseline.info.run_id}


# (run name, config overrides, parent) of an experiment as `make demo` and two example sweeps leave it: 11 runs, 9 with
# training curves, as in the report of #44
TINY_RUNS = (
    [(f"tiny-demo-{i}", {}, None) for i in (1, 2)]
    + [(f"tiny-lr-beta-t{t:03d}", {"grpo.learning_rate": lr, "grpo.beta": beta, "grpo.max_steps": 60,
                                   "output_dir": "runs/tiny-lr-beta"}, "tiny-lr-beta")
       for t, (lr, beta) in enumerate([(1e-4, 0.0), (1e-4, 0.04), (3e-4, 0.0), (3e-4, 0.04)])]
    + [(f"tiny-tpe-t{t:03d}", {"grpo.learning_rate": lr, "grpo.beta": beta, "grpo.temperature": temp,
                               "grpo.max_steps": 60, "output_dir": "runs/tiny-tpe"}, "tiny-tpe")
       for t, (lr, beta, temp) in enumerate([(0.0002612293709960431, 0.0123, 0.7), (3.3e-5, 0.071, 1.0),
                                             (0.000112, 0.0401, 0.7)])])
TINY_LEGENDS = ["beta=0, learning_rate=1e-4, max_steps=150, temperature=1 (tiny-demo-1)",
                "beta=0, learning_rate=1e-4, max_steps=150, temperature=1 (tiny-demo-2)",
                "beta=0, learning_rate=1e-4, max_steps=60, temperature=1",
                "beta=0.04, learning_rate=1e-4, max_steps=60, temperature=1",
                "beta=0, learning_rate=3e-4, max_steps=60, temperature=1",
                "beta=0.04, learning_rate=3e-4, max_steps=60, temperature=1",
                "beta=0.0123, learning_rate=2.61e-4, max_steps=60, temperature=0.7",
                "beta=0.071, learning_rate=3.3e-5, max_steps=60, temperature=1",
                "beta=0.0401, learning_rate=1.12e-4, max_steps=60, temperature=0.7"]


def make_tiny_experiment(uri: str) -> dict:
    """:data:`TINY_RUNS` in a new experiment, each run with what the platform logs: every config param of the tiny
    preset (with its overrides), the prep and plan figures as params, ``train/reward`` and ``train/reward_std`` per step
    and ``eval/accuracy`` / ``eval/pass_at_4`` before and after; each sweep's parent run with its own params only."""
    from grpo.config import flatten
    from grpo.config.loading import load_config
    from grpo.tracking.run_tracking import plan_params, prep_params
    from grpo.tracking.values import param_value

    client = MlflowClient(uri)
    name = f"grpo-tiny-{uuid.uuid4().hex[:8]}"
    exp_id = client.create_experiment(name)
    t0 = int(time.time() * 1000) - 3_600_000
    base = flatten(load_config("tiny"))
    parents = {}
    for sweep, sampler, trials in (("tiny-lr-beta", "grid", 4), ("tiny-tpe", "tpe", 3)):
        run = client.create_run(exp_id, run_name=sweep, start_time=t0, tags={"grpo.sweep": sweep})
        client.log_batch(run.info.run_id, params=[Param("sweep.sampler", sampler), Param("sweep.trials", str(trials))])
        client.set_terminated(run.info.run_id, "FINISHED", end_time=t0 + 900_000)
        parents[sweep] = run.info.run_id
    for i, (run_name, overrides, parent) in enumerate(TINY_RUNS):
        tags = {"mlflow.parentRunId": parents[parent]} if parent else {}
        run = client.create_run(exp_id, run_name=run_name, start_time=t0 + i * 60_000, tags=tags)
        steps = overrides.get("grpo.max_steps", base["grpo.max_steps"])
        params = {**base, **overrides,
                  **prep_params({"rows_in": 5500, "rows_valid": 5500, "rows_quarantined": 0,
                                 "prompt_chars": {"min": 4, "mean": 5.5, "max": 6}}),
                  **plan_params({"generation_rounds": steps, "epochs": 1,
                                 "predicted_imbalance": {"plan_order": {"max_over_mean": 1.0312345}}})}
        items = [Param(k, param_value(v)) for k, v in params.items()]
        for at in range(0, len(items), 100):  # MLflow takes 100 params per batch
            client.log_batch(run.info.run_id, params=items[at:at + 100])
        after = 0.5 + 0.04 * i
        metrics = [Metric("eval/accuracy", 0.3, t0, 0), Metric("eval/pass_at_4", 0.5, t0, 0),
                   Metric("eval/accuracy", after, t0 + 30_000, steps),
                   Metric("eval/pass_at_4", min(1.0, after + 0.2), t0 + 30_000, steps)]
        for s in range(10, steps + 1, 10):
            metrics += [Metric("train/reward", 0.3 + 0.5 * s / steps + 0.01 * i, t0 + s * 1000, s),
                        Metric("train/reward_std", 0.4 - 0.2 * s / steps, t0 + s * 1000, s)]
        client.log_batch(run.info.run_id, metrics=metrics)
        client.set_terminated(run.info.run_id, "FINISHED", end_time=t0 + i * 60_000 + 300_000)
    return {"experiment": name, "experiment_id": exp_id}


@pytest.fixture(scope="module")
def experiment(mlflow_server):
    return make_experiment(mlflow_server.uri)


def plot_div_ids(page: str) -> list[str]:
    return re.findall(r'<div id="([^"]+)" class="plotly-graph-div"', page)


def plot_traces(page: str) -> dict[str, list[dict]]:
    """div id -> the traces passed to its ``Plotly.newPlot`` (the layout's template has trace-like entries too)."""
    decoder = json.JSONDecoder()
    out = {}
    for m in re.finditer(r'Plotly\.newPlot\(\s*"([^"]+)",\s*', page):
        out[m.group(1)], _ = decoder.raw_decode(page, m.end())
    return out


def test_sweep_dashboard_is_one_self_contained_html(tmp_path, mlflow_server, experiment):
    out = build_dashboard(mlflow_server.uri, experiment["experiment"], experiment["sweep"],
                          out=tmp_path / "sub" / "sweep.html")
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    # Self-contained: plotly.js inlined once, nothing loaded from elsewhere.
    assert not re.search(r"<script[^>]*\bsrc=", page), "external script"
    assert not re.search(r'<link[^>]*rel="stylesheet"', page)
    assert page.count("<script charset=\"utf-8\">") == 1 and len(page) > 1_000_000
    # Says what it shows and when it was generated.
    assert "GRPO sweep sweep-lr" in page and experiment["sweep"] in page and experiment["experiment"] in page
    assert re.search(r'id="generated-at">generated \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC', page)
    # Only the sweep's children.
    for name in SWEEP_RUNS:
        assert name in page
    assert "baseline-other" not in page

    assert plot_div_ids(page) == SWEEP_PLOTS
    assert 'id="skipped-panels"' in page and "System" in page[page.index('id="skipped-panels"'):]
    # Traces: reward + reward_std per run, eval before/after bars, one line per (metric, run that logged it).
    traces = plot_traces(page)
    counts = {div: [t["type"] for t in data] for div, data in traces.items()}
    assert counts == {"panel-reward": ["scatter"] * 6, "panel-eval": ["bar"] * 2, "panel-zero-adv": ["scatter"] * 6,
                      "panel-replay": ["scatter"] * 2, "panel-reroll": ["scatter"] * 3,
                      "panel-balance": ["scatter"] * 3, "panel-async": ["scatter"] * 5,
                      "panel-step-time": ["scatter"] * 3}
    # Trials are told apart by the param values that differ between them, not by their names (#15).
    legends = ["learning_rate=1e-5, num_generations=4", "learning_rate=3e-5, num_generations=4",
               "learning_rate=1e-4, num_generations=8"]  # numbers as people write them (grpo.formatting)
    reward = [t for t in traces["panel-reward"] if t["yaxis"] == "y"]
    assert [t["name"] for t in reward] == legends and all(len(t["x"]) == STEPS for t in reward)
    assert traces["panel-eval"][1]["x"] == legends and traces["panel-eval"][1]["y"] == pytest.approx(
        [0.4, 0.5, 0.6])
    assert re.search(r'id="run-count">3 runs<', page)

    table = page[page.index('<table id="final-metrics"'):page.index("</table>")]
    header = re.findall(r"<th[^>]*>([^<]*)</th>", table)
    # The results first, then only the params that differ; model.name and seed are the same everywhere.
    assert header == ["run", "status", "eval accuracy before", "eval accuracy after", "pass@k after", "final reward",
                      "steps", "wall time", "grpo.learning_rate", "grpo.num_generations"]
    rows = re.findall(r"<tr>(.*?)</tr>", table[table.index("<tbody>"):], re.S)
    assert len(rows) == 3
    cells = [re.findall(r"<td[^>]*>(.*?)</td>", row) for row in rows]
    first = cells[0]
    assert "lr-1e-5" in first[0] and first[1] == "FINISHED"
    # metrics with 3 decimals each (reward 0.7602 stood next to accuracy 0.9), the step count as a count
    assert first[2:5] == ["0.300", "0.400", "0.600 (k=8)"] and re.fullmatch(r"0\.\d{3}", first[5]), first
    assert first[6:10] == ["20", "12m 34s", "1e-5", "4"]
    assert cells[2][1] == "FAILED"


def test_experiment_dashboard_has_every_run(tmp_path, mlflow_server, experiment):
    page = build_dashboard(mlflow_server.uri, experiment["experiment"], out=tmp_path / "exp.html").read_text()
    for name in [*SWEEP_RUNS, "baseline-other", "sweep-lr"]:
        assert name in page
    assert f"GRPO experiment {experiment['experiment']}" in page
    assert plot_div_ids(page)[0] == "panel-reward"
    # the sweep's parent run logs no training metrics: counted, and said to be without curves
    assert re.search(r'id="run-count">5 runs, 4 with training curves<', page)
    # the columns are the params with different values, not every param some run lacks (the parent has none of the
    # config's params, the baseline only one): model.name, seed and max_grad_norm are the same wherever logged
    table = page[page.index('<table id="final-metrics"'):page.index("</table>")]
    header = re.findall(r"<th[^>]*>([^<]*)</th>", table)
    assert header == ["run", "status", "eval accuracy before", "eval accuracy after", "pass@k after", "final reward",
                      "steps", "wall time", "grpo.learning_rate", "grpo.num_generations"]
    rows = {re.search(r'title="[^"]+">([^<]+)</a>', row).group(1): re.findall(r"<td[^>]*>(.*?)</td>", row)
            for row in re.findall(r"<tr>(.*?)</tr>", table[table.index("<tbody>"):], re.S)}
    assert [rows[n][8] for n in ("baseline-other", "lr-1e-5", "lr-1e-4", "sweep-lr")] == ["5e-6", "1e-5", "1e-4", "—"]
    # the plots name the runs by the params that differ among the runs that logged them (the parent, without the
    # config's params, and the baseline, with one, made every param differ: the legends were the run names)
    reward = [t for t in plot_traces(page)["panel-reward"] if t["yaxis"] == "y"]
    assert sorted(t["name"] for t in reward) == ["learning_rate=1e-4, num_generations=8",  # (two start together)
                                                 "learning_rate=1e-5, num_generations=4",
                                                 "learning_rate=3e-5, num_generations=4",
                                                 "learning_rate=5e-6, num_generations=—"]


def test_experiment_dashboard_of_demo_and_sweep_runs_names_them_by_their_settings(tmp_path, mlflow_server):
    """The experiment of #44 (two demo runs and two sweeps, 11 runs): the legends say which settings each run had,
    not its name; the measured prep/plan figures and the output folder do not count as settings. The final-metrics
    table leads with the eval columns; the 8 params that differ between the runs follow."""
    exp = make_tiny_experiment(mlflow_server.uri)
    page = build_dashboard(mlflow_server.uri, exp["experiment"], out=tmp_path / "tiny.html").read_text()
    assert re.search(r'id="run-count">11 runs, 9 with training curves<', page)
    reward = [t for t in plot_traces(page)["panel-reward"] if t["yaxis"] == "y"]
    assert [t["name"] for t in reward] == TINY_LEGENDS
    assert plot_traces(page)["panel-eval"][1]["x"] == TINY_LEGENDS
    table = page[page.index('<table id="final-metrics"'):page.index("</table>")]
    assert re.findall(r"<th[^>]*>([^<]*)</th>", table) == [
        "run", "status", "eval accuracy before", "eval accuracy after", "pass@k after", "final reward", "steps",
        "wall time", "grpo.beta", "grpo.learning_rate", "grpo.max_steps", "grpo.temperature", "output_dir",
        "plan.generation_rounds", "sweep.sampler", "sweep.trials"]


def test_human_number():
    from grpo.formatting import human_number

    assert [human_number(x) for x in (0.0002612293709960431, 1e-05, "3e-05", 100000.0, 1.5e6, -2.5e-4)] == [
        "2.61e-4", "1e-5", "3e-5", "1e5", "1.5e6", "-2.5e-4"]
    assert [human_number(x) for x in (5500, "16", 0.123456, 42.0, 0.0, 0.001, 12345.6)] == [
        "5500", "16", "0.1235", "42", "0", "0.001", "1.23e4"]
    assert human_number("tiny") == "tiny" and human_number(True) == "True"


def test_unknown_experiment_lists_existing_ones(tmp_path, mlflow_server, experiment):
    with pytest.raises(ValueError, match=r"unknown MLflow experiment 'nope-xyz'; existing experiments: .*"
                                         + re.escape(repr(experiment["experiment"]))):
        build_dashboard(mlflow_server.uri, "nope-xyz", out=tmp_path / "x.html")
    empty = f"empty-{uuid.uuid4().hex[:6]}"
    MlflowClient(mlflow_server.uri).create_experiment(empty)
    with pytest.raises(ValueError, match="has no runs"):
        build_dashboard(mlflow_server.uri, empty, out=tmp_path / "x.html")
    with pytest.raises(ValueError, match="has no child runs"):  # a run that is nobody's parent
        build_dashboard(mlflow_server.uri, experiment["experiment"], experiment["baseline"], out=tmp_path / "x.html")
    with pytest.raises(DashboardError, match="sweep run 'f00' not found"):
        build_dashboard(mlflow_server.uri, experiment["experiment"], "f00", out=tmp_path / "x.html")
    assert not (tmp_path / "x.html").exists()


def test_log_dashboard_uploads_to_the_sweep_run(tmp_path, mlflow_server, experiment):
    out = build_dashboard(mlflow_server.uri, experiment["experiment"], experiment["sweep"], out=tmp_path / "d.html")
    client = MlflowClient(mlflow_server.uri)
    assert log_dashboard(client, experiment["sweep"], out) == "dashboard/d.html"
    assert [a.path for a in client.list_artifacts(experiment["sweep"], "dashboard")] == ["dashboard/d.html"]
    local = client.download_artifacts(experiment["sweep"], "dashboard/d.html", str(tmp_path / "dl"))
    assert open(local).read() == out.read_text()


def test_cli(tmp_path, mlflow_server, experiment):
    from grpo.app.cli import app

    runner = CliRunner()
    out = tmp_path / "cli.html"
    ok = runner.invoke(app, ["dashboard", "--experiment", experiment["experiment"], "--sweep", experiment["sweep"],
                             "--out", str(out), "--tracking-uri", mlflow_server.uri])
    assert ok.exit_code == 0, ok.output
    assert out.is_file() and str(out) in ok.stdout
    bad = runner.invoke(app, ["dashboard", "--experiment", "no-such-exp", "--out", str(tmp_path / "bad.html"),
                              "--tracking-uri", mlflow_server.uri])
    assert bad.exit_code == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown MLflow experiment 'no-such-exp'"), bad.stderr
    assert not (tmp_path / "bad.html").exists()
    # The default store is <cwd>/mlflow.db: a missing one is an error, not a new empty database.
    missing = runner.invoke(app, ["dashboard", "--experiment", "x", "--out", str(tmp_path / "m.html"),
                                  "--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"])
    assert missing.exit_code == 2 and "no MLflow store at" in missing.stderr
    assert not (tmp_path / "none.db").exists()


def test_sweep_dashboard_shows_optuna_importances_and_pruned_trials(tmp_path, mlflow_server):
    """A sweep's importances (logged by grpo/pipeline/sweep.py as sweep/importances.json on the parent run) become a bar
    chart and a table; a trial the study pruned (tag grpo.sweep.pruned) shows the status PRUNED; too few trials give
    the sweep's note instead of a chart."""
    exp = make_experiment(mlflow_server.uri)
    client = MlflowClient(mlflow_server.uri)
    client.set_tag(exp["children"]["lr-3e-5"], "grpo.sweep.pruned", "true")
    importances = {"study": "lr-study", "completed_trials": 5, "note": None,
                   "importances": {"grpo.learning_rate": 0.8, "grpo.num_generations": 0.2}}
    client.log_dict(exp["sweep"], importances, "sweep/importances.json")

    page = build_dashboard(mlflow_server.uri, exp["experiment"], exp["sweep"], out=tmp_path / "s.html").read_text()
    assert plot_div_ids(page) == [*SWEEP_PLOTS[:2], "panel-importances", *SWEEP_PLOTS[2:]]
    [bars] = plot_traces(page)["panel-importances"]
    assert bars["type"] == "bar" and bars["y"] == ["grpo.num_generations", "grpo.learning_rate"]  # largest on top
    assert bars["x"] == [0.2, 0.8] and "lr-study" in page and "5 completed" in page
    table = page[page.index('<table id="importances-table"'):]
    assert re.findall(r"<td[^>]*>([^<]*)</td>", table[:table.index("</table>")]) == [
        "grpo.learning_rate", "0.8000", "grpo.num_generations", "0.2000"]
    metrics = page[page.index('<table id="final-metrics"'):]
    assert re.search(r'status-pruned">PRUNED<', metrics)

    note = {"study": "s", "completed_trials": 1, "importances": None,
            "note": "importances need at least 2 completed trials and 2 params"}
    page = build_dashboard(mlflow_server.uri, exp["experiment"], exp["sweep"], out=tmp_path / "n.html",
                           importances=note).read_text()
    assert "panel-importances" not in plot_div_ids(page)
    assert 'id="importances-note">importances need at least 2 completed trials and 2 params.<' in page
    # an experiment page (no sweep) has no importance section
    page = build_dashboard(mlflow_server.uri, exp["experiment"], out=tmp_path / "e.html").read_text()
    assert "panel-importances" not in page


def test_legend_labels_name_runs_by_the_params_that_differ():
    from dashboards.comparison import RunData, legend_labels

    def run(name: str, **params: str) -> RunData:
        return RunData(run_id=name, name=name, label=name, status="FINISHED", start_ms=None, end_ms=None,
                       params={"model.name": "tiny", **{k.replace("__", "."): v for k, v in params.items()}},
                       latest={}, history={"reward": [(1, 0.5)]})

    # the same last part in two sections: the full key names both
    runs = [run("a", grpo__beta="0.0", warm__beta="1"), run("b", grpo__beta="0.04", warm__beta="1"),
            run("c", grpo__beta="0.04", warm__beta="2")]
    assert legend_labels(runs) == ["grpo.beta=0, warm.beta=1", "grpo.beta=0.04, warm.beta=1",
                                   "grpo.beta=0.04, warm.beta=2"]
    # a param one run lacks (an older run) does not set the others apart; one with two values does, and the run
    # without it reads "—"; two runs with the same values keep their names
    assert legend_labels([run("a", grpo__lr="1"), run("b", grpo__lr="1"), run("c")]) == ["a", "b", "c"]
    runs = [run("a", grpo__lr="1"), run("b", grpo__lr="1"), run("c", grpo__lr="2"), run("d")]
    assert legend_labels(runs) == ["lr=1 (a)", "lr=1 (b)", "lr=2", "lr=—"]
    # measured figures and the output folder are no settings; the runs without curves (sweeps' parents) are not in
    # the plots, and their params do not count
    parents = [RunData(run_id=p, name=p, label=p, status="FINISHED", start_ms=None, end_ms=None,
                       params={"sweep.sampler": p}, latest={}) for p in ("grid", "tpe")]
    runs = [run("a", grpo__lr="1", plan__epochs="1", output_dir="x"), run("b", grpo__lr="2", plan__epochs="2"),
            *parents]
    assert legend_labels(runs) == ["lr=1", "lr=2", "lr=— (grid)", "lr=— (tpe)"]
    # unrelated runs (more than six params differ) and identical ones keep their names
    many = [run("a", **{f"p{i}": "1" for i in range(7)}), run("b", **{f"p{i}": "2" for i in range(7)})]
    assert legend_labels(many) == ["a", "b"]
    assert legend_labels([run("a"), run("b")]) == ["a", "b"] and legend_labels([run("solo", x="1")]) == ["solo"]


def test_cli_dashboard_of_a_sweep_prints_one_line_and_no_progress_bar(tmp_path, mlflow_server):
    """``grpo dashboard --sweep`` downloads the sweep's importances from MLflow: that printed MLflow's "Downloading
    artifacts" progress bar; the command says one line, where the page is."""
    import subprocess
    import sys

    exp = make_experiment(mlflow_server.uri)
    MlflowClient(mlflow_server.uri).log_dict(exp["sweep"], {"study": "s", "completed_trials": 3, "note": None,
                                                             "importances": {"grpo.learning_rate": 1.0}},
                                             "sweep/importances.json")
    out = tmp_path / "d.html"
    result = subprocess.run([sys.executable, "-m", "grpo.app.cli", "dashboard", "--experiment", exp["experiment"],
                             "--sweep", exp["sweep"], "--out", str(out), "--tracking-uri", mlflow_server.uri],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "panel-importances" in out.read_text()  # the importances were downloaded
    assert result.stdout.splitlines() == [f"dashboard: {out}"]
    assert "Downloading artifacts" not in result.stderr and "it/s]" not in result.stderr, result.stderr
