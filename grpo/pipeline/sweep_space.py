"""Sweep search spaces over any config field, by dotted path; expanded and validated before anything runs.

A space is a mapping with a ``grid`` part, a ``random`` part, or both::

    grid:                                   # every combination (the last field varies fastest)
      grpo.learning_rate: [1.0e-4, 3.0e-4]
      grpo.beta: [0.0, 0.04]
    random:                                 # n_trials draws, deterministic for the seed
      n_trials: 4
      seed: 0
      params:
        grpo.learning_rate: {loguniform: [1.0e-5, 1.0e-3]}
        grpo.temperature: {uniform: [0.7, 1.2]}
        grpo.num_generations: {choice: [4, 8]}
        model.warm_start.steps: {int: [100, 300]}      # inclusive bounds

With both parts, every grid point is crossed with the same ``n_trials`` random draws (``len(grid) * n_trials``
trials), so grid values are compared on identical random settings. A field may appear in one part only.

:func:`expand_space` applies each trial's values to the base config and validates the result with the same rules as
a config file; a bad path or a combination the config rejects raises :class:`SpaceError` naming the trial and the
field. Paths follow :func:`grpo.config.flatten` (``async.*`` by its YAML name; free-form dict fields such as
``grpo.extra.<trl field>`` take any key). ``output_dir`` and ``tracking.*`` belong to the sweep and can not vary.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import random
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from grpo.config import ExperimentConfig, config_from_dict, flatten, preset_file, presets
from grpo.errors import ConfigError

DISTRIBUTIONS = ("loguniform", "uniform", "int", "choice")
RESERVED = ("output_dir", "tracking")  # the sweep decides where trials write and which MLflow experiment they use
_SPACE_KEYS = ("grid", "random")
_RANDOM_KEYS = ("n_trials", "seed", "params")


class SpaceError(ConfigError):
    """The search space is malformed, names an unknown field, or yields a config that does not validate."""


# ---------------------------------------------------------------- loading and structure


def load_space(path: str | Path) -> dict:
    """Read a space from a ``.yaml``/``.yml``/``.json`` file, or the packaged space preset of that name
    (``tiny-lr-beta``, see ``presets("spaces")``), and check its structure (not yet against a config)."""
    file = Path(path)
    if file.is_file():
        text, source, is_json = file.read_text(), str(file), file.suffix == ".json"
    elif str(path) in presets("spaces"):
        text, source, is_json = preset_file(str(path), "spaces").read_text(encoding="utf-8"), f"space preset {path}", False
    else:
        hint = f"; or a space preset: {', '.join(presets('spaces'))}" if "/" not in str(path) else ""
        raise SpaceError(f"space file not found: {file}{hint}")
    try:
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SpaceError(f"{source}: not valid {'JSON' if is_json else 'YAML'}: {first}") from None
    try:
        check_space(data)
    except SpaceError as err:
        raise SpaceError(f"{source}: {err}") from None
    return data


def check_space(space: Any) -> None:
    """Structure of a space (keys, distribution specs, bounds); field paths are checked by :func:`expand_space`."""
    if not isinstance(space, dict) or not space:
        raise SpaceError("space: expected a mapping with 'grid' and/or 'random'")
    unknown = [k for k in space if k not in _SPACE_KEYS]
    if unknown:
        raise SpaceError(f"space.{unknown[0]}: unknown key{_hint(str(unknown[0]), _SPACE_KEYS)}; valid: grid, random")
    if "grid" in space:
        grid = space["grid"]
        if not isinstance(grid, dict) or not grid:
            raise SpaceError("space.grid: expected a mapping of field path -> list of values")
        for field, values in grid.items():
            if not isinstance(values, list) or not values:
                raise SpaceError(f"space.grid.{field}: expected a non-empty list of values (got {values!r})")
    if "random" in space:
        rnd = space["random"]
        if not isinstance(rnd, dict):
            raise SpaceError("space.random: expected a mapping with n_trials, seed, params")
        unknown = [k for k in rnd if k not in _RANDOM_KEYS]
        if unknown:
            raise SpaceError(f"space.random.{unknown[0]}: unknown key{_hint(str(unknown[0]), _RANDOM_KEYS)}; "
                             f"valid: {', '.join(_RANDOM_KEYS)}")
        n = rnd.get("n_trials")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpaceError(f"space.random.n_trials: expected an integer >= 1 (got {n!r})")
        seed = rnd.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise SpaceError(f"space.random.seed: expected an integer (got {seed!r})")
        params = rnd.get("params")
        if not isinstance(params, dict) or not params:
            raise SpaceError("space.random.params: expected a mapping of field path -> distribution")
        for field, spec in params.items():
            _check_distribution(f"space.random.params.{field}", spec)
    both = set(space.get("grid") or {}) & set((space.get("random") or {}).get("params") or {})
    if both:
        raise SpaceError(f"space: {sorted(both)[0]} is in both grid and random; keep it in one")


def _check_distribution(where: str, spec: Any) -> None:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise SpaceError(f"{where}: expected one of {{{', '.join(f'{d}: ...' for d in DISTRIBUTIONS)}}} (got {spec!r})")
    (kind, arg), = spec.items()
    if kind not in DISTRIBUTIONS:
        raise SpaceError(f"{where}: unknown distribution {kind!r}{_hint(str(kind), DISTRIBUTIONS)}; "
                         f"valid: {', '.join(DISTRIBUTIONS)}")
    if kind == "choice":
        if not isinstance(arg, list) or not arg:
            raise SpaceError(f"{where}: choice needs a non-empty list of values (got {arg!r})")
        return
    if not isinstance(arg, list) or len(arg) != 2:
        raise SpaceError(f"{where}: {kind} needs [low, high] (got {arg!r})")
    if kind == "int":
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in arg) or arg[0] > arg[1]:
            raise SpaceError(f"{where}: int needs integers [low, high] with low <= high (got {arg!r})")
        return
    lo, hi = (_number(v) for v in arg)
    if lo is None or hi is None or not lo < hi:
        raise SpaceError(f"{where}: {kind} needs numbers [low, high] with low < high (got {arg!r})")
    if kind == "loguniform" and lo <= 0:
        raise SpaceError(f"{where}: loguniform needs 0 < low < high (got {arg!r})")


def _number(value: Any) -> float | None:
    """YAML reads ``1e-4`` (no dot) as a string; accept it as the number it means."""
    if isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _hint(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------- field paths


def _all_paths(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[str]:
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{field.alias or name}"
        sub = _section(field.annotation)
        out.extend(_all_paths(sub, key + ".") if sub else [key])
    return out


def _section(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _is_mapping(annotation: Any) -> bool:
    if annotation is dict or typing.get_origin(annotation) is dict:
        return True
    return any(_is_mapping(a) for a in typing.get_args(annotation))  # dict | None


def check_path(path: str) -> list[str]:
    """The path's parts if it names a config field (or a key inside a dict field); else :class:`SpaceError`."""
    if not isinstance(path, str) or not path or any(not p for p in path.split(".")):
        raise SpaceError(f"{path!r}: not a dotted field path like grpo.learning_rate")
    parts = path.split(".")
    if parts[0] in RESERVED:
        raise SpaceError(f"{path}: {parts[0]} is set by the sweep for every trial and can not vary")
    model: type[BaseModel] = ExperimentConfig
    for i, part in enumerate(parts):
        fields = {}
        for name, f in model.model_fields.items():
            fields[f.alias or name] = f
            fields.setdefault(name, f)
        if part not in fields:
            head = ".".join(parts[:i])
            options = [p for p in _all_paths() if p.startswith(head + ".")] if head else _all_paths()
            close = difflib.get_close_matches(path, options, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpaceError(f"{path}: unknown config field{hint}")
        field = fields[part]
        sub = _section(field.annotation)
        if sub is not None:
            model = sub
            continue
        if i < len(parts) - 1 and not _is_mapping(field.annotation):
            raise SpaceError(f"{path}: {'.'.join(parts[: i + 1])} is a value, not a section")
        break
    return ["async" if p == "async_" else p for p in parts]


def _set(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


# ---------------------------------------------------------------- expansion


def _sample(rng: random.Random, spec: dict) -> Any:
    (kind, arg), = spec.items()
    if kind == "choice":
        return arg[rng.randrange(len(arg))]
    if kind == "int":
        return rng.randint(int(arg[0]), int(arg[1]))
    lo, hi = float(arg[0]), float(arg[1])
    x = math.exp(rng.uniform(math.log(lo), math.log(hi))) if kind == "loguniform" else rng.uniform(lo, hi)
    return float(f"{x:.6g}")  # readable run params; still deterministic for the seed


def trial_overrides(space: dict) -> list[dict[str, Any]]:
    """The per-trial values (``{field path: value}``), in trial order; deterministic for the space (and its seed)."""
    check_space(space)
    grid = space.get("grid") or {}
    points: list[dict[str, Any]] = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())] or [{}]
    rnd = space.get("random")
    if not rnd:
        return points
    rng = random.Random(rnd.get("seed", 0))
    draws = [{field: _sample(rng, spec) for field, spec in rnd["params"].items()} for _ in range(rnd["n_trials"])]
    return [{**point, **draw} for point in points for draw in draws]


