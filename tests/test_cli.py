"""CLI contract: bad input -> one line on stderr, exit code 2, no traceback, nothing under runs/ touched."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import MICRO


def grpo(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo.app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--set", "grpo.num_generationz=4"], "grpo.num_generationz: unknown field (did you mean 'num_generations'?)"),
        (["--set", "grpo.reward_funcs=[no_such_reward]"], "unknown reward 'no_such_reward'"),
        (["--set", "data.source=missing/data.jsonl"], "data.source: file does not exist: missing/data.jsonl"),
        (["--config", "nope.yaml"], "config file not found: nope.yaml"),
        (["--config", "BAD"], "YAML syntax error at line 3"),
        (["--reward-module", "nope.py"], "--reward-module: file not found"),
        (["--resume"], "--resume needs --run-name"),
        (["--resume", "--run-name", "never-ran"], "no run to resume"),
        (["--run-name", "../escape"], "--run-name '../escape'"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_touches_nothing(tmp_path, args, fragment):
    (tmp_path / "BAD").write_text("grpo:\n  learning_rate: [1\n")
    args = [str(tmp_path / "BAD") if a == "BAD" else a for a in args]
    result = grpo("run", "--config", str(MICRO), *args, "--set", f"output_dir={tmp_path / 'runs'}", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
    assert not (tmp_path / "runs").exists()


def test_existing_run_directory_is_never_overwritten(tmp_path):
    run = tmp_path / "runs" / "mine"
    run.mkdir(parents=True)
    (run / "precious.txt").write_text("keep me")
    result = grpo("run", "--config", str(MICRO), "--run-name", "mine", "--set", f"output_dir={tmp_path / 'runs'}",
                  cwd=tmp_path)
    assert result.returncode == 2
    assert "already exists; pass --resume" in result.stderr
    assert sorted(p.name for p in run.iterdir()) == ["precious.txt"]


def test_validate_prints_resolved_config(tmp_path):
    result = grpo("validate", "--config", "tiny", "--set", "grpo.beta=0.1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "beta: 0.1" in result.stdout and "carry_error_rate: 0.6" in result.stdout


def test_prefects_temporary_server_lines_stay_out_of_the_console():
    """``grpo run``'s embedded Prefect (no server configured) starts a temporary server; its "Starting temporary
    server ... See https://docs.prefect.io/..." and "Stopping temporary server" lines, after the run's result, are
    dropped where Prefect logs them; its other records are not."""
    import logging

    from prefect.logging import get_logger

    from grpo.console import quiet_library_noise

    quiet_library_noise()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = get_logger()  # the logger Prefect's SubprocessASGIServer says both lines on
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # as Prefect's logging config sets it in a run
    try:
        logger.info("Starting temporary server on http://127.0.0.1:8050\nSee https://docs.prefect.io/v3/concepts/server")
        logger.info("Stopping temporary server on http://127.0.0.1:8050")
        logger.info("Flow run 'x' - Finished in state Completed()")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["Flow run 'x' - Finished in state Completed()"]


def test_serve_says_a_waiting_run_once_not_at_every_poll():
    """While a run waits for ``grpo serve``'s free slot, Prefect's runner logs "1 scheduled runs skipped (at
    capacity)" at every poll (about every 10 s): said once, and again when the count changes."""
    import logging

    from grpo.app.serve import quiet_server_gone_noise

    quiet_server_gone_noise()
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("prefect.runner")  # Prefect's get_logger("runner"), where the poller logs it
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for count in (1, 1, 1, 2, 2, 1):
            logger.info("%d scheduled runs skipped (at capacity)", count)
        logger.info("Runner 'grpo-serve' submitting flow run 'x'")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["1 scheduled runs skipped (at capacity)", "2 scheduled runs skipped (at capacity)",
                    "1 scheduled runs skipped (at capacity)", "Runner 'grpo-serve' submitting flow run 'x'"]


def test_run_requires_a_config(tmp_path):
    result = grpo("run", cwd=tmp_path)
    assert result.returncode == 2 and "--config" in result.stderr and "Traceback" not in result.stderr


