"""WhitenedMuon built from a model: which parameters it whitens, the AdamW half, the module
kinds of the engine's adapters, and the optimizer conventions trainers rely on.

References are independent of the code under test: an HF-style ``Conv1D`` model against its
``nn.Linear`` twin, fused experts against one ``nn.Linear`` per expert, the AdamW half against
``torch.optim.AdamW``, stacks of same-shape weights against one optimizer per weight, and the
steps written out in float64 (Newton-Schulz written out here as a loop).
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import kron_precond.whitened_muon as wm
from kron_precond import RoutedExperts, WhitenedMuon, register_adapter
from kron_precond.modules import _ADAPTERS, KFACAdapter

torch.set_default_dtype(torch.float32)


class Conv1D(nn.Module):
    """transformers' GPT-2 ``Conv1D``: ``y = x @ W + b`` with ``W`` stored ``[in, out]``."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class Block(nn.Module):
    """A GPT-2-like block body: a fused qkv projection (non-square), a square projection and an
    MLP, built from ``make(in, out)`` layers."""

    def __init__(self, make, d=6):
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.norm = nn.LayerNorm(d)
        self.c_attn = make(d, 3 * d)
        self.c_proj = make(d, d)
        self.c_fc = make(d, 2 * d)
        self.c_out = make(2 * d, d)
        self.lm_head = nn.Linear(d, 11, bias=False)

    def qkv(self, h):
        return self.c_attn(h).chunk(3, dim=-1)

    def forward(self, tokens):
        h = self.norm(self.emb(tokens))
        q, k, v = self.qkv(h)
        h = h + self.c_proj(torch.tanh(q * k + v))
        h = h + self.c_out(F.gelu(self.c_fc(h)))
        return self.lm_head(h)


def twins(dtype=torch.float64):
    """A Conv1D model and its nn.Linear twin with the same function."""
    torch.manual_seed(0)
    conv = Block(lambda i, o: Conv1D(o, i)).to(dtype)
    torch.manual_seed(0)
    linear = Block(lambda i, o: nn.Linear(i, o)).to(dtype)
    linear.load_state_dict({k: v.T if k.endswith("weight") and k.split(".")[0] in CONV1D_NAMES else v
                            for k, v in conv.state_dict().items()})
    return conv, linear


CONV1D_NAMES = ("c_attn", "c_proj", "c_fc", "c_out")


def token_batches(steps, batch=4, seq=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (batch, seq), generator=g), torch.randint(0, 11, (batch, seq), generator=g))
            for _ in range(steps)]


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, 11), y.reshape(-1))


def train(model, optimizer, data, loss=lm_loss):
    for x, y in data:
        optimizer.zero_grad()
        loss(model, x, y).backward()
        optimizer.step()


@pytest.mark.parametrize("output_side", [False, True, "wide"])
def test_a_conv1d_model_steps_like_its_linear_twin(output_side):
    """HF ``Conv1D`` stores ``W`` as ``[in, out]``: whitened on its input side it gives the
    nn.Linear twin's steps to float64 precision (the square ``c_proj`` included, where a
    wrong side would not crash but whiten the output instead; with ``output_side="wide"`` the
    4x-wide ``c_fc`` alone has an output side, read from ``[out, in]``, not the stored shape)."""
    conv, linear = twins()
    settings = dict(lr=0.05, weight_decay=0.1, statistics_every=1, factor_decay=0.8, output_side=output_side,
                    ns_dtype=torch.float64, skip_layers=["lm_head"])
    opts = [WhitenedMuon(m, **settings) for m in (conv, linear)]
    for name in CONV1D_NAMES:
        assert any(getattr(conv, name).weight is p for p in opts[0].param_groups[0]["params"])
    data = token_batches(4)
    for model, opt in zip((conv, linear), opts):
        train(model, opt, data)
    start, _ = twins()
    for name in CONV1D_NAMES:
        got, want = getattr(conv, name).weight.T, getattr(linear, name).weight
        moved = (want - getattr(start, name).weight.T).abs().max()
        assert moved > 1e-2
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for (name, a), b in zip(conv.named_parameters(), linear.parameters()):
        if name.split(".")[0] not in CONV1D_NAMES or not name.endswith("weight"):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


class SeparateBlock(Block):
    """``Block`` with its fused ``c_attn`` as three projections of their own (``q_in``,
    ``k_in``, ``v_in``: names the query/key centring rule does not read)."""

    def __init__(self, make, d=6):
        super().__init__(make, d)
        del self.c_attn
        self.q_in, self.k_in, self.v_in = make(d, d), make(d, d), make(d, d)

    def qkv(self, h):
        return self.q_in(h), self.k_in(h), self.v_in(h)


class CausalSelfAttention(Block):
    """``Block`` under the class name nanoGPT gives the attention module that holds ``c_attn``:
    a layout the default knows (its query, key and value in contiguous thirds)."""


def separate_twin(fused: Block, make) -> SeparateBlock:
    """A ``SeparateBlock`` computing what ``fused`` computes: ``c_attn``'s outputs in thirds."""
    twin = SeparateBlock(make).to(fused.lm_head.weight.dtype)
    state = {k: v for k, v in fused.state_dict().items() if not k.startswith("c_attn.")}
    out_dim = 1 if isinstance(fused.c_attn, Conv1D) else 0  # Conv1D stores [in, out]
    for part, name in enumerate(("q_in", "k_in", "v_in")):
        state[f"{name}.weight"] = fused.c_attn.weight.chunk(3, dim=out_dim)[part]
        state[f"{name}.bias"] = fused.c_attn.bias.chunk(3)[part]
    twin.load_state_dict(state)
    return twin


def fused_part(model, name: str):
    """The ``[out, in]`` weight of ``name`` (``q_in`` / ``k_in`` / ``v_in`` read from a fused ``c_attn``)."""
    if hasattr(model, name):
        layer = getattr(model, name)
        return layer.weight.T if isinstance(layer, Conv1D) else layer.weight
    w = model.c_attn.weight.T if isinstance(model.c_attn, Conv1D) else model.c_attn.weight
    return w.chunk(3)[("q_in", "k_in", "v_in").index(name)]


