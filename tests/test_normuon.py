"""benchmarks/normuon.py against a float64 reference written from the paper, row by row.

The reference keeps its own momentum, per-row second moments and weights as Python floats
over explicit row / column loops, so it shares no tensor code with the optimizer. Both use
the exact polar factor (SVD) as the orthogonalisation, so they must agree to float64
rounding over several steps, for wide and tall weights, with weight decay."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.normuon import NorMuon, normalize_rows  # noqa: E402


def polar(matrix: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return u @ vh


def reference_steps(weight, grads, lr, weight_decay, momentum, beta2, eps):
    """NorMuon (arXiv 2510.05491, Algorithm 1, Nesterov momentum as torch.optim.Muon) in
    float64 lists: returns the weights after each gradient of ``grads``."""
    m, n = weight.shape
    w = weight.double().tolist()
    buf = [[0.0] * n for _ in range(m)]
    v = [0.0] * m
    history = []
    for grad in grads:
        g = grad.double().tolist()
        nesterov = [[0.0] * n for _ in range(m)]
        for i in range(m):
            for j in range(n):
                buf[i][j] = momentum * buf[i][j] + (1 - momentum) * g[i][j]
                nesterov[i][j] = (1 - momentum) * g[i][j] + momentum * buf[i][j]
        o = polar(torch.tensor(nesterov, dtype=torch.float64)).tolist()
        o_norm = math.sqrt(sum(x * x for row in o for x in row))
        normalized = []
        for i in range(m):  # one neuron (row) at a time
            mean_square = sum(x * x for x in o[i]) / n
            v[i] = beta2 * v[i] + (1 - beta2) * mean_square
            normalized.append([x / (math.sqrt(v[i]) + eps) for x in o[i]])
        n_norm = math.sqrt(sum(x * x for row in normalized for x in row))
        scale = lr * 0.2 * math.sqrt(max(m, n)) * o_norm / n_norm
        for i in range(m):
            for j in range(n):
                w[i][j] = w[i][j] * (1 - lr * weight_decay) - scale * normalized[i][j]
        history.append(torch.tensor(w, dtype=torch.float64))
    return history


@pytest.mark.parametrize("shape", [(6, 10), (12, 5)])
def test_normuon_matches_row_loop_reference(shape):
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(*shape, generator=generator, dtype=torch.float64)
    # Rows with very different gradient scales, so the per-row normalisation matters.
    row_scales = torch.logspace(-1, 1, shape[0], dtype=torch.float64)[:, None]
    grads = [torch.randn(*shape, generator=generator, dtype=torch.float64) * row_scales for _ in range(5)]
    settings = dict(lr=0.03, weight_decay=0.1, momentum=0.9, beta2=0.95, eps=1e-10)
    expected = reference_steps(weight, grads, **settings)

    param = torch.nn.Parameter(weight.clone())
    optimizer = NorMuon([param], orthogonalize=polar, **settings)
    for grad, want in zip(grads, expected):
        param.grad = grad.clone()
        optimizer.step()
        torch.testing.assert_close(param.detach(), want, rtol=1e-10, atol=1e-12)


def test_row_normalisation_equalises_rows_with_beta2_zero():
    """β2 = 0: v is this step's row mean of squares, so every row of the result has the same
    norm, and the total norm is the input's."""
    generator = torch.Generator().manual_seed(2)
    ortho = torch.randn(7, 9, generator=generator, dtype=torch.float64) * torch.arange(1, 8)[:, None]
    out = normalize_rows(ortho, torch.zeros(7, 1, dtype=torch.float64), beta2=0.0)
    row_norms = out.norm(dim=1)
    torch.testing.assert_close(row_norms, torch.full_like(row_norms, row_norms[0].item()))
    torch.testing.assert_close(out.norm(), ortho.norm())
    assert not torch.allclose(ortho.norm(dim=1), ortho.norm(dim=1)[0].expand(7))  # the input's rows differ


def test_update_rms_is_torch_muons():
    """With torch's own Newton-Schulz, NorMuon's first step moves the weight by the same
    Frobenius norm as torch.optim.Muon(adjust_lr_fn="match_rms_adamw") on the same gradient,
    in a different direction (the rows are rescaled)."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 24, generator=generator)
    grad = torch.randn(16, 24, generator=generator) * torch.logspace(-1, 1, 16)[:, None]
    steps = {}
    for name in ("muon", "normuon"):
        param = torch.nn.Parameter(weight.clone())
        if name == "muon":
            optimizer = torch.optim.Muon([param], lr=0.02, weight_decay=0.0, momentum=0.9,
                                        adjust_lr_fn="match_rms_adamw")  # torch's default decay: 0.1
        else:
            optimizer = NorMuon([param], lr=0.02, weight_decay=0.0, momentum=0.9)
        param.grad = grad.clone()
        optimizer.step()
        steps[name] = (param.detach() - weight)
    torch.testing.assert_close(steps["normuon"].norm(), steps["muon"].norm(), rtol=1e-5, atol=0)
    cosine = (steps["normuon"] * steps["muon"]).sum() / (steps["normuon"].norm() * steps["muon"].norm())
    assert cosine < 0.999


def test_fused_experts_step_expert_by_expert_as_the_row_loop_reference():
    """A fused-experts weight ``[experts, out, in]``: each expert takes the reference's step of
    a 2-D weight of its own (its own momentum and per-row second moments)."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(3, 6, 10, generator=generator, dtype=torch.float64)
    scales = torch.logspace(-1, 1, 6, dtype=torch.float64)[:, None]
    grads = [torch.randn(3, 6, 10, generator=generator, dtype=torch.float64) * scales * torch.tensor(
        [0.1, 1.0, 10.0], dtype=torch.float64)[:, None, None] for _ in range(4)]
    settings = dict(lr=0.03, weight_decay=0.1, momentum=0.9, beta2=0.95, eps=1e-10)
    expected = [reference_steps(weight[e], [g[e] for g in grads], **settings) for e in range(3)]
    param = torch.nn.Parameter(weight.clone())
    optimizer = NorMuon([param], orthogonalize=polar, **settings)
    for step, grad in enumerate(grads):
        param.grad = grad.clone()
        optimizer.step()
        for e in range(3):
            torch.testing.assert_close(param.detach()[e], expected[e][step], rtol=1e-10, atol=1e-12)


