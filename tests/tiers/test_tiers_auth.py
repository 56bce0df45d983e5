"""Credentials and permissions on a real S3 API that enforces them: a moto server of its own with IAM
authentication switched on (moto's ``/moto-api/reset-auth``, the server-side of ``INITIAL_NO_AUTH_ACTION_COUNT``)
after an IAM setup: a user that may use the bucket, one that may only read it, one with no permission at all.
Every configuration problem fails at construction with a ConfigError that names it and the fix."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trainguard as tg
from trainguard.storage import objects

from .helpers import CHUNK, make_state, same, train, weights
from .netfaults import moto_server

pytestmark = pytest.mark.s3
BUCKET = "tg-auth"
READ = (
    "s3:ListBucket",
    "s3:GetObject",
    "s3:HeadBucket",
)  # moto checks HEAD bucket as s3:HeadBucket, AWS as List


def _policy(*actions: str) -> str:
    arns = [f"arn:aws:s3:::{BUCKET}", f"arn:aws:s3:::{BUCKET}/*"]
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": list(actions), "Resource": arns}],
        }
    )


@pytest.fixture(scope="module")
def auth_s3() -> Iterator[dict[str, Any]]:
    """A moto server enforcing IAM: endpoint and the keys of the users ``writer``, ``reader``, ``nobody``."""
    pytest.importorskip("moto", reason="moto is not installed (pip install 'moto[server]==5.2.5')")
    import boto3

    with moto_server() as ep:
        setup = dict(
            endpoint_url=ep, region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
        )
        boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **setup)
        users = {"writer": _policy("s3:*"), "reader": _policy(*READ), "nobody": None}
        keys = {}
        for user, policy in users.items():
            iam.create_user(UserName=user)
            if policy:
                iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=policy)
            k = iam.create_access_key(UserName=user)["AccessKey"]
            keys[user] = {"key": k["AccessKeyId"], "secret": k["SecretAccessKey"]}
        req = urllib.request.Request(
            f"{ep}/moto-api/reset-auth", data=b"0", method="POST", headers={"Content-Type": "text/plain"}
        )
        assert (
            json.loads(urllib.request.urlopen(req, timeout=30).read())["status"] == "ok"
        )  # enforced from now
        yield {"endpoint": ep, "keys": keys}


def _opts(auth_s3: dict[str, Any], user: str | None) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "client_kwargs": {"endpoint_url": auth_s3["endpoint"], "region_name": "us-east-1"}
    }
    if user == "unknown":
        opts.update(key="AKIAIOSFODNN7EXAMPLE", secret="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
    elif user is not None:
        opts.update(auth_s3["keys"][user])
    return opts


@pytest.fixture(params=[True, False], ids=["boto3", "s3fs"])
def s3_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(objects, "FAST_S3", request.param)
    return bool(request.param)


def test_the_store_enforces_auth_and_the_permitted_user_saves_and_restores(
    auth_s3: dict[str, Any], tmp_path: Path, s3_path: bool
) -> None:
    import boto3

    anon = boto3.client(
        "s3",
        endpoint_url=auth_s3["endpoint"],
        region_name="us-east-1",
        aws_access_key_id="AKIAIOSFODNN7EXAMPLE",
        aws_secret_access_key="nope",
    )
    with pytest.raises(Exception, match="InvalidAccessKeyId|403|Forbidden"):
        anon.list_objects_v2(Bucket=BUCKET)  # the server does check: a key IAM does not know is refused
    url = f"s3://{BUCKET}/run-{int(s3_path)}"
    state = make_state()
    with tg.CheckpointManager(
        tmp_path / "hot",
        tiers=[tg.Tier(url, storage_options=_opts(auth_s3, "writer"))],
        chunk_size_bytes=CHUNK,
    ) as mgr:
        train(state)
        mgr.save(1, state).wait()
    fresh = make_state(seed=4)  # a new node with read-only credentials restores from the tier
    with tg.CheckpointManager(
        tmp_path / "node2", read_only=True, tiers=[tg.Tier(url, storage_options=_opts(auth_s3, "reader"))]
    ) as ro:
        assert ro.restore_latest(fresh) == 1
    assert same(weights(state), weights(fresh))


@pytest.mark.parametrize("user", ["nobody", "unknown"])
def test_access_denied_fails_at_construction_naming_the_credentials_and_the_policy(
    auth_s3: dict[str, Any], tmp_path: Path, s3_path: bool, user: str
) -> None:
    tier = tg.Tier(f"s3://{BUCKET}/run", storage_options=_opts(auth_s3, user))
    with pytest.raises(tg.ConfigError, match="access denied") as ei:
        tg.CheckpointManager(tmp_path / "hot", tiers=[tier])
    assert "AWS_ACCESS_KEY_ID" in str(ei.value) and "policy" in str(ei.value)
    with pytest.raises(tg.ConfigError, match="access denied"):
        tg.CheckpointManager(f"s3://{BUCKET}/url-root", storage_options=_opts(auth_s3, user))


def test_credentials_that_may_only_read_fail_a_writer_at_construction_not_in_a_background_upload(
    auth_s3: dict[str, Any], tmp_path: Path, s3_path: bool
) -> None:
    tier = tg.Tier(f"s3://{BUCKET}/run", storage_options=_opts(auth_s3, "reader"))
    with pytest.raises(tg.ConfigError, match="access denied for writing") as ei:
        tg.CheckpointManager(tmp_path / "hot", tiers=[tier])
    assert "s3:PutObject" in str(ei.value) and "read_only=True" in str(ei.value)
    tg.CheckpointManager(tmp_path / "hot", read_only=True, tiers=[tier]).close()  # reading is allowed


def test_missing_credentials_fail_at_construction_naming_the_variables_to_set(
    auth_s3: dict[str, Any], tmp_path: Path, s3_path: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup on a dev machine
    tier = tg.Tier(f"s3://{BUCKET}/run", storage_options=_opts(auth_s3, None), stall_timeout_s=5)
    with pytest.raises(tg.ConfigError, match="no credentials found") as ei:
        tg.CheckpointManager(tmp_path / "hot", tiers=[tier])
    assert "AWS_ACCESS_KEY_ID" in str(ei.value) and "anon" in str(ei.value)