@pytest.mark.parametrize("kind", ["conv1d", "linear"])
@pytest.mark.parametrize("output_side", [False, True, "wide"])
@pytest.mark.parametrize("adjust_lr_fn", ["match_rms_adamw", "original"])
def test_a_fused_qkv_projection_steps_like_three_separate_projections(kind, output_side, adjust_lr_fn):
    """A ``c_attn`` whose outputs are three inputs wide, in a module of a known layout (here
    nanoGPT's class name; GPT-2's ``Conv1D`` or nanoGPT's Linear), is stepped by default as its
    query, key and value: each part orthogonalised on its own
    (and, with the output side, whitened by its own outputs' factor) and scaled for its own
    ``[d, d]`` shape, as the twin with three separate projections is (``output_side="wide"``:
    the parts are square, so neither has an output side). ``fused_qkv=False`` steps it as one
    matrix, which the twin does not follow."""
    make = (lambda i, o: Conv1D(o, i)) if kind == "conv1d" else (lambda i, o: nn.Linear(i, o))
    settings = dict(lr=0.05, weight_decay=0.1, statistics_every=1, factor_decay=0.8, output_side=output_side,
                    ns_dtype=torch.float64, skip_layers=["lm_head"], adjust_lr_fn=adjust_lr_fn)
    data = token_batches(4)
    runs = {}
    for fused_qkv in (None, False):
        torch.manual_seed(0)
        fused = CausalSelfAttention(make).double()
        twin = separate_twin(fused, make)
        start = copy.deepcopy(twin)
        opt = WhitenedMuon(fused, fused_qkv=fused_qkv, **settings)
        assert opt.fused_qkv is fused_qkv
        train(fused, opt, data)
        train(twin, WhitenedMuon(twin, **settings), data)
        runs[fused_qkv] = fused, twin, start
    fused, twin, start = runs[None]
    for name in ("q_in", "k_in", "v_in"):
        assert (fused_part(twin, name) - fused_part(start, name)).abs().max() > 1e-2
        torch.testing.assert_close(fused_part(fused, name), fused_part(twin, name), rtol=1e-10, atol=1e-12)
    for name in ("c_proj", "c_fc", "c_out", "norm", "emb"):
        for a, b in zip(getattr(fused, name).parameters(), getattr(twin, name).parameters()):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    unsplit, twin, _ = runs[False]
    gap = max((fused_part(unsplit, n) - fused_part(twin, n)).abs().max() for n in ("q_in", "k_in", "v_in"))
    assert gap > 1e-3


class RenamedBlock(Block):
    """``Block`` with its fused projection named ``attn_in`` instead of ``c_attn``."""

    def __init__(self, make, d=6):
        super().__init__(make, d)
        self.attn_in = self.c_attn
        del self.c_attn

    def qkv(self, h):
        return self.attn_in(h).chunk(3, dim=-1)


def test_fused_qkv_regexes_name_the_fused_projections_and_nothing_else_is_split():
    """A fused projection under another name, or in a module whose layout the default does
    not know, is split only when a regex names it: the same steps as the default on a known
    layout; by default it is one matrix."""
    settings = dict(lr=0.05, statistics_every=1, ns_dtype=torch.float64, skip_layers=["lm_head"])
    data = token_batches(3)
    torch.manual_seed(0)
    reference = CausalSelfAttention(lambda i, o: nn.Linear(i, o)).double()
    train(reference, WhitenedMuon(reference, **settings), data)
    unknown = Block(lambda i, o: nn.Linear(i, o))  # c_attn, but in a class of unknown layout
    assert all(view.parts == 1 for view in WhitenedMuon(unknown, **settings)._views.values())
    results = {}
    for fused_qkv in ([r"attn_in$"], None):
        torch.manual_seed(0)
        model = RenamedBlock(lambda i, o: nn.Linear(i, o)).double()
        train(model, WhitenedMuon(model, fused_qkv=fused_qkv, **settings), data)
        results[str(fused_qkv)] = model.attn_in.weight
    torch.testing.assert_close(results[str([r"attn_in$"])], reference.c_attn.weight, rtol=1e-10, atol=1e-12)
    assert (results["None"] - reference.c_attn.weight).abs().max() > 1e-3


@pytest.mark.parametrize("fused_qkv, error, match", [
    (True, TypeError, "fused_qkv"), ("c_attn", TypeError, "fused_qkv"), ([1], TypeError, "fused_qkv"),
    (["("], ValueError, "fused_qkv"), (["c_atn"], ValueError, "'c_atn'"),  # a typo: matches nothing
    (["c_fc"], ValueError, "'c_fc'"),  # outputs not three inputs wide: no three square parts
    (["c_proj"], ValueError, "'c_proj'"),  # square: divisible by 3 (6), yet no three square parts
    (["lm_head"], ValueError, "'lm_head'"),  # skipped: not whitened
])
def test_bad_fused_qkv_fails_at_construction_naming_it(fused_qkv, error, match):
    torch.manual_seed(0)
    model = Block(lambda i, o: nn.Linear(i, o))
    model.c_fc = nn.Linear(6, 16)  # 16 outputs: not divisible by 3
    with pytest.raises(error, match=match):
        WhitenedMuon(model, fused_qkv=fused_qkv, skip_layers=["lm_head"])


