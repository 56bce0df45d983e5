"""``tg.Tier``: where a copy of every checkpoint goes, and how it is kept."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..retention import RetentionPolicy, as_retention

SECRET_OPTIONS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "session_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "account_key",
        "sas_token",
        "credentials",
        "client_secret",
    }
)


def redact(options: Any) -> Any:
    """``storage_options`` without secrets (keys in :data:`SECRET_OPTIONS`, at any depth), JSON-safe."""
    if isinstance(options, dict):
        return {str(k): redact(v) for k, v in options.items() if str(k).lower() not in SECRET_OPTIONS}
    if isinstance(options, (list, tuple)):
        return [redact(v) for v in options]
    if isinstance(options, (str, int, float, bool)) or options is None:
        return options
    return repr(options)


@dataclass(frozen=True)
class Tier:
    """A tier of checkpoint storage below the hot run root (a shared filesystem or an object store).

    A tier URL is itself a run root with the same layout: ``trainguard ls|verify URL`` and
    ``CheckpointManager(URL, read_only=True)`` read it directly.

    Args:
        url: a local path (a shared filesystem mount) or any fsspec URL (``s3://bucket/run1``); or a
            :class:`~trainguard.storage.Storage` (e.g. ``open_object_storage(url)`` wrapped in a
            :class:`~trainguard.storage.FaultyStorage` for fault tests; ``storage_options`` then unused).
        keep: retention on this tier: an int N keeps the newest N, a RetentionPolicy (``tg.KeepEvery(1000)``),
            or None to keep every checkpoint. The newest valid step of the tier is never deleted.
        sync: False (default): uploaded in the background after the hot commit. True: a dual-write replica:
            a save's ``wait()`` returns only when the hot root and this tier both committed, and a failure
            here fails the save.
        storage_options: passed to the fsspec filesystem (s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``); they override the environment.
        stall_timeout_s: a request making no progress for this many seconds is aborted and retried.
        upload_timeout_s: how long ``close()`` waits for this tier's uploads before raising TierUploadError.

    Raises:
        ConfigError: an invalid argument (the store itself is checked when the manager opens it).
    """

    url: str | Any
    keep: int | RetentionPolicy | None = field(default=None, kw_only=True)
    sync: bool = field(default=False, kw_only=True)
    storage_options: dict[str, Any] | None = field(default=None, kw_only=True)
    stall_timeout_s: float = field(default=60.0, kw_only=True)
    upload_timeout_s: float = field(default=600.0, kw_only=True)

    def __post_init__(self) -> None:
        from ..storage.base import Storage

        if isinstance(self.url, Storage):  # a tier given as a Storage (a FaultyStorage in fault tests)
            if self.storage_options is not None:
                raise ConfigError(
                    f"Tier({self.url!r}): storage_options apply to a URL; a Storage is already opened"
                )
        elif not isinstance(self.url, (str, os.PathLike)) or not os.fspath(self.url):
            raise ConfigError(f"Tier url must be a path or URL string, got {self.url!r}")
        else:
            object.__setattr__(self, "url", os.fspath(self.url))
        try:
            as_retention(self.keep)
        except (ConfigError, ValueError, TypeError) as e:
            raise ConfigError(f"Tier({self.url!r}) keep: {e}") from None
        for name in ("stall_timeout_s", "upload_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ConfigError(f"Tier({self.url!r}) {name} must be a number of seconds > 0, got {v!r}")
        if self.storage_options is not None and not isinstance(self.storage_options, dict):
            raise ConfigError(
                f"Tier({self.url!r}) storage_options must be a dict, got {self.storage_options!r}"
            )

    @property
    def key(self) -> str:
        """The tier's name in ``tiers`` mappings: the URL as given (a Storage's ``url``), without a trailing
        slash."""
        url = self.url if isinstance(self.url, str) else self.url.url
        return url.rstrip("/") or "/"

    @property
    def retention(self) -> RetentionPolicy | None:
        return as_retention(self.keep)

    def record(self) -> dict[str, Any]:
        """What the hot root records about this tier (no secrets)."""
        return {
            "url": self.key,
            "sync": self.sync,
            "keep": self.keep if isinstance(self.keep, int) or self.keep is None else repr(self.keep),
            "storage_options": redact(self.storage_options or {}),
        }
