"""Optional dependencies: imported lazily, and a missing one names the extra that installs it.

``import trainguard`` never imports an optional package; a feature that needs one calls :func:`require` when
it is used, so the error comes at that point and says what to install::

    safetensors = require("safetensors", feature="export --format safetensors")
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

# top-level module -> the extra of ``pip install 'trainguard[EXTRA]'`` that installs it
EXTRAS: dict[str, str] = {
    "safetensors": "safetensors",
    "lightning": "lightning",
    "pytorch_lightning": "lightning",
    "transformers": "hf",
    "accelerate": "hf",
    "ray": "ray",
    "s3fs": "s3",
    "fsspec": "s3",
    "torchdata": "data",
}


def install_hint(module: str) -> str:
    """``pip install 'trainguard[EXTRA]'`` for ``module`` (or ``pip install MODULE`` when no extra has it)."""
    extra = EXTRAS.get(module.split(".")[0])
    return f"pip install 'trainguard[{extra}]'" if extra else f"pip install {module.split('.')[0]}"


def require(module: str, *, feature: str) -> ModuleType:
    """Import ``module`` for ``feature`` or say which extra installs it.

    Args:
        module: the module to import (e.g. ``"safetensors.torch"``).
        feature: what needs it, for the message (e.g. ``"export --format safetensors"``).

    Returns:
        The imported module.

    Raises:
        MissingDependencyError: the package is not installed (also an ``ImportError``); the message names the
            feature, the package and the ``pip install 'trainguard[EXTRA]'`` command.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        if e.name is not None and e.name.split(".")[0] != top:
            raise  # the package is there but one of ITS dependencies is broken: show the real error
        raise MissingDependencyError(
            f"{feature} needs the optional package {top!r}, which is not installed; install it with "
            f"`{install_hint(top)}`",
            name=top,
        ) from None
