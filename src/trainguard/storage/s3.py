"""``s3://`` through boto3: the fast path for S3 tiers and run roots (same interface and errors as
:class:`~trainguard.storage.objects.FsspecObjects`).

boto3's client is thread-safe and its sockets carry ``stall_timeout_s`` as connect and read timeout, which also
bounds every send: a request that makes no progress for that long fails (TransientStorageError) and the caller
retries. ``storage_options`` take s3fs's names, so the same options work on both paths: ``key``, ``secret``,
``token``, ``anon``, ``endpoint_url``, ``client_kwargs`` (passed to ``boto3.client``: ``endpoint_url``,
``region_name``, ...) and ``config_kwargs`` (``botocore.config.Config``).
"""

from __future__ import annotations

import base64
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, BinaryIO

from ..errors import ConfigError, TransientStorageError
from .objects import MAX_OBJECT_BYTES, _classify, configuration_error


def _code(e: BaseException) -> str:
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        return str(err.get("Code") or resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or "")
    return ""


CLIENT_CACHE_SIZE = 16
_clients: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_clients_lock = threading.Lock()


def _frozen(v: Any) -> Any:
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


def client_for(cfg: dict[str, Any], client_kwargs: dict[str, Any]) -> Any:
    """A boto3 S3 client for this configuration, shared by the stores of one process that ask for the same one.

    Creating a client loads botocore's service and endpoint models (0.2-0.7 s on the project's 2-core VM, most
    of a restore's start-up); a client is thread-safe, so stores with the same configuration share one. The
    key is the configuration, the client arguments and every ``AWS_*`` environment variable (credentials and
    endpoint come from there), so a changed environment gets a new client. At most ``CLIENT_CACHE_SIZE`` are
    kept (least recently used dropped).
    """
    import boto3
    from botocore.config import Config

    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    key = (_frozen(cfg), _frozen(client_kwargs), env)
    with _clients_lock:  # a boto3 Session is not thread-safe: create clients one at a time
        client = _clients.get(key)
        if client is None:
            client = boto3.session.Session().client("s3", config=Config(**cfg), **client_kwargs)
            _clients[key] = client
            while len(_clients) > CLIENT_CACHE_SIZE:
                _clients.popitem(last=False)
        _clients.move_to_end(key)
        return client


