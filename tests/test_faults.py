"""Faults a new user hits (issue #12): edited data, interrupted and corrupted runs, odd input, signals, secrets.

Each test reproduces one reported failure against the real component (files, checkpoints, a real MLflow store, the
CLI as a subprocess); docs/design.md's guarantees table lists what each guarantees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import DataConfig, load_config
from grpo.runs import RunDir, open_run_dir
from tests.conftest import MICRO, micro_overrides


def write_rows(path: Path, n: int, changed: dict[int, str] | None = None) -> Path:
    changed = changed or {}
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": changed.get(i, str(i + 1))}) + "\n"
                            for i in range(n)))
    return path


def grpo_cli(*args: str, cwd: Path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo.app.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


def assert_one_line_error(result: subprocess.CompletedProcess, fragment: str) -> None:
    """Exit 2, exactly one ``error:`` line naming the fault, no traceback (Prefect's progress lines may precede it)."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and fragment in errors[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]


# ---------------------------------------------------------------- data integrity


def test_hub_sources_are_keyed_on_their_contents_never_on_an_unknown_revision(tmp_path, monkeypatch):
    """#12.1 for ``hub:`` sources: a local dataset folder is keyed on its files (editing one moves the cache), a hub id
    on the commit its local cache resolves ``main`` to; a hub id with no local copy under HF_HUB_OFFLINE is a one-line
    DataError, never a key with an unknown revision (which would serve one download's rows for every later one)."""
    import datasets
    import huggingface_hub.constants

    from grpo.errors import DataError
    from grpo.pipeline.cache_dirs import prep_dir_for

    folder = tmp_path / "org" / "qa"
    (folder / "main").mkdir(parents=True)
    for split in ("train", "test"):
        datasets.Dataset.from_dict({"prompt": ["a", "b"], "answer": ["1", "2"]}).to_parquet(
            folder / "main" / f"{split}-00000-of-00001.parquet")
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{"data.source": f"hub:{folder}"}))
    before = prep_dir_for(cfg)
    assert prep_dir_for(cfg) == before  # deterministic
    datasets.Dataset.from_dict({"prompt": ["a", "c"], "answer": ["1", "3"]}).to_parquet(
        folder / "main" / "train-00000-of-00001.parquet")
    assert prep_dir_for(cfg) != before

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    hub = load_config(MICRO, micro_overrides(tmp_path, **{"data.source": "hub:someone/addition"}))
    with pytest.raises(DataError, match="not in the local hub cache") as err:
        prep_dir_for(hub)
    assert "\n" not in str(err.value) and "hub:someone/addition" in str(err.value)
    refs = tmp_path / "hub-cache" / "datasets--someone--addition" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("aaaa")
    first = prep_dir_for(hub)
    (refs / "main").write_text("bbbb")  # the cache moved to a newer commit of the dataset
    assert prep_dir_for(hub) != first


def test_an_edited_data_file_is_prepared_again(tmp_path):
    """#12.1: the prep cache keys on the source's contents, not on its path."""
    from grpo.pipeline.cache_dirs import prep_dir_for
    from grpo.pipeline.stages import prep_stage

    source = write_rows(tmp_path / "data.jsonl", 60)
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{"data.source": str(source)}))
    first_dir = prep_dir_for(cfg)
    first = prep_stage(cfg, first_dir)
    assert first["rows_in"] == 60

    write_rows(source, 100, changed={3: "99"})  # same path, new contents
    assert prep_dir_for(cfg) != first_dir
    second = prep_stage(cfg, prep_dir_for(cfg))
    assert second["rows_in"] == 100 and second["content_hash"] != first["content_hash"]
    assert prep_dir_for(cfg) == prep_dir_for(cfg)  # unchanged contents: a stable key (the cache still hits)


