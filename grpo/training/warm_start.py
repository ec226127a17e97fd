"""Supervised warm start: a few hundred steps of next-token training on (prompt, answer) pairs.

GRPO only learns from groups whose completions differ in reward. A randomly initialised policy almost never
produces a correct answer, so every group would score zero; the warm start lifts it to a success rate where
group-relative advantages carry signal.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from grpo.training.pace import Pace, duration
from grpo.training.padding import padded, padded_rows

Report = Callable[[float, str], None]  # (percent done, what to show): the Prefect run's progress artifact


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    answers: list[str],
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train on ``prompt + answer + eos`` with the loss on answer tokens only; returns the loss curve."""
    if steps <= 0:
        return []
    gen = torch.Generator().manual_seed(seed)
    encoded_prompts = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    encoded_answers = tokenizer(answers, add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / max(1, steps // 10)) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    losses: list[float] = []
    n = len(prompts)
    for step in range(steps):
        idx = torch.randint(n, (batch_size,), generator=gen).tolist()
        seqs = [encoded_prompts[i] + encoded_answers[i] + [eos] for i in idx]
        input_ids, attention = padded_rows(seqs, pad, "right")
        # the loss reads the answer and EOS only: the prompt's positions and the padding are -100
        labels = padded([[-100] * len(encoded_prompts[i]) + seq[len(encoded_prompts[i]):]
                         for i, seq in zip(idx, seqs)], -100, "right")
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    model.eval()
    return losses


@contextlib.contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Torch's intra-op threads set to ``threads`` inside, the process's setting restored after (None: unchanged)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class FasterThreads:
    """Torch's intra-op thread count for the warm start, picked by timing its own steps, as ``on_step``: in each
    ``every`` steps, ``probe`` steps on each of ``choices`` (the process's count and one), then the rest on the faster.
    The tiny model's matrices are small, so which is faster depends on the machine's other load: on 2 quiet cores
    tiny-calculator's step took 40-45 ms on two threads and 63-67 ms on one; on the same cores shared (load 3-9),
    108-490 ms on two (spinning on cores other processes hold) and 60 ms on one; picked this way, 44 ms and 85 ms.
    The model is the same bytes on any count (``tests/test_policy.py``, ``python -m grpo.pipeline.shipped_policies
    --check``), so the choice changes only the time. :meth:`start` before the first step."""

    def __init__(self, choices: tuple[int, ...] | None = None, probe: int = 5, every: int = 200,
                 clock: Callable[[], float] = time.perf_counter,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        self.choices = tuple(dict.fromkeys(choices or (torch.get_num_threads(), 1)))
        self.probe, self.every, self.clock, self.set_threads = probe, every, clock, set_threads
        self.chosen = self.choices[0]
        self._times: list[float] = []
        self._last = 0.0

    def start(self) -> None:
        self._last = self.clock()
        self._use(0)

    def _use(self, step: int) -> None:
        """Set the threads step ``step`` runs on."""
        at = step % self.every
        if at < self.probe * len(self.choices):
            self.set_threads(self.choices[at // self.probe])
        elif at == self.probe * len(self.choices):
            per_choice = [sum(self._times[i * self.probe:(i + 1) * self.probe]) for i in range(len(self.choices))]
            self.chosen = self.choices[per_choice.index(min(per_choice))]
            self.set_threads(self.chosen)

    def __call__(self, step: int, loss: float) -> None:
        now = self.clock()
        if step % self.every == 0:
            self._times = []
        self._times.append(now - self._last)
        self._last = now
        if len(self.choices) > 1:
            self._use(step + 1)


class WarmStartProgress:
    """The warm start as a person follows it, as ``on_step``: a line through ``log`` (the stage's echo: a Prefect run
    logger in a flow) at each tenth of the steps, and between tenths when ``every_s`` seconds passed without one:
    ``warm start: step 300/1000 | loss 0.412 | 0.12 s/step | ETA 1m24s (700 steps left)``; the last step's line says
    the whole: ``warm start: 1000 steps in 2m01s, loss 3.772 → 0.412``. ``report`` gets each line's figures too (the
    percentage done and the line), for the Prefect run's progress artifact; :meth:`start` reports 0 %."""

    def __init__(self, steps: int, log: Callable[[str], None], report: Report | None = None,
                 every_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.steps, self.log, self.report, self.every_s, self.clock = steps, log, report, every_s, clock
        self.pace = Pace(0, clock)
        self.first_loss: float | None = None
        self._last_line = self.pace.started_at
        self._tenth = 0

    def start(self) -> None:
        """Restart the clock (the model is built) and put the progress artifact at 0 %."""
        self.pace = Pace(0, self.clock)
        self._last_line = self.pace.started_at
        if self.report is not None:
            self.report(0.0, f"warm start: step 0/{self.steps}")

    def __call__(self, step: int, loss: float) -> None:
        done = step + 1
        if self.first_loss is None:
            self.first_loss = loss
        tenth = done * 10 // self.steps
        if done < self.steps and tenth == self._tenth and self.clock() - self._last_line < self.every_s:
            return
        self._tenth, self._last_line = tenth, self.clock()
        if done >= self.steps:
            seconds = self._last_line - self.pace.started_at
            parts = [f"{done} steps in {duration(seconds)}, loss {self.first_loss:.3f} → {loss:.3f}"]
        else:
            per_step = self.pace.seconds_per_step(done)
            parts = [f"step {done}/{self.steps}", f"loss {loss:.3f}", f"{per_step:.2f} s/step",
                     self.pace.eta(done, self.steps, per_step)]
        self.log("warm start: " + " | ".join(parts))
        if self.report is not None:
            self.report(100.0 * done / self.steps, "warm start: " + " · ".join(parts))