def test_the_list_form_takes_conv1d_on_its_input_side():
    conv, linear = twins()
    opts = [WhitenedMuon([getattr(m, n) for n in CONV1D_NAMES], lr=0.05, statistics_every=1,
                         ns_dtype=torch.float64) for m in (conv, linear)]
    data = token_batches(3)
    for model, opt in zip((conv, linear), opts):
        train(model, opt, data)
    for name in CONV1D_NAMES:
        torch.testing.assert_close(getattr(conv, name).weight.T, getattr(linear, name).weight, rtol=1e-10, atol=1e-12)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 6, bias=False)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.norm(self.emb(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        h = h + self.down(F.relu(self.up(h))) + self.frozen(h)
        return self.head(h)


def test_the_model_form_whitens_the_linear_units_and_gives_every_other_trainable_parameter_to_adamw():
    torch.manual_seed(0)
    model = TiedLM()
    opt = WhitenedMuon(model, lr=0.02, adamw_lr=0.003, adamw_betas=(0.8, 0.99), adamw_eps=1e-6,
                       adamw_weight_decay=0.01, weight_decay=0.1)
    groups = {g["algorithm"]: g for g in opt.param_groups}
    assert [g["algorithm"] for g in opt.param_groups] == ["whitened_muon", "adamw"]
    whitened = {id(p) for p in groups["whitened_muon"]["params"]}
    adamw = {id(p) for p in groups["adamw"]["params"]}
    # the attention's projections take Muon's step (its in_proj whitened, its out_proj not)
    assert whitened == {id(model.up.weight), id(model.down.weight), id(model.attn.in_proj_weight),
                        id(model.attn.out_proj.weight)}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert adamw == trainable - whitened and not (adamw & whitened)
    assert id(model.emb.weight) in adamw and id(model.attn.in_proj_bias) in adamw
    assert groups["adamw"]["lr"] == 0.003 and groups["adamw"]["betas"] == (0.8, 0.99)
    assert groups["adamw"]["eps"] == 1e-6 and groups["adamw"]["weight_decay"] == 0.01
    assert "momentum" not in groups["adamw"] and groups["whitened_muon"]["weight_decay"] == 0.1
    skipping = WhitenedMuon(model, lr=0.02, skip_layers=["down", "attn"])
    assert {id(p) for p in skipping.param_groups[0]["params"]} == {id(model.up.weight)}
    assert {id(p) for p in skipping.param_groups[1]["params"]} == trainable - {id(model.up.weight)}
    with pytest.raises(ValueError, match="no module of LayerNorm"):
        WhitenedMuon(nn.LayerNorm(3), lr=0.1)
    with pytest.raises(ValueError, match="adamw_lr"):
        WhitenedMuon(model, adamw_lr=0.0)
    with pytest.raises(ValueError, match=r"adamw_betas\[1\]"):
        WhitenedMuon(model, adamw_betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="algorithm"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "algorithm": "sgd"})
    with pytest.raises(ValueError, match="whitened_muon"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))], "algorithm": "whitened_muon"})
    with pytest.warns(UserWarning, match="AdamW steps it"):  # no algorithm, no whitened weight: AdamW
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})
    assert opt.param_groups[-1]["algorithm"] == "adamw"


def split_by_hand(model, **settings):
    """The same training by hand: WhitenedMuon on the list of Linear modules + torch's AdamW."""
    modules = [model.attn, model.up, model.down]
    hidden = {id(model.attn.in_proj_weight), id(model.attn.out_proj.weight), id(model.up.weight),
              id(model.down.weight)}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in hidden]
    return [WhitenedMuon(modules, lr=0.02, weight_decay=0.1, **settings),
            torch.optim.AdamW(rest, lr=0.003, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.01, foreach=False)]


def test_one_optimizer_for_the_model_equals_the_split_by_hand_bitwise():
    """The AdamW half is ``torch.optim.AdamW``'s arithmetic, bitwise (a parameter without a
    gradient on a step keeps its own step count, as torch's); one schedule scales both halves.
    The model's MLP (``up``, ReLU, ``down``) is ungated: the default ``"auto"`` whitens ``up``'s
    output side, which the list form (no parents to read) gets from ``"wide"``."""
    torch.manual_seed(0)
    model = TiedLM()
    twin = copy.deepcopy(model)
    opt = WhitenedMuon(model, lr=0.02, weight_decay=0.1, adamw_lr=0.003, adamw_betas=(0.8, 0.99), adamw_eps=1e-6,
                       adamw_weight_decay=0.01)
    by_hand = split_by_hand(twin, output_side="wide")
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in [opt, *by_hand]]
    for step, (x, y) in enumerate(token_batches(5)):
        for m, opts in ((model, [opt]), (twin, by_hand)):
            for o in opts:
                o.zero_grad()
            lm_loss(m, x, y).backward()
            if step == 2:  # the norm gets no gradient on this step
                m.norm.weight.grad = None
            for o in opts:
                o.step()
        for s in schedules:
            s.step()
    assert opt.param_groups[1]["lr"] == pytest.approx(0.003 / 6)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02 / 6)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert opt.state[model.norm.weight]["step"] == 4


def test_the_model_form_resumes_bitwise_and_a_mismatched_checkpoint_changes_nothing():
    torch.manual_seed(0)
    models = [TiedLM(), None]
    models[1] = copy.deepcopy(models[0])
    settings = dict(lr=0.02, weight_decay=0.1, statistics_every=2, output_side=True)
    opts = [WhitenedMuon(m, **settings) for m in models]
    data = token_batches(6)
    for step, (x, y) in enumerate(data):
        if step == 3:
            saved = copy.deepcopy(opts[1].state_dict())
            opts[1].remove()
            opts[1] = WhitenedMuon(models[1], **settings)
            opts[1].load_state_dict(saved)
        for m, o in zip(models, opts):
            o.zero_grad()
            lm_loss(m, x, y).backward()
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    other = WhitenedMuon([models[1].up, models[1].down], lr=0.02)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError):
        other.load_state_dict(opts[1].state_dict())
    assert str(other.state_dict()) == str(before)


