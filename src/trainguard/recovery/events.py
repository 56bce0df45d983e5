"""The run's event log, as the recovery supervisor and its tools know it: :mod:`trainguard.eventlog` (moved
there so that planning and the save path read it without importing the supervisor's package)."""

from ..eventlog import (
    EVENTS_DIR,
    MAX_EVENT_FILE_BYTES,
    OWN_EVENTS,
    EventLog,
    event_time,
    is_regular_file,
    iter_events,
    read_events,
)

__all__ = [
    "EVENTS_DIR",
    "MAX_EVENT_FILE_BYTES",
    "OWN_EVENTS",
    "EventLog",
    "event_time",
    "is_regular_file",
    "iter_events",
    "read_events",
]
