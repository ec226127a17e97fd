"""The docs site and the README stay true: every example runs, the reference pages are the schema's and the app's.

- Every fenced command, Python, YAML and JSON block of docs/ and README.md is run or checked as a reader would use it
  (``tests/docs_examples.py`` says how, block by block), in a process and folder of its own: a renamed flag, field,
  preset or make target fails here.
- ``mkdocs build --strict`` builds the site as ``make docs`` does (a broken link, nav entry or API reference fails),
  and its generated pages hold every config field with its description and every command and option of the app.
- Every config field has a description (the reference and the Prefect form show it), and every platform metric the
  metrics page names is one the code logs.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs_examples import EXAMPLE_LANGUAGES, OTHER_LANGUAGES, ROOT, all_blocks

README_MAX_LINES = 150


@pytest.mark.integration  # a process of its own
def test_every_example_in_the_docs_and_the_readme_runs(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "docs_examples.py"), str(tmp_path)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "GRPO_ENV_MODULES": "",
                                 "GRPO_REWARD_MODULES": ""})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_every_code_block_says_what_it_is():
    """A block's language decides whether it is run: one without a known language would silently go unchecked."""
    blocks = all_blocks()
    assert len([b for b in blocks if b.language in EXAMPLE_LANGUAGES]) > 40
    unknown = [f"{b.where}: ```{b.language}" for b in blocks if b.language not in EXAMPLE_LANGUAGES | OTHER_LANGUAGES]
    assert not unknown, f"give these blocks a language ({sorted(EXAMPLE_LANGUAGES | OTHER_LANGUAGES)}): {unknown}"
    bad = [b.where for b in blocks if (b.marker == "skip" and not b.argument)
           or (b.marker == "exit" and not b.argument.isdigit())]
    assert not bad, f"a skip needs its reason, an exit its code: {bad}"


def _text(page: Path) -> str:
    """A built page's text, tags dropped, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", page.read_text(encoding="utf-8"))).split())


def _plain(markdown: str) -> str:
    return " ".join(markdown.replace("`", "").replace("\\|", "|").split())


@pytest.mark.integration  # mkdocs in a process of its own
def test_the_site_builds_strictly_and_its_reference_pages_are_the_schema_and_the_app(tmp_path):
    from grpo.app.reference import cli_commands, config_fields

    site = tmp_path / "site"
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-4000:]

    config_page = _text(site / "reference" / "config" / "index.html")
    missing = [key for key, prop, _ in config_fields()
               if f"{key}" not in config_page or _plain(prop.get("description", "")) not in config_page]
    assert not missing, f"config fields missing from the built reference, or without their description: {missing}"

    cli_page = _text(site / "reference" / "cli" / "index.html")
    for name, command, ctx in cli_commands():
        assert name in cli_page, name
        for param in command.params:
            record = param.get_help_record(ctx)
            assert record is None or record[0] in cli_page, f"{name}: {record[0]} missing from the CLI reference"

    # Screenshot markers: the picture when the browser tests took it (copied into the site), else the note.
    for page in (ROOT / "docs").rglob("*.md"):
        for name in re.findall(r"^<!-- screenshot: (\S+\.png) \|", page.read_text(encoding="utf-8"), re.M):
            built = (site / page.relative_to(ROOT / "docs").with_suffix("") / "index.html").read_text()
            if (ROOT / "test-output" / name).is_file():
                assert (site / "screenshots" / name).is_file() and f"screenshots/{name}" in built, name
            else:
                assert f"test-output/{name}" in built, name

    # The pictures draw offline: no page has a mermaid block (Material fetches mermaid.js from unpkg to draw one) or
    # loads a script from another host; the pipeline diagram is an SVG in the page naming the flow's stages in order.
    pages = {page: page.read_text(encoding="utf-8") for page in site.rglob("*.html")}
    fetching = [str(page.relative_to(site)) for page, text in pages.items()
                if re.search(r'<pre class="mermaid"|<script[^>]*\ssrc="(https?:)?//', text)]
    assert not fetching, f"pages that fetch a script from a CDN to draw their pictures: {fetching}"
    for page in (site / "index.html", site / "concepts" / "index.html"):
        diagram = re.search(r'<svg class="grpo-diagram".*?</svg>', pages[page], re.S)
        assert diagram, f"{page.relative_to(site)}: no pipeline diagram"
        assert re.findall(r'<text class="stage-name"[^>]*>([^<]+)</text>', diagram.group(0)) == _stage_names()
    assert re.search(r'<svg class="grpo-chart".*?</svg>', pages[site / "benchmarks" / "index.html"], re.S)


def _stage_names() -> list[str]:
    """The pipeline's subflow runs, in the order a run makes them, as the Prefect UI and the console name them."""
    from flows.pipeline import train_flow
    from flows.stages import eval_flow, plan_flow, policy_flow, prep_flow

    return [prep_flow.flow_run_name, plan_flow.flow_run_name, policy_flow.flow_run_name,
            eval_flow.flow_run_name.format(tag="before"), train_flow.flow_run_name,
            eval_flow.flow_run_name.format(tag="after")]


