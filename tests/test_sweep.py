"""Sweeps: search-space expansion (no servers), and trials as deployment runs (the session's Prefect server + a real
`mlflow server`). The 4-trial sweep run by a process worker is in test_infra.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from grpo.config import load_config
from grpo.pipeline.sweep_space import SpaceError, check_path, expand_space, load_space, trial_overrides
from tests.conftest import MICRO, micro_overrides

@pytest.fixture(scope="module")
def base():
    return load_config(MICRO)


# ---------------------------------------------------------------- space expansion


def test_grid_is_the_product_last_field_fastest(base):
    trials = expand_space(base, {"grid": {"grpo.learning_rate": [1e-4, 3e-4], "grpo.beta": [0.0, 0.04]}})
    assert [o for o, _ in trials] == [
        {"grpo.learning_rate": 1e-4, "grpo.beta": 0.0}, {"grpo.learning_rate": 1e-4, "grpo.beta": 0.04},
        {"grpo.learning_rate": 3e-4, "grpo.beta": 0.0}, {"grpo.learning_rate": 3e-4, "grpo.beta": 0.04}]
    for overrides, cfg in trials:
        assert (cfg.grpo.learning_rate, cfg.grpo.beta) == (overrides["grpo.learning_rate"], overrides["grpo.beta"])
        assert cfg.model.tiny.hidden_size == base.model.tiny.hidden_size  # everything else from the base
    assert base.grpo.beta == 0.0 and base.grpo.learning_rate == 1e-4  # the base is not modified


RANDOM = {"random": {"n_trials": 6, "seed": 0, "params": {
    "grpo.learning_rate": {"loguniform": [1e-5, 1e-3]}, "grpo.temperature": {"uniform": [0.7, 1.2]},
    "grpo.num_generations": {"choice": [4, 8]}, "model.warm_start.steps": {"int": [100, 300]}}}}


def test_random_is_deterministic_for_a_seed_and_within_bounds(base):
    first = [o for o, _ in expand_space(base, RANDOM)]
    assert first == [o for o, _ in expand_space(base, json.loads(json.dumps(RANDOM)))]
    other = json.loads(json.dumps(RANDOM))
    other["random"]["seed"] = 1
    assert first != [o for o, _ in expand_space(base, other)]
    assert len(first) == 6
    for o in first:
        assert 1e-5 <= o["grpo.learning_rate"] <= 1e-3 and 0.7 <= o["grpo.temperature"] <= 1.2
        assert o["grpo.num_generations"] in (4, 8) and 100 <= o["model.warm_start.steps"] <= 300
        assert isinstance(o["model.warm_start.steps"], int)
    assert len({o["grpo.learning_rate"] for o in first}) == 6


def test_grid_and_random_cross(base):
    space = {"grid": {"grpo.beta": [0.0, 0.04]},
             "random": {"n_trials": 3, "seed": 7, "params": {"grpo.temperature": {"uniform": [0.7, 1.2]}}}}
    trials = trial_overrides(space)
    assert len(trials) == 6 and [t["grpo.beta"] for t in trials] == [0.0] * 3 + [0.04] * 3
    assert [t["grpo.temperature"] for t in trials[:3]] == [t["grpo.temperature"] for t in trials[3:]]


@pytest.mark.parametrize("space, fragments", [
    ({"grid": {"grpo.learnin_rate": [1e-4]}}, ["grpo.learnin_rate: unknown config field",
                                               "did you mean 'grpo.learning_rate'"]),
    ({"grid": {"grp.beta": [0.0]}}, ["grp.beta: unknown config field"]),
    ({"grid": {"grpo.beta.x": [0.0]}}, ["grpo.beta.x: grpo.beta is a value, not a section"]),
    ({"grid": {"grpo.beta": [0.0, -1.0]}}, ["trial 1 (grpo.beta=-1.0)", "grpo.beta: Input should be greater"]),
    ({"grid": {"grpo.learning_rate": [1e-4], "grpo.num_generations": [4, 5]}},
     ["trial 1 (grpo.learning_rate=0.0001, grpo.num_generations=5)", "grpo.num_generations (5)"]),
    ({"random": {"n_trials": 3, "seed": 0, "params": {"grpo.reward_funcs": {"choice": [["exact_match"], ["nope"]]}}}},
     ["grpo.reward_funcs: unknown reward 'nope'", "trial "]),
    ({"grid": {"output_dir": ["elsewhere"]}}, ["output_dir: output_dir is set by the sweep"]),
    ({"random": {"n_trials": 2, "params": {"grpo.beta": {"normal": [0, 1]}}}},
     ["space.random.params.grpo.beta: unknown distribution 'normal'"]),
    ({"random": {"n_trials": 2, "params": {"grpo.learning_rate": {"loguniform": [0, 1e-3]}}}},
     ["space.random.params.grpo.learning_rate: loguniform needs 0 < low < high"]),
    ({"grid": {"grpo.beta": []}}, ["space.grid.grpo.beta: expected a non-empty list"]),
    ({"grids": {}}, ["space.grids: unknown key (did you mean 'grid'?)"]),
    ({"grid": {"grpo.beta": [0.0]}, "random": {"n_trials": 1, "params": {"grpo.beta": {"uniform": [0, 1]}}}},
     ["grpo.beta is in both grid and random"]),
])
def test_invalid_space_names_the_trial_and_field(base, space, fragments):
    with pytest.raises(SpaceError) as err:
        expand_space(base, space)
    assert isinstance(err.value, ValueError)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_paths_cover_aliases_and_dict_fields(base):
    assert check_path("async.max_staleness") == ["async", "max_staleness"]
    (overrides, cfg), = expand_space(base, {"grid": {"grpo.extra.adam_beta1": [0.8], "async.max_staleness": [3]}})
    assert cfg.grpo.extra == {"adam_beta1": 0.8} and cfg.async_.max_staleness == 3
    assert overrides == {"grpo.extra.adam_beta1": 0.8, "async.max_staleness": 3}


def test_load_space_yaml_and_json(tmp_path, base):
    (tmp_path / "s.yaml").write_text("grid:\n  grpo.learning_rate: [1e-4, 3.0e-4]\n")
    (tmp_path / "s.json").write_text(json.dumps(RANDOM))
    trials = expand_space(base, load_space(tmp_path / "s.yaml"))
    assert [o["grpo.learning_rate"] for o, _ in trials] == [1e-4, 3e-4]  # YAML's "1e-4" string is read as a number
    assert load_space(tmp_path / "s.json") == RANDOM
    (tmp_path / "bad.yaml").write_text("random:\n  n_trials: 0\n  params: {grpo.beta: {uniform: [0, 1]}}\n")
    with pytest.raises(SpaceError, match=r"bad.yaml: space.random.n_trials: expected an integer >= 1"):
        load_space(tmp_path / "bad.yaml")
    with pytest.raises(SpaceError, match="space file not found"):
        load_space(tmp_path / "missing.yaml")


@pytest.mark.parametrize("space_text, fragment", [
    ("grid:\n  grpo.learnin_rate: [1.0e-4]\n", "grpo.learnin_rate: unknown config field"),
    ("grid:\n  grpo.beta: [0.0, -1.0]\n", "trial 1 (grpo.beta=-1.0): grpo.beta"),
    ("grid: [1\n", "not valid YAML"),
])
def test_cli_bad_space_is_one_line_exit_2(tmp_path, space_text, fragment):
    (tmp_path / "space.yaml").write_text(space_text)
    result = subprocess.run([sys.executable, "-m", "grpo.app.cli", "sweep", "--config", str(MICRO), "--space",
                             str(tmp_path / "space.yaml"), "--set", f"output_dir={tmp_path / 'runs'}"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- a real sweep


def prefect_api(path: str, body: dict) -> list[dict]:
    import httpx
    from prefect.settings import PREFECT_API_URL

    response = httpx.post(f"{PREFECT_API_URL.value().rstrip('/')}/{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


@pytest.mark.integration
def test_sweep_via_deployment_creates_linked_flow_runs(tmp_path, prefect_in_process, mlflow_server):
    """Smoke path of ``use_deployment``: no worker serves the deployment here, so each trial's flow run is created
    (with the trial's config, run name and MLflow nesting tags) and stays scheduled until ``trial_timeout``."""
    from flows.pipeline import grpo_pipeline
    from flows.sweep import SweepError, grpo_sweep

    grpo_pipeline.to_deployment(name="sweep-smoke").apply()
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "tracking.backend": "mlflow", "tracking.tracking_uri": mlflow_server.uri,
        "tracking.experiment_name": "sweep-deploy-tests", "tracking.log_system_metrics": "false"}))
    with pytest.raises(SweepError, match="all 2 trials failed; first error: TimeoutError"):
        grpo_sweep(config=cfg, space={"grid": {"grpo.learning_rate": [1e-4, 3e-4]}}, sweep_name="dep",
                   use_deployment="grpo-pipeline/sweep-smoke", trial_timeout=0.5)
    results = json.loads((tmp_path / "dep" / "results.json").read_text())
    assert [r["status"] for r in results] == ["failed", "failed"]

    runs = prefect_api("flow_runs/filter", {"sort": "EXPECTED_START_TIME_ASC", "limit": 20, "offset": 0,
                                            "flow_runs": {"name": {"any_": ["dep-t000", "dep-t001"]}}})
    assert sorted(r["name"] for r in runs) == ["dep-t000", "dep-t001"]
    assert all(r["parent_task_run_id"] and r["deployment_id"] for r in runs)
    parent = MlflowClient(mlflow_server.uri).search_runs(
        [MlflowClient(mlflow_server.uri).get_experiment_by_name("sweep-deploy-tests").experiment_id],
        filter_string="tags.`grpo.run_type` = 'sweep'")[0]
    assert parent.info.status == "FAILED"
    for r in sorted(runs, key=lambda r: r["name"]):
        params = r["parameters"]
        assert params["run_name"] == r["name"]
        assert params["tracking_tags"]["mlflow.parentRunId"] == parent.info.run_id
        assert params["config"]["output_dir"] == str(tmp_path / "dep")
    assert {r["parameters"]["config"]["grpo"]["learning_rate"] for r in runs} == {1e-4, 3e-4}
    assert {r["state_type"] for r in runs} == {"CANCELLED"}  # given up on: no worker picks them up later


