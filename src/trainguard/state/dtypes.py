"""dtype names on disk <-> torch dtypes. Only names of real torch dtypes are accepted (never a getattr on
an arbitrary string from a manifest)."""

from __future__ import annotations

import math

import torch

from ..errors import CorruptCheckpointError
from ..format import Manifest, TensorEntry

_NAMES: dict[str, torch.dtype] = {}
for _name in dir(torch):
    _obj = getattr(torch, _name, None)
    if isinstance(_obj, torch.dtype):
        _NAMES.setdefault(str(_obj).removeprefix("torch."), _obj)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of :func:`dtype_name`.

    Raises:
        CorruptCheckpointError: the name is not a dtype of this torch build.
    """
    try:
        return _NAMES[name]
    except KeyError:
        raise CorruptCheckpointError(
            f"unknown dtype {name!r} in manifest (this torch {torch.__version__} has no such dtype)"
        ) from None


def check_shard_bytes(manifest: Manifest) -> None:
    """Every tensor shard must hold exactly ``prod(sizes) * itemsize`` bytes of its dtype (any dtype of this
    torch, e.g. ``bits8``, not only the well-known ones the torch-free parser checks), before anything is
    allocated for it.

    Raises:
        CorruptCheckpointError: an unknown dtype, or a shard whose declared elements do not match its bytes
            (e.g. 2**40 elements of ``bits8`` backed by a 1 MB chunk).
    """
    for fqn, e in manifest.entries.items():
        if not isinstance(e, TensorEntry):
            continue
        try:
            itemsize = dtype_from_name(e.dtype).itemsize
        except CorruptCheckpointError as err:
            raise CorruptCheckpointError(f"{fqn}: {err}", step=manifest.step, tensors=[fqn]) from None
        for sh in e.shards:
            need = math.prod(sh.sizes) * itemsize
            if sh.nbytes != need:
                raise CorruptCheckpointError(
                    f"corrupt manifest: {fqn}: shard at {sh.offsets} holds {sh.nbytes} bytes but {sh.sizes} x "
                    f"{e.dtype} needs {need}",
                    step=manifest.step,
                    tensors=[fqn],
                )
