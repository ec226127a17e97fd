"""Things selectable by registered name (rewards, environments, tools): one registry mechanism for all of them.

Configs name things; they never hold import strings. Code gets into a registry only through what whoever installs or
launches the platform chooses, never through a value a UI user types:

* registration in the platform's own modules (the built-ins);
* an entry-point group of an installed package (``name = "pkg.module:object"``);
* a local Python file named on the command line (``--reward-module``, ``--env-module``), imported by path;
* such files listed in an environment variable (separated by ``os.pathsep``), so worker processes, the async
  generator and flow runs served from the Prefect UI find the same names as the CLI.

Entry points and the environment variable are read once, on the first lookup, so importing a registry costs
nothing. A file is imported once per process, whichever registry or option names it first, so one file may register
rewards, environments and tools together.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Generic, TypeVar

from grpo.errors import ConfigError

T = TypeVar("T")

# Files imported by any registry, by resolved path: a second registry (or option) naming the same file gets the
# module already run, instead of running its registrations twice.
_FILES: dict[Path, ModuleType] = {}


class Registry(Generic[T]):
    """Named objects of one kind (``kind`` names it in messages: "reward" -> "unknown reward 'x'; registered
    rewards: ...").

    ``entry_point_group``: the installed packages' group; ``modules_env``: the environment variable listing files;
    ``module_prefix``: the ``sys.modules`` name prefix of imported files (worker processes import a file under the
    same name, so its functions unpickle by reference); ``on_register(name, obj)``: called on registration, e.g. to
    name a function after its registered name.
    """

    def __init__(
        self,
        kind: str,
        *,
        entry_point_group: str,
        modules_env: str,
        module_prefix: str,
        on_register: Callable[[str, T], None] | None = None,
    ) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self.modules_env = modules_env
        self.module_prefix = module_prefix
        self._on_register = on_register
        self._entries: dict[str, T] = {}
        self._external_loaded = False

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: make the object selectable by ``name``; a second object under the same name is refused."""

        def deco(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered by {self._entries[name].__module__}")
            if self._on_register is not None:
                self._on_register(name, obj)
            self._entries[name] = obj
            return obj

        return deco

    def _load_external(self) -> None:
        if self._external_loaded:
            return
        self._external_loaded = True
        for ep in importlib.metadata.entry_points(group=self.entry_point_group):
            if ep.name not in self._entries:
                self.register(ep.name)(ep.load())
        for path in filter(None, os.environ.get(self.modules_env, "").split(os.pathsep)):
            self.load_module(path, source=self.modules_env)

    def load_module(self, path: str | Path, source: str) -> list[str]:
        """Import a local Python file so its registrations join the registry; returns the names it added here.
        ``source`` names where the path came from, for the error message."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{source}: file not found: {path}")
        before = set(self._entries)
        module_name = f"{self.module_prefix}{path.stem}"
        loaded = sys.modules.get(module_name)
        if path.resolve() in _FILES or (
            loaded is not None and Path(getattr(loaded, "__file__", "")).resolve() == path.resolve()
        ):
            return []  # already imported (e.g. named by both the option and the environment variable)
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{source}: cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # so worker processes can unpickle its functions
        try:
            spec.loader.exec_module(module)
        except Exception as err:  # the user's code: any error is theirs to fix, named in one line
            sys.modules.pop(module_name, None)
            raise ConfigError(f"{source}: importing {path} failed: {type(err).__name__}: {err}") from None
        _FILES[path.resolve()] = module
        return sorted(set(self._entries) - before)

    def names(self) -> list[str]:
        """Every registered name: built-ins, entry points and the environment variable's files."""
        self._load_external()
        return sorted(self._entries)

    def get(self, name: str) -> T:
        """The object registered as ``name``; an unknown name is one line naming the valid ones."""
        self._load_external()
        if name not in self._entries:
            raise ConfigError(f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(self.names())}")
        return self._entries[name]
