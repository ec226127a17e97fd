"""Sweeps: search spaces as Optuna distributions, samplers and pruners (no servers); a TPE study with a median pruner
on the micro model, continued by a second invocation; trials as deployment runs; the CLI (the session's Prefect server
+ a real `mlflow server`). The 4-trial grid sweep run by a process worker is in test_infra.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from grpo.config import load_config
from grpo.pipeline.sweep_space import SpaceError, check_path, load_space, validate_space
from tests.conftest import MICRO, micro_overrides


@pytest.fixture(scope="module")
def base():
    return load_config(MICRO)


# ---------------------------------------------------------------- spaces


def test_grid_is_the_product_last_field_fastest(base):
    space = validate_space(base, {"grid": {"grpo.learning_rate": [1e-4, 3e-4], "grpo.beta": [0.0, 0.04]}})
    assert space.sampler_kind == "grid" and space.n_trials == 4
    assert space.grid_points() == [
        {"grpo.learning_rate": 1e-4, "grpo.beta": 0.0}, {"grpo.learning_rate": 1e-4, "grpo.beta": 0.04},
        {"grpo.learning_rate": 3e-4, "grpo.beta": 0.0}, {"grpo.learning_rate": 3e-4, "grpo.beta": 0.04}]
    for point in space.grid_points():
        overrides, cfg = space.config(point, "trial")
        assert (cfg.grpo.learning_rate, cfg.grpo.beta) == (overrides["grpo.learning_rate"], overrides["grpo.beta"])
        assert cfg.model.tiny.hidden_size == base.model.tiny.hidden_size  # everything else from the base
    assert base.grpo.beta == 0.0 and base.grpo.learning_rate == 1e-4  # the base is not modified
    # the current form is the same space
    same = validate_space(base, {"sampler": "grid", "params": {"grpo.learning_rate": [1e-4, 3e-4],
                                                               "grpo.beta": [0.0, 0.04]}})
    assert same.grid_points() == space.grid_points()


def _draws(space, n: int) -> list[dict]:
    """What the space's Optuna sampler suggests for n trials of a new in-memory study (nothing told)."""
    import optuna

    study = optuna.create_study(sampler=space.sampler(), direction="maximize")
    if space.sampler_kind == "grid":
        space.enqueue_grid(study)
    return [space.suggest(study.ask()) for _ in range(n)]


RANDOM = {"random": {"n_trials": 6, "seed": 0, "params": {
    "grpo.learning_rate": {"loguniform": [1e-5, 1e-3]}, "grpo.temperature": {"uniform": [0.7, 1.2]},
    "grpo.num_generations": {"choice": [4, 8]}, "model.warm_start.steps": {"int": [100, 300]}}}}


def test_random_and_tpe_draw_from_optuna_distributions_deterministic_for_a_seed(base):
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space = validate_space(base, RANDOM)
    assert (space.sampler_kind, space.n_trials, type(space.sampler()).__name__) == ("random", 6, "RandomSampler")
    dists = space.distributions()
    assert dists["grpo.learning_rate"] == FloatDistribution(1e-5, 1e-3, log=True)
    assert dists["grpo.temperature"] == FloatDistribution(0.7, 1.2)
    assert dists["grpo.num_generations"] == CategoricalDistribution([4, 8])
    assert dists["model.warm_start.steps"] == IntDistribution(100, 300)
    first = _draws(space, 6)
    assert first == _draws(validate_space(base, json.loads(json.dumps(RANDOM))), 6)
    other = json.loads(json.dumps(RANDOM))
    other["random"]["seed"] = 1
    assert first != _draws(validate_space(base, other), 6)
    for o in first:
        assert 1e-5 <= o["grpo.learning_rate"] <= 1e-3 and 0.7 <= o["grpo.temperature"] <= 1.2
        assert o["grpo.num_generations"] in (4, 8) and 100 <= o["model.warm_start.steps"] <= 300
        assert isinstance(o["model.warm_start.steps"], int)
    assert len({o["grpo.learning_rate"] for o in first}) == 6

    tpe = validate_space(base, {"sampler": "tpe", "n_trials": 3, "seed": 0, "startup_trials": 1,
                                "params": RANDOM["random"]["params"],
                                "pruner": {"type": "hyperband", "min_resource": 2, "reduction_factor": 3}})
    sampler, pruner = tpe.sampler(), tpe.pruner()
    assert type(sampler).__name__ == "TPESampler" and sampler._n_startup_trials == 1
    assert type(pruner).__name__ == "HyperbandPruner"
    assert tpe.pruner_spec == {"type": "hyperband", "metric": "reward", "direction": "maximize", "min_resource": 2,
                               "reduction_factor": 3}
    median = validate_space(base, {"sampler": "random", "n_trials": 1, "params": {"grpo.beta": [0.0, 0.1]},
                                   "pruner": {"type": "median", "n_startup_trials": 2, "n_warmup_steps": 1}})
    assert type(median.pruner()).__name__ == "MedianPruner"
    assert median.distributions()["grpo.beta"] == CategoricalDistribution([0.0, 0.1])  # a plain list: a choice
    assert type(validate_space(base, {"sampler": "random", "n_trials": 1, "params": {"grpo.beta": [0.0]},
                                      "pruner": "none"}).pruner()).__name__ == "NopPruner"


