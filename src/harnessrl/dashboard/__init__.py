"""dashboard: browse a run in a web browser (`harnessrl dashboard --run RUN_DIR`).

Modules, outside in: `cli` (arguments, loopback by default, the admin key off loopback), `app` (the
Starlette app: static pages under `static/`, a read-only paginated JSON API, server-sent events for
live updates), `data` (what the pages show, read from the store in read-only mode with the readers of
`harnessrl.inspection`). The pages are plain HTML, CSS and JavaScript: no build step, no CDN.
Nothing here imports torch.
"""

from __future__ import annotations

from harnessrl.dashboard.app import create_dashboard
from harnessrl.dashboard.data import Filters, RunData

__all__ = ["Filters", "RunData", "create_dashboard"]
