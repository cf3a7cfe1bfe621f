"""setup.py says what the code needs: the Python version its syntax and calls require, and
trainer frameworks as an optional extra only (the core package never imports them)."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "torchtitan")


def _setup_call() -> dict:
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(node for node in ast.walk(tree)
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup")
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords
            if kw.arg in ("python_requires", "install_requires", "extras_require")}


def _minimum_python_used() -> tuple[tuple[int, int], str]:
    """The newest Python version that a construct in the package needs, and where."""
    needed, where = (3, 8), "nothing newer than 3.8"
    for path in sorted((ROOT / "kron_precond").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "zip"
                    and any(kw.arg == "strict" for kw in node.keywords)):
                if (3, 10) > needed:
                    needed, where = (3, 10), f"zip(strict=...) in {path.relative_to(ROOT)}:{node.lineno}"
            if isinstance(node, ast.Match) and (3, 10) > needed:
                needed, where = (3, 10), f"match statement in {path.relative_to(ROOT)}:{node.lineno}"
    return needed, where


def test_python_requires_admits_no_version_the_code_cannot_run_on():
    spec = _setup_call()["python_requires"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)", spec.strip())
    assert match, f"python_requires={spec!r} is not a plain lower bound"
    declared = (int(match.group(1)), int(match.group(2)))
    needed, where = _minimum_python_used()
    assert declared >= needed, f"python_requires={spec!r} but the code needs {needed} ({where})"


def test_trainer_frameworks_are_an_optional_extra_never_a_requirement():
    spec = _setup_call()
    core = " ".join(spec["install_requires"]).lower()
    assert not any(name.replace("_", "-") in core or name in core for name in FRAMEWORKS), core
    extra = " ".join(spec["extras_require"]["trainers"]).lower()
    assert "transformers" in extra and "accelerate" in extra and "lightning" in extra


def test_torchtitan_is_a_pinned_extra():
    # kron_precond.integrations.torchtitan builds on torchtitan's config internals
    assert _setup_call()["extras_require"]["torchtitan"] == ["torchtitan==0.3.0"]


def test_importing_the_package_imports_no_trainer_framework():
    code = ("import sys, kron_precond; "
            f"print(sorted(m for m in {FRAMEWORKS!r} if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == "[]", out
