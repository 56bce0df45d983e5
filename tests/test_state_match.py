"""A restore returns the state that was saved or says why not (issue 16, "A restore that returns a state
different from the one saved"): optimizer dtypes, strict key/dtype matching, wrapper prefixes, optimizer-state
coverage, quantized and other unstorable tensors, the data loader's epoch after the last batch."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.testing._internal.two_tensor import TwoTensor

import trainguard as tg

from .bf16_optim import BF16MomentsAdamW


def save(root, state, step: int = 1, *, async_save: bool = False) -> None:
    with tg.CheckpointManager(root, async_save=async_save, fsync=False) as mgr:
        mgr.save(step, state).wait()


def restore(root, state, **kw) -> int | None:
    return tg.CheckpointManager(root, read_only=True).restore_latest(state, **kw)


# -- optimizer state keeps its saved dtype ---------------------------------------------------------------------
def bf16_adamw(seed: int = 0, steps: int = 3):
    """fp32 parameters, bf16 exp_avg/exp_avg_sq (a common memory-saving setup), after ``steps`` steps."""
    model, optim = fresh_model_and_optim(seed, BF16MomentsAdamW)
    train(model, optim, steps, seed=seed)
    return model, optim


def train(model, optim, n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(n):
        loss = model(torch.randn(8, 6, generator=g)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def fresh_model_and_optim(seed: int = 99, optim_cls=BF16MomentsAdamW):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return model, optim_cls(model.parameters(), lr=1e-2)


def assert_same_optimizer_state(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    sa, sb = a.state_dict()["state"], b.state_dict()["state"]
    assert sorted(sa) == sorted(sb)
    for i in sa:
        for k, v in sa[i].items():
            assert sb[i][k].dtype == v.dtype, (i, k, sb[i][k].dtype, v.dtype)
            assert torch.equal(sb[i][k], v), (i, k)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_bf16_adam_moments_of_fp32_parameters_come_back_bf16_and_the_run_continues_bit_for_bit(
    tmp_path, async_save
):
    model, optim = bf16_adamw()
    assert optim.state_dict()["state"][0]["exp_avg"].dtype == torch.bfloat16, "precondition"
    save(tmp_path, {"model": model, "optim": optim}, async_save=async_save)
    model2, optim2 = fresh_model_and_optim()
    assert restore(tmp_path, {"model": model2, "optim": optim2}) == 1
    assert_same_optimizer_state(optim, optim2)
    assert train(model, optim, 3, seed=7) == train(model2, optim2, 3, seed=7)
    assert_same_optimizer_state(optim, optim2)


def test_bf16_moments_come_back_bf16_into_an_optimizer_that_already_holds_fp32_state(tmp_path):
    model, optim = bf16_adamw()
    save(tmp_path, {"model": model, "optim": optim})
    model2, optim2 = fresh_model_and_optim(optim_cls=torch.optim.AdamW)
    train(model2, optim2, 2, seed=3)  # its moments are fp32: replaced by the saved bf16 ones
    restore(tmp_path, {"model": model2, "optim": optim2})
    assert_same_optimizer_state(optim, optim2)


def test_bf16_moments_come_back_bf16_through_model_optimizer_state(tmp_path):
    model, optim = bf16_adamw()
    save(tmp_path, {"app": tg.ModelOptimizerState(model, optim)})
    model2, optim2 = fresh_model_and_optim()
    assert restore(tmp_path, {"app": tg.ModelOptimizerState(model2, optim2)}) == 1
    assert_same_optimizer_state(optim, optim2)
    assert train(model, optim, 3, seed=7) == train(model2, optim2, 3, seed=7)


def test_fp32_moments_of_bf16_parameters_are_not_rounded_to_bf16(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2).to(torch.bfloat16)
    optim = BF16MomentsAdamW(model.parameters(), moment_dtype=torch.float32)
    for _ in range(2):
        model(torch.randn(8, 6, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    save(tmp_path, {"model": model, "optim": optim})
    torch.manual_seed(1)
    model2 = torch.nn.Linear(6, 2).to(torch.bfloat16)
    optim2 = BF16MomentsAdamW(model2.parameters(), moment_dtype=torch.float32)
    restore(tmp_path, {"model": model2, "optim": optim2})
    assert_same_optimizer_state(optim, optim2)  # torch alone rounds them to bf16


# -- strict keys and dtypes ----------------------------------------------------------------------------------
def test_a_plain_dict_restores_into_keys_with_a_compile_prefix(tmp_path):
    save(tmp_path, {"model": {"w": torch.arange(3.0), "b": torch.full((2,), 7.0)}})
    target = {"model": {"_orig_mod.w": torch.zeros(3), "_orig_mod.b": torch.zeros(2)}}
    assert restore(tmp_path, target) == 1
    assert sorted(target["model"]) == ["_orig_mod.b", "_orig_mod.w"], "no keys added beside the target's"
    assert torch.equal(target["model"]["_orig_mod.w"], torch.arange(3.0))
    assert torch.equal(target["model"]["_orig_mod.b"], torch.full((2,), 7.0))


def test_a_key_on_one_side_only_raises_listing_both_sides_and_loads_nothing(tmp_path):
    save(tmp_path, {"model": {"w": torch.ones(3), "b": torch.ones(2)}})
    target = {"model": {"w": torch.zeros(3), "c": torch.zeros(2)}}
    with pytest.raises(tg.StateMismatchError) as ei:
        restore(tmp_path, target)
    msg = str(ei.value)
    assert "only in the checkpoint (1): model.b" in msg and "only in the target (1): model.c" in msg
    assert "strict=False" in msg and "empty dict" in msg
    assert torch.equal(target["model"]["w"], torch.zeros(3)), "nothing may be loaded when it does not match"
    assert sorted(target["model"]) == ["c", "w"]


@pytest.mark.parametrize(
    ("saved", "live", "names"),
    [
        (
            torch.tensor([70000.0], dtype=torch.float64),
            torch.zeros(1, dtype=torch.float16),
            "float64.*float16",
        ),
        (torch.tensor([2.7]), torch.zeros(1, dtype=torch.int64), "float32.*int64"),
        (torch.tensor([1.5], dtype=torch.bfloat16), torch.zeros(1), "bfloat16.*float32"),
    ],
    ids=["f64-into-f16", "f32-into-i64", "bf16-into-f32"],
)
def test_a_dtype_difference_raises_naming_both_dtypes_and_loads_nothing(tmp_path, saved, live, names):
    save(tmp_path, {"d": {"x": saved, "ok": torch.ones(2)}})
    target = {"d": {"x": live.clone(), "ok": torch.zeros(2)}}
    with pytest.raises(tg.StateMismatchError, match=rf"dtype differs \(1\): d\.x \(checkpoint {names}"):
        restore(tmp_path, target)
    assert torch.equal(target["d"]["x"], live) and torch.equal(target["d"]["ok"], torch.zeros(2))


def test_a_model_in_another_dtype_is_a_mismatch_too(tmp_path):
    save(tmp_path, {"model": torch.nn.Linear(3, 2)})
    with pytest.raises(tg.StateMismatchError, match=r"model\.weight \(checkpoint float32, target bfloat16\)"):
        restore(tmp_path, {"model": torch.nn.Linear(3, 2).to(torch.bfloat16)})


def test_every_shape_key_and_dtype_difference_is_listed_at_once(tmp_path):
    """Tester finding: only the first shape mismatch was named; the key and dtype differences appeared only once
    the shapes were fixed. One error now lists all of them, checkpoint side and target side."""
    save(
        tmp_path,
        {"m": {"a": torch.ones(3), "b": torch.ones(4), "c": torch.ones(2).half(), "d": torch.ones(1)}},
    )
    target = {"m": {"a": torch.zeros(5), "b": torch.zeros(6), "c": torch.zeros(2), "e": torch.zeros(1)}}
    for strict in (True, False):  # a shape cannot be converted: strict=False refuses it too
        with pytest.raises(tg.StateMismatchError) as ei:
            restore(tmp_path, target, strict=strict)
        msg = str(ei.value)
        assert (
            "shape differs (2): m.a (checkpoint (3,), target (5,)), m.b (checkpoint (4,), target (6,))" in msg
        )
        assert "only in the checkpoint (1): m.d" in msg and "only in the target (1): m.e" in msg
        assert "dtype differs (1): m.c (checkpoint float16, target float32)" in msg
        assert torch.equal(target["m"]["a"], torch.zeros(5)), "nothing may be loaded when it does not match"


def test_a_model_with_another_hidden_size_names_every_tensor_that_differs(tmp_path):
    def mlp(hidden: int) -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))

    save(tmp_path, {"model": mlp(16)})
    with pytest.raises(tg.StateMismatchError) as ei:
        restore(tmp_path, {"model": mlp(32)})
    msg = str(ei.value)
    assert "shape differs (3): " in msg  # 0.weight, 0.bias, 2.weight (2.bias keeps its shape)
    for name in ("model.0.weight (checkpoint (16, 8), target (32, 8))", "model.0.bias", "model.2.weight"):
        assert name in msg
    assert "configuration the checkpoint was saved with" in msg


def test_a_long_list_of_differences_is_bounded_with_a_count(tmp_path):
    save(tmp_path, {"m": {f"t{i:02d}": torch.ones(2) for i in range(25)}})
    with pytest.raises(tg.StateMismatchError) as ei:
        restore(tmp_path, {"m": {f"t{i:02d}": torch.zeros(3) for i in range(25)}})
    msg = str(ei.value)
    assert "shape differs (25): m.t00 " in msg and "m.t19 (checkpoint" in msg and "m.t20" not in msg
    assert "... and 5 more" in msg


def test_an_empty_dict_target_takes_everything_as_saved(tmp_path):
    state = {"d": {"a": torch.tensor([70000.0], dtype=torch.float64), "n": {"b": torch.arange(3)}, "v": 3}}
    save(tmp_path, state)
    target: dict = {"d": {}}
    restore(tmp_path, target)
    assert target["d"]["a"].dtype == torch.float64 and target["d"]["a"].item() == 70000.0
    assert torch.equal(target["d"]["n"]["b"], torch.arange(3)) and target["d"]["v"] == 3


def test_an_empty_dict_target_takes_a_saved_top_level_tensor_as_saved(tmp_path):
    save(tmp_path, {"w": torch.arange(4, dtype=torch.int16)})
    target: dict = {"w": {}}
    restore(tmp_path, target)
    assert target["w"].dtype == torch.int16 and torch.equal(target["w"], torch.arange(4, dtype=torch.int16))


@pytest.mark.parametrize(
    "saved",
    [
        {"": torch.ones(2), "a": torch.zeros(1)},  # was: CorruptCheckpointError "a leaf and a container ..."
        {"": torch.ones(2)},  # was: target["m"] became the tensor itself
        {"": {"": torch.arange(3)}},
    ],
    ids=["empty-key-beside-another", "empty-key-alone", "nested-empty-keys"],
)
def test_an_empty_dict_target_takes_a_saved_empty_string_key_as_saved(tmp_path, saved):
    """The key ``""`` inside ``m`` has the relative name ``""``, as ``m``'s own empty container has: the
    container is filled, not replaced by that entry."""
    save(tmp_path, {"m": saved})
    target: dict = {"m": {}}
    restore(tmp_path, target)
    assert target["m"].keys() == saved.keys()
    assert repr(target["m"]) == repr(saved)  # the same keys, tensors and values at the same places


def test_strict_false_loads_what_matches_converting_dtypes_and_logs_the_differences(tmp_path, caplog):
    save(tmp_path, {"d": {"x": torch.tensor([2.7]), "saved_only": torch.ones(1)}})
    target = {"d": {"x": torch.zeros(1, dtype=torch.int64), "live_only": torch.zeros(1)}}
    with caplog.at_level(logging.WARNING, logger="trainguard"):
        assert restore(tmp_path, target, strict=False) == 1
    assert target["d"]["x"].dtype == torch.int64 and target["d"]["x"].item() == 2
    assert torch.equal(target["d"]["saved_only"], torch.ones(1)) and torch.equal(
        target["d"]["live_only"], torch.zeros(1)
    )
    assert "d.x (checkpoint float32, target int64)" in caplog.text and "d.live_only" in caplog.text


def test_a_subset_of_top_level_entries_can_still_be_restored(tmp_path):
    model, optim = bf16_adamw()
    save(tmp_path, {"model": model, "optim": optim, "extra": {"t": torch.ones(2)}})
    model2, _ = fresh_model_and_optim()
    assert restore(tmp_path, {"model": model2}) == 1
    assert torch.equal(model2[0].weight, model[0].weight)


# -- wrapper prefixes ------------------------------------------------------------------------------------------
def test_a_compiled_checkpoint_wrapped_model_restores_into_the_plain_model_and_back(tmp_path):
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    wrapped = torch.compile(checkpoint_wrapper(inner))
    assert all(k.startswith("_orig_mod.") for k in wrapped.state_dict()), "precondition: prefixed keys"
    save(tmp_path / "a", {"model": wrapped})
    torch.manual_seed(1)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    assert restore(tmp_path / "a", {"model": plain}) == 1
    for k, v in inner.state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k
    # the other way: saved plain, restored into the compiled, checkpoint-wrapped model
    save(tmp_path / "b", {"model": {k: v + 1 for k, v in inner.state_dict().items()}})
    assert restore(tmp_path / "b", {"model": wrapped}) == 1
    for k, v in inner.state_dict().items():
        assert torch.equal(wrapped.state_dict()["_orig_mod." + k], v), k


def test_a_ddp_module_prefix_in_a_plain_entry_is_matched(tmp_path):
    save(tmp_path, {"model": {"module.enc.w": torch.ones(2), "module.enc.b": torch.ones(1)}})
    target = {"model": {"enc.w": torch.zeros(2), "enc.b": torch.zeros(1)}}
    restore(tmp_path, target)
    assert torch.equal(target["model"]["enc.w"], torch.ones(2)) and torch.equal(
        target["model"]["enc.b"], torch.ones(1)
    )


def test_a_canonical_name_that_is_not_unique_is_not_guessed(tmp_path):
    save(tmp_path, {"m": {"module.w": torch.ones(1), "_orig_mod.w": torch.full((1,), 2.0)}})
    with pytest.raises(tg.StateMismatchError, match="only in the target.*m.w"):
        restore(tmp_path, {"m": {"w": torch.zeros(1)}})


# -- optimizer state coverage after load ----------------------------------------------------------------------
def test_an_optimizer_that_drops_a_parameters_state_on_load_is_refused(tmp_path):
    model, optim = bf16_adamw()
    save(tmp_path, {"model": model, "optim": optim})
    model2, optim2 = fresh_model_and_optim()

    def drop_second(opt):  # a buggy wrapper or hook: one parameter restarts with empty Adam state
        opt.state.pop(opt.param_groups[0]["params"][1])

    optim2.register_load_state_dict_post_hook(drop_second)
    with pytest.raises(
        tg.StateMismatchError,
        match=r"optim.*not restored \(3\): 1\.exp_avg, 1\.exp_avg_sq, 1\.step\n.*drops state",
    ):
        restore(tmp_path, {"model": model2, "optim": optim2})


def test_model_optimizer_state_whose_optimizer_drops_a_parameters_state_on_load_is_refused(tmp_path):
    model, optim = bf16_adamw()
    save(tmp_path, {"app": tg.ModelOptimizerState(model, optim)})
    model2, optim2 = fresh_model_and_optim()
    optim2.register_load_state_dict_post_hook(lambda opt: opt.state.pop(opt.param_groups[0]["params"][0]))
    with pytest.raises(tg.StateMismatchError, match=r"(?s)'app'.*not restored \(3\): 0\.weight\.exp_avg, "):
        restore(tmp_path, {"app": tg.ModelOptimizerState(model2, optim2)})


def test_frozen_parameters_without_optimizer_state_are_not_a_mismatch(tmp_path):
    model, optim = fresh_model_and_optim(0, torch.optim.AdamW)
    model[2].weight.requires_grad_(False)
    train(model, optim, 2, seed=0)
    assert len(optim.state) == 3, "precondition: the frozen weight has no state"
    save(tmp_path, {"model": model, "optim": optim})
    model2, optim2 = fresh_model_and_optim(optim_cls=torch.optim.AdamW)
    model2[2].weight.requires_grad_(False)
    restore(tmp_path, {"model": model2, "optim": optim2})
    assert_same_optimizer_state(optim, optim2)


# -- tensors whose elements are not their value ---------------------------------------------------------------
UNSTORABLE = {
    "quantized per tensor": lambda: torch.quantize_per_tensor(
        torch.tensor([1.0, 2.0, 3.0]), 0.2, 0, torch.qint8
    ),
    "quantized per channel": lambda: torch.quantize_per_channel(
        torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0, 1]), 0, torch.quint8
    ),
    "sparse coo": lambda: torch.eye(3).to_sparse(),
    "sparse csr": lambda: torch.eye(3).to_sparse_csr(),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "meta": lambda: torch.empty(3, device="meta"),
    "wrapper subclass": lambda: TwoTensor(torch.ones(3), torch.full((3,), 2.0)),
    # torch gives no element size (DCP's planner) or no CPU copy (staging) for bit and sub-byte dtypes
    "bits8": lambda: torch.zeros(4, dtype=torch.bits8),
    "uint4": lambda: torch.zeros(4, dtype=torch.uint4),
}


@pytest.mark.parametrize("kind", sorted(UNSTORABLE))
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_tensor_that_would_not_come_back_as_it_is_is_refused_at_save(tmp_path, kind, async_save):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = UNSTORABLE[kind]()
    with tg.CheckpointManager(tmp_path, async_save=async_save, fsync=False) as mgr:
        mgr.save(1, {"d": {"ok": torch.ones(2)}}).wait()
        with pytest.raises(tg.ConfigError, match=r"'d\.t' is .*Nothing was written"):
            mgr.save(2, {"d": {"ok": torch.ones(2), "t": t}})
        assert [(i.step, i.status) for i in mgr.checkpoints()] == [(1, "valid")]


def test_conjugate_and_negative_views_and_single_element_strided_views_round_trip(tmp_path):
    z = torch.tensor([1 + 2j, 3 - 1j])
    state = {"d": {"conj": z.conj(), "neg": z.conj().imag, "strided": torch.arange(4.0)[::2][:1]}}
    expected = {k: v.resolve_conj().resolve_neg().clone() for k, v in state["d"].items()}
    for async_save in (False, True):
        root = tmp_path / str(async_save)
        with tg.CheckpointManager(root, async_save=async_save, fsync=False) as mgr:
            mgr.save(1, state)
        target: dict = {"d": {}}
        restore(root, target)
        for k, v in expected.items():
            assert torch.equal(target["d"][k], v), (async_save, k)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_one_element_tensors_with_a_stride_other_than_1_save_scan_and_restore_in_place(tmp_path, async_save):
    """``x[:, 0]`` of a ``(1, n)`` tensor is contiguous with stride ``(n,)``: the save's NaN/Inf scan, the
    writer and a restore into such a tensor (in place) all take its bytes (CI found the scan refusing it)."""
    x = torch.arange(10.0).reshape(1, 10)
    bf = torch.arange(6.0).to(torch.bfloat16).reshape(1, 6)
    state = {"d": {"col": x[:, 3], "bf": bf[:, 5]}}
    assert state["d"]["col"].stride() == (10,) and state["d"]["col"].is_contiguous()
    with tg.CheckpointManager(tmp_path, async_save=async_save, fsync=False, check_finite="error") as mgr:
        mgr.save(1, state).wait()
    dest = torch.zeros(1, 10)
    dest_bf = torch.zeros(1, 6, dtype=torch.bfloat16)
    target = {"d": {"col": dest[:, 7], "bf": dest_bf[:, 1]}}
    assert restore(tmp_path, target) == 1
    assert dest[0, 7].item() == 3.0 and dest.sum().item() == 3.0  # written in place, at its own element
    assert dest_bf[0, 1].item() == 5.0 and dest_bf.float().sum().item() == 5.0


@pytest.mark.parametrize("n", [3, 1 << 18], ids=["packed", "own-chunk"])
def test_a_restore_into_conjugate_and_negative_views_loads_their_values(tmp_path, n):
    """A live conjugate or negative view takes the saved values (``Tensor.copy_`` resolves the bit), packed
    with other tensors or in chunks of its own; also from another dtype with ``strict=False`` (a restore into
    a conjugate view crashed on taking its bytes)."""
    z = torch.randn(n, dtype=torch.complex64)
    x = torch.randn(n)
    save(tmp_path, {"d": {"z": z, "x": x, "z128": z.to(torch.complex128)}})
    zc, xn, z64 = torch.zeros(n, dtype=torch.complex64), torch.zeros(n), torch.zeros(n, dtype=torch.complex64)
    target = {"d": {"z": zc.conj(), "x": torch._neg_view(xn), "z128": z64.conj()}}
    assert target["d"]["z"].is_conj() and target["d"]["x"].is_neg()
    assert restore(tmp_path, target, strict=False) == 1
    assert torch.equal(target["d"]["z"].resolve_conj(), z) and torch.equal(zc, z.conj())
    assert torch.equal(target["d"]["x"].resolve_neg(), x) and torch.equal(xn, -x)
    assert torch.equal(z64, z.conj())  # complex128 -> complex64 is exact for values that were complex64


UNLOADABLE = {
    "meta": (lambda: torch.empty(3, 4, device="meta"), "on the meta device"),
    "sparse": (lambda: torch.zeros(3, 4).to_sparse(), "sparse_coo tensor"),
    "expanded": (lambda: torch.zeros(1, 4).expand(3, 4), "expanded view"),
}


@pytest.mark.parametrize("kind", sorted(UNLOADABLE))
def test_a_live_tensor_that_cannot_take_values_is_refused_before_anything_is_loaded(tmp_path, kind):
    """A destination on the meta device (a copy into it does nothing: the restore used to return 1 with
    nothing loaded), a sparse one or an expanded view (torch refuses the copy after other entries were
    loaded) is named in a StateMismatchError before any entry is loaded."""
    make, words = UNLOADABLE[kind]
    save(tmp_path, {"d": {"a": torch.ones(4), "w": torch.randn(3, 4)}})
    a = torch.zeros(4)
    with pytest.raises(
        tg.StateMismatchError, match=rf"d\.w: the live tensor is .*{words}.*\n.*Nothing was loaded"
    ):
        restore(tmp_path, {"d": {"a": a, "w": make()}})
    assert not a.any()  # the entry beside it kept its values


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(3, 4).nonzero(),  # nothing matched: shape (0, 2), stride (1, 0)
        lambda: torch.zeros(1, 0).expand(4, 0),  # stride (0, 1) but no element
        lambda: torch.ones(1, 5).expand(1, 5),  # stride 0 on a dim of size 1 only
    ],
    ids=["empty-nonzero", "empty-expanded", "size-1-dim"],
)
def test_a_live_tensor_with_a_stride_of_0_but_no_shared_element_restores(tmp_path, make):
    """Only elements sharing memory make a destination unloadable: a zero-element tensor or a stride of 0 on a
    dim of size 1 is a valid destination (``x.nonzero()`` of an all-zero mask is one)."""
    saved = make().contiguous() + 0
    save(tmp_path, {"d": {"t": saved, "w": torch.ones(2)}})
    target = {"d": {"t": make(), "w": torch.zeros(2)}}
    assert restore(tmp_path, target) == 1
    assert torch.equal(target["d"]["w"], torch.ones(2)) and torch.equal(target["d"]["t"], saved)


def test_a_lazy_module_that_never_ran_is_refused_naming_the_forward_pass(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.LazyLinear(3)
    model(torch.ones(1, 4))
    save(tmp_path, {"model": model})
    lazy = torch.nn.LazyLinear(3)
    with pytest.raises(
        tg.StateMismatchError, match=r"model\.weight: .*uninitialized parameter.*forward pass"
    ):
        restore(tmp_path, {"model": lazy})
    lazy(torch.zeros(1, 4))
    assert restore(tmp_path, {"model": lazy}) == 1 and torch.equal(lazy.weight, model.weight)


def test_a_module_on_the_meta_device_is_refused_naming_to_empty(tmp_path):
    save(tmp_path, {"model": torch.nn.Linear(4, 4)})
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    with pytest.raises(tg.StateMismatchError, match=r"model\.weight: .*meta device.*to_empty"):
        restore(tmp_path, {"model": model})
    model.to_empty(device="cpu")
    assert restore(tmp_path, {"model": model}) == 1


# -- ResumableLoader after the last batch of an epoch ---------------------------------------------------------
@pytest.mark.parametrize(("n", "batch", "drop_last"), [(8, 4, False), (10, 4, False), (10, 4, True)])
def test_a_loader_saved_after_the_last_batch_of_an_epoch_restores_at_the_next_epochs_start(
    tmp_path, n, batch, drop_last
):
    loader = tg.ResumableLoader(list(range(n)), batch_size=batch, shuffle=True, seed=3, drop_last=drop_last)
    batches = len(loader)
    with tg.CheckpointManager(tmp_path, async_save=False, fsync=False) as mgr:
        for i, _ in enumerate(loader):
            if i == batches - 1:
                mgr.save(1, {"loader": loader})
    after = [b.tolist() for b in loader]  # what the uninterrupted run does next: epoch 1 from batch 0
    resumed = tg.ResumableLoader(list(range(n)), batch_size=batch, shuffle=True, seed=3, drop_last=drop_last)
    restore(tmp_path, {"loader": resumed})
    assert resumed.epoch == 1 and resumed.state_dict()["start"] == 0
    assert [b.tolist() for b in resumed] == after and resumed.epoch == 2 == loader.epoch


def test_a_loader_state_saved_by_older_versions_after_the_last_batch_counts_the_epoch(tmp_path):
    loader = tg.ResumableLoader(list(range(8)), batch_size=4)
    loader.load_state_dict({"epoch": 0, "start": 8, "seed": 0, "num_samples": 8})
    assert loader.epoch == 1 and loader.state_dict()["start"] == 0
    mid = tg.ResumableLoader(list(range(8)), batch_size=4)
    mid.load_state_dict({"epoch": 0, "start": 4, "seed": 0, "num_samples": 8})
    assert mid.epoch == 0 and mid.state_dict()["start"] == 4, "mid-epoch positions are unchanged"


def test_a_loop_counting_epochs_from_the_loader_runs_the_same_number_of_epochs_after_a_resume(tmp_path):
    def run(loader, mgr, stop_after=None) -> int:
        steps = 0
        for _epoch in range(loader.epoch, 3):
            for _ in loader:
                steps += 1
                mgr.save(steps, {"loader": loader})
                if steps == stop_after:
                    return steps
        return steps

    ds = list(range(6))
    with tg.CheckpointManager(tmp_path / "ref", async_save=False, fsync=False) as mgr:
        total = run(tg.ResumableLoader(ds, batch_size=3), mgr)
    with tg.CheckpointManager(tmp_path / "cut", async_save=False, fsync=False) as mgr:
        first = run(tg.ResumableLoader(ds, batch_size=3), mgr, stop_after=2)  # the last batch of epoch 0
    resumed = tg.ResumableLoader(ds, batch_size=3)
    assert tg.CheckpointManager(tmp_path / "cut", read_only=True).restore_latest({"loader": resumed}) == 2
    with tg.CheckpointManager(tmp_path / "after", async_save=False, fsync=False) as mgr:
        rest = run(resumed, mgr)
    assert total == 6 and first == 2 and first + rest == total
