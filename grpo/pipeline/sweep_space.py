"""Sweep search spaces over any config field, by dotted path, as Optuna distributions, samplers and pruners.

A space names a sampler, the fields it varies and optionally a pruner::

    sampler: tpe                              # grid | random | tpe (Optuna's TPESampler)
    n_trials: 6                               # new trials per invocation (a grid: every combination, once)
    seed: 0                                   # the sampler's seed
    startup_trials: 3                         # tpe only: random trials before TPE models the study (Optuna: 10)
    params:
      grpo.learning_rate: {loguniform: [1.0e-5, 1.0e-3]}   # FloatDistribution(log=True)
      grpo.temperature: {uniform: [0.7, 1.2]}              # FloatDistribution
      model.warm_start.steps: {int: [100, 300]}            # IntDistribution, inclusive bounds
      grpo.num_generations: {choice: [4, 8]}               # CategoricalDistribution (a plain list means the same)
    pruner:                                   # optional; stops bad trials from their intermediate values
      type: median                            # median (MedianPruner) | hyperband (HyperbandPruner) | none
      metric: reward                          # a trainer metric reported at every logging step (default reward)
      direction: maximize                     # how that metric improves (default maximize)
      n_startup_trials: 2                     # median: n_startup_trials, n_warmup_steps, interval_steps, n_min_trials
                                              # hyperband: min_resource, max_resource, reduction_factor

With ``sampler: grid`` each param is a list of values and an invocation runs every combination once, in product order
(the last field varies fastest). The earlier forms still load: ``grid: {field: [values]}`` is ``sampler: grid`` and
``random: {n_trials, seed, params}`` is ``sampler: random``; the two together (grid points crossed with the same random
draws) are refused with a message saying how to write it now.

What is own code here, and why: the space file format and its one-line errors (Optuna has no file format), field
paths (a sweep varies this platform's config, by the paths :func:`grpo.config.flatten` uses) and the checks of the
configs a space yields before anything runs. Sampling, pruning and their state are Optuna's. A grid is run by
enqueuing every combination (``Study.enqueue_trial``) rather than with ``GridSampler``: this flow drives Optuna with
ask/tell, where ``GridSampler.after_trial`` calls ``Study.stop()`` (which only works inside ``Study.optimize``), and a
continued grid study would get random repeats; the sweep enqueues only the points its study has not run yet
(:mod:`grpo.pipeline.sweep`).

:func:`validate_space` checks a space against a base config now: field paths (an unknown one is named, with the
closest valid path), every grid combination, and every distribution's bounds and choices one field at a time (a
combination that only fails together fails that trial when sampled, not the sweep). ``output_dir`` and ``tracking.*``
belong to the sweep and can not vary.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from grpo.config import ExperimentConfig, config_from_dict, flatten, preset_file, presets
from grpo.errors import ConfigError

SAMPLERS = ("grid", "random", "tpe")
DISTRIBUTIONS = ("loguniform", "uniform", "int", "choice")
PRUNERS = {  # type -> the options it takes (besides type, metric, direction)
    "none": (),
    "median": ("n_startup_trials", "n_warmup_steps", "interval_steps", "n_min_trials"),
    "hyperband": ("min_resource", "max_resource", "reduction_factor"),
}
DIRECTIONS = ("maximize", "minimize")
RESERVED = ("output_dir", "tracking")  # the sweep decides where trials write and which MLflow experiment they use
_SPACE_KEYS = ("sampler", "n_trials", "seed", "startup_trials", "params", "pruner")
_LEGACY_KEYS = ("grid", "random")
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
        text, source, is_json = (preset_file(str(path), "spaces").read_text(encoding="utf-8"), f"space preset {path}",
                                 False)
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


def normalize_space(space: Any) -> dict:
    """The space in its current form (``sampler``, ``n_trials``, ``seed``, ``params``, ``pruner``), its structure
    checked; :class:`SpaceError` naming the key otherwise. Field paths are checked by :func:`validate_space`."""
    if not isinstance(space, dict) or not space:
        raise SpaceError("space: expected a mapping with sampler (grid, random, tpe) and params")
    legacy = [k for k in space if k in _LEGACY_KEYS]
    if legacy:
        return _normalize(_from_legacy(space))
    return _normalize(space)


def check_space(space: Any) -> None:
    """Structure of a space (keys, sampler, distribution specs, bounds, pruner); raises :class:`SpaceError`."""
    normalize_space(space)


def _from_legacy(space: dict) -> dict:
    other = [k for k in space if k not in _LEGACY_KEYS]
    if other:
        raise SpaceError(f"space.{other[0]}: not allowed next to grid/random; write the space with sampler: "
                         f"{'|'.join(SAMPLERS)} and params")
    if "grid" in space and "random" in space:
        raise SpaceError("space: grid and random together (grid points crossed with the same random draws) are no "
                         "longer supported; use sampler: grid with a list per field, or sampler: random|tpe with "
                         "{choice: [...]} for the grid's fields")
    if "grid" in space:
        grid = space["grid"]
        if not isinstance(grid, dict) or not grid:
            raise SpaceError("space.grid: expected a mapping of field path -> list of values")
        for name, values in grid.items():
            if not isinstance(values, list) or not values:
                raise SpaceError(f"space.grid.{name}: expected a non-empty list of values (got {values!r})")
        return {"sampler": "grid", "params": grid}
    rnd = space["random"]
    if not isinstance(rnd, dict):
        raise SpaceError("space.random: expected a mapping with n_trials, seed, params")
    unknown = [k for k in rnd if k not in _RANDOM_KEYS]
    if unknown:
        raise SpaceError(f"space.random.{unknown[0]}: unknown key{_hint(str(unknown[0]), _RANDOM_KEYS)}; "
                         f"valid: {', '.join(_RANDOM_KEYS)}")
    try:
        return _normalize({"sampler": "random", **rnd})
    except SpaceError as err:  # name the keys as the file does
        raise SpaceError(str(err).replace("space.", "space.random.", 1)) from None


def _normalize(space: dict) -> dict:
    unknown = [k for k in space if k not in _SPACE_KEYS]
    if unknown:
        raise SpaceError(f"space.{unknown[0]}: unknown key{_hint(str(unknown[0]), _SPACE_KEYS + _LEGACY_KEYS)}; "
                         f"valid: {', '.join(_SPACE_KEYS)}")
    sampler = space.get("sampler")
    if sampler not in SAMPLERS:
        raise SpaceError(f"space.sampler: {sampler!r} is not a sampler{_hint(str(sampler), SAMPLERS)}; "
                         f"valid: {', '.join(SAMPLERS)}")
    params = space.get("params")
    if not isinstance(params, dict) or not params:
        raise SpaceError("space.params: expected a mapping of field path -> "
                         + ("list of values" if sampler == "grid" else "distribution"))
    seed = space.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise SpaceError(f"space.seed: expected an integer (got {seed!r})")
    out: dict[str, Any] = {"sampler": sampler, "seed": seed, "params": {}}
    if sampler == "grid":
        if "n_trials" in space:
            raise SpaceError("space.n_trials: a grid runs every combination once; leave n_trials out")
        for name, values in params.items():
            if not isinstance(values, list) or not values:
                raise SpaceError(f"space.params.{name}: a grid needs a non-empty list of values (got {values!r})")
            out["params"][name] = [_maybe_number(v) for v in values]
        out["n_trials"] = math.prod(len(v) for v in out["params"].values())
    else:
        n = space.get("n_trials")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpaceError(f"space.n_trials: expected an integer >= 1 (got {n!r})")
        out["n_trials"] = n
        for name, spec in params.items():
            out["params"][name] = _check_distribution(f"space.params.{name}", spec)
    if "startup_trials" in space:
        startup = space["startup_trials"]
        if sampler != "tpe":
            raise SpaceError(f"space.startup_trials: only for sampler: tpe (this space's sampler is {sampler})")
        if isinstance(startup, bool) or not isinstance(startup, int) or startup < 0:
            raise SpaceError(f"space.startup_trials: expected an integer >= 0 (got {startup!r})")
        out["startup_trials"] = startup
    out["pruner"] = _check_pruner(space.get("pruner"))
    return out


def _check_distribution(where: str, spec: Any) -> dict:
    if isinstance(spec, list):  # a plain list: a choice
        spec = {"choice": spec}
    if not isinstance(spec, dict) or len(spec) != 1:
        raise SpaceError(f"{where}: expected one of {{{', '.join(f'{d}: ...' for d in DISTRIBUTIONS)}}} (got {spec!r})")
    (kind, arg), = spec.items()
    if kind not in DISTRIBUTIONS:
        raise SpaceError(f"{where}: unknown distribution {kind!r}{_hint(str(kind), DISTRIBUTIONS)}; "
                         f"valid: {', '.join(DISTRIBUTIONS)}")
    if kind == "choice":
        if not isinstance(arg, list) or not arg:
            raise SpaceError(f"{where}: choice needs a non-empty list of values (got {arg!r})")
        return {"choice": [_maybe_number(v) for v in arg]}
    if not isinstance(arg, list) or len(arg) != 2:
        raise SpaceError(f"{where}: {kind} needs [low, high] (got {arg!r})")
    if kind == "int":
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in arg) or arg[0] > arg[1]:
            raise SpaceError(f"{where}: int needs integers [low, high] with low <= high (got {arg!r})")
        return {"int": list(arg)}
    lo, hi = (_number(v) for v in arg)
    if lo is None or hi is None or not lo < hi:
        raise SpaceError(f"{where}: {kind} needs numbers [low, high] with low < high (got {arg!r})")
    if kind == "loguniform" and lo <= 0:
        raise SpaceError(f"{where}: loguniform needs 0 < low < high (got {arg!r})")
    return {kind: [lo, hi]}


def _check_pruner(spec: Any) -> dict | None:
    if spec is None:
        return None
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict):
        raise SpaceError(f"space.pruner: expected a mapping with type ({', '.join(PRUNERS)}) (got {spec!r})")
    kind = spec.get("type")
    if kind not in PRUNERS:
        raise SpaceError(f"space.pruner.type: {kind!r} is not a pruner{_hint(str(kind), PRUNERS)}; "
                         f"valid: {', '.join(PRUNERS)}")
    if kind == "none":
        if len(spec) > 1:
            raise SpaceError(f"space.pruner.{next(k for k in spec if k != 'type')}: pruner none takes no options")
        return None
    valid = ("type", "metric", "direction", *PRUNERS[kind])
    unknown = [k for k in spec if k not in valid]
    if unknown:
        raise SpaceError(f"space.pruner.{unknown[0]}: unknown option of the {kind} pruner"
                         f"{_hint(str(unknown[0]), valid)}; valid: {', '.join(valid)}")
    metric = spec.get("metric", "reward")
    if not isinstance(metric, str) or not metric:
        raise SpaceError(f"space.pruner.metric: expected a trainer metric name such as reward (got {metric!r})")
    direction = spec.get("direction", "maximize")
    if direction not in DIRECTIONS:
        raise SpaceError(f"space.pruner.direction: {direction!r}; valid: {', '.join(DIRECTIONS)}")
    for key in PRUNERS[kind]:
        value = spec.get(key)
        if value is None or (key == "max_resource" and value == "auto"):
            continue
        lowest = 2 if key == "reduction_factor" else 0 if key in ("n_startup_trials", "n_warmup_steps") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise SpaceError(f"space.pruner.{key}: expected an integer >= {lowest}"
                             f"{' or auto' if key == 'max_resource' else ''} (got {value!r})")
    return {"type": kind, "metric": metric, "direction": direction,
            **{k: spec[k] for k in PRUNERS[kind] if spec.get(k) is not None}}


def _number(value: Any) -> float | None:
    """YAML reads ``1e-4`` (no dot) as a string; accept it as the number it means."""
    if isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _maybe_number(value: Any) -> Any:
    """A grid/choice value: YAML's ``1e-4`` string as the float it means (a config string that reads as a number
    would be converted back by the config's own validation); everything else as it is."""
    if isinstance(value, str) and _number(value) is not None and any(c.isdigit() for c in value):
        return float(value)
    return value


