"""Property (issue 16, "What must hold"): random nested states with random dtypes, including bf16 optimizer
state, restored into random targets come back bitwise equal with equal dtypes, or raise a StateMismatchError
naming every difference and leave the target untouched; never a silent partial load."""

from __future__ import annotations

import tempfile
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trainguard as tg

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
MOMENT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(), (3,), (2, 2)]
KEYS = ["a", "b", "c"]


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return raw[..., 0] % 2 == 1
    return raw.view(dtype).reshape(shape)  # any bit pattern, NaNs included


def bits(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.bool else t.reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


leaf = st.tuples(st.sampled_from(DTYPES), st.sampled_from(SHAPES), st.integers(0, 2**31 - 1))
tree = st.dictionaries(
    st.sampled_from(KEYS),
    st.one_of(leaf, st.dictionaries(st.sampled_from(KEYS), leaf, min_size=1)),
    min_size=1,
)


def build(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: build(v) if isinstance(v, dict) else make_tensor(*v) for k, v in spec.items()}


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@st.composite
def target_for(draw: Any, spec: dict[str, Any]) -> tuple[dict[str, Any], set[str], dict[str, str]]:
    """A target for the saved ``spec``: (nested target, names that must be reported, saved name -> target name).

    Mutations: drop a leaf, add a leaf, change a dtype, spell a top key with a ``_orig_mod.`` prefix (not a
    difference), or restore into an empty dict (takes everything).
    """
    if draw(st.booleans()) and draw(st.booleans()):
        return {}, set(), {}
    target: dict[str, Any] = {}
    diffs: set[str] = set()
    names: dict[str, str] = {}
    for k, v in spec.items():
        tk = "_orig_mod." + k if draw(st.booleans()) and draw(st.booleans()) else k
        sub = v if isinstance(v, dict) else {None: v}
        kept: dict[Any, Any] = {}
        for kk, (dtype, shape, _seed) in sub.items():
            name = k if kk is None else f"{k}.{kk}"
            tname = tk if kk is None else f"{tk}.{kk}"
            action = draw(st.sampled_from(["keep", "keep", "keep", "drop", "dtype"]))
            if action == "drop":
                diffs.add(f"p.{name}")
                continue
            new_dtype = dtype
            if action == "dtype":
                new_dtype = draw(st.sampled_from([d for d in DTYPES if d != dtype]))
                diffs.add(f"p.{tname}")
            kept[kk] = torch.zeros(shape, dtype=new_dtype)
            names[name] = tname
        if None in kept:
            target[tk] = kept[None]
        elif kept:
            target[tk] = kept
        elif None not in sub:  # every leaf of a nested dict dropped: the dict goes too
            pass
    if draw(st.booleans()):
        target["z"] = torch.zeros(2)
        diffs.add("p.z")
    if not target:
        return {}, set(), {}
    return target, diffs, names


def optimizer_with_state(moment_dtypes: list[torch.dtype], seed: int) -> torch.optim.AdamW:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optim = torch.optim.AdamW(model.parameters())
    for i, p in enumerate(model.parameters()):
        dt = moment_dtypes[i % len(moment_dtypes)]
        optim.state[p] = {
            "step": torch.tensor(float(seed % 7 + 1)),
            "exp_avg": make_tensor(torch.float32, tuple(p.shape), seed + i).nan_to_num().to(dt),
            "exp_avg_sq": make_tensor(torch.float32, tuple(p.shape), seed + 10 + i).abs().nan_to_num().to(dt),
        }
    return optim


def optimizer_state(optim: torch.optim.Optimizer) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, k): v.clone() for i, s in optim.state_dict()["state"].items() for k, v in s.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=tree,
    data=st.data(),
    moments=st.lists(st.sampled_from(MOMENT_DTYPES), min_size=1, max_size=2),
    live_optim_has_state=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_random_states_restore_bitwise_or_raise_naming_every_difference(
    spec, data, moments, live_optim_has_state, seed
):
    saved_plain = build(spec)
    saved_optim = optimizer_with_state(moments, seed)
    target, diffs, names = data.draw(target_for(spec))
    live_optim = optimizer_with_state([torch.float32], seed + 1)
    if not live_optim_has_state:
        live_optim.state.clear()
    empty_target = not target
    before_plain = {k: v.clone() for k, v in flat(target).items()}
    before_optim = optimizer_state(live_optim)
    with tempfile.TemporaryDirectory() as root:
        # random fp16 moments may overflow to Inf: this property is about matching, not check_finite
        with tg.CheckpointManager(root, async_save=False, fsync=False, check_finite="off") as mgr:
            mgr.save(1, {"p": saved_plain, "optim": saved_optim})
        state = {"p": target, "optim": live_optim}
        try:
            tg.CheckpointManager(root, read_only=True, check_finite="off").restore(1, state)
        except tg.StateMismatchError as e:
            assert diffs, f"no difference, yet: {e}"
            for name in diffs:
                assert name in str(e), (name, str(e))
            got = flat(state["p"])
            assert got.keys() == before_plain.keys() and all(same(got[k], before_plain[k]) for k in got)
            after = optimizer_state(live_optim)
            assert after.keys() == before_optim.keys()
            assert all(same(after[k], before_optim[k]) for k in after), (
                "optimizer touched by a failed restore"
            )
            return
    assert not diffs, f"differences {sorted(diffs)} were loaded silently"
    got = flat(state["p"])
    want = flat(saved_plain)
    if empty_target:
        assert got.keys() == want.keys()
        assert all(same(got[k], want[k]) for k in want)
    else:
        assert set(got) == set(names.values()), "no keys added beside the target's"
        assert all(same(got[names[k]], want[k]) for k in want)
    restored, original = optimizer_state(live_optim), optimizer_state(saved_optim)
    assert restored.keys() == original.keys()
    for k, v in original.items():
        assert same(restored[k], v), (k, restored[k].dtype, v.dtype)
