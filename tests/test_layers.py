"""The package's layers and the direction of their imports (AST-based, like torchtune's import checks).

- ``grpo.app`` (CLI, serve/deploy, ui, process supervision) is the only part of ``grpo`` that imports ``flows/``,
  ``dashboards/``, Prefect or typer; ``flows/`` and ``dashboards/`` never import ``grpo.app``, and ``flows/`` never
  imports ``dashboards/`` (the app builds a sweep's comparison dashboard).
- ``benchmarks/`` use the library's public entry points (``grpo.*``), never ``flows/`` internals (nor ``dashboards/``
  or the tests).
- ``grpo.algo`` holds the algorithms on numpy/torch only: no TRL, transformers, accelerate, peft, datasets, MLflow
  or Prefect, and no other ``grpo`` module than itself and ``grpo.errors``: not the config either (not even for type
  hints), so the config can build its batch layout from ``grpo.algo`` without a cycle; algo takes plain numbers.
- ``grpo.rewards`` (registry, worker pool, streaming) imports no training stack and no ``grpo`` layer above it;
  ``grpo.environments`` (environments, tools, the episode runner) neither, except transformers' tool-schema helper
  (``transformers.utils``). Both register through the core ``grpo.registry``.
- ``grpo.training`` (the TRL extension, policy, evaluation) never imports the pipeline, tracking, the app, MLflow or
  Prefect; ``grpo.pipeline`` (recipe, stages, data, run context, the sweep) never imports the app or Prefect.
- ``grpo.paths`` (the cache root) imports no ``grpo`` module: training and the pipeline both cache under it.
- ``grpo.tracking`` (the MLflow tracker, its spool, what a run records, metric names, a sweep's trial runs) sits
  below the pipeline: the pipeline, the flows and the app import it, it never imports them (nor the dashboards or
  Prefect).
- ``grpo.config`` imports below it only: ``grpo.errors``, the batch layout (``grpo.algo.batch_layout``) and the
  synthetic tasks (``grpo.tasks``). One module reaches up, ``grpo.config.trl_and_rewards`` (TRL's ``GRPOConfig``
  fields and help, transformers' loggers, the reward, environment and tool registries), and only inside its
  functions: importing the config imports none of them.
- TRL, accelerate and peft are imported only by the training layer, and by ``grpo.config.trl_and_rewards`` and
  ``grpo.distributed`` (accelerate's process state); transformers besides only by the trainer-callback adapters
  (``grpo.tracking.tracker``, ``flows.progress``), the model logging (``grpo.tracking.model_logging``: MLflow's
  transformers flavour) and ``grpo.console`` (log levels).
- MLflow is imported only where runs are tracked (``grpo.tracking``, but for its generic spool and its metric names),
  by the app, the flows and the dashboards; ``dashboards/`` never import Prefect.
- The TRL methods the trainer overrides are listed in one place (``grpo.training.trainer.TRL_HOOKS``), checked against
  the class and the pinned TRL.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAINING_STACK = {"trl", "transformers", "accelerate", "peft", "datasets", "vllm"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, lazily or not (``from grpo import x`` counts as ``grpo.x``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def modules(*folders: str) -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))}


def top(name: str) -> str:
    return name.split(".")[0]


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(mods: dict[str, set[str]], allowed) -> list[str]:
    return [f"{mod} imports {imp}" for mod, imps in mods.items() for imp in sorted(imps) if not allowed(mod, imp)]


def test_only_the_app_layer_imports_flows_dashboards_and_prefect():
    def allowed(mod: str, imp: str) -> bool:
        if under(mod, "grpo.app") or mod == "grpo.__main__":
            return True
        return top(imp) not in {"flows", "dashboards", "prefect", "typer"}

    assert violations(modules("grpo"), allowed) == []


def test_flows_and_dashboards_never_import_the_app():
    def allowed(mod: str, imp: str) -> bool:
        return not under(imp, "grpo.app") and not (under(mod, "dashboards") and top(imp) in {"prefect", "flows"})

    assert violations(modules("flows", "dashboards"), allowed) == []


def test_flows_never_import_dashboards():
    """The sweep flow publishes its results page; the app (``grpo sweep``) builds the comparison dashboard."""
    def allowed(mod: str, imp: str) -> bool:
        return top(imp) != "dashboards"

    mods = modules("flows")
    assert {"flows.pipeline", "flows.sweep"} <= set(mods)
    assert violations(mods, allowed) == []


def test_benchmarks_use_the_library_not_flows():
    """Benchmarks measure what users run through ``grpo.*`` (the app's ``grpo run`` for the Prefect pipeline), so a
    flow's internals can change without a benchmark breaking."""
    def allowed(mod: str, imp: str) -> bool:
        return top(imp) not in {"flows", "dashboards", "tests"}

    mods = modules("benchmarks")
    assert {"benchmarks.tracking_overhead", "benchmarks.balance"} <= set(mods)
    assert violations(mods, allowed) == []


def test_algorithms_depend_on_numpy_and_torch_only():
    def allowed(mod: str, imp: str) -> bool:
        if top(imp) == "grpo":
            return any(under(imp, p) for p in ("grpo.algo", "grpo.errors"))
        return top(imp) not in TRAINING_STACK | {"mlflow", "prefect", "flows", "dashboards"}

    mods = modules("grpo/algo")
    assert {"grpo.algo.sampling", "grpo.algo.balance", "grpo.algo.batch_layout", "grpo.algo.plan"} <= set(mods)
    assert violations(mods, allowed) == []


CONFIG_REACHES_UP = "grpo.config.trl_and_rewards"  # the config's one module that imports from above it


def test_config_imports_below_it_and_reaches_up_in_one_module():
    below = ("grpo.config", "grpo.errors", "grpo.algo.batch_layout", "grpo.tasks")

    def allowed(mod: str, imp: str) -> bool:
        if mod == CONFIG_REACHES_UP and (top(imp) in {"trl", "transformers"} or under(imp, "grpo.rewards")
                                         or under(imp, "grpo.environments")):
            return True
        if top(imp) == "grpo":
            return imp == "grpo" or any(under(imp, p) for p in below)
        return top(imp) not in TRAINING_STACK | {"torch", "numpy", "mlflow", "prefect", "flows", "dashboards"}

    mods = modules("grpo/config")
    assert {"grpo.config", "grpo.config.sections", "grpo.config.rules", "grpo.config.loading",
            CONFIG_REACHES_UP} <= set(mods)
    assert violations(mods, allowed) == []


def test_importing_the_config_imports_nothing_above_it():
    """``grpo.config.trl_and_rewards`` imports TRL, transformers, the rewards and the environments when a check or the
    form needs them, never at import: every ``grpo`` command and test imports the config."""
    code = "import sys, grpo.config; print(' '.join(sorted(sys.modules)))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    loaded = set(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                                cwd=ROOT).stdout.split())
    assert "grpo.config.trl_and_rewards" in loaded
    above = {"trl", "transformers", "torch", "grpo.rewards", "grpo.environments", "grpo.training", "grpo.pipeline",
             "grpo.app", "mlflow", "prefect"}
    assert sorted(m for m in loaded if any(under(m, a) for a in above)) == []


def test_serve_and_deploy_build_their_deployments_without_the_training_stack():
    """``grpo serve`` and ``grpo deploy`` import the flows and build both deployments (their run forms, TRL's help
    text included) without torch, transformers, TRL, MLflow, Optuna or datasets: serving starts in about 2 s of CPU
    instead of ~9 s, and a served or deployed flow run imports what it runs."""
    code = ("import sys; from grpo.app.serve import build_deployments; assert len(build_deployments()) == 2; "
            "print(' '.join(sorted(sys.modules)))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    loaded = set(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                                cwd=ROOT).stdout.split())
    assert {"flows.pipeline", "flows.sweep", "flows.run_form"} <= loaded
    heavy = {"torch", "transformers", "trl", "accelerate", "peft", "datasets", "mlflow", "optuna", "grpo.training",
             "grpo.pipeline.stages", "grpo.pipeline.recipe", "grpo.pipeline.sweep", "grpo.tracking.tracker"}
    assert sorted(m for m in loaded if any(under(m, h) for h in heavy)) == []


def test_a_run_against_a_prefect_server_never_imports_prefects_server_package():
    """``grpo run`` with ``PREFECT_API_URL`` set (a served, worker or CLI run against a server) starts no embedded
    server and so never imports ``prefect.server`` (FastAPI, SQLAlchemy, Prefect's background workers: about 2 s of
    CPU per run); without it, the embedded server's class is what the CLI starts."""
    code = ("import sys; from grpo.app import procguard; assert procguard.embedded_prefect_server() is None; "
            "print(' '.join(sorted(sys.modules)))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_API_URL": "http://127.0.0.1:9/api"}  # never contacted
    loaded = set(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True,
                                cwd=ROOT).stdout.split())
    assert "prefect.settings" in loaded
    assert sorted(m for m in loaded if under(m, "prefect.server")) == []


def test_rewards_import_no_training_stack_and_no_higher_layer():
    def allowed(mod: str, imp: str) -> bool:
        if top(imp) == "grpo":
            return imp == "grpo" or any(under(imp, p) for p in ("grpo.rewards", "grpo.errors", "grpo.registry"))
        return top(imp) not in TRAINING_STACK | {"mlflow", "prefect", "torch"}

    assert violations(modules("grpo/rewards"), allowed) == []


def test_environments_import_no_training_stack_but_the_tool_schema_helper():
    def allowed(mod: str, imp: str) -> bool:
        if top(imp) == "grpo":
            return imp == "grpo" or any(under(imp, p) for p in ("grpo.environments", "grpo.errors", "grpo.registry"))
        if under(imp, "transformers.utils"):
            return True  # get_json_schema: a tool's schema from its signature and docstring, as TRL builds it
        return top(imp) not in TRAINING_STACK | {"mlflow", "prefect", "torch"}

    mods = modules("grpo/environments")
    assert {"grpo.environments", "grpo.environments.episodes"} <= set(mods)
    assert violations(mods, allowed) == []


def test_training_never_imports_the_pipeline_or_the_app():
    def allowed(mod: str, imp: str) -> bool:
        return not (under(imp, "grpo.pipeline") or under(imp, "grpo.tracking") or under(imp, "grpo.app")
                    or top(imp) in {"mlflow", "prefect", "flows", "dashboards"})

    mods = modules("grpo/training")
    assert {"grpo.training.trainer", "grpo.training.policy"} <= set(mods)
    assert violations(mods, allowed) == []


def test_pipeline_never_imports_the_app_or_prefect():
    def allowed(mod: str, imp: str) -> bool:
        return not under(imp, "grpo.app") and top(imp) not in {"prefect", "flows", "dashboards"}

    mods = modules("grpo/pipeline")
    assert {"grpo.pipeline.recipe", "grpo.pipeline.stages", "grpo.pipeline.data"} <= set(mods)
    assert violations(mods, allowed) == []


def test_tracking_never_imports_the_pipeline_the_app_or_the_flows():
    """The direction is pipeline -> tracking: the recipe and the flows start trackers and log through them."""
    def allowed(mod: str, imp: str) -> bool:
        return not (under(imp, "grpo.pipeline") or under(imp, "grpo.app")
                    or top(imp) in {"prefect", "flows", "dashboards"})

    mods = modules("grpo/tracking")
    assert {"grpo.tracking.tracker", "grpo.tracking.spool", "grpo.tracking.run_tracking",
            "grpo.tracking.metric_keys"} <= set(mods)
    assert violations(mods, allowed) == []


def test_the_cache_root_lies_below_training_and_the_pipeline():
    """Training caches the tiny model and the pipeline prepared data and plans under one root: the pipeline finds it
    without importing the policy module (the training stack), training without importing the pipeline."""
    cache_dirs, policy = imports_of(ROOT / "grpo/pipeline/cache_dirs.py"), imports_of(ROOT / "grpo/training/policy.py")
    assert "grpo.paths.cache_root" in cache_dirs & policy
    assert [i for i in cache_dirs if under(i, "grpo.training")] == []
    assert [i for i in imports_of(ROOT / "grpo/paths.py") if top(i) == "grpo"] == []


def test_the_training_stack_stays_in_the_training_layer():
    callbacks = {"grpo.tracking.tracker", "grpo.tracking.model_logging", "flows.progress", "grpo.console"}

    def allowed(mod: str, imp: str) -> bool:
        if under(mod, "grpo.training") or top(imp) not in {"trl", "transformers", "accelerate", "peft"}:
            return True
        if mod in {"grpo.config.trl_and_rewards", "grpo.distributed"}:
            return top(imp) in {"trl", "transformers", "accelerate"}
        if under(mod, "grpo.environments"):
            return under(imp, "transformers.utils")
        return top(imp) == "transformers" and mod in callbacks

    assert violations(modules("grpo", "flows", "dashboards"), allowed) == []


def test_mlflow_only_where_runs_are_tracked():
    tracking = set(modules("grpo/tracking")) - {"grpo.tracking.spool", "grpo.tracking.metric_keys"}
    assert {"grpo.tracking.tracker", "grpo.tracking.run_lifecycle", "grpo.tracking.batched_logging",
            "grpo.tracking.sync_logging", "grpo.tracking.model_logging", "grpo.tracking.run_tracking"} <= tracking

    def allowed(mod: str, imp: str) -> bool:
        return (top(imp) != "mlflow" or mod in tracking
                or any(under(mod, p) for p in ("grpo.app", "flows", "dashboards")))

    assert violations(modules("grpo", "flows", "dashboards"), allowed) == []


def test_the_rule_catches_a_violation(tmp_path):
    """The checker itself can fail: an algorithm importing transformers, a pipeline module importing a flow."""
    bad = tmp_path / "bad.py"
    bad.write_text("import transformers\nfrom flows.pipeline import grpo_pipeline\nfrom grpo import app\n")
    assert {"transformers", "flows.pipeline", "flows.pipeline.grpo_pipeline", "grpo.app"} <= imports_of(bad)
    assert violations({"grpo.algo.bad": imports_of(bad)}, lambda m, i: top(i) not in TRAINING_STACK | {"flows"})


def test_trl_hooks_are_listed_once_and_exist_in_the_pinned_trl():
    trl = pytest.importorskip("trl")
    from grpo.training.trainer import TESTED_TRL_VERSION, TRL_HOOKS, GRPOTrainer

    assert trl.__version__ == TESTED_TRL_VERSION
    ours = GRPOTrainer.__mro__[:GRPOTrainer.__mro__.index(trl.GRPOTrainer)]  # the class and its feature mixins
    overridden = {name for cls in ours for name, value in vars(cls).items()
                  if callable(value) and hasattr(trl.GRPOTrainer, name)}
    assert overridden == set(TRL_HOOKS), "list every overridden TRL method in grpo.training.trainer.TRL_HOOKS, with why"
    for name in TRL_HOOKS:
        if name == "__init__":
            continue
        ours, theirs = inspect.signature(getattr(GRPOTrainer, name)), inspect.signature(getattr(trl.GRPOTrainer, name))
        assert list(ours.parameters) == list(theirs.parameters), f"{name}: TRL's signature is {theirs}"


def test_every_python_file_in_the_repository_parses():
    """Benchmarks and tests too (a broken import line in a benchmark's function was caught only by its smoke run)."""
    broken = []
    for folder in ("grpo", "flows", "dashboards", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            try:
                ast.parse(path.read_text(), str(path))
            except SyntaxError as err:
                broken.append(f"{path.relative_to(ROOT)}:{err.lineno}: {err.msg}")
    assert broken == []
