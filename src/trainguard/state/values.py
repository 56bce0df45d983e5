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
import re
import zipfile
from typing import Any

import torch

from ..errors import ConfigError, CorruptCheckpointError, UnsafeCheckpointError, plain_text

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


_GENERIC_FIX = (
    "store it as tensors or plain Python values (int, float, str, list, dict, tuple), or wrap it in an object "
    "with state_dict()/load_state_dict()"
)


def instead_of(value: Any) -> str:
    """What to put in the state instead of ``value``, a value trainguard cannot store safely."""
    from torch.utils.data import DataLoader, Sampler

    if isinstance(value, DataLoader):
        return (
            "use tg.ResumableLoader(dataset, batch_size=..., shuffle=..., seed=...) in place of the DataLoader: "
            "it takes the same arguments (num_workers, collate_fn, ...) and its position (epoch and samples "
            "delivered) is saved and restored exactly; or torchdata's StatefulDataLoader"
        )
    if isinstance(value, Sampler):
        return (
            "use tg.ResumableLoader, or tg.ResumableSampler(len(dataset), shuffle=..., seed=...) whose "
            "state_dict() holds the epoch and the position your loop advances, with its DataLoader built by "
            "sampler.dataloader(dataset, batch_size=...) (seeded per epoch, so a resume is bit-exact)"
        )
    if type(value).__name__.endswith("DataLoaderIter"):
        return "save the loader, not its iterator: use tg.ResumableLoader, whose position is its state"
    if isinstance(value, torch.Generator):
        return "use tg.RNGState() for the global generators, or store generator.get_state() (a uint8 tensor)"
    if callable(value):
        return "store the settings that rebuild it (plain values), not the callable itself"
    return _GENERIC_FIX


def encode_value(value: Any, fqn: str) -> bytes:
    """Encode a value as tagged bytes.

    Raises:
        ConfigError: the value cannot be stored without pickle of arbitrary classes; the message names the
            entry, its type and what to store instead (e.g. ``tg.ResumableLoader`` for a ``DataLoader``).
    """
    if is_strict_json(value):
        try:
            return TAG_JSON + json.dumps(value, separators=(",", ":")).encode()
        except ValueError as e:  # an int beyond Python's int-to-str digit limit (4300 digits by default)
            raise ConfigError(
                f"state entry {fqn!r} holds an integer too large to store ({str(e).split(';')[0]}); store it as "
                "a string or split it into smaller ints"
            ) from None
    try:
        buf = io.BytesIO()
        torch.save(value, buf)
        data = buf.getvalue()
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure means the value would need unsafe pickle
        raise unsupported_value(value, fqn, e) from None
    if not all(bool_bytes_valid(t) for t in _tensors_in(loaded)):  # a restore would refuse it: refused now
        raise ConfigError(
            f"state entry {fqn!r} holds a bool tensor with bytes other than 0 and 1 (a uint8 tensor viewed as "
            "bool?), which a restore refuses as corrupt; store t.clone() of it (every nonzero byte becomes 1) "
            "or the uint8 tensor itself"
        )
    return TAG_TORCH + data


_PLAIN = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.Tensor,
    torch.dtype,
    torch.device,
    torch.Size,
)


def _culprit(x: Any, where: str = "", depth: int = 0) -> tuple[str, Any]:
    """The first value inside containers ``x`` that is not a plain value, and where it is (``"['a'][0]"``)."""
    if depth < 50 and isinstance(x, dict):
        for k, v in x.items():
            found = _culprit(v, f"{where}[{k!r}]", depth + 1)
            if found[1] is not None:
                return found
    elif depth < 50 and isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            found = _culprit(v, f"{where}[{i}]", depth + 1)
            if found[1] is not None:
                return found
    elif not isinstance(x, _PLAIN):
        return where, x
    return where, None


