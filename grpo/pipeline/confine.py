"""Path confinement for runs started from the Prefect UI (served deployments, #12.15).

``grpo serve`` sets :data:`ENV` to the allowed roots (the directory it was started in, plus each ``--allow-path`` and
the operator's ``GRPO_SERVE_ALLOW_PATHS``); its flow runs (subprocesses) inherit it, and the pipeline and sweep flows
refuse a config that reads or writes outside those roots. ``grpo run`` does not set it: a person at the shell may use
any path their account can.
"""

from __future__ import annotations

import os
from pathlib import Path

from grpo.errors import GRPOPlatformError

ENV = "GRPO_ALLOWED_ROOTS"  # os.pathsep-separated absolute directories; unset = no confinement
OPERATOR_ENV = "GRPO_SERVE_ALLOW_PATHS"  # extra roots the operator gives `grpo serve` (os.pathsep-separated)


class PathNotAllowed(GRPOPlatformError):
    """A served run's config names a path outside the allowed roots."""


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(path))))  # symlinks and '..' resolved, relative to cwd


def serve_roots(project_dir: Path, allow: list[Path] | None = None) -> list[Path]:
    """The roots ``grpo serve`` confines its flow runs to: ``project_dir``, ``--allow-path``s,
    ``$GRPO_SERVE_ALLOW_PATHS``."""
    extra = [p for p in os.environ.get(OPERATOR_ENV, "").split(os.pathsep) if p]
    roots: list[Path] = []
    for p in [project_dir, *(allow or []), *extra]:
        real = _real(p)
        if real not in roots:
            roots.append(real)
    return roots


def allowed_roots() -> list[Path] | None:
    value = os.environ.get(ENV)
    if value is None:
        return None
    return [_real(p) for p in value.split(os.pathsep) if p]


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or root in path.parents for root in roots)


def config_paths(cfg) -> dict[str, str]:
    """The config's filesystem paths by field: where runs are written, and local files read."""
    paths = {"output_dir": cfg.output_dir}
    source = cfg.data.source
    if not (source.startswith("synthetic:") or source.startswith("hub:")):
        paths["data.source"] = source
    name = cfg.model.name_or_path
    if name != "tiny" and (name.startswith(("/", ".", "~")) or Path(name).exists()):
        paths["model.name_or_path"] = name  # a local model directory (a hub id otherwise)
    if cfg.model.chat_template_file is not None:
        paths["model.chat_template"] = cfg.model.chat_template
    return paths


def check_config_paths(cfg, roots: list[Path] | None = None) -> None:
    """:class:`PathNotAllowed` naming the field and the allowed roots when a path leaves them; no-op when no roots
    are configured (not a served run)."""
    roots = allowed_roots() if roots is None else roots
    if roots is None:
        return
    for field, value in config_paths(cfg).items():
        if not _inside(_real(value), roots):
            raise PathNotAllowed(
                f"{field} {value!r} is outside the allowed roots ({', '.join(map(str, roots)) or 'none'}); runs "
                f"started from the Prefect UI may only read and write there (`grpo serve --allow-path DIR` or "
                f"{OPERATOR_ENV} adds a root)")
