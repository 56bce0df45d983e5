"""Encoding of non-tensor values (ints, floats, strings, containers, ...).

A value is stored as strict JSON when it round-trips exactly (dict with str keys, list, str, int, finite float,
bool, None); anything else (tuples, int-keyed dicts, NaN, torch.Size, dtypes, ...) is stored with
``torch.save`` and loaded only with ``torch.load(weights_only=True)``, which refuses to build arbitrary objects.
A value that ``weights_only`` cannot load is rejected at save time, so it never reaches a checkpoint.
Payloads carry a one-byte codec tag: ``J`` (JSON) or ``T`` (torch, weights_only).
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from typing import Any

import torch

from ..errors import CorruptCheckpointError, TrainguardError, UnsafeCheckpointError

TAG_JSON = b"J"
TAG_TORCH = b"T"


class EncodedValue:
    """A value already encoded by :func:`encode_value` (staging snapshots values this way)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes) -> None:
        self.payload = payload


def is_strict_json(x: Any, depth: int = 0) -> bool:
    """True if ``json.loads(json.dumps(x)) == x`` with the same types (no tuples, no non-str keys)."""
    if depth > 200:
        return False
    if x is None or isinstance(x, (bool, str)):
        return True
    if type(x) is int:
        return True
    if type(x) is float:
        return math.isfinite(x)
    if type(x) is list:
        return all(is_strict_json(v, depth + 1) for v in x)
    if type(x) is dict:
        return all(type(k) is str and is_strict_json(v, depth + 1) for k, v in x.items())
    return False


def encode_value(value: Any, fqn: str) -> bytes:
    """Encode a value as tagged bytes.

    Raises:
        TrainguardError: the value cannot be stored without pickle of arbitrary classes; the message names the
            entry and suggests converting it to tensors / plain Python values.
    """
    if is_strict_json(value):
        try:
            return TAG_JSON + json.dumps(value, separators=(",", ":")).encode()
        except ValueError as e:  # an int beyond Python's int-to-str digit limit (4300 digits by default)
            raise TrainguardError(
                f"state entry {fqn!r} holds an integer too large to store ({str(e).split(';')[0]}); store it as "
                "a string or split it into smaller ints"
            ) from None
    try:
        buf = io.BytesIO()
        torch.save(value, buf)
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the value would need unsafe pickle
        raise TrainguardError(
            f"state entry {fqn!r} holds a {type(value).__name__} that cannot be stored without pickle of "
            f"arbitrary classes ({str(e).splitlines()[0][:200]}). Store it as tensors or plain Python values "
            "(int, float, str, list, dict, tuple), or wrap it in an object with state_dict()/load_state_dict()."
        ) from None
    return TAG_TORCH + data


def decode_value(payload: bytes, fqn: str) -> Any:
    """Decode tagged bytes written by :func:`encode_value`.

    Raises:
        CorruptCheckpointError: unknown tag or undecodable payload.
        UnsafeCheckpointError: a torch payload that ``weights_only`` refuses (e.g. a pickle that would run code),
            or a zip archive with compressed members (decoded, it could be far larger than its declared bytes).
    """
    tag, body = payload[:1], payload[1:]
    if tag == TAG_JSON:
        try:
            return json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"value {fqn!r}: JSON payload does not parse ({e})") from None
    if tag == TAG_TORCH:
        _check_torch_archive(body, fqn)
        try:
            return torch.load(io.BytesIO(bytes(body)), weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise UnsafeCheckpointError(
                f"value {fqn!r}: payload refused by torch.load(weights_only=True): {str(e).splitlines()[0][:200]}"
            ) from None
    raise CorruptCheckpointError(f"value {fqn!r}: unknown payload tag {tag!r}")


def _check_torch_archive(body: bytes, fqn: str) -> None:
    """``torch.save`` writes its zip archive uncompressed; a compressed member (a zip bomb: 0.4 MB declared,
    400 MB decoded) or members adding up to more than the payload's own size are refused before decoding, so
    decoding needs no more memory than the bytes the manifest declares."""
    buf = io.BytesIO(body)
    if not zipfile.is_zipfile(buf):
        return  # not an archive: torch.load(weights_only=True) reads it as a bare pickle or refuses it
    try:
        with zipfile.ZipFile(buf) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        raise CorruptCheckpointError(f"value {fqn!r}: torch payload is a damaged zip archive ({e})") from None
    total = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
            raise UnsafeCheckpointError(
                f"value {fqn!r}: torch payload member {info.filename!r} is compressed ({info.compress_size} "
                f"bytes decoding to {info.file_size}); torch.save never compresses, so this was crafted"
            )
        total += info.file_size
    if total > len(body):
        raise UnsafeCheckpointError(
            f"value {fqn!r}: torch payload members add up to {total} bytes, more than its {len(body)} bytes"
        )
