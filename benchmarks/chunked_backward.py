"""``python -m benchmarks chunked_backward``: one group of 64 long completions, backward unchunked vs in 4 chunks.

Peak memory of the training step is measured in a fresh process per variant (RSS high-water mark during the step
minus the RSS before it); the same processes save the step's gradient (same seeded model and batch), and the
gradients of the two variants are compared (max relative difference) without building a third trainer.

Environment: BENCH_GROUP (64), BENCH_CHUNKS (4), BENCH_COMPLETION_TOKENS (384). ``--smoke``: a group of 8 in 2 chunks
of 32-token completions, one fresh process per variant instead of two.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks._sizes import size

REPO = Path(__file__).resolve().parent.parent


def _trainer(tmp: Path, chunks: int, group: int, length: int):
    import torch

    from grpo.config import load_config
    from grpo.pipeline.data import load_data
    from grpo.rewards import get_reward
    from grpo.training.policy import load_policy
    from grpo.training.train import grpo_args
    from grpo.training.trainer import GRPOTrainer

    cfg = load_config(REPO / "tests" / "micro.yaml", [
        f"output_dir={tmp}", "model.tiny.hidden_size=256", "model.tiny.num_hidden_layers=4",
        "model.tiny.intermediate_size=1024", f"model.tiny.max_position_embeddings={length + 16}",
        "model.warm_start.steps=0", f"grpo.num_generations={group}", f"grpo.per_device_train_batch_size={group}",
        f"grpo.num_generations_chunks={chunks}", f"grpo.max_completion_length={length}"])
    data = load_data(cfg)
    policy = load_policy(cfg, data, log=lambda *_: None)
    trainer = GRPOTrainer(model=policy.model, processing_class=policy.tokenizer,
                          reward_funcs=[get_reward("exact_match")], args=grpo_args(cfg, tmp / "out"),
                          train_dataset=data["train"], experiment=cfg)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    g = torch.Generator().manual_seed(0)
    vocab = trainer.model.config.vocab_size
    batch = {
        "prompt_ids": torch.randint(3, vocab, (group, 6), generator=g),
        "prompt_mask": torch.ones(group, 6, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (group, length), generator=g),
        "completion_mask": torch.ones(group, length, dtype=torch.long),
        "advantages": torch.randn(group, generator=g), "num_items_in_batch": torch.tensor(float(group * length)),
    }
    return trainer, batch


def _step(trainer, batch):
    import torch

    trainer.model.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(trainer.model, batch)
    trainer.accelerator.backward(loss)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def _child(chunks: int, group: int, length: int, grad_file: str) -> dict:
    import resource

    import psutil
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        trainer, batch = _trainer(Path(tmp), chunks, group, length)
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
        grad = _step(trainer, batch)
        stop.set()
        t.join()
        torch.save(grad, grad_file)
        return {"rss_before_mb": before / 2**20, "step_peak_mb": (peak[0] - before) / 2**20,
                "process_peak_mb": max(peak_before, peak[0]) / 2**20}


def main(smoke: bool = False) -> dict:
    group = size("BENCH_GROUP", 64, 8, smoke)
    n_chunks = size("BENCH_CHUNKS", 4, 2, smoke)
    length = size("BENCH_COMPLETION_TOKENS", 384, 32, smoke)
    import torch

    work = Path(tempfile.mkdtemp(prefix="bench-chunk-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GRPO_CACHE_DIR": str(work / "cache")}
    results = {}
    for run, chunks in enumerate((1, n_chunks) if smoke else (1, n_chunks, 1, n_chunks)):
        grad_file = work / f"grad-{run}-{chunks}.pt"
        out = subprocess.run([sys.executable, "-m", "benchmarks.chunked_backward", "--child", str(chunks), str(group),
                              str(length), str(grad_file)], cwd=REPO, env=env, capture_output=True, text=True,
                             check=True)
        row = json.loads(out.stdout.strip().splitlines()[-1])
        results.setdefault(chunks, []).append(row["step_peak_mb"])
    full, chunked = torch.load(work / "grad-0-1.pt"), torch.load(work / f"grad-1-{n_chunks}.pt")
    rel = float((chunked - full).abs().max() / full.abs().max())
    shutil.rmtree(work, ignore_errors=True)
    unchunked_mb, chunked_mb = min(results[1]), min(results[n_chunks])
    ratio = chunked_mb / unchunked_mb if unchunked_mb > 0 else None  # None: no step growth measured (tiny sizes)
    return {
        "group_size": group, "chunks": n_chunks, "completion_tokens": length,
        "step_peak_mb_unchunked": round(unchunked_mb, 1), "step_peak_mb_chunked": round(chunked_mb, 1),
        "peak_ratio_chunked_over_unchunked": None if ratio is None else round(ratio, 3),
        "max_relative_gradient_difference": rel,
        "target_peak_ratio": 0.5, "target_met": ratio is not None and ratio <= 0.5 and rel <= 1e-5,
    }


# The measuring child: python -m benchmarks.chunked_backward --child CHUNKS GROUP LENGTH FILE
if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        print(json.dumps(_child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])))
