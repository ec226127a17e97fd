"""The Prefect UI in Debian's Chromium (Playwright), as a person uses it: the helpers the browser tests share.

Run forms are read by their labels; a section (a collapsed JSON line) opens through its menu's "Use form input", as
the form's help says; a submission is confirmed through the API, since the shared server may be slow under load.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.conftest import REPO

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = REPO / "test-output"
# The pipeline form's config sections, top to bottom (flows/run_form.py SECTIONS).
SECTION_TITLES = ["Data", "Model", "GRPO training", "Sampling and balancing", "Async generation",
                  "Environments and tools", "Evaluation", "MLflow tracking", "Experiment"]


def park(page) -> None:
    """Leave the Prefect UI for a blank page while the test waits on the API for a run. An open flow run's page, running
    or finished, keeps repainting its run graph (WebGL, drawn in software by Chromium's GPU process: about a core while
    it is open), and a deployment's page keeps polling the server: over the served-runs module's waits that took ~140 s
    of CPU from the runs being waited for."""
    page.goto("about:blank")


def require_chromium() -> None:
    if not CHROMIUM.is_file():
        pytest.fail(f"{CHROMIUM} is missing: run .ci/run (it installs it) or `apt-get install -y chromium`",
                    pytrace=False)
    SCREENSHOTS.mkdir(exist_ok=True)


@contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator:
    """One page of a fresh headless Chromium (a new profile: the apps' defaults, nothing chosen before) in a
    ``width`` x ``height`` viewport; the browser is closed after the block, whatever happens in it."""
    from playwright.sync_api import sync_playwright

    require_chromium()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def form_property(page, label: str):
    """The innermost schema-form property labelled ``label`` (the UI appends " (Optional)" to optional fields)."""
    exact = re.compile(rf"^{re.escape(label)}( \(Optional\))?$")
    return page.locator(".schema-form-property",
                        has=page.locator(".schema-form-property__label", has_text=exact)).last


def open_select(page, prop) -> list[str]:
    """Open a Prefect UI dropdown (p-select) and return its option texts."""
    prop.locator(".p-select-button__control").first.click()
    options = page.get_by_role("option")
    if options.count() == 0:  # the first click may only focus it
        page.keyboard.press("Space")
    options.first.wait_for(timeout=60_000)
    return [t.strip() for t in options.all_inner_texts()]


def open_section(page, title: str) -> None:
    """Open a collapsed section into its fields: its menu (⋮) → "Use form input"."""
    section = form_property(page, title)
    section.locator(".schema-form-property__header button").first.click()
    page.locator(".p-overflow-menu-item:visible", has_text="Use form input").click()
    # the bound only ends a hung page: at the suite's start (four workers importing, the servers starting) the
    # renderer once took over 20 s to draw a section's fields
    section.locator(".schema-form-property").first.wait_for(timeout=120_000)


def submit(page, server, deployment_id: str, known: set[str], button: str = "Submit") -> dict:
    """Press ``button`` on a deployment's run page (or the Quick run menu item) and return the flow run it created
    (the deployment's runs not in ``known``), waiting up to 10 minutes (a hung server's bound) for the shared server
    to record it; a refused request ("Something went wrong", the server's SQLite busy under load) is submitted again,
    as a person would."""
    def press() -> None:
        if button == "Quick run":
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Quick run", exact=True).click()
        else:
            page.get_by_role("button", name=button, exact=True).click()

    press()
    deadline, resubmits = time.monotonic() + 600, 0
    while True:
        runs = server.post("flow_runs/filter", {"deployments": {"id": {"any_": [str(deployment_id)]}}}).json()
        created = [r for r in runs if r["id"] not in known]
        if created:
            [run] = created
            return run
        if resubmits < 2 and page.get_by_text("Something went wrong").count():
            resubmits += 1
            page.keyboard.press("Escape")
            press()
            time.sleep(3)
            continue
        if time.monotonic() > deadline:
            page.screenshot(path=str(SCREENSHOTS / "prefect-submit-failed.png"))
            pytest.fail("no flow run 600 s after submitting; the page says: "
                        + page.locator("body").inner_text()[-1500:])
        time.sleep(1)