def test_the_normuon_baseline_steps_mixtrals_fused_experts():
    pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.budget_speedup import build_normuon
    from char_lm import SKIP_LAYERS, ModelConfig, build_model
    from kron_examples_common import PrecondConfig
    model = build_model(ModelConfig(d_model=16, n_layers=2, n_heads=4, seq_len=8, arch="mixtral"))
    chain = build_normuon(model, 0.02, 0.0, 0.9, PrecondConfig(skip_layers=SKIP_LAYERS))
    normuon = next(o for o in chain.optimizers if isinstance(o, NorMuon))
    stepped = {id(p) for g in normuon.param_groups for p in g["params"]}
    experts = {id(p) for n, p in model.named_parameters() if "experts" in n}
    assert len(experts) == 4 and experts <= stepped and len(stepped) == 4 + 2 * 4  # and q, k, v, o
    assert sum(len(g["params"]) for g in chain.param_groups) == len(list(model.parameters()))  # none twice


def test_rejects_non_matrix_parameters():
    with pytest.raises(ValueError, match="2-D"):
        NorMuon([torch.nn.Parameter(torch.zeros(3))])


def test_transposed_weight_steps_as_the_matrix_it_holds():
    """A weight stored ``[in, out]`` (GPT-2's ``Conv1D``) and passed in ``transposed`` takes
    the transpose of the step its ``[out, in]`` twin takes: its neurons are its columns."""
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(6, 10, generator=generator, dtype=torch.float64)  # [out, in]
    grads = [torch.randn(6, 10, generator=generator, dtype=torch.float64) * torch.logspace(-1, 1, 6)[:, None]
             for _ in range(4)]
    settings = dict(lr=0.03, weight_decay=0.1, momentum=0.9, beta2=0.95, eps=1e-10)
    expected = reference_steps(weight, grads, **settings)
    stored = torch.nn.Parameter(weight.T.clone())  # [in, out]
    optimizer = NorMuon([stored], orthogonalize=polar, transposed=[stored], **settings)
    for grad, want in zip(grads, expected):
        stored.grad = grad.T.clone()
        optimizer.step()
        torch.testing.assert_close(stored.detach().T, want, rtol=1e-10, atol=1e-12)
    # not passed as transposed, the same tensor is normalised per input dimension instead
    plain = torch.nn.Parameter(weight.T.clone())
    other = NorMuon([plain], orthogonalize=polar, **settings)
    for grad in grads:
        plain.grad = grad.T.clone()
        other.step()
    assert not torch.allclose(plain.detach().T, expected[-1], rtol=1e-6, atol=1e-8)


def test_transposed_must_be_among_params():
    inside, outside = torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="transposed"):
        NorMuon([inside], transposed=[outside])


def test_the_normuon_baseline_marks_gpt2s_conv1d_weights_transposed():
    """``build_normuon`` on Hugging Face's GPT-2: every ``Conv1D`` weight is stepped as the
    ``[out, in]`` matrix it holds (its neurons normalised), nothing else."""
    pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.budget_speedup import build_normuon
    from char_lm import SKIP_LAYERS, ModelConfig, build_model
    from kron_examples_common import PrecondConfig
    model = build_model(ModelConfig(d_model=16, n_layers=2, n_heads=2, seq_len=8, arch="gpt2"))
    chain = build_normuon(model, 0.02, 0.0, 0.9, PrecondConfig(skip_layers=SKIP_LAYERS))
    normuon = next(o for o in chain.optimizers if isinstance(o, NorMuon))
    conv1d = {id(m.weight) for m in model.modules() if type(m).__name__ == "Conv1D"}
    assert len(conv1d) == 8 and normuon._transposed == conv1d
    assert {id(p) for g in normuon.param_groups for p in g["params"]} == conv1d


@pytest.mark.parametrize("shape", [(12, 20), (20, 12)])
def test_the_fallback_without_torchs_routine_orthogonalises_as_torch(monkeypatch, shape):
    """Where torch has no private Newton-Schulz routine, the baseline's own (the library's
    ``msign`` in bfloat16) gives torch's result bit for bit."""
    import torch.optim._muon as torch_muon

    from benchmarks.normuon import NS_COEFFICIENTS, NS_EPS, NS_STEPS, newton_schulz
    update = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    want = torch_muon._zeropower_via_newtonschulz(update, NS_COEFFICIENTS, NS_STEPS, NS_EPS).float()
    monkeypatch.delattr(torch_muon, "_zeropower_via_newtonschulz")
    with pytest.raises(ImportError):
        from torch.optim._muon import _zeropower_via_newtonschulz  # noqa: F401
    assert torch.equal(newton_schulz(update), want)
