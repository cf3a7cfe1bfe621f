import re
from pathlib import Path

from setuptools import find_packages, setup

# The version is written once, in kron_precond/_version.py (read as text: importing the
# package here would import torch).
VERSION = re.search(r'^__version__ = "([^"]+)"', (Path(__file__).parent / "kron_precond" / "_version.py").read_text(),
                    re.M).group(1)

setup(
    name="kron_precond",
    version=VERSION,
    description="Kronecker-factored second-order preconditioning (K-FAC, PSGD Kron) for any "
    "PyTorch optimizer, distributed over torchrun workers.",
    packages=find_packages(include=["kron_precond", "kron_precond.*"]),
    python_requires=">=3.10",  # zip(strict=...), X | Y unions at run time
    # torch is deliberately unpinned here: install it first (README) so pip never swaps it.
    install_requires=["torch>=2.0", "numpy"],
    extras_require={
        "test": ["pytest", "scikit-learn"],
        "examples": ["scikit-learn", "tqdm", "matplotlib"],
        # kron_precond.keras (Keras 3 on JAX, or TensorFlow/torch if installed); no torch.
        "keras": ["keras>=3.15", "jax"],
        # Optional: the integration tests and examples for trainer frameworks. Never needed by
        # the core package; install with the torch constraint so none of them swaps torch.
        "trainers": ["transformers", "accelerate", "lightning", "peft"],
        # kron_precond.integrations.torchtitan (pinned: it builds on torchtitan's config and
        # override internals). torchtitan also needs `triton` importable: on CPU-only machines
        # install it with `--no-deps` (see .ci/run).
        "torchtitan": ["torchtitan==0.3.0"],
        # Developer checks run by .ci/run before the tests: `ruff check` and `mypy` (configured
        # in ruff.toml and mypy.ini at the repository root).
        "dev": ["ruff", "mypy"],
    },
)
