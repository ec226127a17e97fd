"""MkDocs hooks (mkdocs.yml ``hooks``): the generated reference pages and the screenshots of the browser tests.

- ``<!-- reference: config -->`` and ``<!-- reference: cli -->``, each on a line of its own, become the tables that
  :mod:`grpo.app.reference` generates from the config schema and the Typer app, at every build.
- ``<!-- screenshot: NAME.png | caption -->`` becomes the picture ``test-output/NAME.png`` that the browser tests
  take (``make test``), copied into the site, never committed; before those tests have run, a note says where the
  picture comes from, so the strict build passes on a clean clone too.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

from grpo.app.reference import cli_reference, config_reference

ROOT = Path(__file__).resolve().parent.parent
SCREENSHOTS = ROOT / "test-output"
SITE_FOLDER = "screenshots"
REFERENCE = {"config": config_reference, "cli": cli_reference}
_REFERENCE = re.compile(r"^<!-- reference: (\w+) -->$", re.M)
_SCREENSHOT = re.compile(r"^<!-- screenshot: (\S+\.png) \| (.+?) -->$", re.M)


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


def on_page_markdown(markdown: str, page, config, files) -> str:
    markdown = _REFERENCE.sub(lambda m: REFERENCE[m.group(1)](), markdown)
    return _SCREENSHOT.sub(lambda m: _screenshot(m, page), markdown)
