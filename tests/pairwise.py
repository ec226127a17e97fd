"""A deterministic greedy all-pairs (pairwise) design with constraints.

Running every combination of a dozen options is thousands of trainings; most feature interactions are between two
options, so a design where every pair of option values appears together at least once catches them with a few
dozen rows. ``allowed`` says which (partial) combinations may be built; pairs that no allowed row can hold are
returned separately so the caller can check that each is refused (or documented) rather than silently untested.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

Row = dict[str, Any]
Pair = tuple[tuple[str, Any], tuple[str, Any]]


def all_pairs(options: dict[str, list[Any]]) -> set[Pair]:
    names = list(options)
    return {((a, va), (b, vb)) for a, b in itertools.combinations(names, 2) for va in options[a] for vb in options[b]}


def pairs_of(row: Row, names: list[str]) -> set[Pair]:
    present = [n for n in names if n in row]
    return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(present, 2)}


def pairwise_design(options: dict[str, list[Any]], allowed: Callable[[Row], bool]) -> tuple[list[Row], set[Pair]]:
    """Rows covering every pair that some allowed row can hold, and the pairs no allowed row holds.

    Greedy: seed each row with the first uncovered pair, then give every other option the value that covers most
    uncovered pairs while the partial row stays allowed (ties: the first value listed, so the design is
    deterministic). ``allowed`` must accept partial rows (it sees only the options set so far).
    """
    names = list(options)
    uncovered = {p for p in sorted(all_pairs(options), key=repr) if allowed(dict(p))}
    impossible = all_pairs(options) - uncovered
    rows: list[Row] = []
    while uncovered:
        seed = min(uncovered, key=lambda p: (names.index(p[0][0]), names.index(p[1][0]), repr(p)))
        row = _complete(dict(seed), names, options, allowed, uncovered)
        if row is None:  # the seed pair fits no full row: not coverable after all
            uncovered.discard(seed)
            impossible.add(seed)
            continue
        rows.append(row)
        uncovered -= pairs_of(row, names)
    return rows, impossible


def _complete(row: Row, names: list[str], options: dict[str, list[Any]], allowed: Callable[[Row], bool],
              uncovered: set[Pair]) -> Row | None:
    """Fill the unset options greedily, backtracking (depth first) when a partial row admits no value."""
    todo = [n for n in names if n not in row]
    if not todo:
        return row if allowed(row) else None
    name = todo[0]

    def gain(value: Any) -> int:
        trial = {**row, name: value}
        return sum(1 for other in trial if other != name and _key(name, value, other, trial[other], names) in uncovered)

    for value in sorted(options[name], key=lambda v: -gain(v)):  # stable sort: ties keep the listed order
        trial = {**row, name: value}
        if allowed(trial):
            done = _complete(trial, names, options, allowed, uncovered)
            if done is not None:
                return done
    return None


def _key(a: str, va: Any, b: str, vb: Any, names: list[str]) -> Pair:
    return ((a, va), (b, vb)) if names.index(a) < names.index(b) else ((b, vb), (a, va))
