"""Object stores for tiers and URL run roots: move whole objects by relative name, nothing else.

A store holds a run root's files by relative name (``chunks/ab/<hash>``, ``step-000000100/manifest.json``).
No backend knows about tensors or manifests. Two backends:

- :class:`LocalObjects`: a directory (a shared filesystem mount); every put is atomic (tmp + fsync + rename).
- :class:`FsspecObjects`: any fsspec URL (``s3://`` through s3fs, ``gs://``, ``az://``, ``memory://``). A put
  is one PUT (atomic on an object store: readers see the old object, nothing, or the whole new one).

:func:`open_objects` picks the backend from the URL and checks the configuration at once (unknown scheme,
missing backend package, missing credentials, missing bucket, access denied fail with
:class:`~trainguard.errors.ConfigError`; an unreachable store only sets :attr:`FsspecObjects.unreachable`).
"""

from __future__ import annotations

import gc
import os
import secrets
import sys
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError, MissingDependencyError, TransientStorageError
from .local import atomic_write, fsync_dir
from .safeio import ensure_dir, lstat_regular, read_bounded

# scheme -> (fsspec backend package, trainguard extra that installs it)
BACKEND_PACKAGES = {
    "s3": ("s3fs", "trainguard[s3]"),
    "s3a": ("s3fs", "trainguard[s3]"),
    "gs": ("gcsfs", "gcsfs"),
    "gcs": ("gcsfs", "gcsfs"),
    "az": ("adlfs", "adlfs"),
    "abfs": ("adlfs", "adlfs"),
    "abfss": ("adlfs", "adlfs"),
}
PROBE_EXTRA_S = 5.0
"""The construction check's deadline is ``stall_timeout_s`` plus this (it also creates the client session)."""
MAX_OBJECT_BYTES = 8 << 30
"""Largest object read whole (a chunk is at most ``chunk_size_bytes``; a manifest at most 1 GiB)."""


@runtime_checkable
class ObjectStore(Protocol):
    """The byte interface of a tier. Names are ``/``-separated paths relative to the store's root."""

    url: str
    supports_conditional_create: bool
    unreachable: str | None  # why the store could not be reached when opened (None: it answered)

    def put(self, name: str, data: bytes | memoryview) -> None:
        """Publish ``data`` under ``name`` atomically (replacing an existing object)."""

    def create(self, name: str, data: bytes) -> bool:
        """Create ``name`` only if it does not exist; True if created, False if it existed."""

    def get(self, name: str) -> bytes:
        """The whole object (FileNotFoundError when missing)."""

    def size(self, name: str) -> int | None:
        """The object's size in bytes, or None when missing."""

    def list(self, prefix: str = "") -> dict[str, int]:
        """name -> size of every object whose name starts with ``prefix`` (recursive)."""

    def delete(self, name: str) -> None:
        """Remove an object; missing is fine."""


def is_url(root: object) -> bool:
    """True for ``scheme://...`` strings (``file://`` included), False for plain paths."""
    return isinstance(root, str) and "://" in root