def test_choices_of_lists_reach_the_config(base):
    space = validate_space(base, {"sampler": "random", "n_trials": 4, "seed": 0, "params": {
        "grpo.reward_funcs": {"choice": [["exact_match"], ["exact_match", "digits_format"]]}}})
    draws = _draws(space, 4)
    assert {tuple(d["grpo.reward_funcs"]) for d in draws} <= {("exact_match",), ("exact_match", "digits_format")}
    _, cfg = space.config(draws[0], "trial 0")
    assert cfg.grpo.reward_funcs == draws[0]["grpo.reward_funcs"]


@pytest.mark.parametrize("space, fragments", [
    ({"grid": {"grpo.learnin_rate": [1e-4]}}, ["grpo.learnin_rate: unknown config field",
                                               "did you mean 'grpo.learning_rate'"]),
    ({"grid": {"grp.beta": [0.0]}}, ["grp.beta: unknown config field"]),
    ({"grid": {"grpo.beta.x": [0.0]}}, ["grpo.beta.x: grpo.beta is a value, not a section"]),
    ({"grid": {"grpo.beta": [0.0, -1.0]}}, ["trial 1 (grpo.beta=-1.0)", "grpo.beta: Input should be greater"]),
    ({"grid": {"grpo.learning_rate": [1e-4], "grpo.num_generations": [4, 5]}},
     ["trial 1 (grpo.learning_rate=0.0001, grpo.num_generations=5)", "grpo.num_generations (5)"]),
    ({"random": {"n_trials": 3, "seed": 0, "params": {"grpo.reward_funcs": {"choice": [["exact_match"], ["nope"]]}}}},
     ["grpo.reward_funcs: unknown reward 'nope'", "space.params.grpo.reward_funcs (grpo.reward_funcs=['nope'])"]),
    ({"sampler": "tpe", "n_trials": 2, "params": {"grpo.beta": {"uniform": [-1.0, 0.1]}}},
     ["space.params.grpo.beta (grpo.beta=-1.0)", "grpo.beta: Input should be greater"]),
    ({"grid": {"output_dir": ["elsewhere"]}}, ["output_dir: output_dir is set by the sweep"]),
    ({"random": {"n_trials": 2, "params": {"grpo.beta": {"normal": [0, 1]}}}},
     ["space.random.params.grpo.beta: unknown distribution 'normal'"]),
    ({"random": {"n_trials": 2, "params": {"grpo.learning_rate": {"loguniform": [0, 1e-3]}}}},
     ["space.random.params.grpo.learning_rate: loguniform needs 0 < low < high"]),
    ({"random": {"n_trials": 0, "params": {"grpo.beta": {"uniform": [0, 1]}}}},
     ["space.random.n_trials: expected an integer >= 1"]),
    ({"grid": {"grpo.beta": []}}, ["space.grid.grpo.beta: expected a non-empty list"]),
    ({"grids": {}}, ["space.grids: unknown key (did you mean 'grid'?)"]),
    ({"grid": {"grpo.beta": [0.0]}, "random": {"n_trials": 1, "params": {"grpo.temperature": {"uniform": [0.5, 1]}}}},
     ["space: grid and random together", "use sampler: grid"]),
    ({"sampler": "tpee", "n_trials": 2, "params": {"grpo.beta": [0.0]}},
     ["space.sampler: 'tpee' is not a sampler (did you mean 'tpe'?); valid: grid, random, tpe"]),
    ({"sampler": "tpe", "params": {"grpo.beta": [0.0]}}, ["space.n_trials: expected an integer >= 1 (got None)"]),
    ({"sampler": "grid", "n_trials": 3, "params": {"grpo.beta": [0.0]}},
     ["space.n_trials: a grid runs every combination once"]),
    ({"sampler": "grid", "params": {"grpo.beta": {"uniform": [0, 1]}}},
     ["space.params.grpo.beta: a grid needs a non-empty list of values"]),
    ({"sampler": "random", "n_trials": 2, "startup_trials": 1, "params": {"grpo.beta": [0.0]}},
     ["space.startup_trials: only for sampler: tpe"]),
    ({"sampler": "tpe", "n_trials": 2, "params": {"grpo.beta": [0.0]}, "pruner": {"type": "medain"}},
     ["space.pruner.type: 'medain' is not a pruner (did you mean 'median'?); valid: none, median, hyperband"]),
    ({"sampler": "tpe", "n_trials": 2, "params": {"grpo.beta": [0.0]}, "pruner": {"type": "median", "min_resource": 1}},
     ["space.pruner.min_resource: unknown option of the median pruner", "valid: type, metric, direction, "
      "n_startup_trials"]),
    ({"sampler": "tpe", "n_trials": 2, "params": {"grpo.beta": [0.0]},
      "pruner": {"type": "hyperband", "reduction_factor": 1}},
     ["space.pruner.reduction_factor: expected an integer >= 2"]),
    ({"sampler": "tpe", "n_trials": 2, "params": {"grpo.beta": [0.0]}, "pruner": {"type": "median",
                                                                                "direction": "up"}},
     ["space.pruner.direction: 'up'; valid: maximize, minimize"]),
])
def test_invalid_space_names_the_field(base, space, fragments):
    with pytest.raises(SpaceError) as err:
        validate_space(base, space)
    assert isinstance(err.value, ValueError)
    assert "\n" not in str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value)


