"""Staging: snapshot state into reusable host buffers so training can go on while a save persists."""

from .buffers import BufferSet, Stager
from .pending import PendingSave

__all__ = ["BufferSet", "PendingSave", "Stager"]
