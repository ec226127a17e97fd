#!/usr/bin/env bash
# Install the project into a virtualenv with the exact versions of the lock (constraints.txt), fast.
#
#   infra/install.sh                     # .venv, the `test` extra (what `make install` runs)
#   VENV=/opt/venv EXTRAS= infra/install.sh
#   LOCK=constraints-gpu.txt EXTRAS=gpu TORCH= infra/install.sh   # GPU image: torch comes with vLLM's pin
#
# uv (pinned below) installs when pip can install it, plain pip otherwise; both read the same lock. The CPU build of
# torch goes in first, so nothing later asks for a CUDA build: uv takes it from the wheel folder that pip is
# configured with (PIP_FIND_LINKS / pip's `find-links`, as on this project's machines); without one, pip installs
# torch through its own configuration (your index or mirror). No index URL is written here: set UV_INDEX_URL /
# PIP_INDEX_URL (and their EXTRA_ variants) for your mirror.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS-test}
LOCK=${LOCK:-constraints.txt}
TORCH=${TORCH-torch==2.13.0}
UV_VERSION=0.13.9

target=.
[ -n "$EXTRAS" ] && target=".[$EXTRAS]"
py=$VENV/bin/python
[ -x "$py" ] || "$PYTHON" -m venv "$VENV"

find_links=${UV_FIND_LINKS:-${PIP_FIND_LINKS:-$("$py" -m pip config get global.find-links 2>/dev/null || true)}}

if "$py" -m pip install --quiet --disable-pip-version-check "uv==$UV_VERSION" 2>/dev/null; then
  # --compile-bytecode: .pyc files written now, in parallel, as pip does by default; without them every first import
  # of torch/transformers/mlflow/prefect compiles them (several seconds in each of the first processes to start).
  uv=("$VENV/bin/uv" pip install --quiet --compile-bytecode --python "$py" -c "$LOCK")
  if [ -n "$TORCH" ]; then
    if [ -n "$find_links" ]; then
      "${uv[@]}" --find-links "$find_links" "$TORCH"
    else
      "$py" -m pip install --quiet -c "$LOCK" "$TORCH"
    fi
  fi
  "${uv[@]}" -e "$target"
else
  echo "uv is not installable here: installing with pip (slower)" >&2
  [ -n "$TORCH" ] && "$py" -m pip install --quiet -c "$LOCK" "$TORCH"
  "$py" -m pip install --quiet -c "$LOCK" -e "$target"
fi
