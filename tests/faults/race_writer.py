"""Writer of the reader-race tests: ``race_writer.py ROOT STOP READY``.

Saves a small state at steps 1, 2, 3, ... as fast as it can, with ``keep=1``, so retention deletes the previous
checkpoint right after each commit, until the file STOP exists (or 600 s passed); touches READY after the first
commit and prints the last step.
Every checkpoint of step s holds ``w == s`` and ``meta.step == s`` (the reader checks what it restored).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import trainguard as tg


def main() -> int:
    root, stop, ready = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    deadline = time.monotonic() + 600
    step = 0
    with tg.CheckpointManager(root, keep=1, async_save=False, fsync=False) as mgr:
        while not stop.exists() and time.monotonic() < deadline:
            step += 1
            # 8 KiB + a 2 MiB tensor: a chunk of its own, deleted with its checkpoint (retention frees it)
            big = torch.full((1 << 19,), float(step))
            mgr.save(
                step, {"w": {"small": torch.full((2048,), float(step)), "big": big}, "meta": {"step": step}}
            )
            if step == 1:
                ready.touch()
    print(step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
