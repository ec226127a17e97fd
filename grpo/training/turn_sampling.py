"""Sampling one turn of a batch of episodes with transformers' ``generate``: each row stops where its turn stops, and
what later turns sample does not depend on where the batch stopped.

The episode runner (:func:`grpo.environments.episodes.run_episodes`) cuts every turn at its first stop string or
end-of-sequence token, so tokens sampled past that point are thrown away: a turn that samples the episode's whole
remaining budget spends most of its time on them (multi-turn ``guess_digit`` on an H200: 8.2 s a step).
:class:`TurnStop` ends each row of ``generate``'s batch at its turn's stop string or its own budget, as ``eos_token_id``
ends it at the end-of-sequence token; the batch goes on for the other rows.

The random stream. Sampling draws one set of random numbers per decoding step for the whole batch (the same amount
whichever rows are finished: ``torch.multinomial`` draws for every row), and ``generate`` stops drawing when every row
has stopped. So a row's tokens up to its stop are the same whether the batch stops there or runs on to the budget, but
how many numbers the turn draws, and so the state the next turn starts from, depends on where the batch stopped. (It
already did before rows stopped at their stop strings: ``generate`` ends once every row has written the
end-of-sequence token, and a row went on sampling past its stop string until then; the state after a turn depended on
tokens that were then thrown away.) :func:`turn_random_state` takes that dependence out: a turn samples from the
generator's state at its start, as before, and afterwards the generator is re-seeded from a hash of that start state,
whatever the turn drew. So an episode's kept tokens and log-probs are the same with or without stopping, a round's
first turn is what it was before this change, and later turns follow from the seed alone, on every rank (each rank
keeps its own stream: TRL seeds ranks apart).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria

TAIL_MARGIN = 8
"""Tokens a stop string may span beyond one per character (tokens that decode to no text: special tokens, a piece
of a multi-byte character), so that the tail :class:`TurnStop` decodes still holds a stop the newest token ends."""


class TurnStop(StoppingCriteria):
    """Stops each row of a ``generate`` batch at the end of its turn: once the text of its ids after ``start`` (the
    prompt's padded width) contains one of ``stops``, or once it has generated ``limits[i]`` ids (its episode's
    budget left, when the rows of a turn have different ones). ``ends[i]`` is then the number of ids row ``i``
    generated, the token that completed the stop included (the shortest prefix holding a stop: where the episode
    runner cuts the turn). A row is never stopped at an end-of-sequence token here (``generate``'s ``eos_token_id``
    does that); ``eos_token_ids`` only spares decoding it after one. ``row_stops`` gives each row its own stop strings
    instead (``grpo serve-model`` batches calls that each name theirs).

    Cheap per step: only rows still running are decoded, and only their last ids (the longest stop's characters plus
    :data:`TAIL_MARGIN`), since a new stop must end in the newest token; a hit is confirmed on the row's whole text,
    once, so a row stops exactly where the runner cuts it. Not transformers' ``stop_strings``: that one probes the
    vocabulary with text the tiny character tokenizer cannot encode."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], start: int, limits: Sequence[int],
                 eos_token_ids: Sequence[int] = (), row_stops: Sequence[Sequence[str]] | None = None) -> None:
        self.tokenizer, self.stops, self.start = tokenizer, tuple(s for s in stops if s), start
        self.limits = list(limits)
        self.row_stops = [tuple(s for s in row if s) for row in row_stops] if row_stops is not None else None
        every = self.stops if self.row_stops is None else tuple(s for row in self.row_stops for s in row)
        self.window = max(map(len, every), default=0) + TAIL_MARGIN
        self.eos = set(eos_token_ids)
        self.ends: list[int | None] = [None] * len(self.limits)
        self._running = list(range(len(self.limits)))

    def _decode(self, ids: list[list[int]]) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        generated = input_ids.shape[1] - self.start
        if self._running and generated > 0:
            tails = input_ids[self._running, -min(self.window, generated):].tolist()
            if self.window > TAIL_MARGIN:
                texts = self._decode(tails)
                hits = [i for i, t in zip(self._running, texts) if any(s in t for s in self._stops(i))]
                if hits:
                    whole = self._decode(input_ids[hits, self.start:].tolist())
                    for i, t in zip(hits, whole):
                        if any(s in t for s in self._stops(i)):
                            self.ends[i] = generated
            for i in self._running:
                if self.ends[i] is None and generated >= self.limits[i]:
                    self.ends[i] = generated
            self._running = [i for i, tail in zip(self._running, tails)
                             if self.ends[i] is None and tail[-1] not in self.eos]
        return torch.tensor([e is not None for e in self.ends], dtype=torch.bool, device=input_ids.device)

    def _stops(self, row: int) -> tuple[str, ...]:
        return self.stops if self.row_stops is None else self.row_stops[row]

    @classmethod
    def needed(cls, tokenizer: Any, stops: Sequence[str], start: int, limits: Sequence[int],
               eos_token_ids: Sequence[int] = (),
               row_stops: Sequence[Sequence[str]] | None = None) -> TurnStop | None:
        """The criterion for a turn, or None when ``generate``'s own ``max_new_tokens`` (``max(limits)``) and EOS
        already end every row where its turn ends (no stop strings, one budget)."""
        if not any(stops) and not any(row_stops or ()) and len(set(limits)) <= 1:
            return None
        return cls(tokenizer, stops, start, limits, eos_token_ids, row_stops=row_stops)


def _default_generator(device: torch.device) -> torch.Generator | None:
    """The generator ``torch.multinomial`` draws from on ``device`` (None: a device type without default
    generators, which keeps sampling on its global stream as before)."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    generators = getattr(module, "default_generators", None)
    if not generators:
        return None
    return generators[device.index if device.index is not None else module.current_device()]


@contextlib.contextmanager
def turn_random_state(device: torch.device | str) -> Iterator[None]:
    """Sample a turn on ``device``'s default generator, then re-seed it from a hash of its state at the start: the
    state after the turn does not depend on how many numbers the turn drew (where the batch stopped); see the
    module docstring. The hash is of the generator's state bytes (a CPU tensor for every device): no kernel runs."""
    generator = _default_generator(torch.device(device))
    if generator is None:
        yield
        return
    start = generator.get_state()
    yield
    digest = hashlib.blake2b(start.numpy().tobytes(), digest_size=8).digest()
    generator.manual_seed(int.from_bytes(digest, "little") >> 1)


def trim(rows: list[list[int]], stop: TurnStop | None, eos_token_ids: Sequence[int]) -> list[int]:
    """Each generated row's length to keep: through its first end-of-sequence token or where ``stop`` ended it,
    whichever comes first (the ids after that are padding)."""
    eos = set(eos_token_ids)
    ends = []
    for i, row in enumerate(rows):
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        if stop is not None and stop.ends[i] is not None:
            end = min(end, stop.ends[i])
        ends.append(end)
    return ends


__all__ = ["TurnStop", "trim", "turn_random_state"]