def test_a_closure_runs_with_grad_enabled_and_its_loss_is_returned():
    torch.manual_seed(0)
    model = TiedLM()
    opt = WhitenedMuon(model, lr=0.02)
    x, y = token_batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        return loss

    before = model.up.weight.detach().clone()
    loss = opt.step(closure)
    assert torch.isfinite(loss) and not torch.equal(before, model.up.weight)
    assert opt.state[model.up.weight]["input_factor"].abs().sum() > 0  # the closure's forward was observed


# ----------------------------------------------------------------------------- fused experts
class ExpertTwin(nn.Module):
    """One nn.Linear per expert and weight, routed as RoutedExperts routes."""

    def __init__(self, fused: RoutedExperts):
        super().__init__()
        self.up = nn.ModuleList()
        self.down = nn.ModuleList()
        for e in range(fused.num_experts):
            up, down = nn.Linear(fused.dim, fused.hidden), nn.Linear(fused.hidden, fused.dim)
            with torch.no_grad():
                up.weight.copy_(fused.up_weight[e]), up.bias.copy_(fused.up_bias[e])
                down.weight.copy_(fused.down_weight[e]), down.bias.copy_(fused.down_bias[e])
            self.up.append(up.to(fused.up_weight.dtype))
            self.down.append(down.to(fused.up_weight.dtype))

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e, (up, down) in enumerate(zip(self.up, self.down)):
            token, choice = torch.where(index == e)
            if token.numel():
                out = out.index_add(0, token, down(F.gelu(up(x[token]))) * weights[token, choice].unsqueeze(1))
        return out


class MoE(nn.Module):
    def __init__(self, experts):
        super().__init__()
        torch.manual_seed(3)
        self.router = nn.Linear(4, 3, bias=False).double()
        self.experts = experts

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        weights, index = probs.topk(2, dim=-1)
        return self.experts(x, index, weights)


def test_fused_experts_are_whitened_expert_by_expert_like_one_linear_per_expert():
    torch.manual_seed(0)
    fused = RoutedExperts(3, 4, 5).double()
    models = [MoE(fused), MoE(ExpertTwin(fused))]
    opts = [WhitenedMuon(m, lr=0.05, statistics_every=1, ns_dtype=torch.float64, skip_layers=["router"],
                         output_side=False) for m in models]
    assert [tuple(p.shape) for p in opts[0].param_groups[0]["params"]] == [(3, 5, 4), (3, 4, 5)]
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, 4, generator=g, dtype=torch.float64), torch.randn(16, 4, generator=g, dtype=torch.float64))
            for _ in range(4)]
    for m, o in zip(models, opts):
        train(m, o, data, loss=lambda model, x, y: (model(x) - y).square().mean())
    twin = models[1].experts
    assert opts[0].state[fused.up_weight]["input_whitener"].shape[0] == 3
    for e in range(3):
        torch.testing.assert_close(fused.up_weight[e], twin.up[e].weight, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fused.down_weight[e], twin.down[e].weight, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(fused.up_bias[e], twin.up[e].bias, rtol=1e-10, atol=1e-12)


def test_fused_experts_output_side_is_one_linear_per_expert_up_to_each_experts_scale():
    """The output side of a fused expert scales its gradients by the call's tokens (what the
    mean loss divides by), a per-expert Linear by its own routed rows: the factors agree up to
    one positive number per expert, and so does the first step (a whitener's scale cancels in
    the rescaled direction). Across steps the two weight their statistics differently."""
    torch.manual_seed(0)
    fused = RoutedExperts(3, 4, 5).double()
    models = [MoE(fused), MoE(ExpertTwin(fused))]
    opts = [WhitenedMuon(m, lr=0.05, statistics_every=1, ns_dtype=torch.float64, skip_layers=["router"],
                         output_side=True) for m in models]
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, 4, generator=g, dtype=torch.float64),
             torch.randn(16, 4, generator=g, dtype=torch.float64))]
    for m, o in zip(models, opts):
        train(m, o, data, loss=lambda model, x, y: (model(x) - y).square().mean())
    twin = models[1].experts
    for weight, linears in ((fused.up_weight, twin.up), (fused.down_weight, twin.down)):
        for e in range(3):
            ours = opts[0].state[weight]["output_factor"][e].reshape(-1)
            theirs = opts[1].state[linears[e].weight]["output_factor"].reshape(-1)
            ratio = ours / theirs
            assert ratio.min() > 0
            torch.testing.assert_close(ratio, ratio.mean().expand_as(ratio), rtol=1e-9, atol=0)
            torch.testing.assert_close(weight[e], linears[e].weight, rtol=1e-10, atol=1e-12)


def test_fused_experts_wide_output_side_is_on_the_experts_up_projection_alone():
    """``output_side="wide"`` on fused experts reads each expert's ``[out, in]``: the up
    projection (``[5, 4]`` per expert) keeps an output factor per expert, the down projection
    (``[4, 5]``) none."""
    torch.manual_seed(0)
    fused = RoutedExperts(3, 4, 5).double()
    model = MoE(fused)
    opt = WhitenedMuon(model, lr=0.05, statistics_every=1, ns_dtype=torch.float64, skip_layers=["router"],
                       output_side="wide")
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(16, 4, generator=g, dtype=torch.float64),
             torch.randn(16, 4, generator=g, dtype=torch.float64))]
    train(model, opt, data, loss=lambda model, x, y: (model(x) - y).square().mean())
    assert opt.state[fused.up_weight]["output_factor"].shape[:2] == (3, 1)
    assert opt.state[fused.up_weight]["output_factor"].abs().sum() > 0
    assert not any(k.startswith("output_") for k in opt.state[fused.down_weight])


# ----------------------------------------------------------------------------- register_adapter
class Scaled(nn.Module):
    """A user's Linear-like module: ``y = 2 · x Wᵀ``."""

    def __init__(self, i, o):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(o, i) * 0.3)

    def forward(self, x):
        return 2 * F.linear(x, self.weight)