def unsupported_value(value: Any, fqn: str, cause: BaseException | None = None) -> ConfigError:
    """The error for a state entry that cannot be stored: names it, its type, and what to use instead."""
    where, inner = _culprit(value)
    at = ""
    if inner is not None and where:  # name the object inside the container, not the container
        at, value = f" at {where}", inner
    kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
    why = ""
    if cause is not None:
        # torch's own advice (weights_only=False, add_safe_globals) would run code on load: keep only the fact.
        text = plain_text(str(cause))
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        if found and found.group(1) != kind:
            why = f" (it contains {found.group(1)}, which torch.load(weights_only=True) refuses to build)"
        elif found:
            why = ""
        else:
            first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
            why = f" ({first[:160]})" if first and not first.startswith("Weights only load failed") else ""
    return ConfigError(
        f"state entry {fqn!r}{at} holds a value of type {kind}, which cannot be saved without pickle of arbitrary "
        f"classes{why}; "
        f"{instead_of(value)}"
    )


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
            value = torch.load(io.BytesIO(bytes(body)), weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise UnsafeCheckpointError(
                f"value {fqn!r}: payload refused by torch.load(weights_only=True): "
                f"{plain_text(str(e)).splitlines()[0][:200]}"
            ) from None
        if not all(bool_bytes_valid(t) for t in _tensors_in(value)):
            raise CorruptCheckpointError(
                f"value {fqn!r}: a bool tensor in it holds bytes other than 0 and 1 (torch's kernels assume 0 "
                "or 1): not a value torch.save wrote"
            )
        return value
    raise CorruptCheckpointError(f"value {fqn!r}: unknown payload tag {tag!r}")


def bool_bytes_valid(t: torch.Tensor) -> bool:
    """False for a bool tensor holding a byte other than 0 or 1 (what no torch operation writes; a forged or
    mistaken manifest or payload); True for any other tensor. One reduction over the tensor's own bytes, also
    for a strided view (``view(torch.uint8)`` keeps the strides; ``.contiguous()`` would copy through torch's
    bool copy, which turns every nonzero byte into 1 and hides them)."""
    if t.dtype != torch.bool or t.numel() == 0 or t.is_meta:  # a meta tensor holds no bytes
        return True
    if t.is_nested:
        return all(bool_bytes_valid(x) for x in t.unbind())
    if t.layout != torch.strided:  # sparse: the stored values (COO, CSR, CSC, BSR, BSC)
        values = t._values() if t.layout == torch.sparse_coo else t.values()
        return bool_bytes_valid(values)
    return int(t.detach().view(torch.uint8).max()) <= 1


def invalid_bools_problem(names: list[str]) -> str:
    """The message for bool tensors whose stored bytes are not all 0 or 1 (:func:`bool_bytes_valid`), naming
    up to 8 of them (``[]``: found on another rank), as restore, verify and the DCP reader report it."""
    if not names:
        return "a bool tensor on another rank holds bytes other than 0 and 1" + _BOOL_CAUSE
    shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
    verb = "tensor {} holds" if len(names) == 1 else "tensors {} hold"
    return f"bool {verb.format(shown)} bytes other than 0 and 1" + _BOOL_CAUSE


_BOOL_CAUSE = (
    ": the manifest's dtype does not describe its chunks (a forged or mistaken manifest); not loaded as bools"
)


_ATOMS = frozenset({int, float, str, bytes, bool, complex, type(None)})


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors inside a decoded value (dicts, lists, tuples, sets, slices, and the Python attributes that
    ``torch.load(weights_only=True)`` restores on a tensor or other object; any depth, each object once)."""
    out: list[torch.Tensor] = []
    todo = [value]
    seen: set[int] = set()
    while todo:
        v = todo.pop()
        if type(v) in _ATOMS or id(v) in seen:  # exact types: a subclass may carry attributes
            continue
        seen.add(id(v))
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            todo.extend(v)
        elif isinstance(v, slice):
            todo.extend((v.start, v.stop, v.step))
        attrs = getattr(v, "__dict__", None)  # a tensor's ``t.mask = ...``, restored with it
        if isinstance(attrs, dict):
            todo.extend(attrs.values())
    return out


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
