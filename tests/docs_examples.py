"""The code blocks of the docs (docs/**/*.md) and README.md, and the checks that run them (tests/test_docs.py).

A fenced block's language says what it is: ``bash`` (commands), ``python``, ``yaml``, ``json`` are examples and are
run or checked; ``text`` (output), ``chart`` (a chart's points, drawn and checked by the docs build) and ``mermaid``
(the README's picture) are not. A block whose first line is a comment naming a file (``# my_rewards.py``,
``# my-space.yaml``) is written to that file first, so the commands of the same pages use it as a reader would. An
HTML comment on the line before a block changes what is done with it:

- ``<!-- docs-test: skip REASON -->``: not run (a GPU, your own files, a running team setup), the reason in the page;
- ``<!-- docs-test: exit N -->``: its commands run for real and must exit N; a ``text`` block right after it is
  the output they must print (the troubleshooting page's errors).

Commands: ``grpo`` commands that only read (``--help``, ``validate``, ``rewards``, ``environments``) run for real,
in this process through Typer's test runner; the others (training, sweeps, servers) are parsed by the real Typer app
(every option exists, every value converts) and their ``--config``/``--set``/``--space`` load as the command would
load them. ``make`` targets must exist, ``torchrun``/``accelerate launch`` check the ``grpo`` command they launch,
``python -m`` modules and benchmarks must exist, ``prefect worker start --pool`` must name a work pool of
``infra/work-pools``. Any other command fails: mark it with its reason instead.

Run as ``python tests/docs_examples.py WORKDIR``: it runs every block with WORKDIR as the current folder (the files
are written there) and prints one line per failing block, ``page:line: what failed``; exit 1 if any failed.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE_LANGUAGES = {"bash", "python", "yaml", "json"}
OTHER_LANGUAGES = {"text", "chart", "mermaid"}
REAL_COMMANDS = {"validate", "rewards", "environments"}
SPACE_KEYS = {"sampler", "n_trials", "seed", "startup_trials", "params", "pruner", "grid", "random"}
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARKER = re.compile(r"^\s*<!-- docs-test: (skip|exit) ?(.*?) -->\s*$")
_FILE_COMMENT = re.compile(r"^#\s*([\w.-]+\.(?:py|yaml|yml|json))\s*$")


@dataclass
class Block:
    page: str
    line: int
    language: str
    text: str
    marker: str | None = None  # "skip" or "exit"
    argument: str = ""  # the reason of a skip, the code of an exit
    output: str | None = None  # the ``text`` block right after an ``exit`` block
    end: int = 0  # the line after the closing fence

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def file_name(self) -> str | None:
        first = self.text.split("\n", 1)[0]
        match = _FILE_COMMENT.match(first)
        return match.group(1) if match and self.language in ("python", "yaml", "json") else None


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of one page, in order, each with the marker on the line before it."""
    lines = path.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        indent, language = fence.group(1), fence.group(2)
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^{indent}```\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        before = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = _MARKER.match(before)
        block = Block(str(path.relative_to(ROOT)), i + 1, language, "\n".join(body),
                      marker.group(1) if marker else None, marker.group(2) if marker else "")
        if out and out[-1].marker == "exit" and out[-1].output is None and language == "text" \
                and all(not lines[k].strip() for k in range(out[-1].end, i)):
            out[-1].output = block.text
        block.end = j + 1
        out.append(block)
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    return [b for page in pages() for b in blocks_of(page)]


# ---------------------------------------------------------------------------------------------------------- commands

def logical_lines(text: str) -> list[str]:
    """The block's commands: continuation lines joined, blank and comment-only lines left out."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line for line in joined.split("\n") if line.strip() and not line.strip().startswith("#")]


class Checker:
    def __init__(self, workdir: Path) -> None:
        import typer
        from typer.testing import CliRunner

        from grpo.app import cli

        self.workdir = workdir
        self.cli = cli
        self.root = typer.main.get_command(cli.app)
        self.runner = CliRunner()
        self.make_targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
        self.failures: list[str] = []

    def fail(self, block: Block, message: str) -> None:
        self.failures.append(f"{block.where}: {message}")

    # ---- files, python, yaml, json
    def write_files(self, blocks: list[Block]) -> None:
        written: dict[str, Block] = {}
        for block in blocks:
            name = block.file_name
            if name is None or block.marker == "skip":
                continue
            if name in written and written[name].text != block.text:
                self.fail(block, f"{name} is also written, differently, at {written[name].where}")
            written[name] = block
            (self.workdir / name).write_text(block.text + "\n", encoding="utf-8")

    def python(self, block: Block) -> None:
        from grpo.rewards import load_reward_module

        try:
            if block.file_name:  # a module people pass with --reward-module / --env-module: imported as those do
                load_reward_module(self.workdir / block.file_name)
            else:
                exec(compile(block.text, block.where, "exec"), {"__name__": "__docs__"})
        except Exception as err:  # noqa: BLE001 - any error is the block's failure
            self.fail(block, f"python: {type(err).__name__}: {err}")

    def yaml(self, block: Block) -> None:
        import yaml

        from grpo.config import load_config

        try:
            data = yaml.safe_load(block.text)
            path = self.workdir / (block.file_name or "_docs_block.yaml")
            if not block.file_name:
                path.write_text(block.text, encoding="utf-8")
            if isinstance(data, dict) and data and set(data) <= SPACE_KEYS:
                from grpo.pipeline.sweep_space import load_space, validate_space

                validate_space(load_config("tiny"), load_space(path))
            else:
                load_config(path)
        except Exception as err:  # noqa: BLE001
            self.fail(block, f"yaml: {err}")

    def json(self, block: Block) -> None:
        try:
            data = json.loads(block.text)
        except ValueError as err:
            self.fail(block, f"json: {err}")
            return
        if isinstance(data, dict) and "preset" in data:  # a pipeline run's parameters through Prefect's API
            unknown = sorted(set(data) - flow_parameters("grpo_pipeline"))
            if unknown:
                self.fail(block, f"json: not parameters of the grpo-pipeline flow: {unknown}")

    # ---- commands
    def commands(self, block: Block) -> None:
        for line in logical_lines(block.text):
            try:
                words = shlex.split(line, comments=True)
            except ValueError as err:
                self.fail(block, f"{line!r}: {err}")
                continue
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words.pop(0)  # environment assignments before the command
            if words:
                message = self.command(words, block)
                if message:
                    self.fail(block, f"{' '.join(words)}: {message}")

    def command(self, words: list[str], block: Block) -> str | None:
        name, args = words[0], words[1:]
        if name == "grpo":
            return self.grpo(args, block)
        if name == "export":
            bad = [a for a in args if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", a)]
            return f"not NAME=VALUE: {bad}" if bad else None
        if name == "make":
            missing = [t for t in args if "=" not in t and t not in self.make_targets]
            return f"no such make target: {missing}" if missing else None
        if name == "torchrun" or words[:2] == ["accelerate", "launch"]:
            if "-m" not in args or args[args.index("-m") + 1] != "grpo":
                return "launches no `-m grpo` command"
            return self.grpo(args[args.index("-m") + 2:], block, parse_only=True)
        if name == "python" and args[:1] == ["-m"]:
            module = args[1]
            if module == "benchmarks":
                return None if (ROOT / "benchmarks" / f"{args[2]}.py").is_file() else f"no benchmark {args[2]!r}"
            import importlib.util

            return None if importlib.util.find_spec(module) else f"no module {module!r}"
        if words[:3] == ["prefect", "worker", "start"]:
            pool = args[args.index("--pool") + 1] if "--pool" in args else None
            return None if pool and (ROOT / "infra" / "work-pools" / f"{pool}.json").is_file() \
                else f"no work pool {pool!r} in infra/work-pools"
        return "no rule runs or checks this command: mark the block `<!-- docs-test: skip REASON -->`"

    def grpo(self, args: list[str], block: Block, parse_only: bool = False) -> str | None:
        command, path, rest = self.root, ["grpo"], list(args)
        while hasattr(command, "commands") and rest and rest[0] in command.commands:
            command = command.commands[rest[0]]
            path.append(rest.pop(0))
        real = not parse_only and (block.marker == "exit" or "--help" in rest or hasattr(command, "commands")
                                   or path[-1] in REAL_COMMANDS)
        if real:
            return self.run_for_real(args, block)
        try:
            ctx = command.make_context(path[-1], rest)
        except Exception as err:  # noqa: BLE001 - click's usage errors: an unknown option, a bad value
            return f"{type(err).__name__}: {getattr(err, 'message', err)}"
        params = ctx.params
        if params.get("config"):
            try:
                config = self.cli._load(params["config"], params.get("set_"), params.get("reward_module"),
                                        params.get("env_module"))
            except Exception as err:  # noqa: BLE001
                if "vllm is not installed" in str(err):  # the GPU preset: valid, its extra is not installed here
                    return None
                return f"config: {err}"
            if params.get("space"):
                from grpo.pipeline.sweep_space import load_space, validate_space

                try:
                    validate_space(config, load_space(params["space"]))
                except Exception as err:  # noqa: BLE001
                    return f"space: {err}"
        return None

    def run_for_real(self, args: list[str], block: Block) -> str | None:
        result = self.runner.invoke(self.cli.app, args)
        expected = int(block.argument) if block.marker == "exit" else 0
        output = result.output.strip()
        if result.exit_code != expected:
            return f"exit {result.exit_code}, expected {expected}: {output[-600:]}"
        if block.output is not None and output != block.output.strip():
            return f"printed {output!r}, the page shows {block.output.strip()!r}"
        if not output:
            return "printed nothing"
        return None

    def run(self, blocks: list[Block]) -> list[str]:
        examples = [b for b in blocks if b.language in EXAMPLE_LANGUAGES and b.marker != "skip"]
        self.write_files(examples)
        for kind in ("python", "yaml", "json", "bash"):  # modules before the configs and commands that name them
            for block in (b for b in examples if b.language == kind):
                {"python": self.python, "yaml": self.yaml, "json": self.json, "bash": self.commands}[kind](block)
        return self.failures


def flow_parameters(function: str) -> set[str]:
    """The parameters of a flow function of flows/pipeline.py, read from its source (no Prefect import)."""
    tree = ast.parse((ROOT / "flows" / "pipeline.py").read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    return {a.arg for a in node.args.args + node.args.kwonlyargs}


def main(workdir: str) -> int:
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    failures = Checker(Path(workdir)).run(all_blocks())
    for line in failures:
        print(line)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv[1]))