def test_paths_cover_aliases_and_dict_fields(base):
    assert check_path("async.max_staleness") == ["async", "max_staleness"]
    space = validate_space(base, {"grid": {"grpo.extra.adam_beta1": [0.8], "async.max_staleness": [3]}})
    (point,) = space.grid_points()
    overrides, cfg = space.config(point, "trial 0")
    assert cfg.grpo.extra == {"adam_beta1": 0.8} and cfg.async_.max_staleness == 3
    assert overrides == {"grpo.extra.adam_beta1": 0.8, "async.max_staleness": 3}


def test_load_space_yaml_and_json(tmp_path, base):
    (tmp_path / "s.yaml").write_text("grid:\n  grpo.learning_rate: [1e-4, 3.0e-4]\n")
    (tmp_path / "s.json").write_text(json.dumps(RANDOM))
    space = validate_space(base, load_space(tmp_path / "s.yaml"))
    assert [p["grpo.learning_rate"] for p in space.grid_points()] == [1e-4, 3e-4]  # YAML's "1e-4" is a number
    assert load_space(tmp_path / "s.json") == RANDOM
    (tmp_path / "bad.yaml").write_text("random:\n  n_trials: 0\n  params: {grpo.beta: {uniform: [0, 1]}}\n")
    with pytest.raises(SpaceError, match=r"bad.yaml: space.random.n_trials: expected an integer >= 1"):
        load_space(tmp_path / "bad.yaml")
    (tmp_path / "bad2.yaml").write_text("sampler: tpe\nn_trials: 2\nparams: {grpo.beta: {uniform: [0, 1]}}\n"
                                        "pruner: {type: hyperband, max_resource: lots}\n")
    with pytest.raises(SpaceError, match=r"bad2.yaml: space.pruner.max_resource: expected an integer >= 1 or auto"):
        load_space(tmp_path / "bad2.yaml")
    with pytest.raises(SpaceError, match="space file not found"):
        load_space(tmp_path / "missing.yaml")


def test_study_names_storage_and_continuing_a_study(tmp_path, base):
    """The study a sweep continues: by name in the storage; a deployment's runs share <config.name>-<deployment>; a
    stored study's direction and metric can not change under it."""
    from grpo.pipeline.sweep import StudyError, default_storage, default_study_name, open_study

    cfg = base.model_copy(update={"output_dir": str(tmp_path / "runs")})
    assert default_storage(cfg) == f"sqlite:///{tmp_path / 'runs' / 'optuna.db'}"
    assert default_study_name(cfg, "micro-sweep-20260101-020000", "nightly") == "micro-nightly"
    assert default_study_name(cfg, "lr", None) == "lr"
    space = validate_space(base, {"sampler": "tpe", "n_trials": 2, "params": {"grpo.beta": {"uniform": [0, 0.1]}}})
    storage = default_storage(cfg)
    study = open_study("s", storage, space, "reward_last", "maximize")
    study.tell(study.ask(), 0.5)
    again = open_study("s", storage, space, "reward_last", "maximize")
    assert len(again.trials) == 1 and again.user_attrs["metric"] == "reward_last"
    with pytest.raises(StudyError, match=r"study 's' in sqlite:///.*optuna.db is to maximize its metric, not to "
                                         r"minimize; choose another study name"):
        open_study("s", storage, space, "reward_last", "minimize")
    with pytest.raises(StudyError, match=r"ranks trials by 'reward_last', not 'wall_seconds'"):
        open_study("s", storage, space, "wall_seconds", "maximize")