def test_rewards_lists_builtins(tmp_path):
    """One line each, a whole first sentence in plain text: a docstring's first line ended mid-sentence
    (env_reward's ``... the``) and showed reStructuredText's double backticks."""
    result = grpo("rewards", cwd=tmp_path)
    assert result.returncode == 0 and "exact_match" in result.stdout and "digits_format" in result.stdout
    lines = result.stdout.strip().splitlines()
    assert all(line.rstrip().endswith(".") and "``" not in line for line in lines), lines
    assert any(line.startswith("env_reward") and "the column env_reward the episode runner adds)." in line
               for line in lines), lines


def test_missing_reward_module_from_the_environment_is_one_line_exit_2(tmp_path):
    """GRPO_REWARD_MODULES (how workers get custom rewards) names itself when a listed file is missing."""
    import os

    result = subprocess.run([sys.executable, "-m", "grpo.app.cli", "validate", "--config", str(MICRO)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "GRPO_REWARD_MODULES": str(tmp_path / "gone.py")})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"GRPO_REWARD_MODULES: file not found: {tmp_path / 'gone.py'}" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("command", ["run", "plan", "validate", "sweep", "serve", "deploy", "dashboard", "ui"])
def test_help_reads_as_a_person_expects(command):
    """Flags show no value type (typer printed `--resume <bool>`), list options a metavar, no reST markup."""
    result = subprocess.run([sys.executable, "-m", "grpo.app.cli", command, "--help"], capture_output=True, text=True,
                            timeout=120, env={**os.environ, "COLUMNS": "150"})
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "<bool>" not in out and "list[" not in out and "``" not in out, out
    if command == "run":
        assert re.search(r"--resume\s+Continue", out) and re.search(r"--set\s+-s\s+KEY=VALUE", out), out


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--schedule", "61 * * * *"], "--schedule '61 * * * *': Invalid cron string"),
        (["--schedule", "* * * *"], "--schedule '* * * *': Invalid cron string"),
        (["--schedule", "0 2 * * *", "--timezone", "Mars/Base"], "--timezone 'Mars/Base': Invalid timezone"),
    ],
)
def test_serve_with_an_invalid_cron_is_one_line_exit_2_before_connecting(tmp_path, args, fragment):
    """A bad --schedule (validated as Prefect's CronSchedule does) names the option and the value, before any server
    is contacted: nothing answers at PREFECT_API_URL here, and that must not be the error reported."""
    result = subprocess.run([sys.executable, "-m", "grpo.app.cli", "serve", *args], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={**os.environ, "PREFECT_API_URL": "http://127.0.0.1:9/api"})
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout and "serving" not in result.stdout


@pytest.mark.integration
def test_run_names_the_model_folder_without_progress_bars(tmp_path, prefect_server, mlflow_server):
    """The end of ``grpo run`` says where the trained model is; no library progress bar (transformers' loading and
    saving, MLflow's artifact transfers) or MLflow link to its GenAI view reaches the console."""
    result = subprocess.run(
        [sys.executable, "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "named",
         *(a for s in (f"output_dir={tmp_path / 'runs'}", "grpo.max_steps=2", "grpo.save_steps=100",
                       "tracking.backend=mlflow", f"tracking.tracking_uri={mlflow_server.uri}",
                       "tracking.experiment_name=cli-run", "tracking.log_system_metrics=false")
           for a in ("--set", s))],
        cwd=tmp_path, env=prefect_server.env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    model = tmp_path / "runs" / "named" / "model"
    assert f"model: {model}" in result.stdout.splitlines(), result.stdout[-2000:]
    assert (model / "config.json").is_file()
    for bar in ("Loading weights", "Writing model shards", "Downloading artifacts", "Uploading artifacts", "it/s]"):
        assert bar not in out, bar
    assert "View run named at" not in out  # MLflow's own link, which opens its GenAI view
    run_link = [line for line in result.stdout.splitlines() if line.startswith("mlflow: ")]
    assert len(run_link) == 1 and "workflowType=machine_learning" in run_link[0], result.stdout[-2000:]
