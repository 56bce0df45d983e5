"""The probe fingerprint: outputs of the user's model on a fixed probe batch, stored with each checkpoint and
compared after a restore.

``CheckpointManager(..., probe=fn)``: ``fn()`` returns a tensor or a dict of tensors computed from the live
training objects (typically ``model.eval()`` and ``torch.no_grad()`` on a fixed batch, then ``model.train()``).
At each save it runs in the caller's thread (its cost is the save's ``probe_s``); the outputs are stored as
``step-N/probe.json`` (written before the manifest, so a committed checkpoint has it). After a restore it runs
again on the restored objects and must match: bitwise by default, or within ``probe_rtol``/``probe_atol``.

``probe.json``: ``{"format": 1, "crc32c": <CRC32C of the canonical JSON of "tensors">, "tensors": {name:
{"dtype": "float32", "shape": [...], "data": <base64 of the raw little-endian bytes>}}}``. It is read like
every per-step record (no symlink, bounded size) and never unpickled; a record that fails its CRC32C or does
not parse is reported and ignored (the probe cannot vouch for the checkpoint then, nor condemn it).
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import crc32c
import torch

from ..errors import ConfigError
from ..format import step_dir_name
from ..storage.safeio import MIB
from .finite import byte_view

if TYPE_CHECKING:
    from ..storage.base import Storage

PROBE_FILE = "probe.json"
MAX_PROBE_BYTES = 16 * MIB
"""Largest probe output stored (raw bytes of all its tensors): a few samples' logits, not a whole batch's."""
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


class ProbeRecordError(ValueError):
    """A ``probe.json`` that does not parse or fails its CRC32C."""


def compute(fn: Callable[[], Any]) -> dict[str, torch.Tensor]:
    """Run the probe and return its outputs as name -> contiguous CPU tensor (detached copies).

    Raises:
        ConfigError: ``fn`` returned something other than a tensor or a dict of str -> tensor, a dtype the
            record cannot hold, or more than ``MAX_PROBE_BYTES``.
    """
    out = fn()
    if isinstance(out, torch.Tensor):
        items = {"output": out}
    elif isinstance(out, dict) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in out.items()
    ):
        items = dict(out)
    else:
        raise ConfigError(
            f"probe() must return a tensor or a dict of str -> tensor, got {type(out).__name__}; e.g. "
            "`lambda: model(probe_batch)` run under torch.no_grad() with the model in eval mode"
        )
    res: dict[str, torch.Tensor] = {}
    total = 0
    for name, t in items.items():
        if str(t.dtype).removeprefix("torch.") not in _DTYPES:
            raise ConfigError(f"probe output {name!r} has dtype {t.dtype}; use one of {sorted(_DTYPES)}")
        c = t.detach().to("cpu", copy=True).contiguous()
        total += c.numel() * c.element_size()
        res[name] = c
    if total > MAX_PROBE_BYTES:
        raise ConfigError(
            f"probe outputs hold {total} bytes (limit {MAX_PROBE_BYTES}): probe a few samples, or return a "
            "reduction such as the logits of 8 inputs"
        )
    return res


def _raw(t: torch.Tensor) -> bytes:
    return byte_view(t).numpy().tobytes()


def encode(outputs: dict[str, torch.Tensor], *, manifest: bytes | None = None) -> bytes:
    """The ``probe.json`` bytes for ``outputs`` (from :func:`compute`), bound to the manifest whose bytes are
    ``manifest`` (its CRC32C is recorded)."""
    tensors = {
        name: {
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": base64.b64encode(_raw(t)).decode("ascii"),
        }
        for name, t in sorted(outputs.items())
    }
    body = json.dumps(tensors, sort_keys=True, separators=(",", ":"))
    doc: dict[str, Any] = {"format": 1, "crc32c": crc32c.crc32c(body.encode()), "tensors": tensors}
    if manifest is not None:
        doc["manifest_crc32c"] = crc32c.crc32c(manifest)
    return json.dumps(doc).encode()


def decode(data: bytes, *, manifest_crc: int | None = None) -> dict[str, torch.Tensor]:
    """Parse ``probe.json`` bytes (``manifest_crc``: the CRC32C of the manifest file it must belong to).

    Raises:
        ProbeRecordError: malformed, unknown dtype, sizes that do not match, a CRC32C mismatch, or a record of
            another manifest (a save that replaced this step was killed before its manifest).
    """
    try:
        doc = json.loads(data)
        bound = doc.get("manifest_crc32c")
        if manifest_crc is not None and bound is not None and bound != manifest_crc:
            raise ProbeRecordError("probe record belongs to another manifest of this step")
        tensors = doc["tensors"]
        body = json.dumps(tensors, sort_keys=True, separators=(",", ":"))
        if crc32c.crc32c(body.encode()) != doc["crc32c"]:
            raise ProbeRecordError("probe record fails its CRC32C")
        out: dict[str, torch.Tensor] = {}
        for name, rec in tensors.items():
            dtype = _DTYPES[rec["dtype"]]
            shape = [int(x) for x in rec["shape"]]
            raw = bytearray(base64.b64decode(rec["data"], validate=True))
            n = 1
            for x in shape:
                n *= x
            if len(raw) != n * torch.empty((), dtype=dtype).element_size():
                raise ProbeRecordError(f"probe output {name!r}: {len(raw)} bytes do not match shape {shape}")
            t = torch.frombuffer(raw, dtype=torch.uint8).view(dtype) if raw else torch.empty(0, dtype=dtype)
            out[str(name)] = t.reshape(shape)
        return out
    except ProbeRecordError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise ProbeRecordError(f"probe record does not parse ({type(e).__name__}: {e})") from None


def read_probe(root: str | os.PathLike[str] | Storage, step: int) -> dict[str, torch.Tensor] | None:
    """The stored probe outputs of ``step``; None when the checkpoint has none.

    Raises:
        ProbeRecordError: the record exists but is damaged or unsafe (a symlink, oversized, not parsing).
    """
    from ..storage.base import as_storage
    from .suspect import manifest_crc

    key = f"{step_dir_name(step)}/{PROBE_FILE}"
    try:
        data = as_storage(root).read(key, limit_bytes=2 * MAX_PROBE_BYTES, what="probe record")
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise ProbeRecordError(f"probe record of step {step} cannot be read: {e}") from None
    return decode(data, manifest_crc=manifest_crc(root, step))


def compare(
    stored: dict[str, torch.Tensor], now: dict[str, torch.Tensor], *, rtol: float = 0.0, atol: float = 0.0
) -> str | None:
    """None when ``now`` matches ``stored`` (bitwise when both tolerances are 0), else what differs."""
    if set(stored) != set(now):
        return f"probe outputs differ in names: stored {sorted(stored)}, now {sorted(now)}"
    for name in sorted(stored):
        a, b = stored[name], now[name]
        if a.shape != b.shape:
            return f"probe output {name!r} has shape {list(b.shape)}, stored {list(a.shape)}"
        if rtol == 0.0 and atol == 0.0:
            if a.dtype != b.dtype:
                return (
                    f"probe output {name!r} has dtype {b.dtype}, stored {a.dtype} (set probe_rtol/probe_atol)"
                )
            if not torch.equal(_raw_view(a), _raw_view(b)):
                diff = _max_diff(a, b)
                return f"probe output {name!r} differs bitwise from the one stored at save (max |diff| {diff:.3g})"
        else:
            af, bf = a.double(), b.to(a.device).double()
            if not torch.allclose(bf, af, rtol=rtol, atol=atol, equal_nan=False):
                diff = _max_diff(a, b)
                return (
                    f"probe output {name!r} differs from the one stored at save (max |diff| {diff:.3g}, "
                    f"probe_rtol={rtol}, probe_atol={atol})"
                )
    return None


def _raw_view(t: torch.Tensor) -> torch.Tensor:
    return byte_view(t.contiguous())


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.double() - b.double()).abs()
    d = torch.where(torch.isnan(d), torch.full_like(d, float("inf")), d)
    return float(d.max())
