"""Worker of ``test_manifest_fuzz.py``: runs verify and restore of step 2 of a run root under an address-space
limit of the bytes the manifest declares plus a fixed margin, and reports what happened.

Protocol: one JSON request per stdin line ``{"root": PATH, "margin": BYTES}``; one JSON reply per stdout line
``{"outcome": "ok" | "refused" | "memory" | "crash" | "wrong", "detail": str, "declared": int}``:

- ``ok``: verify and restore both succeeded, and every restored tensor equals, bit for bit, the bytes its
  shards name in the chunk files (an oracle that reads the chunks with plain file reads);
- ``refused``: a TrainguardError (verify reports a problem, or restore raises one);
- ``memory``: MemoryError (more than the declared bytes plus the margin was allocated);
- ``crash``: any other exception;
- ``wrong``: restore succeeded but a tensor differs from what the manifest says.

Run as a script: ``python bounds_worker.py`` (imports torch once, then serves requests).
"""

from __future__ import annotations

import json
import math
import resource
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

import trainguard as tg
from trainguard.errors import TrainguardError
from trainguard.integrity.verify import verify

_ITEM = {
    name: getattr(torch, name).itemsize
    for name in dir(torch)
    if isinstance(getattr(torch, name), torch.dtype)
}


def declared_bytes(body: Any) -> int:
    """Tensor bytes (elements x item size of each shard) and value segment bytes the manifest declares; an
    unparseable field counts 0 (the parser refuses such a manifest before allocating)."""
    total = 0
    try:
        for e in body["entries"].values():
            if e.get("kind") == "tensor":
                size = _ITEM.get(e.get("dtype"), 1)
                total += math.prod(int(x) for x in e["shape"]) * size
            for s in e.get("segments") or []:
                total += int(s[2])
    except Exception:  # noqa: BLE001 - malformed on purpose: refused by the parser
        pass
    return max(0, total)


def vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def chunk_bytes(root: Path, body: dict[str, Any], h: str) -> bytes:
    """A chunk's decoded bytes, decoded here without trainguard (blosc2 frame, then a delta on its base)."""
    import blosc2
    import numpy as np

    c = body["chunks"][h]
    data = (root / c["path"]).read_bytes()
    if c["codec"] == "blosc2":
        data = bytes(blosc2.decompress2(data))
    if "base" in c:
        base = chunk_bytes(root, body, c["base"])
        word = c["word"] if len(data) % c["word"] == 0 else 1
        a, b = np.frombuffer(data, f"<u{word}"), np.frombuffer(base, f"<u{word}")
        data = (a ^ b if c["delta"] == "xor" else a + b).tobytes()
    return data


def oracle(root: Path, body: dict[str, Any], fqn: str) -> torch.Tensor:
    """What the manifest says ``fqn`` holds, assembled from plain reads of the chunk files."""
    e = body["entries"][fqn]
    dtype = getattr(torch, e["dtype"])
    out = torch.empty(e["shape"], dtype=dtype)
    for sh in e["shards"]:
        data = b"".join(chunk_bytes(root, body, c)[off : off + ln] for c, off, ln in sh["segments"])
        part = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(sh["sizes"])
            if data
            else (torch.empty(sh["sizes"], dtype=dtype))
        )
        view = out
        for d, (o, n) in enumerate(zip(sh["offsets"], sh["sizes"], strict=True)):
            view = view.narrow(d, o, n)
        view.copy_(part)
    return out


def lookup(state: Any, path: list[list[Any]]) -> Any:
    """The leaf at a manifest path in the restored state."""
    for _, key in path:
        state = state[key]
    return state


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaNs compare bitwise)."""
    return t.contiguous().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def run(root: Path, margin: int) -> dict[str, Any]:
    try:
        body = json.loads((root / "step-000000002" / "manifest.json").read_bytes())
    except ValueError:
        body = {}
    declared = declared_bytes(body)
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    limit = vm_size() + declared + margin
    outcome, detail = "ok", ""
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        report = verify(root, [2])
        state: dict[str, Any] = {"model": {}, "optim": {}, "trainer": {}, "epoch": -1}
        with tg.CheckpointManager(root, read_only=True) as mgr:
            mgr.restore(2, state)
        if not report.ok:
            outcome, detail = "wrong", f"verify reported {report.corrupt} but restore succeeded"
    except TrainguardError as e:
        outcome, detail = "refused", f"{type(e).__name__}: {e}"[:300]
    except MemoryError:
        outcome, detail = "memory", traceback.format_exc()[-1500:]
    except Exception:  # noqa: BLE001 - reported to the test
        outcome, detail = "crash", traceback.format_exc()[-1500:]
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    if outcome == "ok":
        try:
            for fqn, entry in body["entries"].items():
                if entry.get("kind") == "tensor":
                    want, got = oracle(root, body, fqn), lookup(state, entry["path"])
                    if (
                        got.dtype != want.dtype
                        or got.shape != want.shape
                        or not torch.equal(raw(got), raw(want))
                    ):
                        outcome, detail = "wrong", f"{fqn} differs from the bytes its manifest names"
        except Exception:  # noqa: BLE001
            outcome, detail = "crash", "oracle: " + traceback.format_exc()[-1500:]
    return {"outcome": outcome, "detail": detail, "declared": declared}


def main() -> None:
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps(run(Path(req["root"]), int(req["margin"]))), flush=True)


if __name__ == "__main__":
    main()
