"""Short real GRPO runs on the tiny model: a killed run resumes, and the run's pieces (checkpoints, plans, rewards)
hold together. That the tiny preset learns, run to the end, is asserted on the docs' main path, the served form
(tests/test_ui_runs.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from grpo.algo.plan import read_plan_indices
from grpo.config import load_config
from grpo.pipeline.experiment import run_experiment
from grpo.pipeline.prep import load_prepared
from grpo.runs import RunDir, open_run_dir
from tests.conftest import MICRO, micro_overrides, recorded_calls, write_prompt_recorder

pytestmark = pytest.mark.integration  # trains a model, starts servers or processes: not in `make test-fast`


def read_metrics(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in run.metrics_file.read_text().splitlines()]


def test_killed_run_resumes_from_last_checkpoint_at_the_plans_next_step(tmp_path, prefect_server, mlflow_server):
    """Kill training (SIGKILL to the CLI and its temporary Prefect server) after its first checkpoint; ``--resume``
    continues there into the same MLflow run, the step sequence is continuous locally and in MLflow (nothing missing,
    nothing twice), the console stays readable, and the prompts after the resume are exactly the sampler plan's next
    rounds."""
    from mlflow import MlflowClient

    from tests.test_pipeline import assert_readable_console

    recorder = write_prompt_recorder(tmp_path)
    overrides = micro_overrides(tmp_path, **{"grpo.max_steps": 40, "grpo.save_steps": 8, "grpo.logging_steps": 4,
                                             "evaluation.enabled": "false",
                                             "grpo.reward_funcs": "[exact_match_recorded]",
                                             "tracking.backend": "mlflow", "tracking.tracking_uri": mlflow_server.uri,
                                             "tracking.experiment_name": "killed-resume"})
    cmd = [sys.executable, "-m", "grpo.app.cli", "run", "--config", str(MICRO), "--run-name", "killed",
           "--reward-module", str(recorder)]
    for item in overrides:
        cmd += ["--set", item]
    run = RunDir(tmp_path / "killed")
    env = prefect_server.env(PROMPT_LOG=str(tmp_path / "first.jsonl"))
    # its own process group, so the kill below takes the whole CLI (the Prefect server is the session's, elsewhere)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    def past_checkpoint() -> bool:  # killed after logging a step beyond its last checkpoint: resume must re-run it
        if not (run.checkpoints / "checkpoint-8" / "trainer_state.json").is_file() or not run.metrics_file.is_file():
            return False
        return any(json.loads(line)["step"] >= 12 for line in run.metrics_file.read_text().splitlines() if line)

    while time.time() < deadline and not past_checkpoint():
        if proc.poll() is not None:
            raise AssertionError("training finished or failed before it could be killed")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first_run_id = json.loads((run.path / "tracking_spool" / "state.json").read_text())["run_id"]
    killed_at = run.latest_checkpoint()
    assert killed_at is not None and int(killed_at.name.split("-")[1]) < 40
    assert not run.summary_file.exists()

    env["PROMPT_LOG"] = str(tmp_path / "resumed.jsonl")
    resumed = subprocess.run(cmd + ["--resume"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads(run.summary_file.read_text())
    assert summary["steps"] == 40 and summary["resumed_from"].endswith(killed_at.name)
    assert summary["mlflow_run_id"] == first_run_id
    mlflow_steps = [m.step for m in MlflowClient(mlflow_server.uri).get_metric_history(first_run_id, "train/reward")]
    assert mlflow_steps == list(range(4, 41, 4))
    assert_readable_console(resumed.stdout + resumed.stderr, steps=40)

    steps = [row["step"] for row in read_metrics(run) if "reward" in row["metrics"]]
    resumed_from = int(killed_at.name.split("-")[1])
    after = [s for s in steps if s > resumed_from]
    assert after == list(range(resumed_from + 4, 41, 4))

    # one generation round per optimizer step here: the resumed process scored rounds resumed_from .. 39 of the plan
    inputs = run.inputs()
    prompts = load_prepared(inputs["data_dir"])["train"]["prompt"]
    planned = list(read_plan_indices(inputs["plan_path"], sp_group=0, start_round=resumed_from))
    scored = [p for call in recorded_calls(tmp_path / "resumed.jsonl") for p in call["prompts"]]
    assert scored == [prompts[i] for i in planned]
    assert len(scored) == (40 - resumed_from) * 16

    changed = subprocess.run(cmd + ["--resume", "--set", "grpo.learning_rate=0.5"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
    assert changed.returncode == 2 and "config differs" in changed.stderr and "grpo.learning_rate" in changed.stderr


def test_a_half_written_checkpoint_is_never_the_resume_point(tmp_path):
    """A process killed while saving leaves a checkpoint directory without trainer_state.json (written last)."""
    import torch
    from safetensors.torch import save_file

    run = RunDir(tmp_path / "run")
    for step, complete in ((4, True), (8, True), (12, False)):
        ckpt = run.checkpoints / f"checkpoint-{step}"
        ckpt.mkdir(parents=True)
        save_file({"w": torch.zeros(2)}, str(ckpt / "model.safetensors"))
        if complete:
            (ckpt / "trainer_state.json").write_text("{}")
    assert run.latest_checkpoint() == run.checkpoints / "checkpoint-8"
    (run.checkpoints / "checkpoint-12" / "trainer_state.json").write_text("{}")
    assert run.latest_checkpoint() == run.checkpoints / "checkpoint-12"


def test_two_trainings_in_one_process_take_turns(tmp_path):
    """Sweep trials run in threads of one process, and transformers/accelerate keep process-global state: a trial
    building its trainer while another one did failed with "AcceleratorState object has no attribute num_processes"
    (worker-run sweep test), a model loaded while another thread loaded one held meta tensors ("Cannot copy out of
    meta tensor", `grpo sweep` test); both windows are too narrow to hit on demand. Model loads and trainings in one
    process now take turns: the second trial waits, says so, and both finish."""
    import threading
    import time

    said: list[str] = []
    results: dict[str, object] = {}

    def trial(name: str, steps: int) -> None:
        cfg = load_config(MICRO, micro_overrides(tmp_path, **{"grpo.max_steps": steps, "grpo.save_steps": 100,
                                                              "evaluation.enabled": "false"}))
        try:
            results[name] = run_experiment(cfg, open_run_dir(cfg, name, resume=False), log=said.append)
        except BaseException as err:  # noqa: BLE001 - reported below
            results[name] = err

    first = threading.Thread(target=trial, args=("first", 300))
    first.start()
    metrics = tmp_path / "first" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.is_file() and metrics.read_text().strip()) and first.is_alive():  # the first one is training
        assert time.monotonic() < deadline
        time.sleep(0.2)
    second = threading.Thread(target=trial, args=("second", 4))
    second.start()
    first.join(900)
    second.join(900)
    assert {name: getattr(r, "get", lambda _: r)("steps") for name, r in results.items()} == {"first": 300, "second": 4}
    assert any("waiting for another training or model load in this process" in line for line in said), said


@pytest.mark.parametrize("signals", [1, 2])
def test_an_interrupt_saves_the_step_it_arrived_in_and_a_second_one_stops_at_once(tmp_path, signals):
    """#12.5: SIGINT during step 3 (of a run saving every 100 steps): the step finishes, is logged and checkpointed,
    then the interrupt goes on (KeyboardInterrupt, as before). Sent twice, it stops within the step: no checkpoint."""
    from transformers import TrainerCallback

    class Interrupt(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 2:
                for _ in range(signals):
                    os.kill(os.getpid(), signal.SIGINT)

    cfg = load_config(MICRO, micro_overrides(tmp_path, **{"grpo.max_steps": 8, "grpo.save_steps": 100,
                                                          "grpo.logging_steps": 2, "evaluation.enabled": "false"}))
    run = open_run_dir(cfg, "interrupted", resume=False)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, run, log=lambda *_: None, callbacks=[Interrupt()])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler before training, restored
    latest = run.latest_checkpoint()
    logged = [row["step"] for row in read_metrics(run) if "loss" in row["metrics"]]
    if signals == 1:
        assert latest is not None and latest.name == "checkpoint-3" and logged == [2, 3], (latest, logged)
    else:
        assert latest is None and logged == [2], (latest, logged)
