"""Validation in depth: content checks that CRC32C cannot make (docs/VALIDATION.md, issue 11).

- :mod:`.finite`: NaN/Inf scans of the floating tensors saved (in the persist path) and restored.
- :mod:`.probe`: the probe fingerprint stored with each checkpoint and compared after a restore.
- :mod:`.suspect`: the ``suspect.json`` marker of a checkpoint whose bytes are intact but whose content failed.
- :mod:`.trajectory`: the append-only metric log and the loss-trajectory check after a resume.
- :mod:`.scrub`: rate-capped re-verification (``verify --max-bandwidth``, the background scrubber) and ``gc``.
"""

from __future__ import annotations

CHECK_FINITE_MODES = ("error", "warn", "off")