def expand_space(base: ExperimentConfig, space: dict) -> list[tuple[dict[str, Any], ExperimentConfig]]:
    """``[(trial_overrides, trial_config), ...]``: every trial's config built from ``base`` and validated now.

    Raises :class:`SpaceError` (a ``ValueError``) for a malformed space, an unknown field path (naming the field), or
    a trial whose config does not validate (naming the trial, its values and the failing field).
    """
    overrides = trial_overrides(space)
    fields = {f for trial in overrides for f in trial}
    parsed = {}
    for field in sorted(fields):
        try:
            parsed[field] = check_path(field)
        except SpaceError as err:
            raise SpaceError(f"space: {err}") from None
    base_data = base.model_dump(mode="json", by_alias=True)
    trials = []
    for index, values in enumerate(overrides):
        data = json.loads(json.dumps(base_data))
        for field, value in values.items():
            _set(data, parsed[field], value)
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        try:
            cfg = config_from_dict(data, source=f"trial {index} ({shown})")
        except ConfigError as err:
            raise SpaceError(str(err)) from None
        flat = flatten(cfg)  # the validated value ("3e-4" read from YAML -> 0.0003)
        trials.append(({k: flat.get(k, v) for k, v in values.items()}, cfg))
    return trials


__all__ = ["SpaceError", "load_space", "check_space", "check_path", "trial_overrides", "expand_space"]