def test_a_module_taught_by_register_adapter_is_whitened_and_unknown_ones_are_refused():
    with pytest.raises(ValueError, match=r"modules\[0\] \(Scaled\)"):
        WhitenedMuon([Scaled(3, 3)], lr=0.1)
    count = len(_ADAPTERS)
    register_adapter(Scaled, KFACAdapter)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(Scaled(4, 6), nn.Tanh(), Scaled(6, 2)).double()
        opt = WhitenedMuon(model, lr=0.05, statistics_every=1)
        assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == 2
        x = torch.randn(8, 4, dtype=torch.float64)
        train(model, opt, [(x, None)], loss=lambda m, x, y: m(x).square().mean())
        factor = opt.state[model[0].weight]["input_factor"][0]
        centred = x - x.mean(dim=0)  # no bias: centred by default
        torch.testing.assert_close(factor, centred.T @ centred / 8)
    finally:
        del _ADAPTERS[: len(_ADAPTERS) - count]


# ----------------------------------------------------------------------------- stacks and NaNs
class Parallel(nn.Module):
    """Three same-shape layers on different inputs: one stack in the step."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(5, 4, bias=False) for _ in range(3))

    def forward(self, x):
        return sum(layer(torch.tanh(x * (i + 1)) + i) for i, layer in enumerate(self.layers))


def test_a_stack_of_same_shape_weights_steps_each_with_its_own_whitener():
    """One optimizer (the three weights one stack) against one optimizer per weight (stacks of
    one); a NaN in one member's gradient leaves that member alone and the others as if alone."""
    torch.manual_seed(0)
    model = Parallel().double()
    twin = copy.deepcopy(model)
    settings = dict(lr=0.05, weight_decay=0.1, statistics_every=1, output_side=True, ns_dtype=torch.float64)
    together = WhitenedMuon(model, **settings)
    alone = [WhitenedMuon([layer], **settings) for layer in twin.layers]
    g = torch.Generator().manual_seed(4)
    data = [(torch.randn(12, 5, generator=g, dtype=torch.float64) * torch.logspace(0, -1, 5, dtype=torch.float64),
             torch.randn(12, 4, generator=g, dtype=torch.float64)) for _ in range(4)]
    for step, (x, y) in enumerate(data):
        for m, opts in ((model, [together]), (twin, alone)):
            for o in opts:
                o.zero_grad()
            (m(x) - y).square().mean().backward()
            if step == 2:
                m.layers[1].weight.grad[0, 0] = float("nan")
            if step == 2 and m is twin:
                frozen = twin.layers[1].weight.detach().clone()
            for o in opts:
                o.step()
        if step == 2:
            assert torch.equal(model.layers[1].weight, frozen)
    whiteners = [together.state[layer.weight]["input_whitener"] for layer in model.layers]
    assert not torch.allclose(whiteners[0], whiteners[1])  # the inputs differ
    for a, b in zip(model.layers, twin.layers):
        torch.testing.assert_close(a.weight, b.weight, rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- written-out steps
# Polar Express's five quintics, as printed with the paper (arXiv 2505.16932) and used by the
# NanoGPT speedrun; the input is scaled by 1 / (1.02 ||X||_F)
PAPER_POLAR_EXPRESS = [(8.156554524902461, -22.48329292557795, 15.878769915207462),
                       (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                       (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                       (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                       (2.3465413258596377, -1.7097828382687081, 0.42323551169305323)]


def newton_schulz(matrix: torch.Tensor, steps: int, polar_express: bool = False) -> torch.Tensor:
    """torch.optim.Muon's quintic iteration (or Polar Express's), written out as a loop in float64."""
    x = matrix.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (1.02 * x.norm().item() + 1e-7) if polar_express else x / max(x.norm().item(), 1e-7)
    for i in range(steps):
        a, b, c = PAPER_POLAR_EXPRESS[min(i, 4)] if polar_express else (3.4445, -4.7750, 2.0315)
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def inverse_root(factor: torch.Tensor, damping: float) -> torch.Tensor:
    lam = damping * torch.trace(factor) / factor.shape[0]
    values, vectors = torch.linalg.eigh(factor + lam * torch.eye(factor.shape[0], dtype=factor.dtype))
    return vectors @ torch.diag(values.rsqrt()) @ vectors.T


def written_out(model, data, *, lrs, wd, momentum, nesterov, ns_steps, rows=None, damping=0.1, decay=0.8,
                swap_sides=False, polar_express=False, output_side=False, center=None, output_damping=None):
    """The step of every nn.Linear of ``model`` (statistics every step), in float64: input
    factor ``A`` = mean of the input rows' products, output factor ``G`` = mean of ``δδᵀ`` with
    ``δ`` the output gradient times the call's rows (the mean loss's 1/N undone), each side's
    whitener ``(F + λI)^{-1/2}`` (``λ``: ``damping``, ``output_damping`` for ``G``), direction
    ``T_G msign(T_G M T_A) T_A`` at ``msign``'s norm.
    ``swap_sides`` whitens the input side from the wrong end (``T_A M`` instead of ``M T_A``).
    ``center``: the input rows are centred on their mean (``None``: for the layers without a bias)."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    inputs, grads, factors, buffers = {}, {}, {}, {}
    hooks = [m.register_forward_pre_hook(lambda mod, args: inputs.__setitem__(mod, args[0].detach())) for m in layers]

    def keep_output_grad(mod, args, out):
        out.register_hook(lambda grad: grads.__setitem__(mod, grad.detach()))

    hooks += [m.register_forward_hook(keep_output_grad) for m in layers]

    def running(key, r, centred=False):
        if centred:
            r = r - r.mean(dim=0)
        batch = r.T @ r / r.shape[0]
        factors[key] = batch if key not in factors else decay * factors[key] + (1 - decay) * batch
        return inverse_root(factors[key], output_damping if key[1] == "output" and output_damping else damping)

    for (x, y), lr in zip(data, lrs):
        model.zero_grad()
        (model(x) - y).square().mean().backward()
        for m in layers:
            w, g = m.weight, m.weight.grad.double()
            r = inputs[m].reshape(-1, w.shape[1]).double()
            t = running((m, "input"), r[:rows] if rows is not None else r,
                        centred=m.bias is None if center is None else center)
            d = grads[m].reshape(-1, w.shape[0]).double() * (grads[m].numel() // w.shape[0])
            left = running((m, "output"), d[:rows] if rows is not None else d) if output_side else None
            buffers[m] = buffers.get(m, torch.zeros_like(g)) * momentum + (1 - momentum) * g
            update = (1 - momentum) * g + momentum * buffers[m] if nesterov else buffers[m]
            whitened = t @ update if swap_sides else update @ t
            ortho = newton_schulz(whitened if left is None else left @ whitened, ns_steps, polar_express)
            direction = t @ ortho if swap_sides else ortho @ t
            if left is not None:
                direction = left @ direction
            direction = direction * ortho.norm() / direction.norm()
            with torch.no_grad():
                w.mul_(1 - lr * wd).sub_(direction.to(w.dtype), alpha=lr * 0.2 * math.sqrt(max(w.shape)))
    for h in hooks:
        h.remove()
    return [m.weight.detach().clone() for m in layers]


def square_net(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6, bias=False), nn.Tanh(), nn.Linear(6, 6, bias=False)).to(dtype)


def square_data(steps, dtype=torch.float64, rows=10):
    g = torch.Generator().manual_seed(5)
    scale = torch.logspace(0.5, -1, 6, dtype=dtype)
    return [(torch.randn(rows, 6, generator=g, dtype=dtype) * scale, torch.randn(rows, 6, generator=g, dtype=dtype))
            for _ in range(steps)]


def run_optimizer(model, data, scheduler=None, **settings):
    opt = WhitenedMuon(model, statistics_every=1, factor_decay=0.8, root="symmetric", **settings)
    sched = scheduler(opt) if scheduler else None
    for x, y in data:
        opt.zero_grad()
        (model(x) - y).square().mean().backward()
        opt.step()
        if sched:
            sched.step()
    return [m.weight.detach().clone() for m in model if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("nesterov, ns_steps", [(False, 5), (True, 2), (False, 3)])
def test_nesterov_and_ns_steps_are_the_written_out_step(nesterov, ns_steps):
    data = square_data(4)
    want = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=nesterov,
                       ns_steps=ns_steps)
    got = run_optimizer(square_net(), data, lr=0.05, nesterov=nesterov, ns_steps=ns_steps, ns_dtype=torch.float64)
    for a, b in zip(got, want):  # float64, up to the eigendecompositions' rounding through Newton-Schulz
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    other = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=not nesterov,
                        ns_steps=ns_steps + 1)
    assert not torch.allclose(got[0], other[0], rtol=1e-4)


@pytest.mark.parametrize("rows", [None, 4])
def test_the_output_side_is_the_written_out_two_sided_step(rows):
    data = square_data(4)
    want = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=True, ns_steps=5,
                       rows=rows, output_side=True)
    got = run_optimizer(square_net(), data, lr=0.05, ns_dtype=torch.float64, output_side=True, statistics_rows=rows)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    one_sided = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=True, ns_steps=5,
                            rows=rows)
    assert not torch.allclose(got[0], one_sided[0], rtol=1e-4)


@pytest.mark.parametrize("ns_steps", [5, 7])
def test_polar_express_is_the_written_out_step(ns_steps):
    data = square_data(4)
    want = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=True,
                       ns_steps=ns_steps, polar_express=True)
    got = run_optimizer(square_net(), data, lr=0.05, ns_steps=ns_steps, ns_dtype=torch.float64,
                        ns_coefficients="polar_express")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    muon = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=True, ns_steps=ns_steps)
    assert not torch.allclose(got[0], muon[0], rtol=1e-4)


@pytest.mark.parametrize("shape", [(64, 64), (32, 96), (96, 32)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_polar_express_is_closer_to_the_polar_factor(shape, dtype):
    """Against the SVD's U Vᵀ, for a spectrum spread over three decades: five Polar Express
    iterations land nearer than five of Muon's quintic, in float64 and in bf16."""
    g = torch.Generator().manual_seed(3)
    q1, _ = torch.linalg.qr(torch.randn(shape[0], shape[0], generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(shape[1], shape[1], generator=g, dtype=torch.float64))
    k = min(shape)
    matrix = q1[:, :k] @ torch.diag(torch.logspace(0, -3, k, dtype=torch.float64)) @ q2[:, :k].T
    polar = q1[:, :k] @ q2[:, :k].T
    errors = {c: (wm.msign(matrix, 5, dtype=dtype, coefficients=c).double() - polar).norm() / polar.norm()
              for c in ("muon", "polar_express")}
    assert errors["polar_express"] < 0.8 * errors["muon"], errors
    singular = torch.linalg.svdvals(wm.msign(matrix, 5, dtype=dtype, coefficients="polar_express").double())
    assert singular.max() < 1.2  # the 2 % margin keeps the first quintic's input inside [0, 1]


def test_ns_coefficients_is_checked():
    with pytest.raises(ValueError, match="ns_coefficients.*'newton'"):
        WhitenedMuon(square_net(), ns_coefficients="newton")
    with pytest.raises(ValueError, match="coefficients"):
        wm.msign(torch.eye(3), coefficients="newton")


def test_a_scheduler_with_weight_decay_is_the_written_out_step():
    data = square_data(4)
    lrs = [0.05 * 0.5 ** i for i in range(4)]
    want = written_out(square_net(), data, lrs=lrs, wd=0.3, momentum=0.9, nesterov=True, ns_steps=5)
    got = run_optimizer(square_net(), data, lr=0.05, weight_decay=0.3, ns_dtype=torch.float64,
                        scheduler=lambda o: torch.optim.lr_scheduler.ExponentialLR(o, 0.5))
    for a, b in zip(got, want):  # float64, up to the eigendecompositions' rounding through Newton-Schulz
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)


def test_statistics_rows_takes_the_first_rows_of_each_call():
    data = square_data(3, rows=10)
    want = written_out(square_net(), data, lrs=[0.05] * 3, wd=0.0, momentum=0.9, nesterov=True, ns_steps=5, rows=4)
    got = run_optimizer(square_net(), data, lr=0.05, statistics_rows=4, ns_dtype=torch.float64)
    for a, b in zip(got, want):  # float64, up to the eigendecompositions' rounding through Newton-Schulz
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9)
    every = run_optimizer(square_net(), data, lr=0.05, statistics_rows=None, ns_dtype=torch.float64)
    assert not torch.allclose(every[0], got[0], rtol=1e-4)


def test_the_default_bfloat16_path_is_the_exact_step_within_its_rounding_and_not_the_wrong_side():
    """The library's default (Newton-Schulz in bfloat16) against the written-out float64 step: the
    weights' displacement agrees to a few percent, far closer than whitening the wrong side."""
    data = square_data(4)
    start = square_net()[0].weight.detach().clone()
    exact = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=True, ns_steps=5)
    wrong = written_out(square_net(), data, lrs=[0.05] * 4, wd=0.0, momentum=0.9, nesterov=True, ns_steps=5,
                        swap_sides=True)
    got = run_optimizer(square_net(torch.float32), [(x.float(), y.float()) for x, y in data], lr=0.05)

    def gap(a, b):
        return ((a.double() - b.double()).norm() / (b.double() - start).norm()).item()

    assert gap(got[0], exact[0]) < 0.05
    assert gap(wrong[0], exact[0]) > 0.2


# the runs without grad_scaler= are the point here: their float16 gradients' warning is expected
@pytest.mark.filterwarnings("ignore:output gradients arrive in float16")
def test_an_fp16_grad_scaler_is_divided_out_of_the_output_statistics():
    """fp16 autocast with a GradScaler whose scale doubles every step: the output-side factor
    equals the one of the unscaled run only when the scale is divided out (``grad_scaler=``); an
    overflowing step that the scaler skips leaves no non-finite row in the statistics."""
    def run(use_scaler, pass_scaler):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1, enabled=use_scaler)
        opt = WhitenedMuon([net[0], net[2]], lr=0.02, statistics_every=1, factor_decay=0.5, output_side=True,
                           grad_scaler=scaler if pass_scaler else None)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = (net(x).float() - y).square().mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        return opt.state[net[2].weight]["output_factor"], [p.detach().clone() for p in net.parameters()]

    reference, _ = run(False, False)
    scaled, _ = run(True, True)
    unscaled, _ = run(True, False)
    torch.testing.assert_close(scaled, reference, rtol=2e-2, atol=1e-6)
    assert not torch.allclose(unscaled, reference, rtol=0.1)
    with pytest.raises(TypeError, match="grad_scaler"):
        WhitenedMuon([nn.Linear(2, 2)], grad_scaler="yes")


def test_a_weight_applied_outside_its_module_warns_once_naming_it():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 3)
            self.bypassed = nn.Linear(3, 3)

        def forward(self, x):
            return F.linear(self.used(x), self.bypassed.weight)

    model = Functional()
    opt = WhitenedMuon(model, lr=0.02, statistics_every=1)
    with pytest.warns(RuntimeWarning, match="bypassed"):
        train(model, opt, [(torch.randn(4, 3), None)], loss=lambda m, x, y: m(x).square().mean())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, opt, [(torch.randn(4, 3), None)] * 2, loss=lambda m, x, y: m(x).square().mean())


