"""`moe-dashboard RUN_DIR [RUN_DIR ...] [--out FILE.html] [--serve --port P] [--png DIR]`."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from launch.errors import cli
from launch.files import check_writable
from launch.metrics.dashboard.page import build_html, view_ids
from launch.metrics.dashboard.runs import load_run


def load_runs(run_dirs: list[str]) -> list:
    """Runs named by unique short names (the folder, or its parent/folder where two share one)."""
    names = [Path(d).resolve().name for d in run_dirs]
    return [load_run(d, name=n if names.count(n) == 1 else str(Path(d))) for d, n in zip(run_dirs, names)]


def export_png(html_file: Path, out_dir: Path, views: list[str], workers: int = 4) -> list[Path]:
    """One PNG per view, rendered by headless Chromium from the page itself (#view=ID shows that chart alone),
    several browsers at once (each mostly waits on its own start-up)."""
    from launch.metrics.dashboard.browser import screenshot

    url = html_file.resolve().as_uri()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda view: screenshot(f"{url}#view={view}", out_dir / f"{view}.png", width=1200,
                                                     height=560 if view == "curves" else 480), views))


@cli("moe-dashboard")
def main(argv: list[str] | None = None) -> int:
    """Write (or serve) the dashboard of the given runs; exit 2 with a message on unusable input."""
    parser = argparse.ArgumentParser(prog="moe-dashboard", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", default="dashboard.html", help="HTML file to write (default: dashboard.html)")
    parser.add_argument("--serve", action="store_true", help="serve the page and refresh it while runs write")
    parser.add_argument("--port", type=int, default=8050, help="port for --serve (default 8050)")
    parser.add_argument("--refresh", type=float, default=10.0, help="seconds between --serve update checks")
    parser.add_argument("--png", metavar="DIR", help="also save a PNG of every view into DIR (headless Chromium)")
    parser.add_argument("--check", action="store_true", help="open the written page in headless Chromium and "
                        "print its render times and console messages (exit 1 if it shows errors)")
    args = parser.parse_args(argv)
    if args.refresh <= 0:
        parser.error(f"--refresh = {args.refresh} must be > 0")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: allowed 0 (any free port) to 65535")
    out = Path(args.out)
    if not args.serve:
        check_writable(out, "--out")
    if args.serve:
        from launch.metrics.dashboard.serve import serve

        try:
            return serve(args.run_dirs, args.port, args.refresh, load_runs)
        except OSError as error:
            raise ValueError(f"cannot serve on port {args.port} (--port): {error.strerror or error}") from None
    runs = load_runs(args.run_dirs)
    out.write_text(build_html(runs))
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB): " +
          "; ".join(f"{r.name}: {r.records} records" for r in runs))
    for note in (f"{r.name}: {n}" for r in runs for n in r.notes):
        print(f"note: {note}")
    if args.png:
        try:
            files = export_png(out, Path(args.png), view_ids(runs))
        except RuntimeError as error:
            print(f"moe-dashboard: PNG export failed: {error}", file=sys.stderr)
            return 1
        print(f"wrote {len(files)} PNGs to {args.png}")
    return check_page(out) if args.check else 0


def check_page(page: Path) -> int:
    """Print how headless Chromium rendered the page; 1 when it reported errors or no browser is installed."""
    from launch.metrics.dashboard.browser import render_report

    try:
        report = render_report(page)
    except RuntimeError as error:
        print(f"moe-dashboard: --check failed: {error}", file=sys.stderr)
        return 1
    print(f"headless Chromium: {report['status']}, {report['charts']} charts, first chart at "
          f"{report['first_chart_ms']} ms, all at {report['rendered_ms']} ms after navigation start")
    for line in report["console"]:
        print(f"console: {line}")
    return 0 if report["status"] == "rendered" and not report["console"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