def test_a_resume_before_the_first_checkpoint_logs_each_step_once(tmp_path):
    """#12.2: a run killed before its first checkpoint restarts at step 0; its earlier lines are dropped."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from grpo.training.train import MetricsRecorder

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "metrics": {"reward": 0.1}}) + "\n" for s in range(1, 6)))
    recorder = MetricsRecorder(metrics)
    state = TrainerState()  # a resume with no checkpoint: global_step 0
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    recorder.on_train_begin(args, state, TrainerControl())
    for step in range(1, 6):
        state.global_step = step
        recorder.on_log(args, state, TrainerControl(), logs={"reward": 0.2})
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_metrics_jsonl_keeps_every_logged_point_when_the_process_is_killed(tmp_path):
    """The recorder keeps metrics.jsonl open through the training: a training killed (SIGKILL: no cleanup, no
    on_train_end, no flush at exit) right after logging still left every logged step in the file."""
    import signal

    from transformers import TrainerControl, TrainerState, TrainingArguments

    from grpo.training.train import MetricsRecorder

    metrics = tmp_path / "metrics.jsonl"
    args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
    pid = os.fork()
    if pid == 0:  # the training process: log three steps, then die as a killed process does
        try:
            recorder, state = MetricsRecorder(metrics), TrainerState()
            recorder.on_train_begin(args, state, TrainerControl())
            for step in (1, 2, 3):
                state.global_step = step
                recorder.on_log(args, state, TrainerControl(), logs={"reward": step / 10, "loss": 0.5})
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(r["step"], r["metrics"]["reward"]) for r in rows] == [(1, 0.1), (2, 0.2), (3, 0.3)]


def write_checkpoint(ckpt: Path, step: int) -> None:
    """The files a Trainer checkpoint has: safetensors weights, torch pickles, trainer_state.json (last)."""
    import torch
    from safetensors.torch import save_file

    ckpt.mkdir(parents=True)
    save_file({"w": torch.ones(64, 64)}, str(ckpt / "model.safetensors"))
    torch.save({"state": {0: torch.zeros(64)}}, ckpt / "optimizer.pt")
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_corrupt_checkpoint_is_skipped_with_a_message(tmp_path):
    """#12.3: truncated weights or optimizer state are not a resume point; the newest loadable one is, and the
    skip is reported."""
    run = RunDir(tmp_path / "run")
    for step in (4, 8, 12):
        write_checkpoint(run.checkpoints / f"checkpoint-{step}", step)
    truncate(run.checkpoints / "checkpoint-12" / "model.safetensors")
    truncate(run.checkpoints / "checkpoint-8" / "optimizer.pt")
    said: list[str] = []
    assert run.latest_checkpoint(report=said.append) == run.checkpoints / "checkpoint-4"
    assert len(said) == 2 and "checkpoint-12" in said[0] and "model.safetensors" in said[0]
    assert "checkpoint-8" in said[1] and "optimizer.pt" in said[1]
    truncate(run.checkpoints / "checkpoint-4" / "model.safetensors")
    assert run.latest_checkpoint(report=said.append) is None and "starts from step 0" in said[-1]


@pytest.mark.integration
def test_resuming_onto_a_corrupt_checkpoint_falls_back_and_never_unfinishes_the_run(tmp_path):
    """#12.3 end to end (in-process recipe, real SQLite MLflow store): a finished run whose latest checkpoint was
    truncated resumes from the previous one; a resume that fails leaves the MLflow run FINISHED."""
    from mlflow import MlflowClient

    from grpo.pipeline.experiment import run_experiment

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "grpo.max_steps": 8, "grpo.save_steps": 4, "grpo.logging_steps": 2, "evaluation.num_prompts": 8,
        "evaluation.pass_k": 0, "tracking.backend": "mlflow", "tracking.tracking_uri": uri}))
    run = open_run_dir(cfg, "corrupt", resume=False)
    first = run_experiment(cfg, run, log=lambda *_: None)
    client = MlflowClient(uri)
    assert client.get_run(first["mlflow_run_id"]).info.status == "FINISHED"

    truncate(run.checkpoints / "checkpoint-8" / "model.safetensors")
    resumed = run_experiment(cfg, run, resume=True, log=lambda *_: None)
    assert resumed["resumed_from"].endswith("checkpoint-4") and resumed["steps"] == 8
    assert resumed["mlflow_run_id"] == first["mlflow_run_id"]
    assert client.get_run(first["mlflow_run_id"]).info.status == "FINISHED"

    (run.path / "eval_before.json").write_text("{not json")  # a resume that fails part-way
    with pytest.raises(ValueError):
        run_experiment(cfg, run, resume=True, log=lambda *_: None)
    assert client.get_run(first["mlflow_run_id"]).info.status == "FINISHED"


@pytest.mark.integration
def test_summary_names_the_data_trained_on_and_a_resume_refuses_changed_data(tmp_path):
    """#11.1 / #12.4: the recipe records the content hash of the prepared data it trained on (it was null on every
    path), prepared data lives in the shared content-addressed cache (the same place on every path), and a resume
    whose source changed since the run started is refused before it trains on other rows."""
    from grpo.errors import DataError
    from grpo.pipeline.experiment import run_experiment

    source = write_rows(tmp_path / "d.jsonl", 40)
    cfg = load_config(MICRO, micro_overrides(tmp_path, **{
        "data.source": str(source), "grpo.max_steps": 2, "grpo.save_steps": 2, "evaluation.enabled": False}))
    run = open_run_dir(cfg, "hash", resume=False)
    summary = run_experiment(cfg, run, log=lambda *_: None)
    data_dir = Path(run.inputs()["data_dir"])
    stats = json.loads((data_dir / "stats.json").read_text())
    assert summary["data_content_hash"] == stats["content_hash"] and len(stats["content_hash"]) == 64
    assert data_dir.parent.name == "prepared" and not (run.path / "data").exists()

    write_rows(source, 44)  # the source changed since the run started
    with pytest.raises(DataError, match="changed since run hash started"):
        run_experiment(cfg, run, resume=True, log=lambda *_: None)


# ---------------------------------------------------------------- errors a person can act on


def _setup_bad_inputs(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    (tmp_path / "raises.py").write_text("raise RuntimeError('no GPU here')\n")
    run = tmp_path / "runs" / "corrupt"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("grpo: [unclosed\n")


@pytest.mark.parametrize("args, fragment", [
    (["--set", "output_dir=a-file/runs"], "output_dir a-file/runs: a-file is not a directory"),
    (["--config", "latin1.yaml"], "latin1.yaml: not UTF-8 text (line 1"),
    (["--reward-module", "raises.py"], "--reward-module: importing raises.py failed: RuntimeError: no GPU here"),
    (["--run-name", ""], "--run-name ''"),
    (["--run-name", "corrupt", "--resume"], "corrupt/config.yaml is corrupt"),
])
def test_input_errors_are_one_line_exit_2(tmp_path, args, fragment):
    """#12.8 and #12.11: each used to print a traceback and exit 1 (or, for --run-name "", start a default run)."""
    _setup_bad_inputs(tmp_path)
    config = [] if "--config" in args else ["--config", str(MICRO)]
    result = grpo_cli("run", *config, "--set", "output_dir=runs", *args, cwd=tmp_path)
    assert_one_line_error(result, fragment)
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["corrupt"]


