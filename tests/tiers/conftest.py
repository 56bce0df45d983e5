from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from .netfaults import Proxy, moto_server


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """moto's standalone S3 server on 127.0.0.1 (a free port) for the whole session."""
    pytest.importorskip("moto", reason="moto is not installed (pip install 'moto[server]==5.2.5')")
    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install 'trainguard[s3]')")
    with moto_server() as url:
        yield url


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The standard AWS environment pointing at the moto server (any credentials work there)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return s3_endpoint


@pytest.fixture
def bucket(s3_env: str) -> str:
    """A fresh bucket on the moto server; returns its name."""
    import boto3

    name = f"tg-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_env, region_name="us-east-1").create_bucket(Bucket=name)
    return name


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[Proxy]:
    """A stall/drop-capable TCP proxy in front of the moto server."""
    port = int(s3_endpoint.rsplit(":", 1)[1])
    p = Proxy(port)
    yield p
    p.close()
