"""Uploads yield to a save's staging: bytes of upload work (1 MiB blocks read from the hot root, CRC32C-checked
and handed to the HTTP client) done while a save was staging, with the StagingGate on vs off (a no-op), in a
training loop with an async S3 tier on moto (4 saves of 256 MiB, 10 steps of matmuls between saves). A count,
not a time: it does not depend on the machine's load.

    .venv/bin/python benchmarks/bench_tiers_yield.py [PAIRS]
"""

import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

import boto3
import torch

import trainguard as tg
import trainguard.tiers.upload as U

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from tiers.netfaults import moto_server  # noqa: E402

scratch = Path(
    tempfile.mkdtemp(dir=os.path.join(REPO, "build") if os.path.isdir(os.path.join(REPO, "build")) else None)
)
real_fill, real_yield = U.ChunkBody._fill, U.StagingGate.yield_to_staging
stats = {"during": 0, "total": 0}
gates = []


def fill(self):
    before = self._read
    real_fill(self)
    n = self._read - before if self._read >= before else self._read
    stats["total"] += n
    if any(g._staging for g in gates):
        stats["during"] += n


U.ChunkBody._fill = fill
real_init = U.StagingGate.__init__


def init(self):
    real_init(self)
    gates.append(self)


U.StagingGate.__init__ = init
with moto_server() as url:
    os.environ.update(
        AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1"
    )
    s3 = boto3.client("s3", endpoint_url=url)
    g = torch.Generator().manual_seed(0)
    d = {f"w{i}": torch.randn(16 << 20, generator=g) for i in range(4)}

    class H:
        def state_dict(self):
            return d

        def load_state_dict(self, sd):
            pass

    a = torch.randn(512, 512)
    for rep in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
        for gate_on in (True, False) if rep % 2 == 0 else (False, True):
            U.StagingGate.yield_to_staging = real_yield if gate_on else (lambda self, max_s=None: False)
            stats.update(during=0, total=0)
            b = f"g{uuid.uuid4().hex[:10]}"
            s3.create_bucket(Bucket=b)
            root = scratch / uuid.uuid4().hex[:6]
            staged = 0.0
            last = None
            with tg.CheckpointManager(root, tiers=[tg.Tier(f"s3://{b}/run")], fsync=False) as m:
                for step in range(1, 41):
                    for _ in range(20):
                        torch.mm(a, a)
                    if step % 10 == 0:
                        for v in d.values():
                            v.add_(1.0)
                        if last is not None:
                            last.wait()
                        last = m.save(step, {"model": H()})
                        staged += last.staging_s
            shutil.rmtree(root)
            print(
                f"gate {'on ' if gate_on else 'off'}: upload bytes handed out while a save staged {stats['during'] / 2**20:7.1f} MiB "
                f"of {stats['total'] / 2**20:7.1f} MiB; staging {staged:.3f} s; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
shutil.rmtree(scratch, ignore_errors=True)