class S3Objects:
    """An S3 (or S3-compatible) prefix as an object store, through boto3.

    Args:
        url: ``s3://bucket/prefix``.
        storage_options: s3fs-style options (module docstring); they override the AWS environment
            (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``).
        stall_timeout_s: connect and read timeout of every request, in seconds.

    Raises:
        ConfigError: missing credentials, a missing bucket, access denied (an unreachable store only sets
            :attr:`unreachable`).
    """

    supports_conditional_create = True

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, *, stall_timeout_s: float = 60.0
    ) -> None:
        self.url = url.rstrip("/")
        path = self.url.split("://", 1)[1]
        self.bucket, _, prefix = path.partition("/")
        if not self.bucket:
            raise ConfigError(f"{url!r}: no bucket in the URL (s3://BUCKET/prefix)")
        self.prefix = prefix.strip("/")
        self.stall_timeout_s = float(stall_timeout_s)
        self.unreachable: str | None = None
        opts = dict(storage_options or {})
        client_kwargs = dict(opts.pop("client_kwargs", None) or {})
        cfg = dict(opts.pop("config_kwargs", None) or {})
        cfg.setdefault("connect_timeout", min(self.stall_timeout_s, 10.0))
        cfg.setdefault("read_timeout", self.stall_timeout_s)
        cfg.setdefault("retries", {"max_attempts": 1})  # trainguard retries with its own backoff
        cfg.setdefault("max_pool_connections", 32)
        # trainguard checks every byte it reads against its own CRC32C: no second checksum pass by botocore
        cfg.setdefault("response_checksum_validation", "when_required")
        if opts.pop("anon", False):
            from botocore import UNSIGNED

            cfg["signature_version"] = UNSIGNED
        for ours, theirs in (
            ("key", "aws_access_key_id"),
            ("secret", "aws_secret_access_key"),
            ("token", "aws_session_token"),
            ("endpoint_url", "endpoint_url"),
            ("region_name", "region_name"),
        ):
            if ours in opts:
                client_kwargs.setdefault(theirs, opts.pop(ours))
        opts.pop("skip_instance_cache", None)
        opts.pop("use_listings_cache", None)
        self.client = client_for(cfg, client_kwargs)
        self._probe()

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _probe(self) -> None:
        try:
            self._call(self.client.head_bucket, Bucket=self.bucket)
        except FileNotFoundError:
            configuration_error(self.url, self.bucket, "missing", FileNotFoundError(self.bucket))
        except TransientStorageError as e:
            cause = e.__cause__ or e
            configuration_error(self.url, self.bucket, _classify(cause), cause)
            self.unreachable = str(e)

    def _call(self, fn: Any, **kwargs: Any) -> Any:
        try:
            return fn(**kwargs)
        except Exception as e:  # noqa: BLE001 - classified below
            code = _code(e)
            if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
                raise FileNotFoundError(f"{self.url}: {code}") from e
            if code in ("AccessDenied", "403", "Forbidden", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                raise TransientStorageError(f"{self.url}: access denied ({code})") from PermissionError(
                    str(e)
                )
            raise TransientStorageError(
                f"{self.url}: {type(e).__name__}: {e or 'no progress within the stall timeout'}"
            ) from e

    def put(self, name: str, data: bytes | bytearray | memoryview) -> None:
        body = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self._call(self.client.put_object, Bucket=self.bucket, Key=self._key(name), Body=body)

    def put_checked(self, name: str, data: bytes | bytearray | BinaryIO, crc: int) -> None:
        """:meth:`put` with the bytes' CRC32C (an unsigned 32-bit int) sent as ``x-amz-checksum-crc32c``: S3
        refuses the object when the bytes it received do not match it (end-to-end integrity on the way in), and
        botocore computes no checksum of its own. moto accepts it without checking (tests check on our side).
        ``data`` may be a seekable file-like object with ``len()`` (streamed in blocks, e.g.
        :class:`~trainguard.tiers.upload.ChunkBody`); an exception its ``read`` raises fails the request
        before the last byte is sent, so no object is created."""
        digest = base64.b64encode(int(crc).to_bytes(4, "big")).decode()
        self._call(
            self.client.put_object, Bucket=self.bucket, Key=self._key(name), Body=data, ChecksumCRC32C=digest
        )

    def create(self, name: str, data: bytes) -> bool:
        try:
            self._call(
                self.client.put_object, Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*"
            )
        except TransientStorageError as e:
            if _code(e.__cause__ or e) in ("PreconditionFailed", "412", "ConditionalRequestConflict"):
                return False
            raise
        return True

    def get(self, name: str) -> bytes:
        resp = self._call(self.client.get_object, Bucket=self.bucket, Key=self._key(name))
        size = int(resp.get("ContentLength") or 0)
        body = resp["Body"]
        try:
            if size > MAX_OBJECT_BYTES:
                raise TransientStorageError(f"{self.url}/{name}: {size} bytes, more than an object may have")
            return bytes(self._read(body))
        finally:
            body.close()

    def stream(self, name: str, block_bytes: int = 8 << 20) -> Iterator[bytes]:
        """The object's bytes in blocks of at most ``block_bytes`` as they arrive (a download to a file writes
        each block while the next one is on the wire). FileNotFoundError when missing; a dropped connection or
        a read timeout mid-body raises TransientStorageError."""
        resp = self._call(self.client.get_object, Bucket=self.bucket, Key=self._key(name))
        body = resp["Body"]
        try:
            while True:
                try:
                    block = body.read(block_bytes)
                except Exception as e:  # noqa: BLE001 - a read timeout or a dropped connection mid-body
                    raise TransientStorageError(f"{self.url}: {type(e).__name__}: {e}") from e
                if not block:
                    return
                yield block
        finally:
            body.close()

    def _read(self, body: Any) -> bytes:
        try:
            return body.read()
        except Exception as e:  # noqa: BLE001 - a read timeout or a dropped connection mid-body
            raise TransientStorageError(f"{self.url}: {type(e).__name__}: {e}") from e

    def size(self, name: str) -> int | None:
        try:
            resp = self._call(self.client.head_object, Bucket=self.bucket, Key=self._key(name))
        except FileNotFoundError:
            return None
        return int(resp.get("ContentLength") or 0)

    def list(self, prefix: str = "") -> dict[str, int]:
        base = self._key("")
        out: dict[str, int] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base + prefix}
            if token:
                kwargs["ContinuationToken"] = token
            resp = self._call(self.client.list_objects_v2, **kwargs)
            for obj in resp.get("Contents") or []:
                out[obj["Key"][len(base) :]] = int(obj.get("Size") or 0)
            if not resp.get("IsTruncated"):
                return out
            token = resp.get("NextContinuationToken")

    def delete(self, name: str) -> None:
        try:
            self._call(self.client.delete_object, Bucket=self.bucket, Key=self._key(name))
        except FileNotFoundError:
            pass
