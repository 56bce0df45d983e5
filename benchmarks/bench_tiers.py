"""Tiers on an object store: trainguard vs the raw S3 client on the same moto server, side by side.

    .venv/bin/python benchmarks/bench_tiers.py --gib 1 --repeat 2

Starts moto's S3 server on 127.0.0.1 (a free port). Measures, best of ``--repeat``:
- upload: sending one committed checkpoint (``--gib`` of fp32 tensors in 64 MiB chunks) from the hot root to
  an S3 tier (``Uploader.upload``: read + CRC32C check + parallel PUT + manifest) vs the raw client (boto3
  ``put_object`` of the same chunk bytes from memory, 8 threads). Target >= 0.9x the raw throughput.
- download: an empty hot root made intact from the tier (``prefetch``: parallel GET + CRC32C + write) vs the raw
  client (boto3 ``get_object`` of the same objects, 8 threads, into memory). Target >= 0.9x. Also printed: the
  raw client getting and writing the same objects to files (the disk work a download to the hot root does).
- restore from S3 alone: ``restore_latest`` on a new node (empty hot root: parallel GET into memory + CRC32C +
  load into the model; the hot root is written behind it) vs raw GET, timed from the manager's construction
  to ``restore_latest`` returning (when training may go on). Target >= 0.9x. Also printed: ``tg restore+hot``,
  the same until ``close()`` returned (the background copy to the hot root finished).
- training-visible save time with an async S3 tier attached vs without (sum of ``PendingSave.staging_s`` over
  ``--saves`` async saves of a smaller state, each followed by ``wait()``). Target <= 1.05x.
moto keeps objects in memory in one Python process: it, not the network, is the bottleneck here, for both
sides. The machine is shared: compare the rows of one run only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))

from _common import log, machine_info, print_targets  # noqa: E402

import trainguard as tg  # noqa: E402
from tiers.netfaults import moto_server  # noqa: E402


def state_of(nbytes: int) -> dict[str, torch.Tensor]:
    n = max(1, nbytes // (64 << 20))
    per = nbytes // n // 4
    g = torch.Generator().manual_seed(0)
    return {"model": {f"w{i}": torch.randn(per, generator=g) for i in range(n)}}


class Holder:
    def __init__(self, d: dict[str, torch.Tensor]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.d

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            self.d[k].copy_(v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--saves", type=int, default=6)
    args = ap.parse_args()
    nbytes = int(args.gib * (1 << 30))
    import boto3

    scratch = Path(
        tempfile.mkdtemp(
            prefix="bench-tiers-", dir=str(REPO / "build") if (REPO / "build").is_dir() else None
        )
    )
    with moto_server() as url:
        os.environ.update(
            AWS_ENDPOINT_URL=url,
            AWS_ACCESS_KEY_ID="x",
            AWS_SECRET_ACCESS_KEY="x",
            AWS_DEFAULT_REGION="us-east-1",
        )
        s3 = boto3.client("s3", endpoint_url=url)
        info = machine_info()
        print(
            f"# {info['date']}  {info.get('cpu')} x{info['nproc']}, load {info['loadavg_1m']}; moto on {url}"
        )
        data = Holder(state_of(nbytes)["model"])
        hot = scratch / "hot"
        with tg.CheckpointManager(hot, async_save=False, fsync=False) as mgr:
            mgr.save(1, {"model": data})
        chunk_files = sorted(p for p in (hot / "chunks").rglob("*") if p.is_file())
        blobs = [p.read_bytes() for p in chunk_files]
        total = sum(len(b) for b in blobs)
        print(f"# checkpoint: {total / (1 << 30):.2f} GiB in {len(blobs)} chunks; best of {args.repeat}")
        best = {
            "raw put": 1e9,
            "tg upload": 1e9,
            "raw get": 1e9,
            "raw get+write": 1e9,
            "tg prefetch": 1e9,
            "tg restore": 1e9,
            "tg restore+hot": 1e9,
        }
        for r in range(args.repeat):
            bucket = f"bench-{uuid.uuid4().hex[:10]}"
            s3.create_bucket(Bucket=bucket)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(
                    pool.map(
                        lambda ib, bucket=bucket: s3.put_object(
                            Bucket=bucket, Key=f"raw/{ib[0]}", Body=ib[1]
                        ),
                        enumerate(blobs),
                    )
                )
            best["raw put"] = min(best["raw put"], time.perf_counter() - t0)
            tier_url = f"s3://{bucket}/run"
            from trainguard.storage.objects import open_objects
            from trainguard.tiers.upload import TierLink, Uploader

            link = TierLink(tg.Tier(tier_url), open_objects(tier_url))
            up = Uploader(hot, [link], lambda *a, **k: None)
            t0 = time.perf_counter()
            up.upload(link, 1)
            best["tg upload"] = min(best["tg upload"], time.perf_counter() - t0)
            up.close()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                got = list(
                    pool.map(
                        lambda i, bucket=bucket: s3.get_object(Bucket=bucket, Key=f"raw/{i}")["Body"].read(),
                        range(len(blobs)),
                    )
                )
            best["raw get"] = min(best["raw get"], time.perf_counter() - t0)
            assert sum(len(g) for g in got) == total
            del got
            rawdir = scratch / f"raw{r}"
            rawdir.mkdir()

            def get_to_file(i: int, bucket: str = bucket, rawdir: Path = rawdir) -> None:
                body = s3.get_object(Bucket=bucket, Key=f"raw/{i}")["Body"].read()
                (rawdir / str(i)).write_bytes(body)

            t0 = time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(get_to_file, range(len(blobs))))
            best["raw get+write"] = min(best["raw get+write"], time.perf_counter() - t0)
            shutil.rmtree(rawdir)
            node = scratch / f"node{r}"
            t0 = time.perf_counter()
            with tg.CheckpointManager(node, tiers=[tg.Tier(tier_url)], fsync=False) as m2:
                assert m2.prefetch() == 1
            best["tg prefetch"] = min(best["tg prefetch"], time.perf_counter() - t0)
            shutil.rmtree(node)
            target = Holder({k: torch.empty_like(v) for k, v in data.d.items()})
            t0 = time.perf_counter()
            with tg.CheckpointManager(node, tiers=[tg.Tier(tier_url)], fsync=False, read_only=True) as m3:
                assert m3.restore_latest({"model": target}) == 1
                best["tg restore"] = min(best["tg restore"], time.perf_counter() - t0)  # training may go on
            # close() waits for the hot root's background copy
            best["tg restore+hot"] = min(best["tg restore+hot"], time.perf_counter() - t0)
            assert all(torch.equal(target.d[k], data.d[k]) for k in data.d)
            shutil.rmtree(node)
            log(f"repetition {r + 1}: {best}")
        gib = total / (1 << 30)
        print(f"{'method':<14}{'seconds':>9}{'GiB/s':>8}")
        for k, v in best.items():
            print(f"{k:<14}{v:>9.2f}{gib / v:>8.3f}")
        up_ratio = best["raw put"] / best["tg upload"]
        down_ratio = best["raw get"] / best["tg prefetch"]
        restore_ratio = best["raw get"] / best["tg restore"]
        down_disk_ratio = best["raw get+write"] / best["tg prefetch"]
        print(f"download vs raw get + write to files (the same disk work): {down_disk_ratio:.2f}x")
        # training-visible time: async saves of a smaller state with and without an async S3 tier
        small = Holder(state_of(min(nbytes, 256 << 20))["model"])
        visible = {}
        for label in ("without tier", "with async S3 tier", "without tier ", "with async S3 tier "):
            bucket = f"vis-{uuid.uuid4().hex[:10]}"
            s3.create_bucket(Bucket=bucket)
            root = scratch / f"vis-{uuid.uuid4().hex[:6]}"
            tiers = [tg.Tier(f"s3://{bucket}/run")] if "with" in label else None
            with tg.CheckpointManager(root, tiers=tiers, fsync=False) as m:
                block = 0.0
                for s in range(1, args.saves + 1):
                    for v in small.d.values():
                        v.add_(1.0)
                    h = m.save(s, {"model": small})
                    block += h.staging_s
                    h.wait()
            visible[label.strip()] = min(visible.get(label.strip(), 1e9), block)
            shutil.rmtree(root)
        vis_ratio = visible["with async S3 tier"] / visible["without tier"]
        print(
            f"training-visible save time over {args.saves} saves: without {visible['without tier']:.3f} s, "
            f"with async S3 tier {visible['with async S3 tier']:.3f} s"
        )
        print_targets(
            [
                ("upload >= 0.9x raw parallel put", up_ratio >= 0.9, f"{up_ratio:.2f}x"),
                ("download >= 0.9x raw parallel get", down_ratio >= 0.9, f"{down_ratio:.2f}x"),
                ("restore from S3 alone >= 0.9x raw get", restore_ratio >= 0.9, f"{restore_ratio:.2f}x"),
                ("training-visible time with async tier <= 1.05x", vis_ratio <= 1.05, f"{vis_ratio:.2f}x"),
            ]
        )
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
