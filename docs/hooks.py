"""MkDocs hooks (mkdocs.yml ``hooks``): the generated reference pages, the pictures and the browser tests' screenshots.

- ``<!-- reference: config -->`` and ``<!-- reference: cli -->``, each on a line of its own, become the tables that
  :mod:`grpo.app.reference` generates from the config schema and the Typer app, at every build.
- ``<!-- screenshot: NAME.png | caption -->`` becomes the picture ``test-output/NAME.png`` that the browser tests
  take (``make test``), copied into the site, never committed; before those tests have run, a note says where the
  picture comes from, so the strict build passes on a clean clone too.
- ``<!-- diagram: pipeline -->`` becomes the pipeline diagram (:mod:`pipeline_diagram`, its stages read from the code)
  and a ```` ```chart ```` block of measured points a line chart (:mod:`line_chart`, matplotlib): SVGs drawn at every
  build into the page, so every picture shows offline. A ```` ```mermaid ```` block is refused (a warning: the strict
  build fails): the theme draws one with mermaid.js fetched from a CDN, which an offline reader never gets.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from line_chart import chart_figure  # docs/, on sys.path while MkDocs loads this file
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files
from pipeline_diagram import pipeline_svg

from grpo.app.reference import cli_reference, config_reference

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "test-output"
SITE_FOLDER = "screenshots"
REFERENCE = {"config": config_reference, "cli": cli_reference}
_REFERENCE = re.compile(r"^<!-- reference: (\w+) -->$", re.M)
_SCREENSHOT = re.compile(r"^<!-- screenshot: (\S+\.png) \| (.+?) -->$", re.M)
DIAGRAMS = {"pipeline": pipeline_svg}
_DIAGRAM = re.compile(r"^<!-- diagram: (\w+) -->$", re.M)
_CHART = re.compile(r"^```chart\n(.*?)^```$", re.M | re.S)
_MERMAID = re.compile(r"^\s*```mermaid", re.M)
_PLACEHOLDER = "GRPO-PICTURE-{}"
log = logging.getLogger("mkdocs.hooks")
# Each page's pictures (HTML), kept from its markdown to its HTML: Markdown would mangle an SVG passed through it.
_pictures: dict[str, list[str]] = {}


def on_files(files: Files, config) -> Files:
    """The browser tests' screenshots that exist, as files of the site."""
    for png in sorted(SCREENSHOTS.glob("*.png")):
        files.append(File.generated(config, f"{SITE_FOLDER}/{png.name}", abs_src_path=str(png)))
    return files


def _screenshot(match: re.Match, page) -> str:
    name, caption = match.group(1), match.group(2)
    if (SCREENSHOTS / name).is_file():
        link = posixpath.relpath(f"{SITE_FOLDER}/{name}", posixpath.dirname(page.file.src_uri))
        return f"![{caption}]({link})"
    return (f'!!! note "Picture: {caption}"\n    The screenshot `test-output/{name}` appears here once the browser '
            f"tests have run (`make test`), then `make docs`.")


def _picture(html: str, page) -> str:
    pictures = _pictures.setdefault(page.file.src_uri, [])
    pictures.append(html)
    return f"\n{_PLACEHOLDER.format(len(pictures) - 1)}\n"


def _diagram(match: re.Match, page) -> str:
    name = match.group(1)
    if name not in DIAGRAMS:
        raise PluginError(f"{page.file.src_uri}: no diagram {name!r} (known: {', '.join(DIAGRAMS)})")
    try:
        return _picture(f'<figure class="grpo-figure">{DIAGRAMS[name]()}</figure>', page)
    except ValueError as err:
        raise PluginError(f"{page.file.src_uri}: {err}") from None


def _chart(match: re.Match, page) -> str:
    try:
        return _picture(chart_figure(match.group(1)), page)
    except ValueError as err:
        raise PluginError(f"{page.file.src_uri}: {err}") from None


def on_page_markdown(markdown: str, page, config, files) -> str:
    if _MERMAID.search(markdown):
        log.warning(f"{page.file.src_uri}: a mermaid block is drawn by mermaid.js from a CDN, so offline it shows as "
                    "text: use <!-- diagram: NAME --> or a ```chart block (docs/hooks.py)")
    _pictures.pop(page.file.src_uri, None)
    markdown = _REFERENCE.sub(lambda m: REFERENCE[m.group(1)](), markdown)
    markdown = _DIAGRAM.sub(lambda m: _diagram(m, page), markdown)
    markdown = _CHART.sub(lambda m: _chart(m, page), markdown)
    return _SCREENSHOT.sub(lambda m: _screenshot(m, page), markdown)


def on_page_content(html: str, page, config, files) -> str:
    for i, picture in enumerate(_pictures.pop(page.file.src_uri, [])):
        if f"<p>{_PLACEHOLDER.format(i)}</p>" not in html:
            raise PluginError(f"{page.file.src_uri}: picture {i + 1} is not a paragraph of its own: put its marker or "
                              "block at the start of a line, between blank lines")
        html = html.replace(f"<p>{_PLACEHOLDER.format(i)}</p>", picture)
    return html
