"""WhitenedMuon on ``nn.MultiheadAttention``, whose projections are applied functionally.

References are built another way: the same attention from ``nn.Linear`` projections and
``F.scaled_dot_product_attention`` (stepped by WhitenedMuon's list form, whose Linear path
the rest of the suite checks against written-out steps), a fused ``nn.Linear`` query/key/value
projection for the unsplit in_proj, and ``torch.optim.Muon`` / ``torch.optim.AdamW`` for the
weights stepped unwhitened and the biases.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_utils import results_of
from kron_precond import WhitenedMuon

E, HEADS, T = 8, 2, 5


def causal(t: int = T) -> torch.Tensor:
    return torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), 1)


class Packed(nn.Module):
    """A self-attention through ``nn.MultiheadAttention`` (one packed in_proj)."""

    def __init__(self, bias: bool = True):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, bias=bias, batch_first=True, dtype=torch.float64)

    def forward(self, x):
        return self.attn(x, x, x, attn_mask=causal(), need_weights=False)[0]


class LinearTwin(nn.Module):
    """``Packed`` with nn.Linear projections: three (``fused=False``) or one of ``3E`` outputs."""

    def __init__(self, packed: Packed, fused: bool):
        super().__init__()
        mha = packed.attn
        bias = mha.in_proj_bias is not None
        self.fused = fused
        if fused:
            self.qkv = nn.Linear(E, 3 * E, bias=bias, dtype=torch.float64)
            self.qkv.weight.data.copy_(mha.in_proj_weight.data)
            if bias:
                self.qkv.bias.data.copy_(mha.in_proj_bias.data)
        else:
            for i, name in enumerate("qkv"):
                layer = nn.Linear(E, E, bias=bias, dtype=torch.float64)
                layer.weight.data.copy_(mha.in_proj_weight.data[i * E:(i + 1) * E])
                if bias:
                    layer.bias.data.copy_(mha.in_proj_bias.data[i * E:(i + 1) * E])
                setattr(self, name, layer)
        self.out = copy.deepcopy(mha.out_proj)

    def projections(self) -> list[nn.Linear]:
        return [self.qkv] if self.fused else [self.q, self.k, self.v]

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        heads = [t.unflatten(-1, (HEADS, E // HEADS)).transpose(1, 2) for t in (q, k, v)]
        h = F.scaled_dot_product_attention(*heads, attn_mask=causal())
        return self.out(h.transpose(1, 2).flatten(-2))


def batches(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, T, E, generator=g, dtype=torch.float64) + 0.5,
             torch.randn(4, T, E, generator=g, dtype=torch.float64)) for _ in range(steps)]


def train(model: nn.Module, optimizers: list, data) -> None:
    for x, y in data:
        for o in optimizers:
            o.zero_grad()
        F.mse_loss(model(x), y).backward()
        for o in optimizers:
            o.step()


SETTINGS = dict(lr=0.05, momentum=0.9, statistics_every=2, ns_dtype=torch.float64)


@pytest.mark.parametrize("fused_qkv", [None, False])
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_self_attention_steps_like_its_linear_twin(fused_qkv, bias):
    """The packed in_proj is whitened by the query's statistics and stepped as three parts (or
    whole with ``fused_qkv=False``): the steps of three nn.Linear projections (one fused
    nn.Linear), whitened by the same input. Biases: AdamW's. A bias-free in_proj is centred,
    as bias-free Linears are."""
    torch.manual_seed(0)
    packed = Packed(bias)
    packed.attn.out_proj.requires_grad_(False)  # out_proj: the next test
    twin = LinearTwin(packed, fused=fused_qkv is False)
    twin.out.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        ours = WhitenedMuon(packed, fused_qkv=fused_qkv, **SETTINGS)
    names = [ours._names[id(p)] for g in ours.param_groups for p in g["params"]]
    assert names == ["attn.in_proj_weight"] + (["attn.in_proj_bias"] if bias else [])
    reference = [WhitenedMuon(twin.projections(), **SETTINGS)]
    if bias:
        reference.append(torch.optim.AdamW([p.bias for p in twin.projections()], lr=SETTINGS["lr"],
                                           weight_decay=0.0))
    initial = packed.attn.in_proj_weight.detach().clone()
    data = batches(7)
    train(packed, [ours], data)
    train(twin, reference, data)
    expected = torch.cat([p.weight for p in twin.projections()])
    assert (expected - initial).abs().max() > 0.1  # it trained
    torch.testing.assert_close(packed.attn.in_proj_weight, expected, rtol=1e-9, atol=1e-11)
    if bias:  # the key's bias has no gradient but rounding noise, which AdamW's steps follow to ~1e-10
        torch.testing.assert_close(packed.attn.in_proj_bias, torch.cat([p.bias for p in twin.projections()]),
                                   rtol=1e-9, atol=1e-9)
    assert ours.state[packed.attn.in_proj_weight]["input_whitener"].shape == (1, E, E)


def test_a_whole_attention_steps_like_its_linear_twin_with_torch_muon_on_out_proj():
    """Every projection at once: the in_proj whitened, the out_proj (whose input no hook sees)
    stepped by ``torch.optim.Muon`` unwhitened."""
    torch.manual_seed(0)
    packed = Packed()
    twin = LinearTwin(packed, fused=False)
    settings = dict(lr=0.05, momentum=0.9, weight_decay=0.1, statistics_every=2, adjust_lr_fn="match_rms_adamw",
                    ns_dtype=torch.bfloat16)  # torch.optim.Muon's iteration, on every CPU
    ours = WhitenedMuon(packed, **settings)
    assert {ours._names[id(p)] for p in ours.param_groups[0]["params"]} == {"attn.in_proj_weight",
                                                                            "attn.out_proj.weight"}
    biases = [p.bias for p in twin.projections()] + [twin.out.bias]
    reference = [WhitenedMuon(twin.projections(), **settings),
                 torch.optim.Muon([twin.out.weight], lr=0.05, momentum=0.9, weight_decay=0.1,
                                  adjust_lr_fn="match_rms_adamw"),
                 torch.optim.AdamW(biases, lr=0.05, weight_decay=0.1)]
    data = batches(6)
    train(packed, [ours], data)
    train(twin, reference, data)
    # bfloat16 Newton-Schulz on inputs equal to float64 rounding: equal up to a rare flip of a bfloat16 rounding
    torch.testing.assert_close(packed.attn.out_proj.weight, twin.out.weight, rtol=0, atol=2e-3)
    torch.testing.assert_close(packed.attn.in_proj_weight, torch.cat([p.weight for p in twin.projections()]),
                               rtol=0, atol=2e-3)
    torch.testing.assert_close(packed.attn.in_proj_bias, torch.cat([p.bias for p in twin.projections()]),
                               rtol=0, atol=1e-6)
    torch.testing.assert_close(packed.attn.out_proj.bias, twin.out.bias, rtol=0, atol=1e-6)
    assert "input_whitener" not in ours.state[packed.attn.out_proj.weight]  # no statistics for it


class Separate(nn.Module):
    """Cross-attention with key and value of other widths: three projection weights."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, kdim=3, vdim=5, batch_first=True, dtype=torch.float64)

    def forward(self, x, memory):
        key, value = memory[..., :3], memory[..., 3:]
        return self.attn(x, key=key, value=value, need_weights=False)[0]


