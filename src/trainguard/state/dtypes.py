"""dtype names on disk <-> torch dtypes. Only names of real torch dtypes are accepted (never a getattr on
an arbitrary string from a manifest)."""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError

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