def test_the_shipped_example_space_expands():
    space = load_space("tiny-lr-beta")
    trials = expand_space(load_config("tiny"), space)
    assert len(trials) == 4 and {o["grpo.learning_rate"] for o, _ in trials} == {1e-4, 3e-4}
    assert all(0.0 <= o["grpo.beta"] <= 0.04 for o, _ in trials)


@pytest.mark.integration
def test_cli_sweep_prints_the_parent_run_and_the_dashboard(tmp_path, prefect_server, mlflow_server):
    """#15: the console named neither the parent MLflow run (what `grpo dashboard --sweep` needs) nor the dashboard."""
    (tmp_path / "space.yaml").write_text("grid:\n  grpo.learning_rate: [1.0e-4, 3.0e-4]\n")
    sets = [f"output_dir={tmp_path / 'runs'}", "tracking.backend=mlflow", "grpo.max_steps=2", "grpo.save_steps=100", "evaluation.enabled=false",
            f"tracking.tracking_uri={mlflow_server.uri}", "tracking.experiment_name=cli-sweep",
            "tracking.log_system_metrics=false"]
    # --direction minimize on a metric that differs between trials (their wall time): the best is the smallest
    result = subprocess.run([sys.executable, "-m", "grpo.app.cli", "sweep", "--config", str(MICRO), "--space",
                             str(tmp_path / "space.yaml"), "--name", "lr", "--metric", "wall_seconds",
                             "--direction", "minimize", *(a for s in sets for a in ("--set", s))],
                            cwd=tmp_path, env=prefect_server.env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    parent = MlflowClient(mlflow_server.uri).search_runs(
        [MlflowClient(mlflow_server.uri).get_experiment_by_name("cli-sweep").experiment_id],
        filter_string="tags.`grpo.run_type` = 'sweep'")[0].info.run_id
    out = result.stdout
    assert f"mlflow parent run: {parent} (compare again: grpo dashboard --experiment cli-sweep --sweep {parent}" in out
    assert f"dashboard: {tmp_path / 'runs' / 'lr' / 'dashboard.html'} (comparison, logged to MLflow as dashboard/" in out

    # the best trial (tagged on the parent, registered with alias "best") has the smallest wall_seconds of the
    # completed trials, read from each trial's own summary.json
    trials = json.loads((tmp_path / "runs" / "lr" / "sweep.json").read_text())["trials"]
    seconds = {t["mlflow_run_id"]: json.loads((Path(t["run_dir"]) / "summary.json").read_text())["wall_seconds"]
               for t in trials if t["status"] == "completed"}
    assert len(seconds) == 2, seconds
    client = MlflowClient(mlflow_server.uri)
    tags = client.get_run(parent).data.tags
    assert seconds[tags["grpo.sweep.best_run_id"]] == min(seconds.values()), (tags, seconds)  # ties: either is right
    if "grpo.sweep.registered_model" in tags:
        version = client.get_model_version(tags["grpo.sweep.registered_model"], tags["grpo.sweep.registered_version"])
        assert version.run_id == tags["grpo.sweep.best_run_id"]