def test_msign_module_constant_is_torch_muons():
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C
    assert wm.NS_COEFFICIENTS == (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def test_a_frozen_bias_leaves_its_weight_whitened_and_its_inputs_centred():
    """The bias is not whitened (AdamW steps it when it trains), so a frozen one must not send
    its weight to AdamW (K-FAC's rule for ``[W | b]`` units). A bias that does not train gives
    the layer no free shift, so the layer is centred like one without a bias: its factor is the
    covariance of its inputs about their mean (float64 reference from the inputs)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model[0].bias.requires_grad_(False)
    opt = WhitenedMuon(model, lr=0.02, statistics_every=1, factor_decay=0.5)
    names = {g["algorithm"]: g["param_names"] for g in opt.param_groups}
    assert names == {"whitened_muon": ["0.weight", "2.weight"], "adamw": ["2.bias"]}
    seen = {}

    def record(index):
        def hook(module, inputs, output):
            seen.setdefault(index, inputs[0].detach().double())
        return hook

    for index in (0, 2):
        model[index].register_forward_hook(record(index))
    x, y = torch.randn(16, 5) + 3.0, torch.randn(16, 3)  # inputs far from the origin
    frozen = model[0].bias.detach().clone()
    F.mse_loss(model(x), y).backward()
    opt.step()
    rows = seen[0] - seen[0].mean(dim=0)
    factor = opt.state[model[0].weight]["input_factor"][0]
    torch.testing.assert_close(factor.double(), rows.T @ rows / rows.shape[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(model[0].bias, frozen)
    # a trainable bias: that layer stays uncentred (the inputs' second moment)
    hidden = seen[2]
    factor2 = opt.state[model[2].weight]["input_factor"][0]
    torch.testing.assert_close(factor2.double(), hidden.T @ hidden / hidden.shape[0], rtol=1e-5, atol=1e-6)


class SparseExperts(nn.Module):
    """Eight Linear experts of which two (chosen per call) run: the others get no gradient."""

    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(8, 8) for _ in range(8))
        self.head = nn.Linear(8, 2)

    def forward(self, x, used):
        return self.head(sum(self.experts[i](x) for i in used))


def _count_statistics(model, opt, steps, used_at, statistics_every=5):
    """(steps whose forward collected statistics, products computed per expert)."""
    import kron_precond.whitening as whitening
    products: dict[int, int] = {}
    original = whitening.WhiteningStatistics.terms  # where a call's products are computed

    def counting(self, unit, side, rows, scale):
        if self.due(unit.param):
            products[id(unit.param)] = products.get(id(unit.param), 0) + 1
        return original(self, unit, side, rows, scale)

    collecting_steps = []
    whitening.WhiteningStatistics.terms = counting
    try:
        g = torch.Generator().manual_seed(1)
        for step in range(steps):
            collecting_steps.append(opt._capture.collecting)
            x = torch.randn(16, 8, generator=g)
            opt.zero_grad()
            model(x, used_at(step, g)).square().mean().backward()
            opt.step()
    finally:
        whitening.WhiteningStatistics.terms = original
    return collecting_steps, products


def test_weights_without_a_gradient_on_some_steps_keep_the_statistics_schedule():
    """Experts that miss steps must not spread the statistics over every step: the hooks
    collect on every ``statistics_every``-th step, for every weight that runs then."""
    torch.manual_seed(0)
    model = SparseExperts()
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=5)
    collecting, _ = _count_statistics(model, opt, 100, lambda step, g: torch.randperm(8, generator=g)[:2].tolist())
    assert [i for i, c in enumerate(collecting) if c] == list(range(0, 100, 5))


def test_a_weight_frozen_during_training_stops_costing_statistics():
    """A layer frozen mid-run (progressive freezing) computes no more products, and the other
    layers keep their schedule."""
    torch.manual_seed(0)
    model = SparseExperts()
    opt = WhitenedMuon(model, lr=1e-2, statistics_every=5)
    _count_statistics(model, opt, 7, lambda step, g: [0, 1])
    model.experts[0].requires_grad_(False)  # frozen at step 7; it still runs in the forward
    collecting, products = _count_statistics(model, opt, 30, lambda step, g: [0, 1])
    assert products.get(id(model.experts[0].weight), 0) == 0
    assert products[id(model.experts[1].weight)] == 6  # steps 10, 15, ..., 35
    assert [i + 7 for i, c in enumerate(collecting) if c] == list(range(10, 37, 5))


def test_the_statistics_schedule_resumes_from_a_checkpoint_bitwise():
    """Experts that miss steps have lower counts than the optimizer: the resumed schedule is
    the optimizer's, so a resumed run continues exactly as the uninterrupted one."""
    def run(resume_at=None):
        torch.manual_seed(0)
        model = SparseExperts()
        opt = WhitenedMuon(model, lr=1e-2, statistics_every=3)
        g = torch.Generator().manual_seed(1)
        for step in range(14):
            if step == resume_at:
                saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
                torch.manual_seed(5)
                model = SparseExperts()
                model.load_state_dict(weights)
                opt = WhitenedMuon(model, lr=1e-2, statistics_every=3)
                opt.load_state_dict(saved)
            x = torch.randn(16, 8, generator=g)
            used = torch.randperm(8, generator=g)[:2].tolist()
            opt.zero_grad()
            model(x, used).square().mean().backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    straight = run()
    for resume_at in (4, 7):
        assert torch.equal(run(resume_at), straight)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_an_expert_without_tokens_or_with_a_non_finite_gradient_stays_put_like_its_own_linear(dtype):
    """An expert the router sends no token has an all-zero slice of the stacked gradient, where
    a Linear of its own would have none: it keeps its weight and momentum (no step from the
    stale momentum, no weight decay), as the Linear does. A non-finite gradient of one expert
    leaves that expert alone, not the other experts of the weight. Bitwise, bfloat16 weights
    included (each expert's lr factor rounds as a Linear's does)."""
    torch.manual_seed(0)
    fused = RoutedExperts(3, 4, 5, bias=False).to(dtype)
    twin_up = [nn.Linear(4, 5, bias=False).to(dtype) for _ in range(3)]
    twin_down = [nn.Linear(5, 4, bias=False).to(dtype) for _ in range(3)]
    with torch.no_grad():
        for e in range(3):
            twin_up[e].weight.copy_(fused.up_weight[e])
            twin_down[e].weight.copy_(fused.down_weight[e])

    def twin(x, index, weights):
        out = torch.zeros_like(x)
        for e in range(3):
            token, choice = torch.where(index == e)
            if token.numel():
                out = out.index_add(0, token, twin_down[e](F.gelu(twin_up[e](x[token])))
                                    * weights[token, choice].unsqueeze(1))
        return out

    settings = dict(lr=0.05, weight_decay=0.1, statistics_every=1, output_side=False,
                    ns_dtype=torch.float64 if dtype == torch.float64 else None)
    ours, theirs = WhitenedMuon([fused], **settings), WhitenedMuon(twin_up + twin_down, **settings)
    g = torch.Generator().manual_seed(2)
    for step in range(5):
        x, y = (torch.randn(12, 4, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
        scores = torch.rand(12, 3, generator=g)
        if step in (1, 2):
            scores[:, 1] = -1.0  # expert 1 gets no token
        index = scores.topk(2, dim=1).indices
        weights = (torch.rand(12, 2, generator=g, dtype=torch.float64) + 0.1).to(dtype)
        for model, opt, downs in ((fused, ours, None), (twin, theirs, twin_down)):
            opt.zero_grad()
            (model(x, index, weights) - y).square().mean().backward()
            if step == 3:  # expert 2's output weight overflows
                if downs is None:
                    fused.down_weight.grad[2, 0, 0] = float("inf")
                else:
                    downs[2].weight.grad[0, 0] = float("inf")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the unused experts' and the overflow's warnings
                opt.step()
        for e in range(3):
            torch.testing.assert_close(fused.up_weight[e], twin_up[e].weight, rtol=0, atol=0)
            torch.testing.assert_close(fused.down_weight[e], twin_down[e].weight, rtol=0, atol=0)
    assert int(ours.state[fused.down_weight]["nonfinite_steps"]) == 1
