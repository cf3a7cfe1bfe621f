"""End-to-end training with K-FAC: fixed seeds, small problems, a few seconds each.

* Badly scaled least squares: inputs scaled by logspace(0, -2) (cond E[xxᵀ] = 1e4);
  K-FAC + SGD at its best lr from a small grid must reach a ≥10× lower loss than plain
  SGD at its best lr from a grid that runs past SGD's stability edge.
* sklearn digits (standardised, fixed stratified split): an MLP and a small CNN trained
  with K-FAC + SGD and K-FAC + AdamW reach ≥95% test accuracy.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner

# --------------------------------------------------------------------------- least squares
D, STEPS, BATCH = 20, 200, 64
SGD_GRID = [0.03, 0.1, 0.3, 0.5, 0.7, 1.0, 1.4, 2.0]  # diverges above ~1 (Hessian λmax ≈ 2)
KFAC_GRID = [0.1, 0.3, 1.0]


def _ls_data(seed=0, n_eval=4096):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -2, D)  # E[xxᵀ] = diag(scales²): condition number 1e4
    # every direction carries comparable signal, so the small ones matter
    w = torch.randn(D, 1, generator=g) / scales[:, None] * 0.3

    def sample(n):
        x = torch.randn(n, D, generator=g) * scales
        return x, x @ w + 1.0 + 0.01 * torch.randn(n, 1, generator=g)

    return sample, sample(n_eval), scales


def _ls_run(lr, use_kfac, **kfac_kw):
    sample, (xe, ye), _ = _ls_data()
    torch.manual_seed(0)
    model = nn.Linear(D, 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    # kl_clip uses the optimizer's lr
    precond = KronPreconditioner(model, lr=lr, **kfac_kw) if use_kfac else None
    for _ in range(STEPS):
        x, y = sample(BATCH)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        if precond is not None:
            precond.step()
        opt.step()
    with torch.no_grad():
        loss = F.mse_loss(model(xe), ye).item()
    return loss if math.isfinite(loss) else math.inf


def test_least_squares_data_is_badly_conditioned():
    _, (xe, _), scales = _ls_data()
    cov = torch.diag(scales**2)
    assert torch.linalg.cond(cov) >= 1e4
    emp = xe.T @ xe / len(xe)
    assert torch.linalg.cond(emp) >= 5e3


def test_kfac_beats_sgd_on_badly_scaled_least_squares():
    sgd = {lr: _ls_run(lr, False) for lr in SGD_GRID}
    best_sgd_lr = min(sgd, key=sgd.get)
    # the grid brackets SGD's optimum and crosses its stability edge
    assert best_sgd_lr != SGD_GRID[-1] and best_sgd_lr != SGD_GRID[0], sgd
    assert sgd[SGD_GRID[-1]] > 10 * sgd[best_sgd_lr], f"grid does not reach SGD's stability edge: {sgd}"
    kfac = {lr: _ls_run(lr, True, damping=1e-3) for lr in KFAC_GRID}
    best_kfac_lr = min(kfac, key=kfac.get)
    assert kfac[best_kfac_lr] * 10 <= sgd[best_sgd_lr], (kfac, sgd)


# --------------------------------------------------------------------------- digits
@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = load_digits(return_X_y=True)
    Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=0, stratify=y)
    scaler = StandardScaler().fit(Xtr)

    def f(a):
        return torch.tensor(scaler.transform(a), dtype=torch.float32)

    return f(Xtr), torch.tensor(ytr), f(Xte), torch.tensor(yte)


def _mlp():
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


class _CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.c2(F.relu(self.c1(x))))
        return self.fc(x.flatten(1))


def _train_digits(data, make_model, make_opt, epochs, batch=64, **kfac_kw):
    Xtr, ytr, Xte, yte = data
    torch.manual_seed(0)
    model = make_model()
    opt = make_opt(model.parameters())
    precond = KronPreconditioner(model, **kfac_kw)
    g = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        perm = torch.randperm(len(Xtr), generator=g)
        for i in range(0, len(Xtr), batch):
            idx = perm[i : i + batch]
            opt.zero_grad()
            F.cross_entropy(model(Xtr[idx]), ytr[idx]).backward()
            precond.step()
            opt.step()
    model.eval()
    with torch.no_grad():
        return (model(Xte).argmax(1) == yte).float().mean().item()


OPTS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.02, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=1e-2),
}


@pytest.mark.parametrize("opt", list(OPTS))
@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_digits_accuracy(digits, arch, opt):
    make = _mlp if arch == "mlp" else _CNN
    acc = _train_digits(digits, make, OPTS[opt], epochs=5, damping=1e-2)
    assert acc >= 0.95, f"{arch}+K-FAC+{opt}: test accuracy {acc:.3f}"
