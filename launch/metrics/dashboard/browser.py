"""Headless Chromium (the Debian `chromium` package) for PNG export and the dashboard's browser test."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def find_chromium() -> str:
    """Path of a Chromium/Chrome binary ($MOE_CHROMIUM first); RuntimeError saying how to get one."""
    for name in (os.environ.get("MOE_CHROMIUM"), *BROWSERS):
        path = name and shutil.which(name)
        if path:
            return path
    raise RuntimeError("no Chromium found (looked for $MOE_CHROMIUM, " + ", ".join(BROWSERS) + "): install the "
                       "Debian package `chromium` (apt-get install chromium; .ci/run does this)")


def run_headless(url: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run headless Chromium on url with extra args; stdout/stderr captured as text, a throwaway profile."""
    with tempfile.TemporaryDirectory(prefix="moe-chromium-") as profile:
        command = [find_chromium(), "--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
                   "--hide-scrollbars", "--disable-extensions", "--mute-audio", f"--user-data-dir={profile}",
                   "--enable-logging=stderr", "--v=0", *args, url]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            command.insert(2, "--no-sandbox")  # Chromium's sandbox refuses to run as root (containers, CI)
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)


def dump_dom(url: str, *args: str, timeout: float = 120.0) -> tuple[str, str]:
    """(the DOM after the page's load event, or after --virtual-time-budget=MS of page time when given in args,
    Chromium's log with the page's console lines)."""
    result = run_headless(url, "--dump-dom", *args, timeout=timeout)
    if result.returncode:
        raise RuntimeError(f"chromium --dump-dom exited with {result.returncode}: {result.stderr[-2000:]}")
    return result.stdout, result.stderr


def console_lines(log: str) -> list[str]:
    """The page's console messages (logs, warnings, errors, uncaught exceptions) in a Chromium log."""
    return [line for line in log.splitlines() if ":CONSOLE" in line]


def render_report(page: str | Path, timeout: float = 120.0) -> dict:
    """Open a dashboard file in headless Chromium: its status ("rendered" or "error"), milliseconds from
    navigation to the first and to the last chart, the number of plotly charts drawn, the console lines."""
    dom, log = dump_dom(Path(page).resolve().as_uri(), timeout=timeout)
    body = re.search(r"<body([^>]*)>", dom)
    attributes = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(1))) if body else {}
    return {"status": attributes.get("status", "missing"), "first_chart_ms": attributes.get("first-chart-ms"),
            "rendered_ms": attributes.get("rendered-ms"), "charts": dom.count('class="chart js-plotly-plot"'),
            "console": console_lines(log)}


def screenshot(url: str, out: str | Path, width: int = 1400, height: int = 2000, timeout: float = 120.0) -> Path:
    """Save a PNG of url rendered at width x height pixels."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    result = run_headless(url, f"--screenshot={out}", f"--window-size={width},{height}", timeout=timeout)
    if result.returncode or not out.is_file():
        raise RuntimeError(f"chromium --screenshot failed ({result.returncode}): {result.stderr[-2000:]}")
    return out
