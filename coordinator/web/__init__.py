"""The coordinator's live page for people: `/`, its static files, and the history its charts draw.

The page is static HTML, CSS and JavaScript that polls `/status` every few seconds and redraws.
Everything it loads ships in this package and is served by the coordinator itself (no CDN, no web
fonts), so it works offline and inside a swarm with no internet access.

Charts: uPlot 1.6.32 (vendor/, MIT, see vendor/uPlot.LICENSE), copied unchanged from the npm
package's dist/. It is one 51 KB minified file plus 2 KB of CSS, has no dependencies, and is made
for exactly this: time series drawn on a canvas, cheap to redraw every few seconds.
"""

from __future__ import annotations

import math
import threading
import time
from importlib import resources
from typing import Any

from swarm.metrics import Reply, Request, Route

HISTORY_CAPACITY = 720  # points kept per series: an hour at one point per 5 s
HISTORY_SPACING = 5.0  # seconds between points, to begin with (doubles each time the history is thinned)

# The page itself is revalidated on every load so that an upgraded coordinator shows its new page
# at once; the files it loads may be kept a few minutes (they only change with the coordinator).
PAGE_CACHE = "no-cache"
ASSET_CACHE = "public, max-age=600"

# path -> (file in this package, content type, Cache-Control)
FILES: dict[str, tuple[str, str, str]] = {
    "/": ("index.html", "text/html; charset=utf-8", PAGE_CACHE),
    "/app.js": ("app.js", "text/javascript; charset=utf-8", ASSET_CACHE),
    "/style.css": ("style.css", "text/css; charset=utf-8", ASSET_CACHE),
    "/vendor/uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8", ASSET_CACHE),
    "/vendor/uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8", ASSET_CACHE),
}


def page_routes() -> dict[str, Route]:
    """Routes for MetricsServer serving the page and its files, read once from this package."""
    package = resources.files(__name__)
    routes: dict[str, Route] = {}
    for path, (name, content_type, cache) in FILES.items():
        reply = Reply(200, content_type, package.joinpath(name).read_bytes(), cache=cache)
        routes[path] = _constant(reply)
    return routes


def _constant(reply: Reply) -> Route:
    def route(request: Request) -> Reply:
        return reply

    return route


class StatusHistory:
    """Step, loss and samples per second of the swarm over the run, for the page's charts.

    Points are at least `spacing` seconds apart and there are at most `capacity` of them. When the
    history is full, every other point is dropped and the spacing doubles: the charts always span the
    whole run, at a resolution that coarsens as the run grows (a day fits in 720 points of 2 minutes),
    and `/status`, which carries the history, stays a few tens of KB.

    `record` is called by the coordinator's status loop and `columns` by HTTP threads, hence the lock.
    """

    def __init__(self, capacity: int = HISTORY_CAPACITY, spacing: float = HISTORY_SPACING):
        if capacity < 2 or spacing <= 0:
            raise ValueError("a history needs room for two points and a positive spacing")
        self.capacity = capacity
        self.spacing = spacing
        self._points: list[tuple[float, int, float | None, float]] = []
        self._lock = threading.Lock()

    def record(self, status: dict[str, Any], now: float | None = None) -> bool:
        """Add a point from a `/status` document, unless the last one is too recent. True if added."""
        now = time.time() if now is None else now
        loss = status.get("loss")
        # Rounded to what a chart can show: each point costs fewer bytes in every poll of /status.
        point = (
            round(now, 1),
            int(status.get("step", 0)),
            float(f"{loss:.5g}") if loss is not None and math.isfinite(loss) else None,
            round(float(status.get("samples_per_second", 0.0)), 2),
        )
        with self._lock:
            if self._points and now - self._points[-1][0] < self.spacing:
                return False
            if len(self._points) >= self.capacity:
                # Keep the 1st, 3rd, ... point: the last one kept is then two old spacings back,
                # which is the new spacing before `point`.
                self._points = self._points[::2]
                self.spacing *= 2
            self._points.append(point)
            return True

    def __len__(self) -> int:
        with self._lock:
            return len(self._points)

    def columns(self) -> dict[str, list]:
        """The points as one list per field (what the charts take, and more compact as JSON than rows)."""
        with self._lock:
            points = list(self._points)
        names = ("time", "step", "loss", "samples_per_second")
        return {name: [p[i] for p in points] for i, name in enumerate(names)}
