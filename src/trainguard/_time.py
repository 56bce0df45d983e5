"""Small time helpers shared by the event log, the manager and the supervisor."""

from __future__ import annotations

import datetime as _dt
import time


def iso(t: float | None = None) -> str:
    """Return ``t`` (seconds since the epoch, default now) as ISO 8601 in UTC with milliseconds."""
    if t is None:
        t = time.time()
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).isoformat(timespec="milliseconds")
