"""bf16 Adam moments of FSDP2-sharded fp32 parameters come back bf16 through ModelOptimizerState (issue 16):
DCP's set_state_dict ends in Optimizer.load_state_dict, which casts them to the parameter dtype."""

from __future__ import annotations

import pytest

from .launch import run_workers

pytestmark = pytest.mark.distributed


def test_bf16_moments_of_sharded_parameters_restore_bf16_and_training_continues_identically(tmp_path):
    res = run_workers(2, "bf16", tmp_path, root=str(tmp_path / "root"))
    for r in res:
        assert r["restored"] == 2
        assert r["moment_dtypes"] == ["torch.bfloat16"] and r["local_types"] == ["DTensor"]
    assert res[0]["differences"] == []
    assert res[0]["differences_after_a_step"] == []
