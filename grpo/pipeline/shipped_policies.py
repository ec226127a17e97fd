"""The warm-started tiny models that ship with the package (``grpo/presets/policies/``), one per tiny preset: a
preset's first run copies its model into the cache instead of warm-starting one (1000 supervised steps cost more
than the preset's GRPO training). Any other config (another seed, model size, data or environment) builds its own.

``python -m grpo.pipeline.shipped_policies`` rebuilds them after a change to a tiny preset, its data or environment,
or the warm start (a new cache key): each preset's model built as a first run builds it, into a fresh cache, copied
here, and the folders no preset names any more removed. ``--check`` builds them and says whether the shipped ones
are the same bytes, without writing.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from grpo.config import ExperimentConfig, load_config, preset_file, presets
from grpo.console import quiet_library_noise
from grpo.pipeline.prep import load_prepared
from grpo.pipeline.stages import cached_prep
from grpo.training.policy import build_tiny_policy, shipped_policies, tiny_policy_entry

# The package's folder, written into: a maintainer runs this from a checkout (an editable install's package is it).
SHIPPED = Path(str(shipped_policies()))


def tiny_presets() -> list[ExperimentConfig]:
    """The presets whose model is the tiny one, as a first run loads them (read as YAML first: a hub model's preset
    may not load here, e.g. without vLLM)."""
    return [load_config(name) for name in presets()
            if (yaml.safe_load(preset_file(name).read_text()).get("model") or {}).get("name_or_path") == "tiny"]


def entry_names(configs: list[ExperimentConfig]) -> dict[str, str]:
    """Preset name -> its model's cache entry (``tiny-<key>``), the folder it ships in."""
    return {cfg.name: tiny_policy_entry(cfg, load_prepared(cached_prep(cfg)["data_dir"])).name for cfg in configs}


def build(configs: list[ExperimentConfig], cache: Path) -> dict[str, Path]:
    """Each config's model built into the fresh ``cache`` (nothing shipped is read): preset name -> entry."""
    os.environ["GRPO_CACHE_DIR"] = str(cache)
    out = {}
    for cfg in configs:
        data = load_prepared(Path(cached_prep(cfg)["data_dir"]))
        record = build_tiny_policy(cfg, data, log=lambda line, name=cfg.name: print(f"{name}: {line}"),
                                   use_shipped=False)
        assert record["origin"] == "built", record
        out[cfg.name] = Path(record["source"])
    return out


def _same(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    return names == sorted(p.name for p in b.iterdir()) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.pipeline.shipped_policies",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="build and compare with the shipped models; write nothing")
    args = parser.parse_args(argv)
    quiet_library_noise()
    configs = tiny_presets()
    with tempfile.TemporaryDirectory(prefix="grpo-shipped-") as cache:
        built = build(configs, Path(cache))
        if args.check:
            stale = [name for name, entry in built.items()
                     if not (SHIPPED / entry.name).is_dir() or not _same(entry, SHIPPED / entry.name)]
            print(f"differ or missing: {', '.join(stale)}" if stale else "the shipped models are the built ones")
            return 1 if stale else 0
        SHIPPED.mkdir(exist_ok=True)
        keep = {entry.name for entry in built.values()}
        for old in SHIPPED.iterdir():
            if old.is_dir() and old.name not in keep:
                shutil.rmtree(old)
        for name, entry in built.items():
            shutil.rmtree(SHIPPED / entry.name, ignore_errors=True)
            shutil.copytree(entry, SHIPPED / entry.name)
            print(f"{name}: {SHIPPED / entry.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
