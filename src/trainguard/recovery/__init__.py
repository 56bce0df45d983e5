"""Recovery: the supervisor (``trainguard run``), heartbeats, time-to-resume timing and the event log."""

from .events import EventLog, iter_events, read_events

__all__ = ["EventLog", "iter_events", "read_events"]
