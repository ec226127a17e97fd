"""Run directories: ``<output_dir>/<run_name>/`` holds the resolved config, checkpoints, metrics and summary.

A run directory is never silently overwritten: a new run refuses an existing name, and ``--resume`` refuses a
config that differs from the one the run started with.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import re
import shutil
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml
from safetensors import safe_open

from grpo.config import ExperimentConfig, config_from_dict, flatten, to_yaml
from grpo.errors import RunDirectoryError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class RunDir:
    path: Path

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_file(self) -> Path:
        return self.path / "summary.json"

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def merged_model_dir(self) -> Path:
        """The LoRA adapter merged into its base, a plain transformers model (``model.lora.save_merged``)."""
        return self.path / "model-merged"

    def inputs(self) -> dict:
        """Where this run's prepared data and sampler plan live (written by the pipeline's plan stage)."""
        return self.read_json("inputs.json") or {}

    def latest_checkpoint(self, report: Callable[[str], None] | None = None) -> Path | None:
        """The newest checkpoint that can be loaded. The Trainer writes ``trainer_state.json`` last, so a directory
        without it is one a killed process left half-written; a truncated or corrupt file (disk full, a copy cut
        short) is caught by :func:`checkpoint_problem`. Skipped checkpoints are passed to ``report``, so a resume
        that falls back to an older one says so."""
        found = sorted(
            (p for p in self.checkpoints.glob("checkpoint-*")
             if p.name.split("-")[-1].isdigit() and (p / "trainer_state.json").is_file()),
            key=lambda p: int(p.name.split("-")[-1]), reverse=True,
        )
        for ckpt in found:
            problem = checkpoint_problem(ckpt)
            if problem is None:
                return ckpt
            if report is not None:
                report(f"checkpoint {ckpt} can not be loaded ({problem}); falling back to an older one")
        if found and report is not None:
            report(f"no loadable checkpoint in {self.checkpoints}; training starts from step 0")
        return None

    def write_json(self, name: str, data: dict) -> Path:
        target = self.path / name
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
        tmp.replace(target)
        return target

    def read_json(self, name: str) -> dict | None:
        f = self.path / name
        return json.loads(f.read_text()) if f.is_file() else None


def checkpoint_problem(ckpt: Path) -> str | None:
    """Why ``ckpt`` can not be resumed from, or None. Cheap structural checks, no tensors read: the trainer state
    parses, every safetensors file's header matches its size, every torch pickle (optimizer, scheduler, RNG) is a
    complete zip archive."""
    try:
        json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError) as err:
        return f"trainer_state.json: {err}"
    for f in sorted(ckpt.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="np"):
                pass
        except Exception as err:  # SafetensorError: truncated, bad header, size mismatch
            return f"{f.name}: {err}"
    for f in sorted([*ckpt.glob("*.pt"), *ckpt.glob("*.pth"), *ckpt.glob("*.bin")]):
        try:
            with zipfile.ZipFile(f) as z:
                z.infolist()
        except (OSError, zipfile.BadZipFile) as err:
            return f"{f.name}: {err}"
    return None


def default_run_name(cfg: ExperimentConfig) -> str:
    return f"{cfg.name}-{datetime.now(timezone.utc).strftime('%Y%m%d-%H%M%S')}"


def validate_run_name(name: str) -> str:
    if not _NAME.match(name):
        raise RunDirectoryError(
            f"--run-name {name!r}: use letters, digits, '.', '_' or '-' (max 128 characters, no leading punctuation)"
        )
    return name


# What a run directory holds before training writes anything (metrics.jsonl, checkpoints/, model/, summary.json).
_BEFORE_TRAINING = {".lock", "config.yaml", "run.log", "inputs.json", "eval_before.json", "tracking_spool", "plan",
                    "data"}


_LOCK = ".lock"
_CLAIMED: dict[Path, object] = {}  # run dir -> its open lock file, held until this process exits


@atexit.register
def _release_claims() -> None:
    for f in _CLAIMED.values():
        f.close()


def _claim(run: RunDir) -> None:
    """Hold an exclusive lock on the run directory for the life of this process (the OS drops it when the process
    dies, however it dies), so two runs started under one name never write into one directory."""
    key = run.path.resolve()
    if key in _CLAIMED:  # a retried flow run in this process
        return
    f = (run.path / _LOCK).open("a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise RunDirectoryError(f"run directory {run.path} is in use by another running process; "
                                "choose another --run-name") from None
    _CLAIMED[key] = f


def never_trained(run: RunDir) -> bool:
    """A directory left by a run that failed before training (bad data, unreachable tracking, an import error), or
    an empty one: it holds nothing worth keeping, so it must not block a fresh start under the same name."""
    return run.path.is_dir() and all(p.name in _BEFORE_TRAINING for p in run.path.iterdir())


def _check_output_dir(cfg: ExperimentConfig) -> None:
    out = Path(cfg.output_dir)
    existing = next((p for p in (out, *out.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise RunDirectoryError(f"output_dir {out}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirectoryError(f"output_dir {out}: {existing} is not writable")


def check_run_dir(cfg: ExperimentConfig, run_name: str, resume: bool) -> RunDir:
    """Everything :func:`open_run_dir` checks, without creating anything (for failing fast before a pipeline)."""
    validate_run_name(run_name)
    _check_output_dir(cfg)
    run = RunDir(Path(cfg.output_dir) / run_name)
    if resume:
        _check_resumable(cfg, run)
    elif run.path.exists() and not never_trained(run):
        raise RunDirectoryError(
            f"run directory {run.path} already exists; pass --resume to continue it or choose another --run-name"
        )
    return run


def _check_resumable(cfg: ExperimentConfig, run: RunDir) -> None:
    if not run.config_file.is_file():
        raise RunDirectoryError(f"--resume: no run to resume at {run.path} (no config.yaml there)")
    try:
        saved_data = yaml.safe_load(run.config_file.read_text(encoding="utf-8"))
        if not isinstance(saved_data, dict):
            raise ValueError("not a mapping of sections")
        saved = config_from_dict(saved_data, str(run.config_file))
    except (yaml.YAMLError, ValueError) as err:  # UnicodeDecodeError and ConfigError are ValueErrors too
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RunDirectoryError(
            f"--resume: {run.config_file} is corrupt ({detail}); restore it or start a new --run-name"
        ) from None
    changed = _differences(saved, cfg)
    if changed:
        raise RunDirectoryError(
            f"--resume: config differs from the one {run.path} started with ({', '.join(changed[:5])}); "
            f"resume with the same config or start a new --run-name"
        )


def open_run_dir(cfg: ExperimentConfig, run_name: str, resume: bool) -> RunDir:
    """Create a fresh run directory, or reopen one for ``--resume`` after checking the config is unchanged.

    A directory that :func:`never_trained` is reused for a fresh start: what the failed attempt left (its MLflow run
    id, inputs, eval) is cleared, its ``run.log`` kept."""
    run = check_run_dir(cfg, run_name, resume)
    try:
        run.path.mkdir(parents=True, exist_ok=True)
        _claim(run)
        if resume:
            return run
        for entry in run.path.iterdir():  # what a failed earlier attempt left (check_run_dir: nothing trained)
            if entry.name not in ("run.log", _LOCK):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        run.config_file.write_text(to_yaml(cfg))
    except OSError as err:
        raise RunDirectoryError(
            f"output_dir {cfg.output_dir}: can not create {run.path}: {err.strerror or err}"
        ) from None
    return run


def _differences(a: ExperimentConfig, b: ExperimentConfig) -> list[str]:
    fa, fb = flatten(a), flatten(b)
    return [f"{k}: {fa.get(k)!r} -> {fb.get(k)!r}" for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