@pytest.mark.integration
def test_a_data_error_in_the_flow_is_one_line_not_retried_and_does_not_block_a_rerun(tmp_path, prefect_server):
    """#12.8-10: an all-bad data file fails once (no retries), the console shows one error line (the traceback is in
    the run's log file), and the same command run again is not refused with 'already exists'."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"prompt": "", "answer": "1"}) + "\n" for _ in range(20)))
    args = ["run", "--config", str(MICRO), "--run-name", "bad", "--set", "output_dir=runs",
            "--set", f"data.source={bad}"]
    server = {k: prefect_server.env()[k] for k in ("PREFECT_API_URL", "PREFECT_HOME")}
    first = grpo_cli(*args, cwd=tmp_path, timeout=300, **server)
    assert_one_line_error(first, "no valid rows")
    log = (tmp_path / "runs" / "bad" / "run.log").read_text()
    assert "Traceback" in log and "DataError" in log
    assert "Retrying" not in log + first.stderr and log.count("Traceback") <= 3  # no retry (structural, not a timer)

    second = grpo_cli(*args, cwd=tmp_path, timeout=300, **server)
    assert_one_line_error(second, "no valid rows")  # not "already exists; pass --resume"


# ---------------------------------------------------------------- validation gaps


@pytest.mark.parametrize("override, fragment", [
    ("grpo.learning_rate=inf", "grpo.learning_rate"),
    ("grpo.learning_rate=.nan", "grpo.learning_rate"),
    ("grpo.max_steps=true", "grpo.max_steps: expected a number, got True"),
    ("grpo={}", "an empty mapping would reset section grpo"),
])
def test_values_that_are_never_meant_are_refused(override, fragment):
    """#12.12: each of these loaded before (inf/NaN as a learning rate, true as 1 step, a whole section reset)."""
    from grpo.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config(MICRO, [override])
    assert fragment in str(err.value)


