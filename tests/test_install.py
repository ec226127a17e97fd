"""The pinned install: what is installed is exactly what constraints.txt names, and every install path uses it."""

from __future__ import annotations

import re
import subprocess
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
KEY_PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "tokenizers", "mlflow", "prefect",
                "pydantic", "numpy", "pandas", "fastapi", "pytest")


def pins(lock: Path) -> dict[str, str]:
    """``name -> version`` of the lock's lines whose environment marker holds here."""
    out = {}
    for line in lock.read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)\s*(?:;\s*(.+))?", line.strip())
        if match and (match[3] is None or Marker(match[3]).evaluate()):
            out[canonicalize_name(match[1])] = match[2]
    return out


def test_installed_versions_are_the_locked_ones():
    locked = pins(REPO / "constraints.txt")
    assert set(map(canonicalize_name, KEY_PACKAGES)) <= set(locked)
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions()}
    # Every locked package that is installed has the locked version (torch's local label, e.g. +cpu, aside).
    wrong = {name: (installed[name], pin) for name, pin in locked.items()
             if name in installed and Version(installed[name]).public != Version(pin).public}
    assert not wrong, f"installed != constraints.txt (run `make install`, or `make lock` after editing ranges): {wrong}"
    missing = [name for name in map(canonicalize_name, KEY_PACKAGES) if name not in installed]
    assert not missing


def test_lock_satisfies_pyproject_and_names_no_index():
    """The lock is what `make lock` resolves from pyproject.toml's ranges; no index URL or registry host anywhere."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    locked = pins(REPO / "constraints.txt")
    extras = project["optional-dependencies"]
    specs = project["dependencies"] + extras["test"]
    # the test extra names other extras of the project (`grpo-platform[team]`): their requirements are locked too
    specs += [s for spec in extras["test"] if Requirement(spec).name == project["name"]
              for extra in Requirement(spec).extras for s in extras[extra]]
    for spec in specs:
        req = Requirement(spec)
        if req.name == project["name"]:
            continue
        assert req.specifier.contains(locked[canonicalize_name(req.name)], prereleases=True), (spec, locked[req.name])
    gpu = pins(REPO / "constraints-gpu.txt")  # resolved for the GPU image (Python 3.12, linux x86_64): no markers
    assert {"vllm", "torch", "trl"} <= set(gpu) and gpu["trl"] == locked["trl"]
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    for name in tracked:
        path = REPO / name
        if path.suffix in {".txt", ".toml", ".sh", ".yaml", ".yml", ".json", ""} or "Dockerfile" in name:
            text = path.read_text(errors="ignore") if path.is_file() else ""
            assert not re.search(r"(index-url|INDEX_URL)\S*\s*[= ]\s*\"?https?://|download\.pytorch\.org|pypi\.org",
                                 text), name


def test_every_install_path_uses_the_lock():
    makefile = (REPO / "Makefile").read_text()
    assert "infra/install.sh" in makefile and "constraints.txt" in makefile and "upgrade-lock:" in makefile
    assert "make test" in (REPO / ".ci" / "run").read_text()
    script = (REPO / "infra" / "install.sh").read_text()
    assert '-c "$LOCK"' in script and "uv==" in script
    for name, lock in (("Dockerfile.cpu", "constraints.txt"), ("Dockerfile.gpu", "constraints-gpu.txt")):
        text = (REPO / "infra" / "docker" / name).read_text()
        assert "infra/install.sh" in text and lock in text, name



def test_the_wheel_ships_the_presets(tmp_path):
    """Presets are package data (read with importlib.resources, never from the source tree): a wheel built from this
    tree holds every experiment and space preset and the tiny presets' warm-started models, so `--config tiny` works
    from an installed package (and its first run copies its model instead of training one)."""
    import shutil
    import sys
    import zipfile

    from grpo.config import presets

    src = tmp_path / "src"  # a copy: building in place would leave build/ and *.egg-info in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for package in ("grpo", "flows", "dashboards"):
        shutil.copytree(REPO / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                            "--no-index", "-q", "-w", str(tmp_path / "dist")], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = ({f"grpo/presets/{n}.yaml" for n in presets()}
                | {f"grpo/presets/spaces/{n}.yaml" for n in presets("spaces")}
                | {str(f.relative_to(REPO)) for f in (REPO / "grpo" / "presets" / "policies").glob("*/*")})
    assert len(expected) >= 3 and expected <= names, sorted(expected - names)
