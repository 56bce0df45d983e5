"""Flattening of nested state into ``{fqn: leaf}`` and back.

Leaves are tensors and non-tensor values. A dict/list/tuple is descended into only when it contains a tensor
somewhere; otherwise it is one value leaf (so an optimizer's ``param_groups`` is one entry, not hundreds).
Each leaf keeps its path as ``(tag, key)`` pairs: ``s`` str key, ``i`` int key, ``l`` list index, ``t`` tuple
index, so the nested structure is rebuilt exactly from the manifest alone (no template needed). The FQN joins
the keys with ``.`` as torch does (``model.layer.0.weight``, ``optim.state.0.exp_avg``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError, CorruptCheckpointError

PathT = tuple[tuple[str, Any], ...]

INT_KEY_MIN, INT_KEY_MAX = -(1 << 63), (1 << 63) - 1
"""The int keys a manifest path holds (a signed 64-bit integer, as JSON readers outside Python keep them)."""


def has_tensor(x: Any, depth: int = 0) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if depth > 100:
        return False
    if isinstance(x, Mapping):
        return any(has_tensor(v, depth + 1) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(has_tensor(v, depth + 1) for v in x)
    return False


def _short_int(k: int) -> str:
    """``k`` as text, or its size for an int too long to print (Python refuses beyond 4,300 digits)."""
    return str(k) if k.bit_length() <= 256 else f"of {k.bit_length()} bits"


def key_text(k: Any) -> str:
    """A path key as a name shows it: the text a manifest path stores for it.

    A str or int subclass (a ``(str, Enum)`` or ``(int, Enum)`` member, whose ``str()`` is ``"Phase.TRAIN"``)
    shows its value, as JSON writes it into the path (``"train"``, ``1``), so a name read back from a
    manifest equals the name a live state's key gives.
    """
    if isinstance(k, str):
        return str.__str__(k)
    if isinstance(k, int):
        return int.__repr__(k)
    return str(k)


def fqn_of(path: PathT) -> str:
    """The name of a leaf at ``path``: its keys' :func:`key_text` joined with ``.`` (``model.layer.0.weight``)."""
    return ".".join(key_text(k) for _, k in path)


def flatten(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, PathT]]:
    """Flatten ``state`` (str keys at the top) into leaves.

    Returns:
        ``(flat, paths)``: ``flat[fqn]`` is a tensor or a value; ``paths[fqn]`` its path.

    Raises:
        ConfigError: a key that is neither str nor int inside a container holding tensors, an int key outside
            the signed 64-bit range, or two leaves
            whose FQNs collide (e.g. keys ``"a.b"`` and ``"a" -> "b"``).
    """
    flat: dict[str, Any] = {}
    paths: dict[str, PathT] = {}

    def visit(x: Any, path: PathT) -> None:
        if (
            isinstance(x, torch.Tensor)
            or not has_tensor(x)
            or (isinstance(x, (Mapping, list, tuple)) and len(x) == 0)
        ):
            fqn = fqn_of(path)
            if fqn in flat:
                raise ConfigError(
                    f"two state entries flatten to the same name {fqn!r}; rename one of the keys "
                    "(keys are joined with '.')"
                )
            flat[fqn] = x
            paths[fqn] = path
            return
        if isinstance(x, Mapping):
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise ConfigError(
                        f"state key {k!r} under {fqn_of(path)!r} is a {type(k).__name__}; only str and int keys are "
                        "supported in containers that hold tensors"
                    )
                if isinstance(k, int) and not INT_KEY_MIN <= k <= INT_KEY_MAX:
                    raise ConfigError(
                        f"state key {_short_int(k)} under {fqn_of(path)!r} is outside the signed 64-bit range "
                        "[-2**63, 2**63 - 1] a manifest path holds; use a smaller int or a str key"
                    )
                visit(v, (*path, ("s" if isinstance(k, str) else "i", k)))
        else:
            tag = "t" if isinstance(x, tuple) else "l"
            for i, v in enumerate(x):
                visit(v, (*path, (tag, i)))

    for key, value in state.items():
        if not isinstance(key, str):
            raise ConfigError(f"top-level state keys must be strings, got {key!r}")
        visit(value, (("s", key),))
    return flat, paths


def unflatten(flat: Mapping[str, Any], paths: Mapping[str, PathT]) -> dict[str, Any]:
    """Rebuild the nested structure from leaves and their paths.

    Raises:
        CorruptCheckpointError: the paths are inconsistent (a list index missing, a key used as both).
    """
    root: dict[str, Any] = {"kind": "d", "children": {}}

    def child(node: dict[str, Any], tag: str, key: Any, leaf: bool, fqn: str) -> dict[str, Any]:
        kind = "d" if tag in ("s", "i") else tag
        if node["kind"] is None:
            node["kind"] = kind
        elif node["kind"] != kind:
            raise CorruptCheckpointError(f"inconsistent structure at {fqn!r}: mixed container kinds")
        children = node["children"]
        if key not in children:
            children[key] = {"kind": None, "children": {}, "leaf": leaf}
        elif leaf or children[key].get("leaf"):
            raise CorruptCheckpointError(
                f"inconsistent structure at {fqn!r}: a leaf and a container share a path"
            )
        return children[key]

    values: dict[int, Any] = {}
    for fqn, path in paths.items():
        node = root
        for n, (tag, key) in enumerate(path):
            last = n == len(path) - 1
            node = child(node, tag, key, last, fqn)
            if last:
                values[id(node)] = flat[fqn]

    def build(node: dict[str, Any]) -> Any:
        if node.get("leaf"):
            return values[id(node)]
        kind, children = node["kind"], node["children"]
        if kind == "d" or kind is None:
            return {k: build(v) for k, v in children.items()}
        idx = sorted(children)
        if idx != list(range(len(idx))):
            raise CorruptCheckpointError("inconsistent structure: list indices are not 0..n-1")
        items = [build(children[i]) for i in idx]
        return tuple(items) if kind == "t" else items

    out = build(root)
    assert isinstance(out, dict)
    return out
