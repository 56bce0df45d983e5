"""The documentation site: every public name has a generated reference entry, and the pages the nav lists
exist. (The strict build itself runs in ``scripts/docs``, called by ``./scripts/test``.)"""

from __future__ import annotations

import re

import yaml

import trainguard as tg

from .conftest import REPO


def directives() -> set[str]:
    found = set()
    for page in (REPO / "docs").glob("*.md"):
        found |= set(re.findall(r"^::: ([\w.]+)$", page.read_text(), flags=re.M))
    return found


def test_every_public_name_has_a_reference_entry_on_some_page():
    documented = {d.rsplit(".", 1)[-1] for d in directives()}
    missing = sorted(set(tg.__all__) - documented)
    assert not missing, f"add `::: <module>.<name>` for {missing} to a page under docs/"


def test_every_directive_names_the_module_that_defines_it():
    for d in directives():
        module, name = d.rsplit(".", 1)
        if name in tg.__all__:
            assert getattr(tg, name).__module__ == module, d


def test_the_nav_lists_existing_pages_one_per_concern_and_the_cli_page_is_generated():
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())

    def pages(nav):
        for item in nav:
            for value in item.values():
                yield from pages(value) if isinstance(value, list) else [value]

    listed = list(pages(config["nav"]))
    assert all((REPO / "docs" / p).is_file() for p in listed), listed
    for concern in ("getting-started.md", "training-loop.md", "distributed.md", "async.md", "recovery.md"):
        assert concern in listed
    assert {"PLANNING.md", "FORMAT.md", "cli.md"} <= set(listed)
    assert ":module: trainguard.cli.main" in (REPO / "docs" / "cli.md").read_text()
    assert config["strict"] is True


def test_the_readme_names_every_public_name_and_lists_every_exported_error():
    readme = (REPO / "README.md").read_text()

    def named(n: str) -> bool:
        return any(x in readme for x in (f"`{n}", f"tg.{n}", f"trainguard.{n}"))

    assert not [n for n in tg.__all__ if not named(n)]
    errors = readme.split("**Errors**")[1].split("\n\n")[0]
    exported = [n for n in tg.__all__ if n.endswith("Error")]
    assert "CheckpointNotFoundError" in exported and "ConfigError" in exported
    assert not [n for n in exported if n not in errors], (
        "name every exported error in the README's error list"
    )
    assert "tg.ResumableSampler(" in readme


def _documented_args(doc: str, heading: str = "Args") -> set[str]:
    """Names documented in the ``Args:`` (or another) section of a Google-style docstring (``a:``, ``a, b:``,
    ``**kw:``)."""
    names: set[str] = set()
    section = re.split(rf"^\s*{heading}:\s*$", doc, maxsplit=1, flags=re.M)
    if len(section) < 2:
        return names
    lines = section[1].splitlines()
    indent = None
    for line in lines:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width < indent:  # the next section (Returns:, Raises:) or the end
            break
        m = re.match(r"\s*([\w*, ]+):", line)
        if width == indent and m:
            names |= {n.strip().lstrip("*") for n in m.group(1).split(",")}
    return names


def test_every_parameter_of_a_public_class_is_documented_in_its_args():
    """Tester finding: ``tiers`` and ``storage_options`` were in CheckpointManager's signature (and the rendered
    reference) but not in its Args, and nothing noticed."""
    import inspect

    missing = {}
    for name in tg.__all__:
        obj = getattr(tg, name)
        if (
            not inspect.isclass(obj)
            or issubclass(obj, BaseException)
            or "__init__" not in vars(obj)
            and not (hasattr(obj, "__dataclass_fields__"))
        ):
            continue
        params = [
            p.name
            for p in inspect.signature(obj).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        doc = inspect.getdoc(obj) or ""
        documented = _documented_args(doc) | _documented_args(inspect.getdoc(obj.__init__) or "")
        documented |= _documented_args(doc, "Attributes")  # a record's fields (PendingSave, SaveResult)
        lacking = [p for p in params if p not in documented]
        if lacking:
            missing[name] = lacking
    assert not missing, f"document these parameters in the class docstring's Args: {missing}"
