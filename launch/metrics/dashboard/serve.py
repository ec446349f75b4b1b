"""`moe-dashboard --serve`: the page over HTTP, rebuilt when a run's metrics grow; open pages reload themselves."""

from __future__ import annotations

import html
import sys
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from launch.metrics.dashboard.page import build_html
from launch.metrics.dashboard.runs import RunError, metrics_path


def metrics_version(run_dirs: list[str]) -> str:
    """A token that changes whenever any run's metrics file changes (sizes and modification times)."""
    parts = []
    for run_dir in run_dirs:
        try:
            stat = metrics_path(run_dir).stat()
            parts.append(f"{stat.st_size}:{stat.st_mtime_ns}")
        except RunError:
            parts.append("none")
    return "-".join(parts)


def make_server(run_dirs: list[str], port: int, refresh: float,
                load_runs: Callable[[list[str]], list]) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1:port (0: any free port) answering / with the page and /version with
    metrics_version; the page is rebuilt only when the version changed."""
    cache: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            version = metrics_version(run_dirs)
            if self.path.rstrip("/").endswith("version"):
                return self._reply(200, "text/plain", version.encode())
            if self.path not in ("/", "/index.html"):
                return self._reply(404, "text/plain", b"not found")
            if version not in cache:
                try:
                    page = build_html(load_runs(run_dirs), live_seconds=refresh, version=version)
                except RunError as error:
                    page = (f"<p>moe-dashboard: {html.escape(str(error))}</p>"
                            f"<script>setTimeout(() => location.reload(), {refresh * 1000:.0f})</script>")
                cache.clear()
                cache[version] = page.encode()
            return self._reply(200, "text/html; charset=utf-8", cache[version])

        def _reply(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", port), Handler)


def serve(run_dirs: list[str], port: int, refresh: float, load_runs: Callable[[list[str]], list]) -> int:
    """Serve the dashboard on localhost:port until interrupted."""
    server = make_server(run_dirs, port, refresh, load_runs)
    print(f"serving the dashboard of {', '.join(run_dirs)} at http://127.0.0.1:{server.server_port}/ "
          f"(refreshes every {refresh:g} s while the runs write; Ctrl-C stops)", file=sys.stderr)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
