"""The docs' pipeline diagram (``<!-- diagram: pipeline -->``): an SVG drawn at build time, in the page, so it shows
offline (a mermaid block needs mermaid.js from a CDN) and takes the theme's colours (``docs/stylesheets/extra.css``:
light and dark schemes).

Its stages are read from the code, not written here: the order from the recipe's calls of its stage runner
(``grpo/pipeline/recipe.py``), each name from the Prefect subflow that runs it (``flow_run_name`` in ``flows/``, the
name the console and the Prefect UI show). A renamed, added or moved stage is in the next build's picture; one the
code no longer maps to a subflow fails the build with a line saying which.
"""

from __future__ import annotations

import ast
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "grpo" / "pipeline" / "recipe.py"
FLOWS = ROOT / "flows"
# What each stage does, under its name; a stage missing here is drawn with its name alone.
NOTES = {"prep": "validate, quarantine", "plan": "prompt schedule", "policy": "build or copy",
         "eval-before": "accuracy, pass@k", "train": "GRPO on TRL", "eval-after": "accuracy, pass@k"}
SOURCE = ("preset or YAML config", "grpo run / the Prefect form")
GROUP = "one Prefect flow run: grpo-pipeline"
OUTPUTS = (("one MLflow run", "params, metrics, model"), ("runs/<name>/", "checkpoints, summary.json"))

NAME_SIZE, NOTE_SIZE, GROUP_SIZE = 14, 12, 12
CHAR = 0.58  # a character's width per font size: generous for the system sans-serif fonts the site uses
STAGE_H, GAP, PAD, GROUP_TOP, MARGIN, ARROW = 50, 26, 14, 30, 2, 34

def stage_names() -> list[str]:
    """The pipeline's stages in the order a run makes them, by their subflow runs' names (``eval-{tag}`` with the
    recipe's tag: ``eval-before``, ``eval-after``)."""
    run_names = _flow_run_names()
    flow_of = _prefect_stage_flows()
    recipe = ast.parse(RECIPE.read_text(encoding="utf-8"))
    body = next(node for node in ast.walk(recipe) if isinstance(node, ast.FunctionDef) and node.name == "_stages")
    calls = sorted((node for node in ast.walk(body) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "stages" and node.func.attr != "finished"),
                   key=lambda node: (node.lineno, node.col_offset))
    names = []
    for call in calls:
        method = call.func.attr
        if method not in flow_of or flow_of[method] not in run_names:
            raise ValueError(f"docs/pipeline_diagram.py: the recipe's stage {method!r} runs no named subflow in "
                             f"flows/pipeline.py PrefectStages (known: {sorted(flow_of)})")
        tags = [arg.value for arg in call.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        names.append(run_names[flow_of[method]].format(tag=tags[-1] if tags else ""))
    if not names:
        raise ValueError("docs/pipeline_diagram.py: no stage calls found in grpo/pipeline/recipe.py _stages")
    return names


def _flow_run_names() -> dict[str, str]:
    """Each ``@flow(flow_run_name=...)`` function of ``flows/``: its run-name template."""
    names = {}
    for path in FLOWS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef):
                for decorator in node.decorator_list:
                    if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "flow":
                        for keyword in decorator.keywords:
                            if keyword.arg == "flow_run_name" and isinstance(keyword.value, ast.Constant):
                                names[node.name] = keyword.value.value
    return names


def _prefect_stage_flows() -> dict[str, str]:
    """Each stage-runner method of ``PrefectStages`` (``flows/pipeline.py``): the function it calls that ends in
    ``_flow``, the subflow that runs the stage."""
    module = ast.parse((FLOWS / "pipeline.py").read_text(encoding="utf-8"))
    runner = next(node for node in module.body if isinstance(node, ast.ClassDef) and node.name == "PrefectStages")
    flows = {}
    for method in runner.body:
        if isinstance(method, ast.FunctionDef):
            called = [node.func.id for node in ast.walk(method) if isinstance(node, ast.Call)
                      and isinstance(node.func, ast.Name) and node.func.id.endswith("_flow")]
            if called:
                flows[method.name] = called[0]
    return flows


def _width(text: str, size: int) -> float:
    return len(text) * size * CHAR


def _text(x: float, y: float, text: str, css: str) -> str:
    return f'<text class="{css}" x="{x:.0f}" y="{y:.0f}" text-anchor="middle">{escape(text)}</text>'


