"""The public surface has one source of truth: every name in ``kron_precond.__all__`` is
documented in docs/API.md, ``Method`` lists exactly the registered methods, and
``__version__`` is the installed distribution's version."""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import kron_precond
from kron_precond.methods import registry

ROOT = Path(__file__).resolve().parents[1]


def _documented_names() -> set[str]:
    """Names that docs/API.md documents: in backticks (`Name`, `Name(...)`, `kron_precond.Name`)
    or as a heading (``## Name``)."""
    text = (ROOT / "docs" / "API.md").read_text()
    names = set()
    for code in re.findall(r"`([^`\n]+)`", text):
        match = re.match(r"(?:kron_precond\.)?([A-Za-z_]\w*)", code.strip())
        if match:
            names.add(match.group(1))
    for heading in re.findall(r"^#+\s+(.+)$", text, flags=re.M):
        names.update(re.findall(r"[A-Za-z_]\w*", heading))
    return names


def test_every_public_name_is_documented_in_api_md():
    missing = sorted(set(kron_precond.__all__) - _documented_names())
    assert not missing, f"in kron_precond.__all__ but not documented in docs/API.md: {missing}"


def test_every_public_name_is_importable():
    for name in kron_precond.__all__:
        assert getattr(kron_precond, name) is not None, name


def test_method_enum_lists_exactly_the_registered_methods():
    assert [member.value for member in kron_precond.Method] == list(registry.METHODS)
    for member in kron_precond.Method:
        assert registry.get(member) is registry.METHODS[member.value]
        assert kron_precond.Method.parse(member.value.upper(), "method") is member
    from kron_precond.enums import Method

    assert Method is kron_precond.Method


def test_version_is_the_installed_distributions():
    try:
        installed = importlib.metadata.version("kron_precond")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kron_precond is not installed (pip install -e .)")
    assert kron_precond.__version__ == installed
