"""Optional dependencies: ``import trainguard`` (every module of it) works without the optional packages, and
using a feature without its package raises MissingDependencyError naming ``pip install 'trainguard[EXTRA]'``.

The packages are blocked in a subprocess (``sys.modules[name] = None`` makes ``import name`` fail as if it
were not installed), so the test runs in the dev environment where they are installed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import trainguard as tg
from trainguard._optional import EXTRAS, require

from .conftest import REPO, run_env

BLOCKED = sorted(EXTRAS)  # safetensors, lightning, transformers, ray, s3fs, fsspec, torchdata, ...

PRELUDE = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None
"""


def run_blocked(body: str, tmp_path) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=run_env(), cwd=tmp_path, timeout=300
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_every_trainguard_module_imports_without_the_optional_packages(tmp_path):
    out = run_blocked(
        """
        import importlib, json, pkgutil
        import trainguard as tg
        names = [getattr(tg, n) and n for n in tg.__all__]   # every public name resolves
        results = {}
        for m in pkgutil.walk_packages(tg.__path__, "trainguard."):
            if m.name.endswith("__main__"):
                continue   # runs the CLI
            try:
                importlib.import_module(m.name)
                results[m.name] = "ok"
            except tg.MissingDependencyError as e:   # a module that IS an integration may say what to install
                results[m.name] = "extra" if "pip install 'trainguard[" in str(e) else "bad: " + str(e)
            except Exception as e:
                results[m.name] = f"bad: {type(e).__name__}: {e}"
        print(json.dumps({"names": len(names), "modules": results}))
        """,
        tmp_path,
    )
    assert out["names"] == len(tg.__all__)
    assert "trainguard.interop.export" in out["modules"] and "trainguard.cli.interop" in out["modules"]
    bad = {m: r for m, r in out["modules"].items() if r.startswith("bad")}
    assert not bad


def test_safetensors_export_and_import_without_the_package_name_the_extra(tmp_path):
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(3)}}).wait()
    torch.save({"w": torch.ones(3)}, tmp_path / "w.pt")
    out = run_blocked(
        f"""
        import json
        from click.testing import CliRunner
        import trainguard as tg
        from trainguard.cli.main import main
        from trainguard.interop import export, import_checkpoint
        res = {{}}
        try:
            export({str(root)!r}, "a.safetensors", format="safetensors")
        except ImportError as e:   # MissingDependencyError is an ImportError too
            res["api"] = [type(e).__name__, str(e)]
        r = CliRunner().invoke(main, ["export", {str(root)!r}, "b.safetensors", "--format", "safetensors"])
        res["cli"] = [r.exit_code, r.output]
        r = CliRunner().invoke(main, ["import", "x.safetensors", "r2", "--format", "safetensors", "--step", "1"])
        res["cli_import"] = [r.exit_code, r.output]
        res["torch"] = export({str(root)!r}, "a.pt", format="torch").tensors  # other formats still work
        res["import_torch"] = import_checkpoint({str(tmp_path / "w.pt")!r}, "r3", format="torch", step=1).tensors
        print(json.dumps(res))
        """,
        tmp_path,
    )
    kind, msg = out["api"]
    assert kind == "MissingDependencyError"
    assert "export --format safetensors" in msg and "pip install 'trainguard[safetensors]'" in msg
    assert out["cli"][0] == 2 and "pip install 'trainguard[safetensors]'" in out["cli"][1]
    assert "Traceback" not in out["cli"][1]
    assert out["cli_import"][0] == 2 and "trainguard[safetensors]" in out["cli_import"][1]
    assert out["torch"] == 1 and out["import_torch"] == 1
    assert not (tmp_path / "a.safetensors").exists()


def test_require_names_the_extra_and_keeps_a_broken_dependency_s_own_error():
    with pytest.raises(tg.MissingDependencyError, match=r"tg.ray.* 'ray_not_here'.*pip install ray_not_here"):
        require("ray_not_here", feature="tg.ray")
    assert require("json", feature="x").dumps([1]) == "[1]"
    assert issubclass(tg.MissingDependencyError, ImportError)


def test_every_extra_named_in_the_registry_exists_in_pyproject():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "safetensors" in extras and any("safetensors" in d for d in extras["safetensors"])
    missing = sorted({e for e in EXTRAS.values() if e not in extras})
    # extras of integrations still being built are allowed to be missing only if no module uses them yet
    import pkgutil

    used = {m.name for m in pkgutil.walk_packages(tg.__path__, "trainguard.")}
    assert not [e for e in missing if f"trainguard.{e}" in used], missing


def test_tg_hf_without_transformers_names_the_extra(tmp_path):
    out = run_blocked(
        """
        import json
        import trainguard as tg
        try:
            tg.hf.TrainguardTrainer
            res = ["imported"]
        except tg.MissingDependencyError as e:
            res = [type(e).__name__, e.name, str(e)]
        print(json.dumps(res))
        """,
        tmp_path,
    )
    kind, name, msg = out
    assert kind == "MissingDependencyError" and name == "transformers"
    assert "trainguard.hf" in msg and "pip install 'trainguard[hf]'" in msg
