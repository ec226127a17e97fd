"""Run one benchmark: ``python -m benchmarks NAME``.

Each benchmark is a module ``benchmarks/NAME.py`` with a ``main() -> dict`` function. The result is printed as a
single JSON object on the last line of output, so scripts can ``tail -1 | jq``.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path


def available() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = available()
    if len(argv) != 1 or argv[0] not in names:
        print(f"usage: python -m benchmarks NAME  (NAME one of: {', '.join(names)})", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{argv[0]}")
    result = module.main()
    print(json.dumps({"benchmark": argv[0], **result}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