def test_param_importances_over_the_study_or_why_not():
    import optuna

    from grpo.pipeline.sweep import param_importances

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    assert param_importances(study)["note"].startswith("importances need at least 2 completed trials and 2 params; "
                                                       "the study has 0 completed trials over 0 params")
    for _ in range(12):  # the value depends on lr only
        t = study.ask()
        lr = t.suggest_float("grpo.learning_rate", 1e-5, 1e-3, log=True)
        t.suggest_float("grpo.beta", 0, 0.1)
        study.tell(t, -abs(lr - 3e-4) * 1e3)
    out = param_importances(study)
    assert out["completed_trials"] == 12 and out["note"] is None
    assert set(out["importances"]) == {"grpo.learning_rate", "grpo.beta"}
    assert out["importances"]["grpo.learning_rate"] > out["importances"]["grpo.beta"]
    one = optuna.create_study()
    for x in (1.0, 2.0):
        t = one.ask()
        t.suggest_float("x", 0, 3)
        one.tell(t, x)
    assert "2 completed trials over 1 param" in param_importances(one)["note"]


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


@pytest.mark.integration
def test_sweep_via_deployment_creates_linked_flow_runs(tmp_path, prefect_in_process, mlflow_server):
    """Smoke path of ``use_deployment``: no worker serves the deployment here, so each trial's flow run is created
    (with the trial's config, run name and MLflow nesting tags) and stays scheduled until ``trial_timeout``."""
    from flows.pipeline import grpo_pipeline
    from flows.sweep import grpo_sweep
    from grpo.pipeline.sweep import SweepError

    grpo_pipeline.to_deployment(name="sweep-smoke").apply()
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "tracking.backend": "mlflow", "tracking.tracking_uri": mlflow_server.uri,
        "tracking.experiment_name": "sweep-deploy-tests", "tracking.log_system_metrics": "false"}))
    with pytest.raises(SweepError, match="all 2 trials failed; first error: TimeoutError"):
        grpo_sweep(config=cfg, space={"grid": {"grpo.learning_rate": [1e-4, 3e-4]}}, sweep_name="dep",
                   use_deployment="grpo-pipeline/sweep-smoke", trial_timeout=0.5)
    results = json.loads((tmp_path / "dep" / "results.json").read_text())
    assert [r["status"] for r in results] == ["failed", "failed"]

    runs = prefect_in_process.query("flow_runs/filter", {
        "sort": "EXPECTED_START_TIME_ASC", "limit": 20, "offset": 0,
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


PLAIN_SWEEP = """
import json, sys
from grpo.config import load_config
from grpo.pipeline.sweep import InProcessTrials, run_sweep

cfg = load_config(sys.argv[1], sys.argv[2:])
result = run_sweep(cfg, {"grid": {"grpo.learning_rate": [1.0e-4, 3.0e-4]}}, InProcessTrials(), name="plain",
                   metric="reward_last", max_concurrency=2)
print(json.dumps({"result": result, "modules": sorted({m.split(".")[0] for m in sys.modules})}, default=str))
"""


@pytest.mark.integration
def test_the_sweep_runs_without_prefect(tmp_path):
    """#29: the sweep itself is Prefect-free: ``run_sweep`` with ``InProcessTrials()`` runs a 2-point grid (trials in
    threads of one process, at most two at once) with the recipe's plain stages, and never imports Prefect or
    ``flows/``."""
    sets = micro_overrides(tmp_path / "runs", **{"grpo.max_steps": 2, "grpo.save_steps": 100,
                                                 "evaluation.enabled": "false"})
    proc = subprocess.run([sys.executable, "-c", PLAIN_SWEEP, str(MICRO), *sets], cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not {"prefect", "flows", "dashboards"} & set(out["modules"]), out["modules"]
    result = out["result"]
    assert [(r["trial"], r["status"], r["grpo.learning_rate"]) for r in result["trials"]] == [
        (0, "completed", 1e-4), (1, "completed", 3e-4)]
    for r in result["trials"]:
        summary = json.loads((Path(r["run_dir"]) / "summary.json").read_text())
        assert summary["steps"] == 2 and r["metric_value"] == summary["reward_last"]
    assert result["best"]["metric_value"] == max(r["metric_value"] for r in result["trials"])
    assert result["completed"] == 2 and result["mlflow_run_id"] is None  # tracking.backend none: no parent run
    assert json.loads((tmp_path / "runs" / "plain" / "sweep.json").read_text())["trials"] == result["trials"]
    assert result["dashboard"]["kind"] == "placeholder" and Path(result["dashboard"]["path"]).is_file()


def test_the_shipped_example_spaces_validate():
    grid = validate_space(load_config("tiny"), load_space("tiny-lr-beta"))
    assert grid.n_trials == 4 and {p["grpo.learning_rate"] for p in grid.grid_points()} == {1e-4, 3e-4}
    assert {p["grpo.beta"] for p in grid.grid_points()} == {0.0, 0.04}
    tpe = validate_space(load_config("tiny"), load_space("tiny-tpe-pruned"))
    assert (tpe.sampler_kind, tpe.n_trials, tpe.pruner_spec["type"]) == ("tpe", 8, "median")
    assert all(1e-5 <= d["grpo.learning_rate"] <= 1e-3 for d in _draws(tpe, 3))


def test_the_sweep_forms_default_space_is_written_as_its_help_documents():
    """#44.7: the sweep form's default space (grpo serve's and the nightly deployment's) was the legacy ``{"grid":
    ...}`` while the field's help documents ``sampler`` / ``params``."""
    from flows.sweep_form import SpaceField
    from grpo.app.serve import SWEEP_PARAMETERS
    from grpo.pipeline.sweep_space import normalize_space

    space = SWEEP_PARAMETERS["space"]
    assert set(space) == {"sampler", "params"} and space["sampler"] == "grid", space
    assert '{"sampler": "grid", "params": {' in SpaceField.__metadata__[0].json_schema["description"]  # the help
    assert normalize_space(space)["params"] == space["params"]


def test_a_trials_line_writes_its_numbers_as_a_person_does():
    """#44.6: the trial and best lines read ``grpo.learning_rate=0.0001``, ``5e-05`` and ``=0.8480``: params as the
    comparison dashboard writes them (grpo.formatting.human_number), metrics with 3 decimals (human_metric)."""
    from grpo.formatting import human_metric
    from grpo.pipeline.sweep import TrialResult

    assert [human_metric(x) for x in (0.848, 0.84812, 0.0, 12.3, 2.612e-4, 1.5e6, None)] == [
        "0.848", "0.848", "0.000", "12.300", "2.61e-4", "1.5e6", "-"]
    row = dict(trial=3, run_name="lr-t003", status="completed", metric="eval_accuracy_after", pruned_at_step=None,
               study_state="complete", mlflow_run_id=None, prefect_flow_run_id=None, wall_seconds=1.0, run_dir="d",
               error=None)
    line = TrialResult(overrides={"grpo.learning_rate": 1e-4, "grpo.beta": 0.0}, metric_value=0.848, **row).line()
    assert line.split() == ["lr-t003", "completed", "eval_accuracy_after=0.848", "grpo.learning_rate=1e-4,",
                            "grpo.beta=0"]
    pruned = TrialResult(**{**row, "status": "pruned", "pruned_at_step": 2},
                         overrides={"grpo.learning_rate": 5e-05}, metric_value=None).line()
    assert pruned.endswith("eval_accuracy_after=-  grpo.learning_rate=5e-5 (pruned at step 2)")


def _one_point_sweep(tmp_path: Path, mlflow_uri: str | None, name: str, steps: int, **kw) -> dict:
    """A sweep of a one-point grid over grpo.max_steps, judged by the trial's ``steps``: its value is ``steps``, so a
    test decides which sweep is better. Prefect-free (the sweep itself), its registry the real MLflow one."""
    from grpo.pipeline.sweep import InProcessTrials, run_sweep
    from grpo.tracking.sweep_runs import MlflowTrialRuns

    tracking = {"tracking.backend": "mlflow", "tracking.tracking_uri": mlflow_uri,
                "tracking.experiment_name": "sweep-best-alias", "tracking.log_system_metrics": "false"} \
        if mlflow_uri else {}
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{"name": f"alias-{tmp_path.name}", "grpo.save_steps": 100,
                                                          "evaluation.enabled": "false", **tracking}))
    return run_sweep(cfg, {"sampler": "grid", "params": {"grpo.max_steps": [steps]}}, InProcessTrials(), name=name,
                     metric="steps", trial_runs=MlflowTrialRuns, **kw)


@pytest.mark.integration
def test_the_best_alias_never_moves_to_a_worse_model(tmp_path, mlflow_server):
    """#44.2: every sweep of a config registers into one model, and a second study's best (worse than the first's)
    took the alias ``best`` from it. Now ``best`` moves only to a version that beats the one it names on the same
    metric and direction; a worse one, or one judged by another direction, is registered and the alias stays, saying
    so; a better one gets it. Each study's own best is ``study-<study>``."""
    client = MlflowClient(mlflow_server.uri)
    model = f"alias-{tmp_path.name}-grpo"

    first = _one_point_sweep(tmp_path, mlflow_server.uri, "s3", 3)
    assert (first["registered_model"]["version"], first["registered_model"]["alias"]) == ("1", "best")

    worse = _one_point_sweep(tmp_path, mlflow_server.uri, "s2", 2)  # a new study, a worse best: 2 steps < 3
    assert client.get_model_version_by_alias(model, "best").version == "1"
    reg = worse["registered_model"]
    assert (reg["version"], reg["alias"], reg["best_version"]) == ("2", None, "1"), reg
    assert reg["note"] == "alias best stays on version 1: its steps 3.000 is not beaten by version 2's 2.000 (maximize)"
    v2 = client.get_model_version(model, "2")
    assert v2.run_id == worse["best"]["mlflow_run_id"]
    assert {k: v2.tags[k] for k in ("grpo.sweep.metric", "grpo.sweep.direction", "grpo.sweep.metric_value")} == {
        "grpo.sweep.metric": "steps", "grpo.sweep.direction": "maximize", "grpo.sweep.metric_value": "2.0"}
    assert client.get_model_version_by_alias(model, "study-s2").version == "2"  # the study's own best

    other = _one_point_sweep(tmp_path, mlflow_server.uri, "s4min", 4, direction="minimize")  # another direction
    assert client.get_model_version_by_alias(model, "best").version == "1"
    reg = other["registered_model"]
    assert (reg["version"], reg["alias"]) == ("3", None)
    assert reg["note"].startswith("alias best stays on version 1: it was judged by steps (maximize), version 3 by "
                                  "steps (minimize)")

    better = _one_point_sweep(tmp_path, mlflow_server.uri, "s4", 4)
    reg = better["registered_model"]
    assert (reg["version"], reg["alias"], reg["note"]) == ("4", "best", None)
    assert client.get_model_version_by_alias(model, "best").run_id == better["best"]["mlflow_run_id"]
    assert client.get_model_version_by_alias(model, "study-s3").version == "1"


def test_a_continued_grid_runs_only_the_points_its_study_lacks(tmp_path, caplog):
    """#44.7: a grid sweep continuing a study ran every point again (the same trials, the same results). Now it runs
    the points the study has no completed trial of, saying how many it has; with none left it ends cleanly with the
    study's best. The study's state is forced: one point told complete before the sweep."""
    import logging

    from grpo.pipeline.sweep import default_storage, open_study
    from grpo.pipeline.sweep_space import validate_space

    cfg = load_config(MICRO, micro_overrides(tmp_path, **{"grpo.max_steps": 2, "grpo.save_steps": 100,
                                                          "evaluation.enabled": "false"}))
    space = {"sampler": "grid", "params": {"grpo.learning_rate": [1e-4, 3e-4]}}
    checked = validate_space(cfg, space)
    study = open_study("lr", default_storage(cfg), checked, "reward_last", "maximize")
    study.enqueue_trial({"grpo.learning_rate": 1e-4})
    done = study.ask()
    checked.suggest(done)
    study.tell(done, -1.0)  # below any reward: the sweep's own trial is the best

    log = logging.getLogger("test-sweep-grid")
    with caplog.at_level(logging.INFO, logger=log.name):
        first = _one_study_sweep(cfg, space, "g1", log)
    assert "grid: 1 of 2 points already in study lr; running the 1 missing point" in caplog.messages
    assert [(r["trial"], r["status"], r["grpo.learning_rate"]) for r in first["trials"]] == [(1, "completed", 3e-4)]

    caplog.clear()
    with caplog.at_level(logging.INFO, logger=log.name):
        second = _one_study_sweep(cfg, space, "g2", log)
    assert "grid: 2 of 2 points already in study lr; nothing to run" in caplog.messages
    assert second["trials"] == [] and second["study"]["n_trials"] == 2
    assert second["best"]["trial"] == 1 and second["best"]["metric_value"] == first["trials"][0]["metric_value"]


def _one_study_sweep(cfg, space: dict, name: str, log) -> dict:
    from grpo.pipeline.sweep import InProcessTrials, run_sweep

    return run_sweep(cfg, space, InProcessTrials(), name=name, study_name="lr", metric="reward_last", log=log)


@pytest.mark.integration
def test_cli_sweep_prints_the_parent_run_and_the_dashboard(tmp_path, prefect_server, mlflow_server):
    """#15: the console named neither the parent MLflow run (what `grpo dashboard --sweep` needs) nor the dashboard.
    #44.6: it printed every trial's stage lines and Prefect's, Optuna's and MLflow's own (151 lines for 4 trials), and
    its numbers as Python prints them (0.0001, 5e-05, 0.8480): now one line per trial as it ends, then the summary.
    #44.7: the same grid again on the same study has nothing to run, and says so."""
    (tmp_path / "space.yaml").write_text("sampler: grid\nparams:\n  grpo.learning_rate: [1.0e-4, 3.0e-4]\n")
    sets = [f"output_dir={tmp_path / 'runs'}", "tracking.backend=mlflow", "grpo.max_steps=2", "grpo.save_steps=100",
            "evaluation.enabled=false", f"tracking.tracking_uri={mlflow_server.uri}",
            "tracking.experiment_name=cli-sweep", "tracking.log_system_metrics=false"]
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
    for bar in ("Loading weights", "Writing model shards", "Downloading artifacts", "Uploading artifacts", "it/s]"):
        assert bar not in out + result.stderr, bar  # library progress bars (grpo.console)
    printed = (out + result.stderr).splitlines()
    # the start, the Prefect link, a line per trial, the study, the best, the registered version, the parent run, the
    # dashboard, the sweep's directory
    assert len(printed) <= 8 + 2, "\n".join(printed)
    for noise in ("View at", "Beginning", "Finished in state", "Trial 0 finished", "A new study created",
                  "Registered model", "Successfully registered", "Created version", "Waiting up to"):
        assert noise not in out + result.stderr, noise
    trial_lines = [line for line in printed if line.startswith("  lr-t")]
    assert len(trial_lines) == 2, printed
    for line in trial_lines:  # the learning rates as the dashboard writes them, the metric with 3 decimals
        assert re.fullmatch(r"  lr-t00[01] +completed +wall_seconds=\d+\.\d{3}  grpo\.learning_rate=[13]e-4",
                            line), line
    assert re.search(r"^best: lr-t00[01] \(wall_seconds=\d+\.\d{3}\)$", out, re.M), out
    assert f"mlflow parent run: {parent} (compare again: grpo dashboard --experiment cli-sweep --sweep {parent}" in out
    assert (f"dashboard: {tmp_path / 'runs' / 'lr' / 'dashboard.html'} (comparison, logged to MLflow as dashboard/"
            in out)

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

    # the same grid on the same study: nothing to run, the study's best reported, exit 0
    again = subprocess.run([sys.executable, "-m", "grpo.app.cli", "sweep", "--config", str(MICRO), "--space",
                            str(tmp_path / "space.yaml"), "--name", "lr-again", "--study", "lr", "--metric",
                            "wall_seconds", "--direction", "minimize", *(a for s in sets for a in ("--set", s))],
                           cwd=tmp_path, env=prefect_server.env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "grid: 2 of 2 points already in study lr; nothing to run" in again.stdout, again.stdout
    best = next(t["run_name"] for t in trials if t["mlflow_run_id"] == tags["grpo.sweep.best_run_id"])
    assert f"best: {best} (wall_seconds=" in again.stdout, again.stdout
    assert not [line for line in again.stdout.splitlines() if line.startswith("  lr-again-t")], again.stdout


# A space where one temperature is clearly bad: sampled at 25.0, the micro model's completions are noise from the first
# step (digits_format reward about 0), while at 1.0 most are bare integers. Trials report the training reward at every
# step; the median pruner prunes a trial once its best reward is below the median of the finished trials' at that
# step. The seed is one whose TPE draws put a bad trial after a good one (checked with these rewards simulated).
TPE_PRUNED = {"sampler": "tpe", "n_trials": 6, "seed": 6, "startup_trials": 2,
              "params": {"grpo.temperature": {"choice": [1.0, 25.0]},
                         "grpo.learning_rate": {"loguniform": [5e-5, 5e-4]}},
              "pruner": {"type": "median", "metric": "reward", "n_startup_trials": 1, "n_warmup_steps": 0}}


@pytest.mark.integration
def test_tpe_sweep_prunes_and_a_scheduled_run_continues_the_study(tmp_path, prefect_in_process, mlflow_server):
    """#sweeps-on-optuna: a 6-trial TPE study with a median pruner on the micro model prunes the bad trials (their
    training stops early, the study has them PRUNED, their MLflow runs are tagged), registers the study's best trial,
    and a second invocation with the nightly deployment's parameters (same study, no sweep name) adds new trials to the
    same stored study."""
    import optuna

    from flows.sweep import grpo_sweep
    from grpo.app.sweep_dashboard import add_comparison_dashboard
    from grpo.pipeline.sweep import default_study_name

    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "grpo.max_steps": 4, "grpo.logging_steps": 1, "grpo.save_steps": 100, "evaluation.enabled": "false",
        "grpo.reward_funcs": "[digits_format]",
        "tracking.backend": "mlflow", "tracking.tracking_uri": mlflow_server.uri,
        "tracking.experiment_name": "sweep-optuna", "tracking.log_system_metrics": "false"}))
    nightly = {"space": TPE_PRUNED, "max_concurrency": 1, "metric": "reward_last", "direction": "maximize",
               "study_name": default_study_name(cfg, "unused", "nightly"),
               "registered_model_name": f"tpe-{tmp_path.name}"}  # its own: `best` is judged across a model's sweeps
    assert nightly["study_name"] == f"{cfg.name}-nightly"  # what a run of grpo-sweep/nightly defaults to

    first = grpo_sweep(config=cfg, sweep_name="night1", **nightly)
    add_comparison_dashboard(cfg, first)  # what `grpo sweep` does after the flow
    print(json.dumps([{k: r[k] for k in ("trial", "status", "grpo.temperature", "metric_value", "pruned_at_step")}
                      for r in first["trials"]], indent=1))
    assert [r["trial"] for r in first["trials"]] == list(range(6))
    pruned = [r for r in first["trials"] if r["status"] == "pruned"]
    assert pruned and first["pruned"] == len(pruned) and first["failed"] == 0
    assert first["completed"] + first["pruned"] == 6
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.load_study(study_name=nightly["study_name"], storage=storage)
    states = {t.number: t.state.name for t in study.trials}
    assert {r["trial"] for r in pruned} == {n for n, s in states.items() if s == "PRUNED"}
    client = MlflowClient(mlflow_server.uri)
    assert all(r["status"] == "pruned" for r in first["trials"][1:] if r["grpo.temperature"] == 25.0)
    for r in pruned:
        assert r["pruned_at_step"] < 4
        run = client.get_run(r["mlflow_run_id"])
        assert run.data.tags["grpo.sweep.pruned"] == "true" and run.info.status == "FINISHED"
        assert run.data.tags["grpo.sweep.pruned_at_step"] == str(r["pruned_at_step"])
        assert json.loads((Path(r["run_dir"]) / "summary.json").read_text())["steps"] == r["pruned_at_step"]
        assert study.trials[r["trial"]].intermediate_values  # what the pruner decided on
    best = first["best"]
    assert best["trial"] == study.best_trial.number and best["metric_value"] == study.best_value
    assert first["registered_model"]["alias"] == "best"
    version = client.get_model_version_by_alias(nightly["registered_model_name"], "best")
    assert version.run_id == best["mlflow_run_id"]
    parent = client.get_run(first["mlflow_run_id"])
    assert parent.data.metrics["sweep/trials_pruned"] == len(pruned)
    assert parent.data.tags["grpo.sweep.study"] == nightly["study_name"]
    page = Path(first["dashboard"]["path"]).read_text()
    assert 'id="panel-importances-section"' in page and "PRUNED" in page
    assert first["study"]["importances"]["importances"] or first["study"]["importances"]["note"]

    # the next night: the deployment's parameters again (no sweep name: a new, timestamped sweep and parent run)
    second = grpo_sweep(config=cfg, **{**nightly, "space": {**TPE_PRUNED, "n_trials": 1}})
    assert second["sweep_name"] != "night1" and second["mlflow_run_id"] != first["mlflow_run_id"]
    assert [r["trial"] for r in second["trials"]] == [6]  # numbers continue in the same study
    assert [r["run_name"] for r in second["trials"]] == [f"{second['sweep_name']}-t006"]
    study = optuna.load_study(study_name=nightly["study_name"], storage=storage)
    assert len(study.trials) == 7 and second["study"]["n_trials"] == 7 and second["study"]["first_trial"] == 6
    assert {t.user_attrs["sweep"] for t in study.trials} == {"night1", second["sweep_name"]}
    assert second["best"]["trial"] == study.best_trial.number  # the best over both nights
    assert (tmp_path / "night1" / "sweep.json").is_file() and Path(second["sweep_dir"]).is_dir()