def test_a_section_mapping_merges_and_an_empty_file_is_refused(tmp_path):
    from grpo.errors import ConfigError

    cfg = load_config(MICRO, ["grpo={learning_rate: 0.002}"])
    assert cfg.grpo.learning_rate == 0.002 and cfg.grpo.max_steps == 12  # micro.yaml's other grpo fields stay
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    with pytest.raises(ConfigError, match="the file is empty"):
        load_config(tmp_path / "empty.yaml")


def test_numeric_answers_are_normalised_and_bad_lines_quarantined_by_line(tmp_path):
    """#12.12: ``28.0`` becomes ``"28"`` (so exact_match can match), ``Infinity`` is quarantined with its reason.
    #12.13: one line that is not UTF-8 is quarantined with its line number; the other rows are kept."""
    import pyarrow.parquet as pq

    from grpo.pipeline.prep import load_prepared, prepare_dataset

    lines = [json.dumps({"prompt": f"q{i}", "answer": str(i)}).encode() for i in range(20)]
    lines[3] = b'{"prompt": "q3", "answer": 28.0}'
    lines[5] = b'{"prompt": "q5", "answer": Infinity}'
    lines[7] = b'{"prompt": "caf\xe9", "answer": "7"}'  # latin-1, not UTF-8
    source = tmp_path / "d.jsonl"
    source.write_bytes(b"\n".join(lines) + b"\n")
    result = prepare_dataset(DataConfig(source=str(source)), tmp_path / "out")

    quarantine = {r["source_row"]: r for r in pq.read_table(result.paths["quarantine"]).to_pylist()}
    assert sorted(quarantine) == [5, 7]
    assert quarantine[5]["rules"] == ["answer_not_finite"] and "inf" in quarantine[5]["reason"]
    assert quarantine[7]["rules"] == ["malformed_record"]
    assert quarantine[7]["reason"].startswith("line 8: not valid UTF-8")
    ds = load_prepared(result.out_dir)
    answers = {p: a for split in ("train", "eval") for p, a in zip(ds[split]["prompt"], ds[split]["answer"])}
    assert answers["q3"] == "28" and len(answers) == 18


# ---------------------------------------------------------------- security


def test_secrets_are_refused_in_the_config_and_masked_if_logged(tmp_path):
    """#12.14: grpo.extra.hub_token was logged as a plain-text MLflow param; it also sat in config.yaml and in the
    Prefect flow-run parameters. A config is stored in plain text in all three, so a secret is refused at load (the
    environment variable named instead); MLflow logging masks secret-like keys as a second line of defence."""
    from grpo.config import ConfigError
    from grpo.tracking.values import redact

    with pytest.raises(ConfigError,
                       match=r"grpo.extra: 'hub_token' is a secret.*set the HF_TOKEN environment variable"):
        load_config(MICRO, micro_overrides(tmp_path, **{"grpo.extra": "{hub_token: hf_SECRETVALUE}"}))
    assert not (tmp_path / "runs").exists()
    masked = redact("grpo.extra", {"hub_token": "hf_SECRETVALUE", "api_key": "k", "num_iterations": 2})
    assert masked == {"hub_token": "***", "api_key": "***", "num_iterations": 2}