class LocalObjects:
    """A directory as an object store (a shared filesystem mount): atomic, durable puts."""

    supports_conditional_create = True

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.root = Path(root)
        self.url = str(root).rstrip("/") or "/"
        self.fsync = fsync
        self.unreachable: str | None = None
        try:
            ensure_dir(self.root, what="tier root")
        except OSError as e:
            raise ConfigError(
                f"tier root {self.root} cannot be created ({e}): choose a writable directory"
            ) from e

    def _path(self, name: str) -> Path:
        return self.root / name

    def put(self, name: str, data: bytes | memoryview) -> None:
        p = self._path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(p, bytes(data), fsync=self.fsync)

    def create(self, name: str, data: bytes) -> bool:
        p = self._path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, data)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if self.fsync:
            fsync_dir(p.parent)
        return True

    def get(self, name: str) -> bytes:
        return read_bounded(self._path(name), MAX_OBJECT_BYTES, what="object")

    def size(self, name: str) -> int | None:
        st = lstat_regular(self._path(name))
        return None if st is None else st.st_size

    def list(self, prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        base = self.root
        for dirpath, _dirs, files in os.walk(base):
            rel_dir = os.path.relpath(dirpath, base)
            for f in files:
                if f.startswith(".") and ".tmp-" in f:
                    continue  # an atomic write in progress
                rel = f if rel_dir == "." else f"{rel_dir}/{f}"
                if rel.startswith(prefix):
                    st = lstat_regular(os.path.join(dirpath, f))
                    if st is not None:
                        out[rel] = st.st_size
        return out

    def delete(self, name: str) -> None:
        try:
            self._path(name).unlink()
        except FileNotFoundError:
            pass


def _classify(e: BaseException) -> str:
    """'missing' | 'denied' | 'credentials' | 'unreachable' | 'other' for an exception of a store call."""
    name = type(e).__name__
    text = str(e)
    if isinstance(e, FileNotFoundError) or "NoSuchBucket" in text:
        return "missing"
    if isinstance(e, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
        return "denied"
    if "NoCredentials" in name or "credentials" in text.lower() and "unable to locate" in text.lower():
        return "credentials"
    if (
        isinstance(e, (ConnectionError, TimeoutError))
        or "Timeout" in name
        or "Connect" in name
        or "Endpoint" in name
        or "ClientOSError" in name
        or "ServerDisconnected" in name
    ):
        return "unreachable"
    if isinstance(e, OSError):
        return "unreachable"
    return "other"


def configuration_error(url: str, bucket: str, kind: str, e: BaseException) -> None:
    """Raise the ConfigError for a construction check that failed with ``kind`` (see :func:`_classify`);
    return for kinds that are not configuration errors (an unreachable store)."""
    if kind == "denied":
        raise ConfigError(
            f"{url!r}: access denied ({e}): check the credentials (AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or storage_options) and the bucket's policy"
        ) from None
    if kind == "credentials":
        raise ConfigError(
            f"{url!r}: no credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or pass "
            "storage_options={'key': ..., 'secret': ...}); for a public bucket pass "
            "storage_options={'anon': True}"
        ) from None
    if kind == "missing":
        raise ConfigError(
            f"{url!r}: the bucket {bucket!r} does not exist on this store: create it (e.g. "
            f"`aws s3 mb s3://{bucket}`) or fix the URL"
        ) from None


_HOOK_LOCK = threading.Lock()


def _construct(cls: Any, opts: dict[str, Any], url: str, scheme: str) -> Any:
    """``cls(**opts)``; a filesystem that fails to construct (``ftp://`` without its ``host`` option, a bad
    option) is a ConfigError naming the URL and the problem. While it is built, the ``__del__`` of ``cls``
    reports nothing: some (FTPFileSystem's) fail on an object whose ``__init__`` did not finish and would print
    "Exception ignored in ..." noise; any other unraisable exception goes to Python's hook as usual."""
    own_del = getattr(cls, "__del__", None)
    problem = None
    with _HOOK_LOCK:  # constructions in several threads: each restores the hook it replaced, in order
        hook = sys.unraisablehook

        def quiet(u: Any) -> None:
            if own_del is None or u.object is not own_del:
                hook(u)

        sys.unraisablehook = quiet
        try:
            return cls(**opts)
        except Exception as e:  # noqa: BLE001 - any construction failure is a configuration problem
            problem = f"{type(e).__name__}: {e}"
        finally:
            if problem is not None:
                gc.collect()  # a half-built object in a reference cycle goes now, while its __del__ is quiet
            sys.unraisablehook = hook
    raise ConfigError(
        f"{url!r}: the {scheme}:// filesystem could not be created from this URL and its storage_options "
        f"({problem}); pass the filesystem's required options in storage_options (see the fsspec "
        f"documentation of {cls.__name__}) or use a supported URL (s3://, gs://, az://, memory://)"
    )


class FsspecObjects:
    """Any fsspec URL as an object store.

    Args:
        url: ``scheme://bucket/prefix`` (the run root on the store).
        storage_options: passed to the fsspec filesystem (for s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``); they override the environment (``AWS_ENDPOINT_URL``,
            ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``).
        stall_timeout_s: a request that makes no progress for this long is aborted (raised as
            TransientStorageError; the caller retries). For s3 this is botocore's connect and read timeout,
            and every request also has a deadline of ``stall_timeout_s`` plus 1 s per MiB it sends.

    Raises:
        ConfigError: an unknown scheme, missing credentials, a bucket the store says does not exist, access
            denied.
        MissingDependencyError: fsspec or the scheme's backend package (s3fs, gcsfs, adlfs) is not installed;
            the message names what to install (``pip install 'trainguard[s3]'``).
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, stall_timeout_s: float = 60.0
    ) -> None:
        from .._optional import require

        fsspec = require("fsspec", feature=f"the run root or tier {url!r}")
        from fsspec.registry import known_implementations

        self.url = url.rstrip("/")
        self.scheme = url.split("://", 1)[0].lower()
        self.stall_timeout_s = float(stall_timeout_s)
        self.unreachable: str | None = None
        if self.scheme not in known_implementations and self.scheme not in fsspec.available_protocols():
            raise ConfigError(
                f"{url!r}: unknown storage scheme {self.scheme!r}; use a local path or an fsspec URL "
                "(s3://, gs://, az://, memory://, ...)"
            )
        try:
            cls = fsspec.get_filesystem_class(self.scheme)
        except ImportError as e:
            pkg, extra = BACKEND_PACKAGES.get(self.scheme, (None, None))
            what = f"`pip install '{extra}'`" if extra else "the fsspec backend package named here"
            raise MissingDependencyError(
                f"{url!r}: the {self.scheme}:// backend package {pkg or ''} is not installed: install it with "
                f"{what} ({e})",
                name=pkg,
            ) from None
        opts = dict(storage_options or {})
        opts.setdefault("skip_instance_cache", True)
        if self.scheme in ("s3", "s3a"):
            opts.setdefault("use_listings_cache", False)
            cfg = dict(opts.get("config_kwargs") or {})
            cfg.setdefault("connect_timeout", min(self.stall_timeout_s, 10.0))
            cfg.setdefault("read_timeout", self.stall_timeout_s)
            cfg.setdefault("retries", {"max_attempts": 1})  # trainguard retries with its own backoff
            opts["config_kwargs"] = cfg
        self.fs = _construct(cls, opts, url, self.scheme)
        self.async_ = bool(getattr(self.fs, "async_impl", False))
        self.root = self.fs._strip_protocol(url).rstrip("/")
        self.supports_conditional_create = self.scheme in ("s3", "s3a", "memory", "file", "local")
        self._probe()

    # -- construction check ---------------------------------------------------------------------------------
    def _probe(self) -> None:
        bucket = self.root.split("/", 1)[0]
        try:
            self._call(
                self.fs.ls,
                bucket if self.scheme in ("s3", "s3a", "gs", "gcs") else self.root,
                detail=False,
                extra_s=PROBE_EXTRA_S,
            )
        except FileNotFoundError:
            if self.scheme in ("s3", "s3a", "gs", "gcs"):
                raise ConfigError(
                    f"{self.url!r}: the bucket {bucket!r} does not exist on this store: create it (e.g. "
                    f"`aws s3 mb s3://{bucket}`) or fix the URL"
                ) from None
        except TransientStorageError as e:
            kind = _classify(e.__cause__ or e)
            self._configuration_error(kind, e.__cause__ or e)
            self.unreachable = str(e)

    def _configuration_error(self, kind: str, e: BaseException) -> None:
        configuration_error(self.url, self.root.split("/", 1)[0], kind, e)

    # -- calls ------------------------------------------------------------------------------------------
    def _call(self, fn: Any, *args: Any, nbytes: int = 0, extra_s: float = 0.0, **kwargs: Any) -> Any:
        """Run one request with a deadline; connection problems become TransientStorageError."""
        deadline = self.stall_timeout_s + nbytes / float(1 << 20) + extra_s
        try:
            if self.async_:
                return fn(*args, timeout=deadline, **kwargs)
            return fn(*args, **kwargs)
        except (FileNotFoundError, FileExistsError):
            raise
        except Exception as e:  # noqa: BLE001 - classified below
            kind = _classify(e)
            if kind in ("unreachable", "other") or "Timeout" in type(e).__name__:
                raise TransientStorageError(
                    f"{self.url}: {type(e).__name__}: {str(e) or 'no progress within the stall timeout'}"
                ) from e
            if kind == "missing":
                raise FileNotFoundError(str(e)) from e
            raise TransientStorageError(f"{self.url}: {type(e).__name__}: {e}") from e

    def _full(self, name: str) -> str:
        return f"{self.root}/{name}"

    def put(self, name: str, data: bytes | memoryview) -> None:
        data = bytes(data)
        self._call(self.fs.pipe_file, self._full(name), data, nbytes=len(data))

    def create(self, name: str, data: bytes) -> bool:
        if not self.supports_conditional_create:
            if self.size(name) is not None:
                return False
            self.put(name, data)
            return True
        try:
            self._call(self.fs.pipe_file, self._full(name), data, mode="create", nbytes=len(data))
        except FileExistsError:
            return False
        except TransientStorageError as e:
            text = str(e.__cause__ or e)
            if "PreconditionFailed" in text or "412" in text or "ConditionalRequestConflict" in text:
                return False
            raise
        return True

    def get(self, name: str) -> bytes:
        size = self.size(name)
        if size is None:
            raise FileNotFoundError(f"{self.url}/{name}")
        if size > MAX_OBJECT_BYTES:
            raise TransientStorageError(f"{self.url}/{name}: {size} bytes, more than an object may have")
        return bytes(self._call(self.fs.cat_file, self._full(name), nbytes=size))

    def size(self, name: str) -> int | None:
        try:
            info = self._call(self.fs.info, self._full(name))
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def list(self, prefix: str = "") -> dict[str, int]:
        head, _, tail = prefix.rpartition("/")
        where = self._full(head) if head else self.root
        kwargs: dict[str, Any] = {"detail": True}
        if tail and self.scheme in ("s3", "s3a"):
            kwargs["prefix"] = tail  # listed by the store, not filtered here
        try:
            found = self._call(self.fs.find, where, **kwargs)
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        base = self.root + "/"
        for path, info in found.items():
            p = self.fs._strip_protocol(path)
            if p.startswith(base) and info.get("type") != "directory":
                rel = p[len(base) :]
                if rel.startswith(prefix):
                    out[rel] = int(info.get("size") or 0)
        return out

    def delete(self, name: str) -> None:
        try:
            self._call(self.fs.rm_file, self._full(name))
        except FileNotFoundError:
            pass


FAST_S3 = True
"""``s3://`` through boto3 (threads, 2x s3fs's throughput on loopback, see benchmarks/RESULTS.md) when boto3 is
installed; False: through s3fs like every other fsspec URL."""


def open_objects(
    url: str | os.PathLike[str],
    storage_options: dict[str, Any] | None = None,
    *,
    stall_timeout_s: float = 60.0,
    fsync: bool = True,
) -> ObjectStore:
    """The object store for a tier or URL root: a local path or ``file://`` URL gives :class:`LocalObjects`,
    ``s3://`` gives :class:`~trainguard.storage.s3.S3Objects` where boto3 is installed (:data:`FAST_S3`), any
    other URL :class:`FsspecObjects` (see there for the errors raised)."""
    s = os.fspath(url)
    if not is_url(s):
        return LocalObjects(s, fsync=fsync)
    if s.startswith("file://"):
        return LocalObjects(s[len("file://") :], fsync=fsync)
    if s.split("://", 1)[0].lower() in ("s3", "s3a") and FAST_S3:
        try:
            import boto3  # noqa: F401 - the fast path needs it
        except ImportError:
            pass
        else:
            from .s3 import S3Objects

            return S3Objects(s, storage_options, stall_timeout_s=stall_timeout_s)
    return FsspecObjects(s, storage_options, stall_timeout_s=stall_timeout_s)


def nonce() -> str:
    return secrets.token_hex(6)
