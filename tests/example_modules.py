"""Load the checkout's ``examples/`` and ``benchmarks/`` scripts by file path, for tests.

Neither folder is a package, and importing them as ``examples.x`` or ``benchmarks.x`` goes
through ``sys.path``: a user who also has another wheel with a top-level ``examples``
package (kfac-pytorch ships one) then gets that package instead and ``No module named
'examples.char_lm'``. Loading by path cannot resolve to anything else.

The scripts import their sibling library ``kron_examples_common`` by its bare name, with
their own folder put first on ``sys.path``; it is loaded here under that same name, so the
tests and the scripts share one copy (one ``PrecondConfig`` class, one ``METHODS``).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
# Imported by the scripts under their bare name (already unique: the examples' convention).
SHARED = frozenset({"kron_examples_common"})


def load(relative: str) -> ModuleType:
    """The module of ``ROOT / relative`` (e.g. ``"examples/char_lm.py"``), executed once.

    Scripts are registered as ``kron_repo_<folder>_<stem>`` (dataclasses and pickling look a
    class's module up in ``sys.modules``); the file's folder goes first on ``sys.path``, as
    the script itself does when run, so its sibling imports resolve.
    """
    path = (ROOT / relative).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no script {relative!r} under {ROOT}")
    name = path.stem if path.stem in SHARED else f"kron_repo_{path.parent.name}_{path.stem}"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(loaded.__file__).resolve() != path:
            raise ImportError(f"{name!r} is already {loaded.__file__}, not {path}")
        return loaded
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