class SeparateTwin(nn.Module):
    def __init__(self, separate: Separate):
        super().__init__()
        mha = separate.attn
        for i, (name, width) in enumerate((("q", E), ("k", 3), ("v", 5))):
            layer = nn.Linear(width, E, dtype=torch.float64)
            layer.weight.data.copy_(getattr(mha, f"{name}_proj_weight").data)
            layer.bias.data.copy_(mha.in_proj_bias.data[i * E:(i + 1) * E])
            setattr(self, name, layer)
        self.out = copy.deepcopy(mha.out_proj)

    def forward(self, x, memory):
        q, k, v = self.q(x), self.k(memory[..., :3]), self.v(memory[..., 3:])
        heads = [t.unflatten(-1, (HEADS, E // HEADS)).transpose(1, 2) for t in (q, k, v)]
        h = F.scaled_dot_product_attention(*heads)
        return self.out(h.transpose(1, 2).flatten(-2))


def test_separate_projections_are_each_whitened_by_their_own_input():
    """kdim / vdim set: q, k and v weights of their own, each whitened by the query, the key
    or the value (cross-attention), as three nn.Linear layers reading them."""
    torch.manual_seed(0)
    ours_model = Separate()
    ours_model.attn.out_proj.requires_grad_(False)
    twin = SeparateTwin(ours_model)
    twin.out.requires_grad_(False)
    ours = WhitenedMuon(ours_model, **SETTINGS)
    reference = [WhitenedMuon([twin.q, twin.k, twin.v], **SETTINGS),
                 torch.optim.AdamW([twin.q.bias, twin.k.bias, twin.v.bias], lr=SETTINGS["lr"], weight_decay=0.0)]
    g = torch.Generator().manual_seed(2)
    data = [((torch.randn(4, T, E, generator=g, dtype=torch.float64),
              torch.randn(4, 7, 8, generator=g, dtype=torch.float64) + 1.0),
             torch.randn(4, T, E, generator=g, dtype=torch.float64)) for _ in range(6)]
    for model, opts in ((ours_model, [ours]), (twin, reference)):
        for (x, memory), y in data:
            for o in opts:
                o.zero_grad()
            F.mse_loss(model(x, memory), y).backward()
            for o in opts:
                o.step()
    for name in "qkv":
        torch.testing.assert_close(getattr(ours_model.attn, f"{name}_proj_weight"), getattr(twin, name).weight,
                                   rtol=1e-9, atol=1e-11)
    widths = [ours.state[getattr(ours_model.attn, f"{n}_proj_weight")]["input_whitener"].shape[-1] for n in "qkv"]
    assert widths == [E, 3, 5]


class Cross(nn.Module):
    """Cross-attention through a packed in_proj: the query from ``x``, the key and value from
    ``memory`` (``distinct``: DETR's three inputs, ``x + pos``, ``memory + pos``, ``memory``)."""

    def __init__(self, distinct: bool = False, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=dtype)
        self.distinct = distinct

    def inputs(self, x, memory):
        if not self.distinct:
            return x, memory, memory
        pos = torch.linspace(-1, 1, E, dtype=x.dtype)
        return x + pos, memory + pos, memory

    def forward(self, x, memory):
        return self.attn(*self.inputs(x, memory), need_weights=False)[0]


class CrossTwin(nn.Module):
    def __init__(self, cross: Cross):
        super().__init__()
        mha = cross.attn
        self.inputs = cross.inputs
        dtype = mha.in_proj_weight.dtype
        for i, name in enumerate("qkv"):
            layer = nn.Linear(E, E, dtype=dtype)
            layer.weight.data.copy_(mha.in_proj_weight.data[i * E:(i + 1) * E])
            layer.bias.data.copy_(mha.in_proj_bias.data[i * E:(i + 1) * E])
            setattr(self, name, layer)
        self.out = copy.deepcopy(mha.out_proj)

    def forward(self, x, memory):
        query, key, value = self.inputs(x, memory)
        heads = [t.unflatten(-1, (HEADS, E // HEADS)).transpose(1, 2)
                 for t in (self.q(query), self.k(key), self.v(value))]
        return self.out(F.scaled_dot_product_attention(*heads).transpose(1, 2).flatten(-2))


def _cross_batches(steps: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(6)
    return [(torch.randn(4, T, E, generator=g, dtype=dtype), torch.randn(4, 3, E, generator=g, dtype=dtype) + 0.5,
             torch.randn(4, T, E, generator=g, dtype=dtype)) for _ in range(steps)]


def _train_cross(pairs, data) -> None:
    for model, opts in pairs:
        for x, memory, y in data:
            for o in opts:
                o.zero_grad()
            F.mse_loss(model(x, memory), y).backward()
            for o in opts:
                o.step()


@pytest.mark.parametrize("distinct", [False, True])
def test_a_packed_attention_called_as_cross_attention_whitens_each_part_by_its_own_input(distinct):
    """Found at the first training forward, the packed in_proj's query, key and value parts are
    each whitened by their own input from then on: the steps of three nn.Linear projections
    reading the query, the key and the value (key and value from one memory, or DETR's three
    inputs), with no warning. Biases: AdamW's."""
    torch.manual_seed(0)
    model = Cross(distinct, dtype=torch.float64)
    model.attn.out_proj.requires_grad_(False)  # unwhitened: the self-attention tests
    twin = CrossTwin(model)
    twin.out.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours = WhitenedMuon(model, **SETTINGS)
        reference = [WhitenedMuon([twin.q, twin.k, twin.v], **SETTINGS),
                     torch.optim.AdamW([twin.q.bias, twin.k.bias, twin.v.bias], lr=SETTINGS["lr"], weight_decay=0.0)]
        initial = model.attn.in_proj_weight.detach().clone()
        _train_cross([(model, [ours]), (twin, reference)], _cross_batches(7, torch.float64))
    expected = torch.cat([twin.q.weight, twin.k.weight, twin.v.weight])
    assert (expected - initial).abs().max() > 0.1  # it trained
    torch.testing.assert_close(model.attn.in_proj_weight, expected, rtol=1e-9, atol=1e-11)
    state = ours.state[model.attn.in_proj_weight]
    assert state["input_whitener"].shape == (3, 1, E, E)
    for part, layer in enumerate((twin.q, twin.k, twin.v)):
        torch.testing.assert_close(state["input_factor"][part], reference[0].state[layer.weight]["input_factor"],
                                   rtol=1e-12, atol=0)


def test_cross_attention_orthogonalised_whole_takes_muons_step_unwhitened():
    """With ``fused_qkv=False`` the three parts are orthogonalised as one matrix, which no
    whitening serves when they read different inputs: from the first call on, Muon's step
    unwhitened (torch.optim.Muon's on a fused nn.Linear), and a warning names the module, once."""
    torch.manual_seed(0)
    model = Cross()
    model.attn.in_proj_bias.requires_grad_(False)  # the weights alone: biases stay as they are
    model.attn.out_proj.bias.requires_grad_(False)
    fused = nn.Linear(E, 3 * E)
    fused.weight.data.copy_(model.attn.in_proj_weight.data)
    out = copy.deepcopy(model.attn.out_proj)
    settings = dict(lr=0.05, momentum=0.9, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ours = WhitenedMuon(model, statistics_every=1, fused_qkv=False, **settings)
    reference = torch.optim.Muon([fused.weight, out.weight], **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for x, memory, y in _cross_batches(5):
            for o, m in ((ours, model), (reference, None)):
                o.zero_grad()
                if m is not None:
                    F.mse_loss(m(x, memory), y).backward()
                    continue
                q, k, v = (F.linear(t, w) + b for t, w, b in zip((x, memory, memory), fused.weight.chunk(3),
                                                                  model.attn.in_proj_bias.chunk(3)))
                heads = [t.unflatten(-1, (HEADS, E // HEADS)).transpose(1, 2) for t in (q, k, v)]
                F.mse_loss(out(F.scaled_dot_product_attention(*heads).transpose(1, 2).flatten(-2)), y).backward()
            ours.step()
            reference.step()
    named = [w for w in caught if "called as cross-attention" in str(w.message)]
    assert len(named) == 1 and "'attn'" in str(named[0].message) and "fused_qkv" in str(named[0].message)
    state = ours.state[model.attn.in_proj_weight]
    assert "input_whitener" not in state and "input_factor" not in state
    torch.testing.assert_close(model.attn.in_proj_weight, fused.weight, rtol=0, atol=2e-3)
    torch.testing.assert_close(model.attn.out_proj.weight, out.weight, rtol=0, atol=2e-3)


def test_an_attention_whitened_as_self_attention_then_called_as_cross_attention_whitens_per_part():
    """Its statistics as self-attention (one factor) are dropped at the first cross-attention
    call, and a factor per part is gathered from then on; the list form does the same."""
    torch.manual_seed(0)
    model = Cross()
    opt = WhitenedMuon(model, lr=0.05, statistics_every=1)
    shapes = []
    for step, (x, memory, y) in enumerate(_cross_batches(4)):
        opt.zero_grad()
        F.mse_loss(model(x, x if step < 2 else memory), y).backward()  # self-attention on the first two steps
        opt.step()
        state = opt.state[model.attn.in_proj_weight]
        shapes.append((tuple(state["input_whitener"].shape), float(state["input_seen"].sum())))
    assert shapes == [((1, E, E), 1.0)] * 2 + [((3, 1, E, E), 3.0)] * 2
    listed = nn.MultiheadAttention(E, HEADS, batch_first=True)
    opt = WhitenedMuon([listed], lr=0.02)
    x, memory = torch.randn(2, T, E), torch.randn(2, 3, E)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        listed(x, memory, memory)[0].sum().backward()
        opt.step()
    assert opt.state[listed.in_proj_weight]["input_whitener"].shape == (3, 1, E, E)


def test_a_checkpoint_resumes_a_packed_attention_as_it_was_saved_bitwise():
    """A per-part checkpoint loaded into a fresh optimizer (which takes the module for
    self-attention until a call shows otherwise) resumes per part, bitwise; a self-attention
    checkpoint loaded into an optimizer that went per-part takes it back to one input. A
    checkpoint whose per-part factor has the wrong shape changes nothing."""
    torch.manual_seed(0)
    models = [Cross(), None]
    models[1] = copy.deepcopy(models[0])
    opts = [WhitenedMuon(m, lr=0.05, statistics_every=2) for m in models]
    data = _cross_batches(6)
    for step, (x, memory, y) in enumerate(data):
        if step == 3:
            saved = copy.deepcopy(opts[1].state_dict())
            opts[1].remove()
            opts[1] = WhitenedMuon(models[1], lr=0.05, statistics_every=2)
            bad = copy.deepcopy(saved)
            weight_key = 0  # in_proj_weight: the first whitened parameter
            bad["state"][weight_key]["input_factor"] = bad["state"][weight_key]["input_factor"][:2]
            with pytest.raises(ValueError, match="in_proj_weight's input_factor"):
                opts[1].load_state_dict(bad)
            assert len(opts[1].state) == 0  # the live state: nothing loaded
            assert not opts[1]._views[id(models[1].attn.in_proj_weight)].part_inputs
            opts[1].load_state_dict(saved)
        for m, o in zip(models, opts):
            o.zero_grad()
            F.mse_loss(m(x, memory), y).backward()
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    # back to one input: a self-attention checkpoint of the same model
    torch.manual_seed(0)
    own = Cross()
    self_opt = WhitenedMuon(own, lr=0.05, statistics_every=1)
    x, _, y = data[0]
    F.mse_loss(own(x, x), y).backward()
    self_opt.step()
    weight = models[1].attn.in_proj_weight
    opts[1].load_state_dict(self_opt.state_dict())
    assert opts[1].state[weight]["input_whitener"].shape == (1, E, E)
    assert not opts[1]._views[id(weight)].part_inputs and not opts[1]._packed[id(weight)].separate
    # orthogonalised whole, the weight has no parts to whiten each: the per-part checkpoint is refused
    whole = WhitenedMuon(Cross(), lr=0.05, statistics_every=2, fused_qkv=False)
    with pytest.raises(ValueError, match="in_proj_weight's input_factor"):
        whole.load_state_dict(saved)
    assert len(whole.state) == 0


@pytest.mark.parametrize("cross_at_save", [True, False])
def test_a_dcp_checkpoint_resumes_an_attention_however_it_was_called_bitwise(tmp_path, cross_at_save):
    """torch.distributed.checkpoint loads into the state of a fresh optimizer, whose packed
    in_proj is in self-attention form until a call shows otherwise. One training forward of the
    fresh model before the template is taken (the documented recipe) puts an attention called as
    cross-attention in its per-part form; the run then resumes bitwise. Without it, DCP refuses
    the per-part factor's shape, loudly."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def make():
        torch.manual_seed(0)
        model = Cross(dtype=torch.float64)
        return model, WhitenedMuon(model, lr=0.05, statistics_every=2, ns_dtype=torch.float64)

    def call(model, x, memory):
        return model(x, memory if cross_at_save else x)

    def steps(model, opt, data):
        for x, memory, y in data:
            opt.zero_grad()
            F.mse_loss(call(model, x, memory), y).backward()
            opt.step()

    def resume(forward_first: bool):
        model, opt = make()
        if forward_first:
            x, memory, _ = data[0]
            call(model, x, memory)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=tmp_path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return model, opt

    data = _cross_batches(6, torch.float64)
    (whole, whole_opt), (saved, saved_opt) = make(), make()
    steps(whole, whole_opt, data)
    steps(saved, saved_opt, data[:3])
    assert saved_opt._views[id(saved.attn.in_proj_weight)].part_inputs == cross_at_save
    model_sd, optim_sd = get_state_dict(saved, saved_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)
    if cross_at_save:
        with pytest.raises(CheckpointException, match="Size mismatch"):  # the planner's ValueError
            resume(forward_first=False)
    fresh, fresh_opt = resume(forward_first=True)
    weight = fresh.attn.in_proj_weight
    assert fresh_opt._views[id(weight)].part_inputs == cross_at_save == fresh_opt._packed[id(weight)].separate
    steps(fresh, fresh_opt, data[3:])
    for a, b in zip(whole.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


class Seq2Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoderLayer(E, HEADS, 16, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        return self.decoder(tgt, self.encoder(src), tgt_mask=causal(tgt.shape[1]).float(), tgt_is_causal=True)


def test_transformer_layers_whiten_self_attention_and_the_decoders_cross_attention_per_part():
    torch.manual_seed(0)
    model = Seq2Seq()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = WhitenedMuon(model, lr=0.02)
        src, tgt = torch.randn(3, 6, E), torch.randn(3, T, E)
        for _ in range(3):
            opt.zero_grad()
            model(src, tgt).square().mean().backward()
            opt.step()
    whitened = {"encoder.self_attn.in_proj_weight", "decoder.self_attn.in_proj_weight", "encoder.linear1.weight",
                "encoder.linear2.weight", "decoder.linear1.weight", "decoder.linear2.weight",
                "decoder.multihead_attn.in_proj_weight"}
    unwhitened = {"encoder.self_attn.out_proj.weight", "decoder.self_attn.out_proj.weight",
                  "decoder.multihead_attn.out_proj.weight"}
    params = dict(model.named_parameters())
    assert {opt._names[id(p)] for p in opt.param_groups[0]["params"]} == whitened | unwhitened
    for name in whitened:
        assert opt.state[params[name]]["input_whitener"] is not None, name
    # known to be cross-attention: a factor per part from the first step (query, memory, memory)
    assert opt.state[params["decoder.multihead_attn.in_proj_weight"]]["input_whitener"].shape == (3, 1, E, E)
    assert opt.state[params["decoder.self_attn.in_proj_weight"]]["input_whitener"].shape == (1, E, E)
    for name in unwhitened:
        assert "input_whitener" not in opt.state[params[name]] and opt.state[params[name]]["step"] == 3, name
    assert {opt._names[id(p)] for p in opt.param_groups[1]["params"]} == {
        n for n, p in model.named_parameters() if n not in whitened | unwhitened}


def test_the_list_form_takes_an_attention_and_a_checkpoint_resumes_bitwise():
    torch.manual_seed(0)
    models = [Packed(), None]
    models[1] = copy.deepcopy(models[0])
    opts = [WhitenedMuon([m.attn], lr=0.05, statistics_every=2) for m in models]
    assert [opts[0]._names[id(p)] for p in opts[0].param_groups[0]["params"]] == [
        "modules[0].in_proj_weight", "modules[0].out_proj.weight"]
    for step, (x, y) in enumerate(batches(6)):
        if step == 3:
            saved = copy.deepcopy(opts[1].state_dict())
            opts[1].remove()
            opts[1] = WhitenedMuon([models[1].attn], lr=0.05, statistics_every=2)
            opts[1].load_state_dict(saved)
        for m, o in zip(models, opts):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(a, b)
    frozen = nn.MultiheadAttention(E, HEADS)
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match=r"modules\[0\] \(MultiheadAttention\) has no trainable projection"):
        WhitenedMuon([frozen], lr=0.02)


def test_with_output_side_the_attention_keeps_the_identity_there():
    """The projections' output gradients are not observable (the module returns out_proj's
    output): their output whitener stays the identity, and training goes on."""
    torch.manual_seed(0)
    model = Packed()
    opt = WhitenedMuon(model, lr=0.05, output_side=True, statistics_every=1)
    losses = []
    for x, y in batches(4):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    state = opt.state[model.attn.in_proj_weight]
    assert torch.equal(state["output_whitener"], torch.eye(E, dtype=torch.float64).expand(3, E, E))
    assert state["input_whitener"].shape == (1, E, E) and all(map(torch.isfinite, map(torch.tensor, losses)))


def test_the_wide_output_side_leaves_out_the_attentions_projections():
    """``output_side="wide"``: ``k_proj_weight`` ``[E, 3]`` and ``v_proj_weight`` ``[E, 5]`` have
    outputs wider than their inputs, but no observable output gradient, so they get no output
    side at all (no factor or whitener to refresh and apply); a wide Linear after the attention
    does get one."""
    torch.manual_seed(0)
    model = nn.ModuleDict(dict(attn=Separate(), up=nn.Linear(E, 3 * E, dtype=torch.float64)))
    opt = WhitenedMuon(model, lr=0.05, output_side="wide", statistics_every=1)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, memory = torch.randn(4, T, E, generator=g, dtype=torch.float64), torch.randn(4, 7, 8, generator=g,
                                                                                          dtype=torch.float64)
        opt.zero_grad()
        model["up"](model["attn"](x, memory)).square().mean().backward()
        opt.step()
    for name in "kv":
        weight = getattr(model["attn"].attn, f"{name}_proj_weight")
        assert weight.shape[0] > weight.shape[1]
        assert "input_whitener" in opt.state[weight]
        assert not any(k.startswith("output_") for k in opt.state[weight]), name
    assert opt.state[model["up"].weight]["output_factor"].abs().sum() > 0


class Attentions(nn.Module):
    """A packed self-attention, a cross-attention with separate projections, a packed one
    (whitened per part from its first call), then a head."""

    def __init__(self):
        super().__init__()
        self.self_attn = Packed()
        self.cross = Separate()
        self.packed_cross = Cross(dtype=torch.float64)
        self.head = nn.Linear(E, 3, dtype=torch.float64)

    def forward(self, x, memory):
        h = x + self.self_attn(x)
        h = h + self.cross(h, memory)
        return self.head(h + self.packed_cross(h, memory))


def _dist_batches(steps: int) -> list:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(8, T, E, generator=g, dtype=torch.float64) + 0.3,
             torch.randn(8, 7, 8, generator=g, dtype=torch.float64),
             torch.randn(8, T, 3, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _dist_worker(rank: int, world: int, out_dir: str):
    from dist_utils import step_as_ddp

    torch.manual_seed(0)
    model = Attentions()
    opt = WhitenedMuon(model, lr=0.05, statistics_every=2, ns_dtype=torch.float64)
    params = list(model.parameters())
    identical = []
    for x, memory, y in _dist_batches(5):
        per = x.shape[0] // world
        rows = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        F.mse_loss(model(x[rows], memory[rows]), y[rows]).backward()
        identical.append(step_as_ddp(opt, params, world))
    per_part = opt.state[model.packed_cross.attn.in_proj_weight]["input_whitener"].shape == (3, 1, E, E)
    return {"params": [p.detach().clone() for p in params], "identical": identical, "per_part": per_part}


def test_any_world_size_gives_the_one_process_result_for_attention(tmp_path, one_process, two_ranks):
    """The attention's statistics (the query's rows, the separate key and value rows, a packed
    cross-attention's rows per part) join the all-reduce like any layer's; the unwhitened
    weights need none: 2 and 4 ranks end where one process on the full batch ends, every rank
    identical after every step. (One process and 2 ranks: the shared spawns at the end of the
    file; 4 ranks: a spawn of its own.)"""
    from dist_utils import run_workers

    single = one_process["dist"]
    assert single["per_part"]
    torch.manual_seed(0)
    start = Attentions()
    assert sum((p - q).abs().max() for p, q in zip(single["params"], start.parameters())) > 1e-2
    names = [n for n, _ in start.named_parameters()]
    for world in (2, 4):
        ranks = (results_of(two_ranks, "dist") if world == 2
                 else run_workers(_dist_worker, 4, tmp_path / "w4", timeout=90))
        assert len(ranks) == world
        for r in ranks:
            assert all(r["identical"])
            for name, got, want in zip(names, r["params"], single["params"]):
                # the key's bias has no gradient but rounding noise, which AdamW's steps follow to ~1e-10
                atol = 1e-9 if name.endswith("in_proj_bias") else 1e-12
                torch.testing.assert_close(got, want, rtol=1e-10, atol=atol)


class _MaskedValue(nn.Module):
    """Self-attention whose value has its padded positions zeroed: a tensor of its own, equal to
    the query wherever a rank's batch has no padding."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, 2, batch_first=True, dtype=torch.float64)
        self.head = nn.Linear(E, 3, dtype=torch.float64)

    def forward(self, x, keep):
        return self.head(self.attn(x, x, x * keep, need_weights=False)[0])


def _masked_value_worker(rank: int, world: int, out_dir: str):
    from dist_utils import step_as_ddp

    torch.manual_seed(0)
    model = _MaskedValue()
    opt = WhitenedMuon(model, lr=0.05, statistics_every=1, ns_dtype=torch.float64)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(7)
    identical = []
    for _ in range(3):
        x = torch.randn(4, T, E, generator=g, dtype=torch.float64)
        keep = torch.ones(4, T, 1, dtype=torch.float64)
        keep[3, -1] = 0  # padding in the last sequence only: on one rank of two
        per = x.shape[0] // world
        rows = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        model(x[rows], keep[rows]).square().mean().backward()
        identical.append(step_as_ddp(opt, params, world))
    return {"params": [p.detach().clone() for p in params], "identical": identical,
            "per_part": opt.state[model.attn.in_proj_weight]["input_whitener"].shape == (3, 1, E, E)}


def _assert_per_part_as_one_process(results: list, single: dict, names: list[str]) -> None:
    """Every rank whitened the attention per part, stayed bitwise identical to the others after
    every step, and ended where one process ended."""
    for r in results:
        assert r["per_part"] and all(r["identical"])
        for name, got, want in zip(names, r["params"], single["params"]):
            # the key's bias has no gradient but rounding noise, which AdamW's steps follow to ~1e-10
            atol = 1e-9 if name.endswith("in_proj_bias") else 1e-12
            torch.testing.assert_close(got, want, rtol=1e-10, atol=atol)


def test_whether_an_attention_is_cross_attention_is_decided_alike_on_every_rank(one_process, two_ranks):
    """Whether key and value are the query is read from their values when they are other
    tensors. Ranks whose batches differ can read differently (padding on one rank only); the
    ranks agree (cross-attention if any rank sees it), so every rank takes the same path into
    the statistics' all-reduce and ends where one process on the full batch ends."""
    single = one_process["masked_value"]
    assert single["per_part"]  # one process sees the padding: per part
    names = [n for n, _ in _MaskedValue().named_parameters()]
    _assert_per_part_as_one_process(results_of(two_ranks, "masked_value"), single, names)


def test_self_attention_whose_arguments_a_pre_hook_rebuilt_is_still_self_attention():
    """A forward pre-hook that remakes the arguments one by one (FSDP2's mixed-precision cast,
    a device move) hands the attention three equal tensors, not one: still self-attention.
    Seq-first inputs and keyword arguments, as nn.MultiheadAttention takes them."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, HEADS, dtype=torch.float64)  # batch second
    twin = copy.deepcopy(mha)
    mha.register_forward_pre_hook(lambda module, args, kwargs: (tuple(a.clone() for a in args),
                                                                {k: v.clone() if torch.is_tensor(v) else v
                                                                 for k, v in kwargs.items()}), with_kwargs=True)
    opts = [WhitenedMuon([m], lr=0.05, statistics_every=1, ns_dtype=torch.float64) for m in (mha, twin)]
    for x, y in batches(3):
        x, y = x.transpose(0, 1), y.transpose(0, 1)  # [T, B, E]
        for m, o in ((mha, opts[0]), (twin, opts[1])):
            o.zero_grad()
            F.mse_loss(m(x, key=x, value=x, need_weights=False)[0], y).backward()
            o.step()
    # one whitener for the three parts, as the twin's (a per-part one would be [3, 1, E, E])
    assert opts[0].state[mha.in_proj_weight]["input_whitener"].shape == (1, E, E)
    # nn.MultiheadAttention projects three equal tensors part by part, one tensor in one
    # product: the same numbers up to the BLAS's rounding, which differs by CPU
    for a, b in zip(mha.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_model_whose_only_muon_weight_is_an_unwhitened_out_proj_is_accepted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.MultiheadAttention(E, HEADS, batch_first=True))
    model[0].in_proj_weight.requires_grad_(False)
    opt = WhitenedMuon(model, lr=0.02)
    assert [opt._names[id(p)] for p in opt.param_groups[0]["params"]] == ["0.out_proj.weight"]


def test_a_fused_qkv_regex_naming_the_attention_splits_its_in_proj_not_its_out_proj():
    torch.manual_seed(0)
    model = nn.ModuleDict({"self_attn": nn.MultiheadAttention(E, HEADS, batch_first=True)})
    opt = WhitenedMuon(model, lr=0.02, fused_qkv=["self_attn"])
    assert opt._views[id(model["self_attn"].in_proj_weight)].parts == 3
    assert opt._views[id(model["self_attn"].out_proj.weight)].parts == 1


def _fsdp_mixed_precision_worker(rank: int, world: int, out_dir: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.attn = nn.Linear(E, E), nn.MultiheadAttention(E, HEADS, batch_first=True)
            self.head = nn.Linear(E, 1)

        def forward(self, x):
            h = self.embed(x)
            return self.head(self.attn(h, h, h, need_weights=False)[0].float())

    torch.manual_seed(0)
    model = Net()
    # the attention computes in bfloat16: FSDP2 casts each float32 argument on its own (three tensors)
    fully_shard(model.attn, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fully_shard(model)
    opt = WhitenedMuon(model, lr=0.02, statistics_every=1)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        x = torch.randn(4 * world, T, E, generator=g)[rank * 4:(rank + 1) * 4]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    in_proj = model.attn.in_proj_weight
    return {"in_proj": in_proj.full_tensor().detach().clone(),
            "whitened": opt.state[in_proj]["input_whitener"] is not None}


def test_fsdp2_mixed_precision_self_attention_is_whitened_as_self_attention(two_ranks):
    """FSDP2's MixedPrecisionPolicy casts the query, key and value one by one: three equal
    tensors, which are still self-attention (not refused as cross-attention)."""
    results = results_of(two_ranks, "fsdp_mixed_precision")
    assert len(results) == 2
    assert all(r["whitened"] for r in results)
    assert torch.equal(results[0]["in_proj"], results[1]["in_proj"])
    assert torch.isfinite(results[0]["in_proj"]).all()


def _fsdp_cross_worker(rank: int, world: int, out_dir: str):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Cross(dtype=torch.float64)
    if world > 1:  # FSDP2 swaps the module's weight for its gathered copy during the forward (and,
        # not resharding after it, keeps the copy there when the module's forward hooks run)
        fully_shard(model.attn, reshard_after_forward=False)
        fully_shard(model)
    opt = WhitenedMuon(model, lr=0.05, statistics_every=1, ns_dtype=torch.float64)
    for x, memory, y in _cross_batches(3, torch.float64):
        per = x.shape[0] // world
        rows = slice(rank * per, (rank + 1) * per)
        opt.zero_grad()
        F.mse_loss(model(x[rows], memory[rows]), y[rows]).backward()
        opt.step()
    in_proj = model.attn.in_proj_weight
    full = in_proj.full_tensor() if world > 1 else in_proj
    return {"in_proj": full.detach().clone(), "whitener": tuple(opt.state[in_proj]["input_whitener"].shape)}


def test_fsdp2_cross_attention_is_whitened_per_part_as_one_process(one_process, two_ranks):
    """Under FSDP2 the module holds a gathered copy of in_proj_weight during its forward, not
    the parameter the optimizer steps: the per-part switch still reaches the optimizer's
    weight, and two sharded ranks end where one process on the full batch ends."""
    single = one_process["fsdp_cross"]
    results = results_of(two_ranks, "fsdp_cross")
    assert single["whitener"] == (3, 1, E, E) and len(results) == 2
    for r in results:
        assert r["whitener"] == (3, 1, E, E)
        torch.testing.assert_close(r["in_proj"], single["in_proj"], rtol=1e-10, atol=1e-12)


def test_the_attention_it_whitens_is_not_logged_as_skipped(caplog):
    """K-FAC's module search skips nn.MultiheadAttention and its out_proj, and says so;
    WhitenedMuon takes both, so its log names neither as skipped (a LayerNorm it leaves to
    AdamW still is). KronPreconditioner, which does skip them, keeps saying so."""
    import logging

    from kron_precond import KronPreconditioner

    layer = nn.TransformerDecoderLayer(E, HEADS, 16, batch_first=True)
    with caplog.at_level(logging.INFO, logger="kron_precond"):
        WhitenedMuon(layer, lr=0.02)
    skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert any(m.startswith("skipping norm1") for m in skipped), skipped
    assert not any("attn" in m for m in skipped), skipped
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kron_precond"):
        KronPreconditioner(layer, method="kfac")
    assert any(r.getMessage().startswith("skipping self_attn.out_proj") for r in caplog.records)


def test_an_excluded_attention_is_logged_once(caplog):
    """An ``nn.MultiheadAttention`` that ``skip_layers`` excludes is reported once per module,
    not once by each of WhitenedMuon's two module searches; KronPreconditioner, which has one
    search, reports it once too."""
    import logging
    from collections import Counter

    from kron_precond import KronPreconditioner

    layer = nn.TransformerDecoderLayer(E, HEADS, 16, batch_first=True)
    for build in (lambda: WhitenedMuon(layer, lr=0.02, skip_layers=["self_attn", "multihead_attn"]),
                  lambda: KronPreconditioner(layer, method="kfac", skip_layers=["self_attn", "multihead_attn"])):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kron_precond"):
            build()
        skipped = Counter(r.getMessage().split(" ")[1] for r in caplog.records
                          if r.getMessage().startswith("skipping"))
        assert skipped["self_attn"] == skipped["multihead_attn"] == 1, skipped
        assert max(skipped.values()) == 1, skipped  # an excluded attention's out_proj: once at most


def test_a_compiled_cross_attention_is_whitened_per_part_as_in_eager():
    """Under ``torch.compile`` the capture hooks still see the packed attention's query, key and
    value: a cross-attention found at its first call switches to a factor per part, and the
    compiled run follows the eager one (Newton-Schulz in float32, so that the kernels' rounding
    stays below the tolerance)."""
    class Cross(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True)
            self.head = nn.Linear(E, E)

        def forward(self, x, memory):
            return self.head(self.attn(x, memory, memory, need_weights=False)[0])

    def make():
        torch.manual_seed(0)
        return Cross()

    eager, compiled = make(), make()
    opts = [WhitenedMuon(m, lr=0.02, statistics_every=2, ns_dtype=torch.float32) for m in (eager, compiled)]
    runs = [(eager, opts[0]), (torch.compile(compiled), opts[1])]
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x, memory = torch.randn(4, T, E, generator=g), torch.randn(4, T + 2, E, generator=g)
        for model, opt in runs:
            opt.zero_grad()
            model(x, memory).square().mean().backward()
            opt.step()
    weights = [m.attn.in_proj_weight for m in (eager, compiled)]
    assert opts[1].state[weights[1]]["input_whitener"].shape == (3, 1, E, E)
    factor = opts[1].state[weights[1]]["input_factor"]
    assert not torch.allclose(factor[1], factor[0])  # the key's rows, not the query's
    torch.testing.assert_close(factor, opts[0].state[weights[0]]["input_factor"], rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        if name == "attn.in_proj_bias":  # the key's bias has a gradient of rounding noise only, which
            a, b = a[[*range(E), *range(2 * E, 3 * E)]], b[[*range(E), *range(2 * E, 3 * E)]]  # AdamW follows
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert (weights[1] - make().attn.in_proj_weight).abs().max() > 1e-3


class _ContextOnSomeBatches(nn.Module):
    """Self-attention, or cross-attention to a context when the batch has one: the model's own
    code decides, so ranks whose batches differ call the attention differently."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, E, dtype=torch.float64)
        self.attn = nn.MultiheadAttention(E, HEADS, batch_first=True, dtype=torch.float64)
        self.head = nn.Linear(E, 2, dtype=torch.float64)

    def forward(self, x, memory=None):
        h = self.inp(x)
        kv = h if memory is None else memory
        return self.head(self.attn(h, kv, kv, need_weights=False)[0])


def _context_batches(steps: int):
    """Per step, two halves: the first with a context, the second without."""
    g = torch.Generator().manual_seed(11)
    return [[(torch.randn(2, T, 4, generator=g, dtype=torch.float64),
              torch.randn(2, 3, E, generator=g, dtype=torch.float64) if half == 0 else None,
              torch.randn(2, T, 2, generator=g, dtype=torch.float64)) for half in (0, 1)]
            for _ in range(steps)]


def _context_on_one_rank_worker(rank: int, world: int, out_dir: str, order=(0, 1)):
    """2 ranks: rank 0's half has the context, rank 1's has none. One process (world 1): both
    halves as two micro-batches of one step, in ``order``."""
    from dist_utils import step_as_ddp

    torch.manual_seed(0)
    model = _ContextOnSomeBatches()
    opt = WhitenedMuon(model, lr=0.05, statistics_every=1, ns_dtype=torch.float64)
    params = list(model.parameters())
    identical = []
    for halves in _context_batches(3):
        opt.zero_grad()
        for half in ((rank,) if world > 1 else order):
            x, memory, y = halves[half]
            (F.mse_loss(model(x, memory), y) / (1 if world > 1 else 2)).backward()
        identical.append(step_as_ddp(opt, params, world))
    return {"params": [p.detach().clone() for p in params], "identical": identical,
            "per_part": opt.state[model.attn.in_proj_weight]["input_whitener"].shape == (3, 1, E, E)}


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_an_attention_called_as_cross_attention_on_one_rank_only_is_whitened_per_part_on_every_rank(
        order, one_process, two_ranks):
    """The model's code picks the key and value per batch: the rank whose batch has a context
    calls cross-attention, the other self-attention with the query itself (no collective of its
    own could run in the forward: the ranks' calls differ). Every rank whitens per part from
    that step on, stays bitwise identical to the others, and ends where one process ends with
    both halves as micro-batches of each step, in either order (the self-attention call's rows
    are the query's, the key's and the value's alike). The 2-rank run does not depend on the
    order: it runs once, and each order's one-process run is compared with it."""
    single = one_process[f"context{order}"]
    assert single["per_part"]
    names = [n for n, _ in _ContextOnSomeBatches().named_parameters()]
    results = results_of(two_ranks, "context")
    assert len(results) == 2
    _assert_per_part_as_one_process(results, single, names)


def _rollback_worker(rank: int, world: int, out_dir: str):
    """Self-attention at step 0 (saved), a context on rank 0's batch at step 1 (every rank goes
    per part), the step-0 checkpoint loaded back, then a context on rank 0's batch again."""
    from dist_utils import step_as_ddp

    torch.manual_seed(0)
    model = _ContextOnSomeBatches()
    opt = WhitenedMuon(model, lr=0.05, statistics_every=1, ns_dtype=torch.float64)
    params = list(model.parameters())
    batches = _context_batches(3)
    weight = model.attn.in_proj_weight
    identical, shapes = [], []
    saved = None
    for step, halves in enumerate(batches):
        x, memory, y = halves[rank]
        opt.zero_grad()
        F.mse_loss(model(x, None if step == 0 else memory), y).backward()
        identical.append(step_as_ddp(opt, params, world))
        shapes.append(tuple(opt.state[weight]["input_whitener"].shape))
        if step == 0:
            saved = copy.deepcopy(opt.state_dict())
        if step == 1:
            opt.load_state_dict(saved)
            shapes.append(tuple(opt.state[weight]["input_whitener"].shape))
    return {"identical": identical, "shapes": shapes}


def test_a_rollback_to_self_attention_is_agreed_on_again_when_one_rank_reads_cross_attention(two_ranks):
    """A checkpoint saved as self-attention, loaded after the ranks went per part, takes the
    attention back to one input on every rank; a call that one rank then reads as
    cross-attention is agreed on anew (the other rank follows), so the ranks' statistics keep
    one layout and stay identical."""
    results = results_of(two_ranks, "rollback")
    assert len(results) == 2
    for r in results:
        assert all(r["identical"]), r
        assert r["shapes"] == [(1, E, E), (3, 1, E, E), (1, E, E), (3, 1, E, E)], r


# ----------------------------------------------------------------------------- the shared spawns
# Spawning gloo ranks (each imports torch) costs more than the scenarios above, so every
# scenario run at one process (the references) shares one spawn, and every scenario run on 2
# ranks another: each scenario seeds and builds its own model and optimizer as it did alone
# (none of them refuses, hangs or depends on a fresh process), one after the other.
_SCENARIOS = {
    "dist": _dist_worker,
    "masked_value": _masked_value_worker,
    "fsdp_mixed_precision": _fsdp_mixed_precision_worker,
    "fsdp_cross": _fsdp_cross_worker,
    "context(0, 1)": functools.partial(_context_on_one_rank_worker, order=(0, 1)),
    "context(1, 0)": functools.partial(_context_on_one_rank_worker, order=(1, 0)),
    "context": _context_on_one_rank_worker,  # on 2 ranks, where the order plays no part
    "rollback": _rollback_worker,
}
ONE_PROCESS = ("dist", "masked_value", "fsdp_cross", "context(0, 1)", "context(1, 0)")
TWO_RANKS = ("dist", "masked_value", "fsdp_mixed_precision", "fsdp_cross", "context", "rollback")
SCENARIO_TIMEOUT = 90  # seconds per scenario: what each had in a spawn of its own


def _scenarios_worker(rank: int, world: int, out_dir: str, names: tuple[str, ...]) -> dict:
    """``{name: the scenario's result on this rank}`` for each of ``names``, in order."""
    return {name: _SCENARIOS[name](rank, world, out_dir) for name in names}



@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """Every one-process reference: ``{scenario: result}``."""
    from dist_utils import run_workers

    return run_workers(_scenarios_worker, 1, tmp_path_factory.mktemp("w1"), ONE_PROCESS,
                       timeout=SCENARIO_TIMEOUT * len(ONE_PROCESS))[0]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """Every 2-rank scenario: per rank, ``{scenario: result}``."""
    from dist_utils import run_workers

    return run_workers(_scenarios_worker, 2, tmp_path_factory.mktemp("w2"), TWO_RANKS,
                       timeout=SCENARIO_TIMEOUT * len(TWO_RANKS))