def _arrow(x1: float, y1: float, x2: float, y2: float) -> str:
    """A straight arrow, its head a triangle (a marker would not take the theme's colour everywhere)."""
    length = ((x2 - x1) ** 2 + (y2 - y1) ** 2) ** 0.5
    ux, uy = (x2 - x1) / length, (y2 - y1) / length
    bx, by = x2 - 8 * ux, y2 - 8 * uy
    head = f"{x2:.1f},{y2:.1f} {bx - 4 * uy:.1f},{by + 4 * ux:.1f} {bx + 4 * uy:.1f},{by - 4 * ux:.1f}"
    return (f'<line class="arrow" x1="{x1:.1f}" y1="{y1:.1f}" x2="{bx:.1f}" y2="{by:.1f}"/>'
            f'<polygon class="head" points="{head}"/>')


def _two_lines(x: float, y: float, w: float, h: float, title: str, note: str, title_css: str) -> str:
    cx = x + w / 2
    return _text(cx, y + h / 2 - 3, title, title_css) + _text(cx, y + h / 2 + 14, note, "note")


def pipeline_svg() -> str:
    """The diagram: the config into the flow run's stages, left to right, and the flow run into its MLflow run and
    its run directory."""
    stages = stage_names()
    widths = [max(_width(name, NAME_SIZE), _width(NOTES.get(name, ""), NOTE_SIZE)) + 14 for name in stages]
    group_x, group_w = MARGIN, sum(widths) + GAP * (len(stages) - 1) + 2 * PAD
    source_w = max(_width(SOURCE[0], NAME_SIZE), _width(SOURCE[1], NOTE_SIZE)) + 24
    source_y = MARGIN
    group_y = source_y + STAGE_H + ARROW
    stage_y = group_y + GROUP_TOP
    group_h = GROUP_TOP + STAGE_H + PAD
    store_y = group_y + group_h + ARROW
    store_h = STAGE_H + 10
    width, height = group_x + group_w + MARGIN, store_y + store_h + MARGIN

    parts = [f'<rect class="group" x="{group_x}" y="{group_y}" width="{group_w:.0f}" height="{group_h}" rx="8"/>',
             # at the right: the config's arrow comes down at the left
             f'<text class="group-label" x="{group_x + group_w - PAD:.0f}" y="{group_y + 20}" text-anchor="end">'
             f"{escape(GROUP)}</text>"]
    x = group_x + PAD
    centres = []
    for i, (name, w) in enumerate(zip(stages, widths)):
        if i:
            parts.append(_arrow(x - GAP, stage_y + STAGE_H / 2, x, stage_y + STAGE_H / 2))
        note = NOTES.get(name)
        label = (_two_lines(x, stage_y, w, STAGE_H, name, note, "stage-name") if note
                 else _text(x + w / 2, stage_y + STAGE_H / 2 + 5, name, "stage-name"))
        parts.append(f'<g class="stage"><rect x="{x:.0f}" y="{stage_y}" width="{w:.0f}" height="{STAGE_H}" rx="6"/>'
                     f"{label}</g>")
        centres.append(x + w / 2)
        x += w + GAP

    source_x = max(MARGIN, centres[0] - source_w / 2)
    parts.append(f'<g class="box"><rect x="{source_x:.0f}" y="{source_y}" width="{source_w:.0f}" height="{STAGE_H}" '
                 f'rx="6"/>{_two_lines(source_x, source_y, source_w, STAGE_H, *SOURCE, "title")}</g>')
    parts.append(_arrow(centres[0], source_y + STAGE_H, centres[0], stage_y))

    # the outputs under the flow run, spread over its width, each a cylinder (a store)
    slot = group_w / len(OUTPUTS)
    for i, (title, note) in enumerate(OUTPUTS):
        w = max(_width(title, NAME_SIZE), _width(note, NOTE_SIZE)) + 24
        cx = group_x + slot * (i + 0.5)
        sx, ry = cx - w / 2, 7
        body = (f"M{sx:.1f},{store_y + ry} V{store_y + store_h - ry} A{w / 2:.1f},{ry} 0 0 0 {sx + w:.1f},"
                f"{store_y + store_h - ry} V{store_y + ry}")
        parts.append(f'<g class="store"><path d="{body}"/><ellipse cx="{cx:.1f}" cy="{store_y + ry}" rx="{w / 2:.1f}" '
                     f'ry="{ry}"/>{_two_lines(sx, store_y + ry, w, store_h - ry, title, note, "title")}</g>')
        parts.append(_arrow(cx, group_y + group_h, cx, store_y))

    summary = f"{SOURCE[0]} → {GROUP}: {' → '.join(stages)} → {OUTPUTS[0][0]} and {OUTPUTS[1][0]}"
    return (f'<svg class="grpo-diagram" role="img" viewBox="0 0 {width:.0f} {height:.0f}" '
            f'xmlns="http://www.w3.org/2000/svg" style="max-width:{width:.0f}px"><title>{escape(summary)}</title>'
            f"{''.join(parts)}</svg>")
