"""Storage tiers: a hot run root plus tiers (shared filesystem, object store) that hold the same layout.

- :mod:`.config`: the :class:`Tier` configuration.
- :mod:`.remote`: a run root on an object store (listing, status, verification).
- :mod:`.upload`: background upload with retries, stall timeouts and per-tier retention.
- :mod:`.repair`: restore from the newest step valid on any tier, chunk-level repair of the hot root.
"""

from .config import Tier
from .remote import RemoteRoot

__all__ = ["RemoteRoot", "Tier"]
