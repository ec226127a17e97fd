"""``python -m benchmarks.gpu_smoke``: check the whole GPU path in minutes -- a vLLM server, sync and async training
through it, one preset -- and print the async/sync step-time ratio as one JSON line.

For a person with a CUDA machine and the GPU install (``LOCK=constraints-gpu.txt EXTRAS=gpu TORCH=
infra/install.sh``). CI never runs it; on a machine without CUDA or vLLM it stops at once (exit 2, one line).

What it does:

1. Starts ``trl vllm-serve --model MODEL`` (``python -m trl.scripts.vllm_serve``) on ``--server-gpu`` (default: GPU 1)
   -- or uses ``--server URL`` -- and waits for ``/health``. The server must be on a GPU of its own: the weight sync is
   an NCCL group of the trainer and the server, and NCCL can not hold two ranks on one device (huggingface/trl#3158,
   #3487). ``--same-gpu`` tries one GPU for both anyway (expect ``NCCL error: invalid usage`` at the first weight sync).
2. Trains the preset for ``--steps`` steps twice, each in its own process on ``--trainer-gpu`` (default: GPU 0), with a
   fresh server each (unless ``--server``): ``sync`` -- TRL's synchronous vLLM server mode (``grpo.use_vllm: true``,
   ``grpo.vllm_mode: server``), weights pushed every step; ``async`` -- the same plus ``async.use_data_producer``,
   ``async_prefetch``, ``prefetch_depth: 1``, ``max_staleness: 1``, ``vllm_sync_interval: 1`` and the
   importance-sampling correction: the vLLM server engine (grpo/training/rollout_engines.py) generates round r+1 while
   round r trains. With ``--environment NAME`` (e.g. ``guess_digit``, ``calculator``) both runs are rounds of multi-turn
   episodes in that registered environment (``environment.name``, reward ``env_reward``): the sync run's episodes
   through TRL's ``rollout_func``, the async run's from the vLLM server engine, which runs the episode runner over TRL's
   client (one ``/v1/completions`` request per turn for every live episode, the environment's stop strings as vLLM's
   ``stop``), each round with one policy version.
3. Prints ``{"ratio_async_over_sync": ..., "sync_step_s": ..., "async_step_s": ..., ...}``: median steady-state step
   times (the first 3 steps skipped), the async run's staleness, dropped rounds and IS-ratio range (a broken weight
   sync shows as a ratio far from 1), and where the logs are.

Examples::

    python -m benchmarks.gpu_smoke                                  # 2 GPUs: server on 1, trainer on 0, qwen preset
    python -m benchmarks.gpu_smoke --steps 20 --set grpo.max_completion_length=256
    python -m benchmarks.gpu_smoke --server http://10.0.0.5:8000     # a server you started yourself
    python -m benchmarks.gpu_smoke --preset tiny --environment guess_digit   # an environment round through vLLM

``--preset qwen2.5-0.5b-gsm8k`` (default) downloads Qwen2.5-0.5B-Instruct and GSM8K. ``--preset tiny`` serves the
locally built tiny model (character tokenizer: pass ``--server-arg=--skip-tokenizer-init`` if vLLM cannot load it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PRESETS = ("qwen2.5-0.5b-gsm8k", "tiny")
ASYNC = ["async.use_data_producer=true", "async.async_prefetch=true", "async.prefetch_depth=1",
         "async.max_staleness=1", "async.vllm_sync_interval=1", "async.vllm_importance_sampling_correction=true"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_smoke", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=PRESETS, default="qwen2.5-0.5b-gsm8k")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per variant (default 12)")
    p.add_argument("--server", metavar="URL", help="use this running vLLM server (started with trl vllm-serve)")
    p.add_argument("--server-gpu", type=int, default=1, help="GPU for the vLLM server the script starts (default 1)")
    p.add_argument("--trainer-gpu", type=int, default=0, help="GPU for the trainer (default 0)")
    p.add_argument("--gpu", type=int, dest="trainer_gpu", help="alias of --trainer-gpu")
    p.add_argument("--same-gpu", action="store_true", help="allow server and trainer on one GPU (NCCL usually refuses)")
    p.add_argument("--port", type=int, default=8000, help="port of the server the script starts (default 8000)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="the server's share of its GPU")
    p.add_argument("--server-timeout", type=float, default=600, help="seconds to wait for the server to come up")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for trl vllm-serve (repeat)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for both runs")
    p.add_argument("--environment", metavar="NAME",
                   help="run both variants as multi-turn episodes in this registered environment (grpo environments)")
    p.add_argument("--out", help="folder for runs and server logs (default: a new temporary folder)")
    p.add_argument("--variant", choices=("sync", "async"), help=argparse.SUPPRESS)  # internal: one training run
    return p


def refusal(args) -> str | None:
    """Why this machine can not run the check, or None."""
    if importlib.util.find_spec("vllm") is None:
        return ("vllm is not installed: install the gpu extra (LOCK=constraints-gpu.txt EXTRAS=gpu TORCH= "
                "infra/install.sh) on a CUDA machine; nothing was run")
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: the GPU path needs one (for the trainer) plus one for the vLLM server; nothing was run"
    count = torch.cuda.device_count()
    if args.variant:  # a training run started by compare(): it sees only its own GPU (CUDA_VISIBLE_DEVICES)
        return None
    if args.trainer_gpu >= count:
        return f"--trainer-gpu {args.trainer_gpu}: only {count} CUDA device(s); nothing was run"
    if args.server is None:
        if args.server_gpu == args.trainer_gpu and not args.same_gpu:
            return (f"--server-gpu and --trainer-gpu are both {args.trainer_gpu}: NCCL can not hold the trainer and "
                    "the vLLM server on one device (weight sync); use another GPU, --server URL, or --same-gpu to "
                    "try anyway; nothing was run")
        if args.server_gpu >= count:
            return (f"--server-gpu {args.server_gpu}: only {count} CUDA device(s); the vLLM server needs a GPU of its "
                    "own (NCCL weight sync): use --server URL for a server elsewhere, or --same-gpu --server-gpu 0 "
                    "to try one GPU anyway; nothing was run")
    return None


def overrides(args, out: Path, base_url: str) -> list[str]:
    env = ([f"environment.name={args.environment}", "grpo.reward_funcs=[env_reward]"]
           if args.environment else [])
    return [f"output_dir={out / 'runs'}", f"grpo.max_steps={args.steps}", "grpo.logging_steps=1",
            "tracking.backend=none", "evaluation.enabled=false", f"grpo.save_steps={args.steps * 10}",
            "grpo.use_vllm=true", "grpo.vllm_mode=server", f"grpo.extra.vllm_server_base_url={base_url}",
            *env, *args.set]


def run_variant(args) -> dict:
    """One training run in this process (``--variant``); returns its figures."""
    from grpo.config import load_config
    from grpo.pipeline.experiment import run_experiment
    from grpo.runs import open_run_dir

    out = Path(args.out)
    sets = overrides(args, out, args.server) + (ASYNC if args.variant == "async" else [])
    cfg = load_config(args.preset, sets)
    run = open_run_dir(cfg, args.variant, resume=False)
    start = time.perf_counter()
    summary = run_experiment(cfg, run, log=lambda line: print(line, file=sys.stderr))
    rows = [json.loads(line)["metrics"] for line in run.metrics_file.read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r]
    steady = times[3:] or times
    pick = lambda key: [r[key] for r in rows if key in r]  # noqa: E731
    return {"variant": args.variant, "steps": summary["steps"] if summary else None,
            "step_s": statistics.median(steady) if steady else None, "wall_s": time.perf_counter() - start,
            "staleness_max": max(pick("async/staleness_max"), default=None),
            "dropped_stale": sum(pick("async/dropped_stale")),
            "is_ratio_min": min(pick("sampling/importance_sampling_ratio/min"), default=None),
            "is_ratio_max": max(pick("sampling/importance_sampling_ratio/max"), default=None),
            "reward_last": (pick("reward") or [None])[-1], "run_dir": str(run.path),
            "env_turns_mean": statistics.mean(pick("env/turns/mean")) if pick("env/turns/mean") else None,
            "env_errors": sum(pick("env/errors")) if pick("env/errors") else None}


def serve_model(args, out: Path) -> str:
    if args.preset != "tiny":
        from grpo.config import load_config

        return load_config(args.preset).model.name_or_path
    from grpo.config import load_config
    from grpo.pipeline.data import load_data
    from grpo.training.policy import load_policy

    cfg = load_config("tiny", [f"output_dir={out / 'runs'}", *args.set])
    return load_policy(cfg, load_data(cfg), log=lambda *_: None).source


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    import requests

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before it was up")
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(3)
    raise RuntimeError(f"the vLLM server at {url} was not up after {timeout:.0f} s")


def start_server(args, model: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(args.server_gpu)}
    cmd = [sys.executable, "-m", "trl.scripts.vllm_serve", "--model", model, "--port", str(args.port),
           "--gpu_memory_utilization", str(args.gpu_memory_utilization), *args.server_arg]
    return subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def compare(args) -> dict:
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    model = None if args.server else serve_model(args, out)
    results = {}
    for variant in ("sync", "async"):
        proc = None
        url = args.server or f"http://127.0.0.1:{args.port}"
        try:
            if args.server is None:
                proc = start_server(args, model, out / f"vllm-serve-{variant}.log")
            wait_healthy(url, proc, args.server_timeout)
            cmd = [sys.executable, "-m", "benchmarks.gpu_smoke", "--variant", variant, "--server", url,
                   "--preset", args.preset, "--steps", str(args.steps), "--out", str(out),
                   *(["--environment", args.environment] if args.environment else []),
                   *[f"--set={s}" for s in args.set]]
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(args.trainer_gpu)}
            done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"the {variant} run failed (exit {done.returncode}); see its output above")
            results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        finally:
            if proc is not None:
                stop_server(proc)
    sync, asyn = results["sync"], results["async"]
    ratio = asyn["step_s"] / sync["step_s"] if sync["step_s"] and asyn["step_s"] else None
    return {"preset": args.preset, "steps": args.steps, "ratio_async_over_sync": ratio,
            "sync_step_s": sync["step_s"], "async_step_s": asyn["step_s"], "environment": args.environment,
            "env_turns_mean": {"sync": sync["env_turns_mean"], "async": asyn["env_turns_mean"]},
            "env_errors": {"sync": sync["env_errors"], "async": asyn["env_errors"]},
            "sync_wall_s": sync["wall_s"], "async_wall_s": asyn["wall_s"],
            "async_staleness_max": asyn["staleness_max"], "async_dropped_stale": asyn["dropped_stale"],
            "async_is_ratio_min": asyn["is_ratio_min"], "async_is_ratio_max": asyn["is_ratio_max"],
            "reward_last": {"sync": sync["reward_last"], "async": asyn["reward_last"]},
            "server": args.server or f"trl vllm-serve on GPU {args.server_gpu}", "out": str(out)}


def main(smoke: bool = False, argv: list[str] | None = None) -> dict:
    """``python -m benchmarks gpu_smoke [--smoke]`` runs the defaults (``--smoke``: 4 steps)."""
    args = parser().parse_args(argv if argv is not None else (["--steps", "4"] if smoke else []))
    why = refusal(args)
    if why is not None:
        print(f"gpu_smoke: {why}", file=sys.stderr)
        raise SystemExit(2)
    if args.variant:
        return run_variant(args)
    return compare(args)


if __name__ == "__main__":
    result = main(argv=sys.argv[1:])
    print(json.dumps(result, sort_keys=True))
