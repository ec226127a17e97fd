"""``python -m benchmarks chunked_backward``: one group of 64 long completions, backward unchunked vs in 4 chunks.

Peak memory of the training step is measured in a fresh process per variant (RSS high-water mark during the step
minus the RSS before it); gradients of the two variants are compared in one process (max relative difference).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GROUP = int(os.environ.get("BENCH_GROUP", "64"))
CHUNKS = int(os.environ.get("BENCH_CHUNKS", "4"))
LENGTH = int(os.environ.get("BENCH_COMPLETION_TOKENS", "384"))


def _trainer(tmp: Path, chunks: int):
    import torch

    from grpo.config import load_config
    from grpo.data import load_task_data
    from grpo.policy import load_policy
    from grpo.rewards import get_reward
    from grpo.train import grpo_args
    from grpo.trainer import GRPOTrainer

    cfg = load_config(REPO / "tests" / "micro.yaml", [
        f"output_dir={tmp}", "model.tiny.hidden_size=256", "model.tiny.num_hidden_layers=4",
        "model.tiny.intermediate_size=1024", f"model.tiny.max_position_embeddings={LENGTH + 16}",
        "model.warm_start.steps=0", f"grpo.num_generations={GROUP}", f"grpo.per_device_train_batch_size={GROUP}",
        f"grpo.num_generations_chunks={chunks}", f"grpo.max_completion_length={LENGTH}"])
    data = load_task_data(cfg.data)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward("exact_match")], args=grpo_args(cfg, tmp / "out"),
                          train_dataset=data["train"], experiment=cfg)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    batch = {
        "prompt_ids": torch.randint(3, vocab, (GROUP, 6), generator=g), "prompt_mask": torch.ones(GROUP, 6, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (GROUP, LENGTH), generator=g),
        "completion_mask": torch.ones(GROUP, LENGTH, dtype=torch.long),
        "advantages": torch.randn(GROUP, generator=g), "num_items_in_batch": torch.tensor(float(GROUP * LENGTH)),
    }
    return trainer, batch


def _step(trainer, batch):
    import torch

    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    trainer.accelerator.backward(loss)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def _child(chunks: int) -> dict:
    import resource

    import psutil

    with tempfile.TemporaryDirectory() as tmp:
        trainer, batch = _trainer(Path(tmp), chunks)
        _step(trainer, batch)  # warm-up: allocator pools, lazy inits
        trainer.model.zero_grad(set_to_none=True)
        before = psutil.Process().memory_info().rss
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        import threading

        peak = [before]
        stop = threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], psutil.Process().memory_info().rss)
                stop.wait(0.002)

        t = threading.Thread(target=sample)
        t.start()
        _step(trainer, batch)
        stop.set()
        t.join()
        return {"rss_before_mb": before / 2**20, "step_peak_mb": (peak[0] - before) / 2**20,
                "process_peak_mb": max(peak_before, peak[0]) / 2**20}


def main() -> dict:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(_child(int(sys.argv[2]))))
        return {}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRPO_CACHE_DIR": tempfile.mkdtemp(prefix="bench-chunk-")}
    results = {}
    for chunks in (1, CHUNKS, 1, CHUNKS):
        out = subprocess.run([sys.executable, "-c", "import sys; sys.argv=['x','--child',sys.argv[1]];"
                              "from benchmarks.chunked_backward import main; main()", str(chunks)],
                             cwd=REPO, env=env, capture_output=True, text=True, check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        results.setdefault(chunks, []).append(row["step_peak_mb"])
    with tempfile.TemporaryDirectory() as tmp:
        trainer, batch = _trainer(Path(tmp), 1)
        full = _step(trainer, batch)
        trainer.experiment.grpo.num_generations_chunks = CHUNKS
        chunked = _step(trainer, batch)
    rel = float((chunked - full).abs().max() / full.abs().max())
    unchunked_mb, chunked_mb = min(results[1]), min(results[CHUNKS])
    return {
        "group_size": GROUP, "chunks": CHUNKS, "completion_tokens": LENGTH,
        "step_peak_mb_unchunked": round(unchunked_mb, 1), "step_peak_mb_chunked": round(chunked_mb, 1),
        "peak_ratio_chunked_over_unchunked": round(chunked_mb / unchunked_mb, 3),
        "max_relative_gradient_difference": rel,
        "target_peak_ratio": 0.5, "target_met": chunked_mb / unchunked_mb <= 0.5 and rel <= 1e-5,
    }
