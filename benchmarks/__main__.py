"""Run one benchmark: ``python -m benchmarks NAME [--smoke]``.

Each benchmark is a module ``benchmarks/NAME.py`` with a ``main(smoke: bool = False) -> dict`` function. The result is
printed as a single JSON object on the last line of output, so scripts can ``tail -1 | jq``. ``--smoke`` runs the same
code path with tiny sizes (a few steps, one round) in seconds to a minute, so the test suite can run every benchmark
(``tests/test_benchmarks.py``); its figures say nothing about performance. ``BENCH_*`` variables override the sizes
in both modes.
"""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
import sys
from pathlib import Path


def available() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = available()
    smoke = "--smoke" in argv
    args = [a for a in argv if a != "--smoke"]
    if len(args) != 1 or args[0] not in names:
        print(f"usage: python -m benchmarks NAME [--smoke]  (NAME one of: {', '.join(names)})", file=sys.stderr)
        return 2
    name = args[0]
    module = importlib.import_module(f"benchmarks.{name}")
    from grpo.console import quiet_library_noise

    quiet_library_noise()  # the console's filters: no per-file load bars or harmless library warnings in the output
    if smoke and "smoke" not in inspect.signature(module.main).parameters:
        print(f"benchmark {name} has no smoke mode: give it main(smoke: bool = False)", file=sys.stderr)
        return 2
    try:
        result = module.main(smoke=True) if smoke else module.main()
    except ValueError as e:  # a bad BENCH_* value: one line, no traceback
        print(f"benchmark {name}: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"benchmark": name, **result, "smoke": smoke}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
