"""The docs site's reference pages, generated from the code they describe so they cannot go stale.

``docs/hooks.py`` (the MkDocs hook) puts :func:`config_reference` and :func:`cli_reference` into the pages that name
them; ``tests/test_docs.py`` checks the same output against the schema and the Typer app. The config page comes from
:class:`grpo.config.ExperimentConfig`'s JSON schema (the descriptions are the fields' attribute docstrings, and for
``grpo`` fields without one, ``trl.GRPOConfig``'s help: what the Prefect form shows) and the presets' YAML files as
written (a preset's value is shown where it differs from the default; the GPU preset loads only where vLLM is
installed, so its file is read, not validated). The CLI page comes from the Typer app's commands, options and help.
"""

from __future__ import annotations

import html
from collections.abc import Iterator
from typing import Any

import typer
import yaml

from grpo.config import ExperimentConfig, preset_file, presets
from grpo.formatting import human_number

TYPE_NAMES = {"integer": "int", "number": "float", "boolean": "bool", "string": "str", "object": "mapping",
              "array": "list", "null": "null"}


def _ref_name(prop: dict[str, Any]) -> str | None:
    """The ``$defs`` name a property points to (a section), directly or through ``anyOf``."""
    ref = prop.get("$ref") or next((a["$ref"] for a in prop.get("anyOf", []) if "$ref" in a), None)
    return ref.rsplit("/", 1)[-1] if ref else None


def config_fields(schema: dict[str, Any] | None = None) -> Iterator[tuple[str, dict[str, Any], bool]]:
    """Every config field as ``(dotted key, its JSON-schema property, is_section)``, in the schema's order."""
    schema = schema or ExperimentConfig.model_json_schema()
    defs = schema.get("$defs", {})

    def walk(node: dict[str, Any], prefix: str) -> Iterator[tuple[str, dict[str, Any], bool]]:
        for name, prop in node.get("properties", {}).items():
            key = prefix + (prop.get("alias") or name)
            section = _ref_name(prop)
            yield key, prop, section is not None
            if section is not None:
                yield from walk(defs[section], key + ".")

    return walk(schema, "")


def _type_name(prop: dict[str, Any]) -> str:
    if "enum" in prop:
        return " \\| ".join(f"`{v}`" for v in prop["enum"])
    if "const" in prop:
        return f"`{prop['const']}`"
    if "anyOf" in prop:
        return " \\| ".join(_type_name(p) for p in prop["anyOf"])
    if "type" in prop:
        kind = TYPE_NAMES.get(prop["type"], prop["type"])
        if kind == "list" and isinstance(prop.get("items"), dict) and prop["items"]:
            return f"list of {_type_name(prop['items'])}"
        return kind
    return "any"


def _value(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        text = {True: "true", False: "false", None: "null"}[value]
    elif isinstance(value, float):
        text = human_number(value)
    elif isinstance(value, (dict, list)):
        text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    else:
        text = str(value)
    return f"`{text}`"


def _flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value and all(isinstance(k, str) for k in value) and key != "extra":
            out.update(_flat(value, f"{prefix}{key}."))
        out[f"{prefix}{key}"] = value
    return out


def preset_values() -> dict[str, dict[str, Any]]:
    """Each packaged preset's settings as its YAML file writes them, by dotted key."""
    return {name: _flat(yaml.safe_load(preset_file(name).read_text()) or {}) for name in presets()}


def _cell(text: str) -> str:
    """One table cell of plain text: one line, pipes escaped, and outside code spans ``<``/``>``/``&`` as entities
    and ``*`` escaped (``'<run name>-merged'`` would be read as an HTML tag, ``'#### (.*)'`` as emphasis)."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(html.escape(p, quote=False).replace("*", "\\*") if i % 2 == 0 else p for i, p in enumerate(parts))


TABLE_HEAD = ["| field | type | default | description |", "| --- | --- | --- | --- |"]


def config_reference() -> str:
    """Markdown: one table per config section, each field with its type, default and description, and the presets
    that set another value."""
    by_preset = preset_values()
    fields = list(config_fields())
    sections = {key for key, _, is_section in fields if is_section}
    lines: list[str] = []
    top: list[str] = []
    for key, prop, is_section in fields:
        if is_section:
            lines += ["", f"## `{key}`", "", _cell(prop.get("description", "")), "", *TABLE_HEAD]
            continue
        default = prop.get("default")
        differs = [f"{name}: {_value(values[key])}" for name, values in by_preset.items()
                   if key in values and key not in sections and values[key] != default]
        presets_note = f"<br>*Presets:* {'; '.join(differs)}" if differs else ""
        row = (f"| `{key}` | {_type_name(prop)} | {_value(default) if 'default' in prop else 'required'} | "
               f"{_cell(prop.get('description', ''))}{presets_note} |")
        (lines if "." in key else top).append(row)
    return "\n".join(["## Top level", "", *TABLE_HEAD] + top + lines) + "\n"


def cli_commands() -> Iterator[tuple[str, Any, Any]]:
    """Every command of the ``grpo`` app as ``(full name, click command, its context)``, groups before their
    subcommands."""
    from grpo.app.cli import app

    root = typer.main.get_command(app)

    def walk(command: Any, name: str, parent: Any) -> Iterator[tuple[str, Any, Any]]:
        ctx = command.make_context(name.rsplit(" ", 1)[-1], [], parent=parent, resilient_parsing=True)
        yield name, command, ctx
        for sub_name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, f"{name} {sub_name}", ctx)

    return walk(root, "grpo", None)


def cli_reference() -> str:
    """Markdown: each command's usage, help and options, as ``grpo COMMAND --help`` prints them."""
    lines: list[str] = []
    for name, command, ctx in cli_commands():
        level = "#" * min(2 + name.count(" "), 4)
        lines += ["", f"{level} `{name}`" if name != "grpo" else "## `grpo`", "",
                  "```text", command.get_usage(ctx), "```", "", (command.help or "").strip(), ""]
        records = [r for r in (p.get_help_record(ctx) for p in command.params) if r]
        if records:
            lines += ["| option | what it does |", "| --- | --- |"]
            lines += [f"| `{opts}` | {_cell(help_text)} |" for opts, help_text in records]
    return "\n".join(lines).lstrip("\n") + "\n"