@pytest.mark.integration
def test_metric_from_mlflow_reads_either_eval_naming(mlflow_server):
    """``--metric`` falls back to the trial's MLflow metrics: ``eval/accuracy_after`` is read from a run that logs
    eval/accuracy at step 0 and the last step as from one logged with the earlier single-point names."""
    from mlflow.entities import Metric

    from grpo.pipeline.sweep import _metric_value

    client = MlflowClient(mlflow_server.uri)
    exp = client.create_experiment(f"metric-names-{time.time_ns()}")
    new, old = client.create_run(exp).info.run_id, client.create_run(exp).info.run_id
    client.log_batch(new, metrics=[Metric("eval/accuracy", 0.25, 1, 0), Metric("eval/accuracy", 0.75, 2, 8)])
    client.log_batch(old, metrics=[Metric("eval/accuracy_before", 0.2, 1, 0), Metric("eval/accuracy_after", 0.7, 2, 8)])
    assert _metric_value({}, "eval/accuracy_after", client, new) == 0.75
    assert _metric_value({}, "eval/accuracy_before", client, new) == 0.25
    assert _metric_value({}, "eval/accuracy_after", client, old) == 0.7
    assert _metric_value({}, "eval/accuracy", client, new) == 0.75  # the latest point: after training
    assert _metric_value({"eval_accuracy_after": 0.5}, "eval_accuracy_after", client, new) == 0.5  # summary first
    assert _metric_value({}, "eval/pass_at_8_after", client, new) is None
