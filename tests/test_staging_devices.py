"""Staging on devices this machine does not have: which stream is waited for, which buffers are pinned, and
where a staged DTensor's local tensor lives (found by a review of the CUDA paths before any GPU run).

No CUDA here: the DTensor test uses a mesh that names "cuda" without initializing it (a DTensor whose shard
sits in host memory, as FSDP2's CPU offload makes them); the others replace ``torch.cuda`` calls with
recorders.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from trainguard.staging import buffers
from trainguard.staging.buffers import BufferSet, synchronize

REPO = Path(__file__).resolve().parent.parent


def test_synchronize_waits_on_the_stream_of_every_source_device(monkeypatch):
    """A device-to-host copy runs on the current stream of its source's device: each such device's stream is
    synchronized, not only the current device's."""
    waited: list[object] = []

    class Stream:
        def __init__(self, device: object) -> None:
            self.device = device

        def synchronize(self) -> None:
            waited.append(self.device)

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    synchronize({torch.device("cuda", 1), torch.device("cuda", 0)})
    assert waited == [torch.device("cuda", 0), torch.device("cuda", 1)]


def test_a_host_only_stage_synchronizes_nothing(monkeypatch):
    def refuse(device=None):
        raise AssertionError("a stream was synchronized for host tensors")

    monkeypatch.setattr(torch.cuda, "current_stream", refuse)
    staged = BufferSet(0).stage({"w": torch.arange(5.0), "n": 3})
    assert torch.equal(staged["w"], torch.arange(5.0))


def test_a_buffer_is_reallocated_when_its_tensor_moves_to_a_cuda_device(monkeypatch):
    """Reuse needs the same pinning too: a tensor staged from host memory once and from a CUDA device later
    gets a pinned buffer (a non-blocking copy into pageable memory is synchronous and slow)."""
    made: list[bool] = []
    empty = torch.empty

    def recording_empty(*args, pin_memory=False, **kw):
        made.append(pin_memory)
        return empty(*args, **kw)  # this build cannot pin: the flag is what is checked

    monkeypatch.setattr(buffers.torch, "empty", recording_empty)
    monkeypatch.setattr(buffers.torch.cuda, "is_available", lambda: True)
    s = BufferSet(0)
    host = torch.zeros(4)
    on_device = types.SimpleNamespace(shape=host.shape, dtype=host.dtype, device=torch.device("cuda", 0))
    first = s._buffer("w", host)
    assert s._buffer("w", host) is first and made == [False]  # reused while nothing changes
    moved = s._buffer("w", on_device)
    assert moved is not first and made == [False, True]
    assert s._buffer("w", on_device) is moved and made == [False, True]
    assert s._buffer("w", host) is not moved and made == [False, True, False]  # and back


DTENSOR_SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from trainguard.staging.buffers import BufferSet

    for device_type, placements in (("cuda", [Replicate()]), ("cpu", [Shard(0)])):
        # "cuda" without initializing it: the DTensor's shard is in host memory (FSDP2 CPU offload)
        mesh = DeviceMesh(device_type, [0], _init_backend=False)
        shard = torch.arange(12.0).reshape(4, 3)  # one rank: the shard is the whole tensor
        spec = DTensorSpec(mesh, tuple(placements), TensorMeta(shard.shape, shard.stride(), shard.dtype))
        src = DTensor(shard, spec, requires_grad=False)  # from_local would move it to the "cuda" device
        s = BufferSet(0)
        staged = s.stage({"w": src})["w"]
        buf = s.buffers["w"]
        assert isinstance(staged, DTensor), type(staged)
        local = staged.to_local()
        assert local.device.type == "cpu", local.device
        assert local.data_ptr() == buf.data_ptr(), "the staged DTensor does not hold the staging buffer"
        assert staged.device_mesh is mesh and tuple(staged.placements) == tuple(placements)
        assert staged.shape == src.shape and staged.stride() == src.stride()
        with torch.no_grad():
            src.to_local().add_(1.0)  # the live shard moves on: the staged copy must not
        assert torch.equal(local, torch.arange(12.0).reshape(4, 3)), local
        print(device_type, "ok")
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # no interpreter finalization beside gloo's threads (tests/distributed/worker.py)
    """
)


def test_a_staged_dtensor_keeps_its_shard_in_the_host_buffer(tmp_path):
    """``DTensor.from_local`` moves a local tensor to its mesh's device: on a CUDA mesh the pinned buffer was
    copied back to the GPU (a second device copy of every shard while the save persists). The staged DTensor
    is now built on the buffer itself; here a "cuda" mesh on a CPU-only build made the old code fail
    ("Torch not compiled with CUDA enabled")."""
    script = tmp_path / "stage_dtensor.py"
    script.write_text(DTENSOR_SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "pg")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == ["cuda", "ok", "cpu", "ok"]


@pytest.mark.parametrize("n", [1, 3])
def test_stale_entries_release_their_buffer_and_pinning_record(n):
    s = BufferSet(0)
    s.stage({f"t{i}": torch.ones(2) for i in range(n)})
    s.stage({"t0": torch.ones(2)})
    assert set(s.buffers) == {"t0"} and set(s._pinned) == {"t0"}