def test_every_config_field_has_a_description():
    from grpo.app.reference import config_fields

    bare = [key for key, prop, _ in config_fields() if not prop.get("description", "").strip()]
    assert not bare, f"config fields without a description (an attribute docstring in grpo/config/sections.py): {bare}"


def test_the_metrics_page_names_metrics_the_code_logs():
    """Each key of the page's table of the platform's metrics is a string the code logs (``<tool>``-style parts stand
    for a name): a metric renamed in the code and not on the page fails here."""
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
    table = page.split("## The platform's", 1)[1]
    keys = [k for row in table.splitlines() if row.startswith("| `")
            for k in re.findall(r"`([^`]+)`", row.split("|")[1])]
    assert len(keys) > 40
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "grpo").rglob("*.py"))
    unlogged = []
    for key in keys:
        pattern = re.escape(key)
        pattern = re.sub(r"<\w+>", r"\\{?\\w*\\}?", pattern.replace(r"\<", "<").replace(r"\>", ">"))
        if not re.search(rf"[\"']{pattern}[\"']", source):
            unlogged.append(key)
    assert not unlogged, f"the metrics page names keys no code logs: {unlogged}"


def test_every_metric_the_platform_logs_is_on_the_metrics_page():
    """The other way round: the keys the trainer's features record (``self._record("...")``) and the platform's own
    metric families (episodes, reward pool, streaming, traces, balancing) are all in the page's table (``{name}`` in
    the code is a ``<name>`` there): a new metric without its meaning fails here."""
    page = (ROOT / "docs" / "reference" / "metrics.md").read_text(encoding="utf-8")
    documented = {re.sub(r"<\w+>", "{}", k) for k in re.findall(r"`([^`]+)`", page.split("## The platform's", 1)[1])}
    source = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "grpo").rglob("*.py"))
    logged = set(re.findall(r"_record\(\s*f?\"([^\"]+)\"", source))
    logged |= set(re.findall(r"\"((?:env|rewards|streaming|traces|balance|async|compaction|shared_prompt|sampling)"
                             r"/[\w/{}]+)\"", source))
    logged = {re.sub(r"\{\w+\}", "{}", key) for key in logged if not key.endswith("/")}
    assert len(logged) > 40
    assert not sorted(logged - documented), f"metrics the code logs, missing from docs/reference/metrics.md: " \
                                            f"{sorted(logged - documented)}"


def test_the_readme_is_the_front_door():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "make demo" in readme and "make test" in readme
    links = re.findall(r"\]\((?!https?://|#)([^)]+)\)", readme)
    assert links and not [link for link in links if not (ROOT / link.split("#")[0]).is_file()]