def _hint(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------- field paths


def _all_paths(model: type[BaseModel] = ExperimentConfig, prefix: str = "") -> list[str]:
    out = []
    for name, f in model.model_fields.items():
        key = f"{prefix}{f.alias or name}"
        sub = _section(f.annotation)
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
        f = fields[part]
        sub = _section(f.annotation)
        if sub is not None:
            model = sub
            continue
        if i < len(parts) - 1 and not _is_mapping(f.annotation):
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


# ---------------------------------------------------------------- the validated space


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


@dataclass
class Space:
    """A space checked against a base config: Optuna's sampler, pruner and distributions for it, and the trial
    config for a set of values. Build it with :func:`validate_space`."""

    sampler_kind: str
    n_trials: int
    seed: int
    params: dict[str, Any]
    pruner_spec: dict | None
    startup_trials: int | None
    base_data: dict
    paths: dict[str, list[str]]
    encoded: set[str] = field(default_factory=set)  # choice fields of lists/dicts, JSON strings in Optuna

    @property
    def fields(self) -> list[str]:
        return list(self.params)

    def grid_points(self) -> list[dict[str, Any]]:
        """A grid's combinations in product order (the last field varies fastest)."""
        return [dict(zip(self.params, combo)) for combo in itertools.product(*self.params.values())]

    def distributions(self) -> dict[str, Any]:
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        out = {}
        for name, spec in self.params.items():
            if self.sampler_kind == "grid":
                spec = {"choice": spec}
            (kind, arg), = spec.items()
            if kind == "choice":
                out[name] = CategoricalDistribution([self._encode(name, v) for v in arg])
            elif kind == "int":
                out[name] = IntDistribution(arg[0], arg[1])
            else:
                out[name] = FloatDistribution(arg[0], arg[1], log=kind == "loguniform")
        return out

    def _encode(self, name: str, value: Any) -> Any:
        return json.dumps(value, sort_keys=True) if name in self.encoded else value

    def decode(self, params: dict[str, Any]) -> dict[str, Any]:
        """Optuna's param values as config values (choices of lists/dicts are JSON strings in Optuna)."""
        return {k: json.loads(v) if k in self.encoded and isinstance(v, str) else v for k, v in params.items()}

    def sampler(self):
        import optuna

        if self.sampler_kind == "tpe":
            startup = {} if self.startup_trials is None else {"n_startup_trials": self.startup_trials}
            return optuna.samplers.TPESampler(seed=self.seed, **startup)
        return optuna.samplers.RandomSampler(seed=self.seed)  # a grid's trials are enqueued: it never samples them

    def pruner(self):
        import optuna

        spec = self.pruner_spec
        if spec is None:
            return optuna.pruners.NopPruner()
        options = {k: v for k, v in spec.items() if k not in ("type", "metric", "direction")}
        if spec["type"] == "median":
            return optuna.pruners.MedianPruner(**options)
        return optuna.pruners.HyperbandPruner(**options)

    def enqueue_grid(self, study, points: list[dict[str, Any]] | None = None) -> None:
        """Enqueue ``points`` (default: every grid combination), in order, for the study's next asks."""
        for point in self.grid_points() if points is None else points:
            study.enqueue_trial({k: self._encode(k, v) for k, v in point.items()})

    def suggest(self, trial) -> dict[str, Any]:
        """The trial's values (config values), sampled (or taken from the enqueued grid point) by Optuna."""
        from optuna.distributions import CategoricalDistribution, IntDistribution

        values = {}
        for name, dist in self.distributions().items():
            if isinstance(dist, CategoricalDistribution):
                values[name] = trial.suggest_categorical(name, dist.choices)
            elif isinstance(dist, IntDistribution):
                values[name] = trial.suggest_int(name, dist.low, dist.high)
            else:
                values[name] = trial.suggest_float(name, dist.low, dist.high, log=dist.log)
        return self.decode(values)

    def config(self, values: dict[str, Any], source: str) -> tuple[dict[str, Any], ExperimentConfig]:
        """(the values as the config validated them, the trial's config); :class:`SpaceError` naming ``source``."""
        data = json.loads(json.dumps(self.base_data))
        for name, value in values.items():
            _set(data, self.paths[name], value)
        shown = ", ".join(f"{k}={v!r}" for k, v in values.items())
        try:
            cfg = config_from_dict(data, source=f"{source} ({shown})")
        except ConfigError as err:
            raise SpaceError(str(err)) from None
        flat = flatten(cfg)  # the validated value ("3e-4" read from YAML -> 0.0003)
        return {k: flat.get(k, v) for k, v in values.items()}, cfg


def validate_space(base: ExperimentConfig, space: dict) -> Space:
    """The space checked against ``base`` before anything runs: structure, field paths, every grid combination,
    every distribution's bounds and choices (one field at a time, the others at the base config's values).

    Raises :class:`SpaceError` (a ``ValueError``) naming the field (and the grid trial or value) that fails.
    """
    norm = normalize_space(space)
    paths = {}
    for name in sorted(norm["params"]):
        try:
            paths[name] = check_path(name)
        except SpaceError as err:
            raise SpaceError(f"space: {err}") from None
    encoded = {name for name, spec in norm["params"].items()
               if not all(_scalar(v) for v in (spec if norm["sampler"] == "grid" else spec.get("choice", [])))}
    out = Space(norm["sampler"], norm["n_trials"], norm["seed"], norm["params"], norm["pruner"],
                norm.get("startup_trials"), base.model_dump(mode="json", by_alias=True), paths, encoded)
    if out.sampler_kind == "grid":
        for index, point in enumerate(out.grid_points()):
            out.config(point, f"trial {index}")
        return out
    for name, spec in out.params.items():
        (kind, arg), = spec.items()
        for value in arg:
            out.config({name: value}, f"space.params.{name}")
    return out


__all__ = ["SpaceError", "Space", "load_space", "check_space", "normalize_space", "check_path", "validate_space",
           "SAMPLERS", "PRUNERS", "DISTRIBUTIONS"]
