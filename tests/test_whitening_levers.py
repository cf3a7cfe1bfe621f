"""benchmarks/whitening_levers.py's variants against float64 references.

A Linear layer with the loss ``Σ (y ⊙ C)`` has the output gradient ``C`` row for row, so the
output factor each variant should build is written out from ``C`` (or, for the gradient-made
factor, from ``∇W = Cᵀ X``) in float64, sharing no code with the optimizer."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.whitening_levers import VARIANTS, WhiteningVariant  # noqa: E402
from kron_precond import WhitenedMuon  # noqa: E402

ROWS, IN, OUT = 40, 8, 8


def _layer_and_batch(seed: int = 0):
    torch.manual_seed(seed)
    layer = nn.Linear(IN, OUT, bias=False)
    x = torch.randn(ROWS, IN)
    c = torch.randn(ROWS, OUT)
    return layer, x, c


def _step(layer, optimizer, x, c):
    (layer(x) * c).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _first_factor(**variant) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The output factor after one statistics step, with the batch it saw."""
    layer, x, c = _layer_and_batch()
    optimizer = WhiteningVariant([layer], lr=1e-2, output_side=True, statistics_rows=None, **variant)
    _step(layer, optimizer, x, c)
    return optimizer.state[layer.weight]["output_factor"].double(), x.double(), c.double()


def _mean_product(rows: torch.Tensor) -> torch.Tensor:
    return rows.T @ rows / rows.shape[0]


def _shape_of(factor: torch.Tensor) -> torch.Tensor:
    """A factor at unit trace: the capture scales output gradients by the batch's rows (a
    mean loss's convention), and the whitener is invariant to a factor's scale."""
    return factor / factor.diagonal(dim1=-2, dim2=-1).sum(-1)[..., None, None]


@pytest.mark.parametrize("spread", [False, True])
def test_output_rows_first_or_spread(spread):
    factor, _, c = _first_factor(output_rows=12, output_spread=spread)
    chosen = c[::4] if spread else c[:12]  # 40 rows: every ceil(40 / 12) = 4th (10 rows), or the first 12
    torch.testing.assert_close(_shape_of(factor[0]), _shape_of(_mean_product(chosen)), rtol=1e-5, atol=1e-7)


def test_all_output_rows_without_a_cap():
    factor, _, c = _first_factor()
    torch.testing.assert_close(_shape_of(factor[0]), _shape_of(_mean_product(c)), rtol=1e-5, atol=1e-7)


def test_output_block_keeps_the_diagonal_blocks():
    layer, x, c = _layer_and_batch()
    optimizer = WhiteningVariant([layer], lr=1e-2, output_side=True, statistics_rows=None, output_block=4)
    _step(layer, optimizer, x, c)
    factor = optimizer.state[layer.weight]["output_factor"].double()
    assert optimizer.state[layer.weight]["input_factor"].shape == (1, IN, IN)  # the input side stays whole
    full = _mean_product(c.double())
    assert factor.shape == (2, 4, 4)
    scale = factor[0].trace() / full[:4, :4].trace()  # the capture's scale (see _shape_of)
    torch.testing.assert_close(factor[0], scale * full[:4, :4], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(factor[1], scale * full[4:, 4:], rtol=1e-5, atol=1e-6)


def test_diag_variant_keeps_the_diagonal_of_the_output_factor():
    layer, x, c = _layer_and_batch()
    optimizer = WhiteningVariant([layer], lr=1e-2, statistics_rows=None, **VARIANTS["diag"])
    _step(layer, optimizer, x, c)
    factor = optimizer.state[layer.weight]["output_factor"].double()
    assert factor.shape == (OUT, 1, 1)
    full = _mean_product(c.double())
    scale = factor.sum() / full.trace()  # the capture's scale (see _shape_of)
    torch.testing.assert_close(factor.flatten(), scale * full.diagonal(), rtol=1e-5, atol=1e-7)
    # each 1-block damped by its own trace (λ = damping · tr / dim), so the whitener is (1.1 g)^(-1/2)
    whitener = optimizer.state[layer.weight]["output_whitener"].double()
    torch.testing.assert_close(whitener.flatten(), (1.1 * factor.flatten()).rsqrt(), rtol=1e-4, atol=1e-7)


def test_gradient_factor_is_the_trace_normalised_gradient_product():
    factor, x, c = _first_factor(output_source="gradient")
    grad = c.T @ x  # ∇W of Σ (x Wᵀ ⊙ c); no input whitener yet on the first step
    scaled = grad * (OUT * IN) ** 0.5 / grad.norm()
    expected = scaled @ scaled.T / IN
    torch.testing.assert_close(factor[0], expected, rtol=1e-5, atol=1e-6)
    assert abs(factor[0].trace().item() - OUT) < 1e-4


def test_gradient_factor_uses_the_input_whitener_on_later_statistics_steps():
    layer, x, c = _layer_and_batch()
    optimizer = WhiteningVariant([layer], lr=1e-2, output_side=True, statistics_rows=None, statistics_every=1,
                                 factor_decay=0.5, output_source="gradient")
    _step(layer, optimizer, x, c)
    before = optimizer.state[layer.weight]["output_factor"].double().clone()
    # (A + λI)⁻¹ from the input factor and the damping rule, not from the optimizer's whitener
    a = optimizer.state[layer.weight]["input_factor"].double()[0]
    inverse = torch.linalg.inv(a + 0.1 * a.trace() / IN * torch.eye(IN, dtype=torch.float64))
    x2, c2 = torch.randn(ROWS, IN), torch.randn(ROWS, OUT)
    grad = c2.double().T @ x2.double()
    _step(layer, optimizer, x2, c2)
    product = grad @ inverse @ grad.T  # = Ĝ Ĝᵀ, with ||Ĝ||_F² = its trace
    expected = 0.5 * before[0] + 0.5 * product * OUT / product.trace()
    torch.testing.assert_close(optimizer.state[layer.weight]["output_factor"].double()[0], expected,
                               rtol=1e-4, atol=1e-5)


def test_output_every_skips_statistics_steps():
    layer, x, c = _layer_and_batch()
    optimizer = WhiteningVariant([layer], lr=1e-2, output_side=True, statistics_rows=None, statistics_every=1,
                                 factor_decay=0.5, output_every=2)
    _step(layer, optimizer, x, c)  # step 0: input and output sides
    assert not optimizer._capture.output_grads  # no hook on step 1
    first = optimizer.state[layer.weight]["output_factor"].clone()
    inputs = optimizer.state[layer.weight]["input_factor"].clone()
    x2, c2 = torch.randn(ROWS, IN), torch.randn(ROWS, OUT)
    _step(layer, optimizer, x2, c2)  # step 1: the input side only
    assert optimizer._capture.output_grads  # the hook again on step 2
    assert torch.equal(optimizer.state[layer.weight]["output_factor"], first)
    assert not torch.equal(optimizer.state[layer.weight]["input_factor"], inputs)
    _step(layer, optimizer, x2, c2)  # step 2: both again
    scale = first.double()[0].trace() / _mean_product(c.double()).trace()  # the capture's (see _shape_of)
    expected = 0.5 * first.double()[0] + 0.5 * scale * _mean_product(c2.double())
    torch.testing.assert_close(optimizer.state[layer.weight]["output_factor"].double()[0], expected,
                               rtol=1e-5, atol=1e-6)


def test_momentum_factor_reads_the_buffer_the_last_step_left():
    layer, x, c = _layer_and_batch()
    optimizer = WhiteningVariant([layer], lr=1e-2, output_side=True, statistics_rows=None, statistics_every=1,
                                 factor_decay=0.5, momentum=0.9, output_source="momentum")
    grad0 = c.double().T @ x.double()
    _step(layer, optimizer, x, c)  # no buffer yet: the gradient itself
    before = optimizer.state[layer.weight]["output_factor"].double().clone()
    a = optimizer.state[layer.weight]["input_factor"].double()[0]
    inverse = torch.linalg.inv(a + 0.1 * a.trace() / IN * torch.eye(IN, dtype=torch.float64))
    _step(layer, optimizer, torch.randn(ROWS, IN), torch.randn(ROWS, OUT))
    buffer = 0.1 * grad0  # torch.optim.Muon's buffer after one step: 0.lerp(g, 1 - 0.9)
    product = buffer @ inverse @ buffer.T
    expected = 0.5 * before[0] + 0.5 * product * OUT / product.trace()
    torch.testing.assert_close(optimizer.state[layer.weight]["output_factor"].double()[0], expected,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("bad", [dict(output_every=7), dict(output_source="hessian"), dict(input_skip="tall")])
def test_bad_settings_raise(bad):
    layer, _, _ = _layer_and_batch()
    with pytest.raises(ValueError, match=next(iter(bad))):
        WhiteningVariant([layer], lr=1e-2, output_side=True, **bad)


def test_an_output_change_needs_the_output_side():
    layer, _, _ = _layer_and_batch()
    with pytest.raises(ValueError, match="output_side=True"):
        WhiteningVariant([layer], lr=1e-2, output_rows=10)


@pytest.mark.parametrize("skip", ["wide", "narrow", "square"])
def test_input_skip_leaves_one_shape_unwhitened(skip):
    torch.manual_seed(0)
    layers = {"narrow": nn.Linear(4, 8, bias=False), "square": nn.Linear(8, 8, bias=False),
              "wide": nn.Linear(8, 4, bias=False)}  # named by how the input compares with the output
    optimizer = WhiteningVariant(list(layers.values()), lr=1e-2, statistics_rows=None, input_skip=skip)
    x = torch.randn(16, 4)
    layers["wide"](layers["square"](layers["narrow"](x))).square().sum().backward()
    optimizer.step()
    assert not optimizer._capture.output_grads  # no output side, no hook
    for name, layer in layers.items():
        whitener = optimizer.state[layer.weight]["input_whitener"][0]
        identity = torch.equal(whitener, torch.eye(layer.weight.shape[1]))
        assert identity == (name == skip), name
        assert "output_whitener" not in optimizer.state[layer.weight]


def _stepped_variant(arch: str, n_layers: int, variant: str) -> tuple[nn.Module, WhiteningVariant]:
    """An examples model of ``arch`` (d_model 16) and the named variant after one step."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitening_levers import VARIANTS
    from char_lm import ModelConfig, build_model
    torch.manual_seed(0)
    model = build_model(ModelConfig(16, n_layers, 2, 8, False, arch))
    settings = {k: v for k, v in VARIANTS[variant].items() if k != "output_side"}
    optimizer = WhiteningVariant(model, lr=1e-2, skip_layers=["Embedding", "lm_head"], **settings)
    tokens = torch.randint(0, 256, (2, 8))
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    optimizer.step()
    return model, optimizer


def test_input_skip_names_leaves_the_named_layers_unwhitened():
    model, optimizer = _stepped_variant("gpt", 1, "input_no_out_proj")
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            whitener = optimizer.state[module.weight]["input_whitener"][0]
            assert torch.equal(whitener, torch.eye(module.in_features)) == name.endswith("attn.out_proj"), name


def test_input_no_cross_leaves_the_decoders_cross_attention_unwhitened():
    """``input_no_cross`` on the encoder-decoder: the cross-attention's packed in_proj keeps an
    identity per part (Muon's step on each), every other input side is whitened."""
    _, optimizer = _stepped_variant("seq2seq", 2, "input_no_cross")
    whiteners = {optimizer._names[id(p)]: optimizer.state[p]["input_whitener"]
                 for p in optimizer.param_groups[0]["params"] if "input_whitener" in optimizer.state[p]}
    cross = whiteners.pop("decoder.0.multihead_attn.in_proj_weight")
    assert torch.equal(cross, torch.eye(16).expand(3, 1, 16, 16))
    assert len(whiteners) == 6 and not any(torch.equal(w[0], torch.eye(16)) for w in whiteners.values())


def test_the_runner_builds_each_variant_with_the_cells_settings():
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitening_levers import VARIANTS, _build
    from char_lm import SKIP_LAYERS, CharTransformer, ModelConfig
    from kron_examples_common import PrecondConfig
    from kron_precond import WhitenedMuon
    model = CharTransformer(ModelConfig(16, 1, 2, 8, False, "gpt"))
    # the cell's output-side flag on: the "input" variant must still be the input side alone
    config = PrecondConfig(skip_layers=SKIP_LAYERS, muon_momentum=0.8, wmuon_factor_decay=0.7, wmuon_both_sides=True)
    built, precond = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["spread256"])
    assert precond is None and isinstance(built, WhiteningVariant) and built.output_side
    assert built.factor_decay == 0.7 and built.param_groups[0]["momentum"] == 0.8
    assert built._statistics.output_rows == 256 and built._statistics.output_spread
    plain, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["input"])
    assert type(plain) is WhitenedMuon and not plain.output_side
    skipping, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["input_no_wide"])
    assert isinstance(skipping, WhiteningVariant) and not skipping.output_side
    assert skipping._statistics.input_skip == "wide"
    # library settings reach the library's optimizer itself, the cell's other settings kept
    fresh, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["auto_every1"])
    assert type(fresh) is WhitenedMuon and fresh.statistics_every == 1 and fresh.factor_decay == 0.96
    assert fresh._statistics.statistics_rows == 1024 and fresh.param_groups[0]["momentum"] == 0.8
    every_row, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["auto_rows_all"])
    assert every_row._statistics.statistics_rows is None and every_row.statistics_every == config.wmuon_every
    # the output side at the input side's damping, unless a variant names its own
    assert fresh.output_damping is None and fresh._statistics.output_damping == fresh.damping == 0.1
    lower, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["auto_out_damping0.03"])
    assert type(lower) is WhitenedMuon and lower.output_damping == 0.03
    assert [fresh._names[id(p)] for p in fresh._whitened_params() if "output" in fresh._statistics.sides_of(p)] \
        == ["blocks.0.mlp.0.weight"]  # "auto": the MLP's first layer alone


@pytest.mark.parametrize("layers", ["narrow", "wide"])
def test_output_layers_whitens_the_output_of_the_chosen_weights_only(layers):
    torch.manual_seed(0)
    wide, narrow = nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)  # out > in, out < in
    optimizer = WhiteningVariant([wide, narrow], lr=1e-2, output_side=True, statistics_rows=None, output_layers=layers)
    narrow(wide(torch.randn(16, 4))).square().sum().backward()
    optimizer.step()
    chosen, other = (narrow, wide) if layers == "narrow" else (wide, narrow)
    eye = torch.eye(other.weight.shape[0])
    assert torch.equal(optimizer.state[other.weight]["output_whitener"][0], eye)
    assert not torch.allclose(optimizer.state[chosen.weight]["output_whitener"][0],
                              torch.eye(chosen.weight.shape[0]))


@pytest.mark.parametrize("damping", [0.1, 0.3])
def test_diagonal_damping_whitens_the_factor_damped_by_its_own_diagonal(damping):
    """``Tᵀ T = (F + λ diag F)⁻¹`` with ``F`` the input rows' mean product, written out in
    float64 (up to the factor's scale, which the step's rescale removes), on inputs whose
    coordinates differ in scale by 10², where the library's ``λ tr(F)/n I`` differs."""
    layer, x, c = _layer_and_batch()
    x = x * torch.logspace(-1, 1, IN)  # coordinates 0.1x to 10x
    optimizer = WhiteningVariant([layer], lr=1e-2, damping=damping, statistics_rows=None, center_inputs=False,
                                 **{k: v for k, v in VARIANTS["input_diag_damping"].items() if k != "damping"})
    _step(layer, optimizer, x, c)
    whitener = optimizer.state[layer.weight]["input_whitener"].reshape(IN, IN).double()
    f = _mean_product(x.double())
    damped = f + damping * torch.diag(f.diagonal())
    implied = torch.linalg.inv(whitener.T @ whitener)
    # (F + λ diag F)⁻¹ (Tᵀ T)⁻¹ is c·I for the right damping, whatever the factor's scale c
    ratio = torch.linalg.solve(damped, implied)
    torch.testing.assert_close(ratio / ratio.diagonal().mean(), torch.eye(IN, dtype=ratio.dtype), rtol=0, atol=1e-4)
    library = torch.linalg.solve(f + damping * f.trace() / IN * torch.eye(IN), implied)
    assert (library / library.diagonal().mean() - torch.eye(IN)).abs().max() > 1e-2
    with pytest.raises(TypeError, match="diagonal_damping"):
        WhiteningVariant([layer], lr=1e-2, diagonal_damping=1)


def test_a_variant_damping_replaces_the_cells_damping():
    """``input_diag_damping0.3`` through the benchmark's builder: its damping (a library setting)
    replaces the cell's, not passed twice, and the diagonal damping is on."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitening_levers import _build
    from char_lm import SKIP_LAYERS, CharTransformer, ModelConfig
    from kron_examples_common import PrecondConfig
    model = CharTransformer(ModelConfig(16, 1, 2, 8, False, "gpt"))
    config = PrecondConfig(skip_layers=SKIP_LAYERS, muon_momentum=0.8, wmuon_damping=0.2)
    built, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["input_diag_damping0.3"])
    assert isinstance(built, WhiteningVariant)
    assert (built.damping, built._statistics.diagonal_damping, built.output_side) == (0.3, True, False)


def test_output_elsewhere_none_steps_the_other_weights_on_their_input_side_alone():
    """``wide_only``: the wide-output weight steps as ``output_side=True`` steps it, the other
    as the input side alone steps it, and the other has no output factor or whitener at all."""
    from kron_precond import WhitenedMuon

    def layers():
        torch.manual_seed(0)
        return nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False)  # out > in, out < in

    def trained(build):
        wide, narrow = layers()
        optimizer = build([wide, narrow])
        # apart, so that each weight's gradients depend on its own steps alone
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
        z = torch.randn(16, 8, generator=torch.Generator().manual_seed(2))
        for _ in range(3):  # a statistics step (the first), then plain steps on its whiteners
            (wide(x).square().sum() + narrow(z).square().sum()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return wide, narrow, optimizer

    common = dict(lr=1e-2, statistics_rows=None, ns_dtype=torch.float64)
    wide, narrow, variant = trained(lambda ps: WhiteningVariant(ps, **VARIANTS["wide_only"] | common))
    both_wide, _, _ = trained(lambda ps: WhitenedMuon(ps, output_side=True, **common))
    _, input_narrow, _ = trained(lambda ps: WhitenedMuon(ps, output_side=False, **common))
    torch.testing.assert_close(wide.weight, both_wide.weight, rtol=0, atol=1e-12)
    torch.testing.assert_close(narrow.weight, input_narrow.weight, rtol=0, atol=1e-12)
    assert "output_whitener" in variant.state[wide.weight]
    assert not {"output_factor", "output_whitener"} & set(variant.state[narrow.weight])
    with pytest.raises(ValueError, match="output_elsewhere"):
        WhiteningVariant(layers(), lr=1e-2, output_side=True, output_layers="wide", output_elsewhere="zero")
    with pytest.raises(ValueError, match="output_side=True"):  # the library's "wide" judges weights by part
        WhiteningVariant(layers(), lr=1e-2, output_side="wide", output_layers="wide")


def test_the_librarys_wide_output_side_steps_the_examples_gpt_as_wide_only():
    """``WhitenedMuon(output_side="wide")`` on the examples' GPT (bfloat16 Newton-Schulz, as
    the benchmark runs it) gives the ``wide_only`` variant's weights bitwise, so the variant's
    records measure the library's setting; the input side alone does not."""
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitening_levers import _build
    from char_lm import SKIP_LAYERS, CharTransformer, ModelConfig
    from kron_examples_common import PrecondConfig
    config = PrecondConfig(skip_layers=SKIP_LAYERS, muon_momentum=0.8, wmuon_every=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (4, 9), generator=g)

    def trained(variant):
        torch.manual_seed(0)
        model = CharTransformer(ModelConfig(16, 1, 2, 8, False, "gpt"))
        optimizer, _ = _build(model, None, lr=0.02, weight_decay=0.0, config=config, variant=variant)
        for _ in range(4):
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return optimizer, [p.detach().clone() for p in model.parameters()]

    library, ours = trained(dict(output_side="wide"))
    _, theirs = trained(VARIANTS["wide_only"])
    _, input_side = trained(VARIANTS["input"])
    assert type(library) is WhitenedMuon
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert not all(torch.equal(a, b) for a, b in zip(ours, input_side))
    wide = [p for p in library.param_groups[0]["params"] if "output_whitener" in library.state[p]]
    assert wide and all(p.shape[0] > p.shape[1] for p in wide)


@pytest.mark.parametrize("name, every, decay, ns_steps, output_side", [
    ("input_every10", 10, 0.6, 5, False), ("input_ns4", 5, 0.8, 4, False), ("both_ns4", 5, 0.8, 4, True),
    ("both_every10", 10, 0.6, 5, True), ("input_block512", 5, 0.8, 5, False),
    ("input_center_all", 5, 0.8, 5, False), ("input_ns_float32", 5, 0.8, 5, False)])
def test_library_setting_variants_override_the_cell_and_stay_the_library_optimizer(name, every, decay, ns_steps,
                                                                                   output_side):
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitening_levers import VARIANTS, _build
    from char_lm import SKIP_LAYERS, CharTransformer, ModelConfig
    from kron_examples_common import PrecondConfig
    from kron_precond import WhitenedMuon
    model = CharTransformer(ModelConfig(16, 1, 2, 8, False, "gpt"))
    # the cell says every 5 steps, decay 0.8 and the output side on: the variant's own settings win
    config = PrecondConfig(skip_layers=SKIP_LAYERS, muon_momentum=0.8, wmuon_every=5, wmuon_factor_decay=0.8,
                           wmuon_both_sides=True, wmuon_damping=0.2)
    built, precond = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS[name])
    assert precond is None and type(built) is WhitenedMuon  # not the variant class: nothing else changed
    assert (built.statistics_every, built.factor_decay, built.ns_steps, built.output_side) == (
        every, decay, ns_steps, output_side)
    assert built.damping == 0.2 and built.param_groups[0]["momentum"] == 0.8  # the cell's other settings
    assert built._statistics.block_size == (512 if name == "input_block512" else None)
    assert built.ns_dtype == (torch.float32 if name == "input_ns_float32" else torch.bfloat16)  # the examples' pin
    # the GPT's layers all have biases: by default none is centred, with input_center_all every one
    centred = built._statistics.centered
    assert centred == (set(built._views) if name == "input_center_all" else set())


def test_best_baseline_takes_the_lr_its_record_holds_not_the_rounded_name(tmp_path):
    """The lever runs retrain the best Muon to time it and to check it reproduces the folder's
    curve: its lr must be the record's (the name rounds it to 6 digits)."""
    import json

    from benchmarks.whitening_levers import best_baseline
    lr = 0.032 * 2 ** 0.5  # 0.045254833995939...: "lr=0.0452548" in the name
    name = f"muon{{mom=0.8}} lr={lr:g}"
    runs = [{"name": "muon{mom=0.9} lr=0.032", "lr": 0.032}, {"name": name, "lr": lr}]
    (tmp_path / "s0_b1_grid.json").write_text(json.dumps({"runs": runs}))
    momentum, found = best_baseline(tmp_path, 0, {"rows": {"muon (tuned)": {"run": name}}})
    assert momentum == 0.8 and found == lr and found != float(name.split("lr=")[1])
    # --baseline normuon: the record's tuned NorMuon, by its own row
    other = f"normuon{{mom=0.9}} lr={lr:g}"
    (tmp_path / "s0_b1_normuon.json").write_text(json.dumps({"runs": [{"name": other, "lr": lr * 1.0000001}]}))
    rows = {"muon (tuned)": {"run": name}, "normuon (tuned)": {"run": other}}
    assert best_baseline(tmp_path, 0, {"rows": rows}, "normuon") == (0.9, lr * 1.0000001)


def test_the_fused_whole_variant_steps_gpt2s_c_attn_as_one_matrix():
    """``input_fused_whole`` is the library's optimizer with ``fused_qkv=False``: GPT-2's
    ``c_attn`` is one matrix there and three in the ``input`` variant (the default)."""
    pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitening_levers import VARIANTS, _build
    from char_lm import SKIP_LAYERS, ModelConfig, build_model
    from kron_examples_common import PrecondConfig
    from kron_precond import WhitenedMuon
    model = build_model(ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8, arch="gpt2"))
    config = PrecondConfig(skip_layers=SKIP_LAYERS, muon_momentum=0.8)
    parts = {}
    for name in ("input", "input_fused_whole"):
        built, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS[name])
        assert type(built) is WhitenedMuon
        parts[name] = {built._names[i]: view.parts for i, view in built._views.items() if view.parts > 1}
        built.remove()
    assert parts["input"] == {"inner.transformer.h.0.attn.c_attn.weight": 3} and parts["input_fused_whole"] == {}


@pytest.mark.parametrize("divisor", [1, 4])
def test_input_rank_whitens_the_wide_input_as_diagonal_plus_low_rank(divisor):
    """``input_rank=D``: the wide layer's whitener satisfies ``Tᵀ T = S^{-1/2} C̃⁻¹ S^{-1/2}``, with
    ``C̃`` the unit-diagonal damped factor ``C`` projected on its top ``n / D`` eigenvectors plus
    the rest's mean eigenvalue on the complement (written out in float64 with numpy); ``D = 1``
    is the exact ``(F + λI)⁻¹``. The first layer (its input narrower) keeps the library's
    Cholesky whitener."""
    import numpy as np

    torch.manual_seed(0)
    first, wide = nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False)
    optimizer = WhiteningVariant([first, wide], lr=1e-2, statistics_rows=None, center_inputs=False,
                                 input_rank=divisor)
    x = torch.randn(64, 8) @ torch.randn(8, 8)  # correlated features of unequal scale
    wide(torch.tanh(first(x) + torch.randn(64, 16))).square().sum().backward()
    optimizer.step()
    for layer in (first, wide):
        state = optimizer.state[layer.weight]
        n = layer.in_features
        f = state["input_factor"].reshape(n, n).double().numpy()
        damped = f + 0.1 * np.trace(f) / n * np.eye(n)
        t = state["input_whitener"].reshape(n, n).double().numpy()
        if layer is first:
            want = np.linalg.inv(damped)
            assert np.allclose(t, np.tril(t)) or np.allclose(t, np.triu(t))  # an inverse Cholesky factor
        else:
            s = 1 / np.sqrt(np.diag(damped))
            c = damped * s[:, None] * s[None, :]
            rank = n // divisor
            vectors = np.linalg.eigh(c)[1][:, n - rank:]
            p = vectors @ vectors.T
            sigma2 = (np.trace(c) - np.trace(p @ c @ p)) / (n - rank) if rank < n else 1.0
            approx = p @ c @ p + sigma2 * (np.eye(n) - p)
            want = s[:, None] * np.linalg.inv(approx) * s[None, :]
            assert not (np.allclose(t, np.tril(t)) or np.allclose(t, np.triu(t)))
        np.testing.assert_allclose(t.T @ t, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_input_rank_must_be_a_positive_int():
    layer, _, _ = _layer_and_batch()
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="input_rank"):
            WhiteningVariant([layer], lr=1e-2, input_rank=bad)


def test_input_rank_applies_its_whitener_factored_as_the_dense_one():
    """The low-rank whitener is applied as ``σ⁻¹ X + (X U) diag(c) Uᵀ`` around ``diag(s)``: the
    steps equal those of its dense ``T`` (checked against numpy above) applied as the library
    applies a whitener, in float64, over refreshes."""
    from kron_precond import WhitenedMuon

    class Dense(WhiteningVariant):
        def _stacked_whiteners(self, params):
            return WhitenedMuon._stacked_whiteners(self, params)

    runs = []
    for cls in (WhiteningVariant, Dense):
        torch.manual_seed(0)
        first, wide = nn.Linear(8, 16, dtype=torch.float64), nn.Linear(16, 4, dtype=torch.float64)
        optimizer = cls([first, wide], lr=1e-2, statistics_every=2, input_rank=4, ns_dtype=torch.float64)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x = torch.randn(32, 8, generator=g, dtype=torch.float64)
            wide(torch.tanh(first(x))).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        runs.append((first, wide, optimizer))
    (first, wide, factored), (first_d, wide_d, _) = runs
    assert id(wide.weight) in factored._statistics.lowrank and id(first.weight) not in factored._statistics.lowrank
    for a, b in ((first.weight, first_d.weight), (wide.weight, wide_d.weight)):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    torch.manual_seed(0)
    start = [nn.Linear(8, 16, dtype=torch.float64), nn.Linear(16, 4, dtype=torch.float64)][1]
    assert (wide.weight - start.weight).abs().max() > 1e-3


def test_the_low_rank_float32_variant_is_the_low_rank_variant_iterating_in_float32():
    sys.path.insert(0, str(ROOT / "examples"))
    from benchmarks.whitening_levers import _build
    from char_lm import SKIP_LAYERS, CharTransformer, ModelConfig
    from kron_examples_common import PrecondConfig
    model = CharTransformer(ModelConfig(16, 1, 2, 8, False, "gpt"))
    config = PrecondConfig(skip_layers=SKIP_LAYERS, muon_momentum=0.8)
    built, _ = _build(model, None, lr=0.01, weight_decay=0.0, config=config, variant=VARIANTS["input_rank4_ns_float32"])
    assert type(built) is WhiteningVariant and built._statistics.input_rank == 4 and built.ns_dtype == torch.float32


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16)])
def test_the_float32_muon_is_torchs_iteration_in_float32(shape):
    """benchmarks/muon_float32.py: torch.optim.Muon's Newton-Schulz without its bfloat16 cast,
    against the same quintic written out in float64 (torch's own bfloat16 result is ~1e-2 off)."""
    from benchmarks.muon_float32 import newton_schulz_float32
    a, b, c = 3.4445, -4.7750, 2.0315
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    x = g.double().T if shape[0] > shape[1] else g.double()
    x = x / x.norm()
    for _ in range(5):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    want = x.T if shape[0] > shape[1] else x
    got = newton_schulz_float32(g, (a, b, c), 5, 1e-7)
    assert got.dtype == torch.float32 and got.shape == g.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="coefficients"):  # torch's quintic only: others are not msign's
        newton_schulz_float32(g, (3.0, -3.2, 1.2), 5, 1e-7)


def test_the_float32_muon_runs_a_script_with_torchs_function_replaced(tmp_path, monkeypatch):
    import torch.optim._muon as torch_muon

    from benchmarks.muon_float32 import newton_schulz_float32
    from benchmarks.swap_newton_schulz import run_script_with
    script = tmp_path / "probe.py"
    out = tmp_path / "replaced.txt"
    script.write_text("import sys, torch, torch.optim._muon as m\n"
                      "g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))\n"
                      "x = m._zeropower_via_newtonschulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7)\n"
                      "open(sys.argv[1], 'w').write(str(x.dtype))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", torch_muon._zeropower_via_newtonschulz)
    run_script_with(newton_schulz_float32, [str(script), str(out)])
    assert out.read_text() == "torch.float32"  # torch's own returns bfloat16


def _spread_factor(n: int, k: int = 2) -> torch.Tensor:
    """A batch of ``k`` covariances with a decaying spectrum (gaps between the top eigenvalues)."""
    g = torch.Generator().manual_seed(3)
    basis = torch.linalg.qr(torch.randn(k, n, n, generator=g, dtype=torch.float64))[0]
    values = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 2
    return (basis * values) @ basis.mT


def test_a_tracked_basis_at_the_solved_one_is_a_fixed_point():
    """One subspace step from the eigh's top basis gives the eigh's whitener: the same top pairs,
    and the rest's mean from the unit trace equal to the mean of the rest of the spectrum."""
    from benchmarks.whitening_levers import lowrank_whitener, tracked_lowrank_whitener
    factor = _spread_factor(24)
    solved = lowrank_whitener(factor, 0.1, 6)
    tracked = tracked_lowrank_whitener(factor, 0.1, solved.basis)
    torch.testing.assert_close(tracked.dense(), solved.dense(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(tracked.inverse_sigma, solved.inverse_sigma, rtol=1e-12, atol=0)


def test_a_tracked_basis_converges_to_the_solved_whitener_from_any_start():
    """Repeated refreshes of one factor from a random basis: the subspace iteration reaches the
    eigh's whitener (the spectrum has gaps); one step from a random start does not."""
    from benchmarks.whitening_levers import lowrank_whitener, tracked_lowrank_whitener
    factor = _spread_factor(24)
    solved = lowrank_whitener(factor, 0.1, 6).dense()
    basis = torch.randn(2, 24, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    first = tracked_lowrank_whitener(factor, 0.1, basis)
    assert (first.dense() - solved).abs().max() > 1e-3
    for _ in range(300):
        basis = tracked_lowrank_whitener(factor, 0.1, basis).basis
    torch.testing.assert_close(tracked_lowrank_whitener(factor, 0.1, basis).dense(), solved, rtol=1e-7, atol=1e-8)


def test_the_tracked_variant_solves_once_then_tracks():
    """``track_rank=True``: the first refresh of the wide input solves (an eigh), the later ones
    step the kept basis; while the inputs drift, the whitener follows the solved one (at less
    than half the first refresh's whitener's distance from it)."""
    from benchmarks import whitening_levers as wl
    calls = {"solved": 0, "tracked": 0}
    solve, track = wl.lowrank_whitener, wl.tracked_lowrank_whitener

    def counted(name, function):
        def run(*args):
            calls[name] += 1
            return function(*args)
        return run

    torch.manual_seed(0)
    first, wide = nn.Linear(8, 32, dtype=torch.float64), nn.Linear(32, 4, dtype=torch.float64)
    optimizer = WhiteningVariant([first, wide], lr=1e-2, statistics_every=1, input_rank=4, track_rank=True,
                                 ns_dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(8, 8, generator=g, dtype=torch.float64)
    try:
        wl.lowrank_whitener, wl.tracked_lowrank_whitener = counted("solved", solve), counted("tracked", track)
        for step in range(6):
            x = torch.randn(64, 8, generator=g, dtype=torch.float64) @ mix + step
            wide(torch.tanh(first(x))).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                stale = optimizer.state[wide.weight]["input_whitener"].reshape(32, 32).clone()
    finally:
        wl.lowrank_whitener, wl.tracked_lowrank_whitener = solve, track
    assert calls == {"solved": 1, "tracked": 5}
    state = optimizer.state[wide.weight]
    exact = solve(state["input_factor"].reshape(1, 32, 32), optimizer.damping, 8).dense()[0]
    tracked = state["input_whitener"].reshape(32, 32)
    assert (tracked - exact).norm() < 0.5 * (stale - exact).norm()
    with pytest.raises(ValueError, match="track_rank"):
        WhiteningVariant([first, wide], lr=1e-2, track_rank=True)


@pytest.mark.parametrize("cautious", ["mean", "norm"])
def test_the_cautious_step_keeps_the_entries_that_agree_with_the_gradient_rescaled(cautious):
    """On the first step the momentum is a multiple of the gradient, so the cautious step is the
    library's step where its sign agrees with the gradient's, zero elsewhere, times ``1 / kept``
    (``"mean"``) or rescaled to the library's step's Frobenius norm (``"norm"``), written out in
    float64 against the library's own step."""
    from kron_precond import WhitenedMuon

    steps = {}
    for variant in (None, cautious):
        layer, x, c = _layer_and_batch()
        layer = layer.double()
        cls = functools.partial(WhiteningVariant, cautious=variant) if variant else WhitenedMuon
        optimizer = cls([layer], lr=1e-2, statistics_rows=None, ns_dtype=torch.float64)
        before = layer.weight.detach().clone()
        (layer(x.double()) * c.double()).sum().backward()
        grad = layer.weight.grad.clone()
        optimizer.step()
        steps[variant] = layer.weight.detach() - before
    plain = steps[None]
    agree = (plain * -grad > 0).double()
    assert 0.2 < agree.mean() < 0.9  # the mask keeps some entries and drops others
    masked = plain * agree
    expected = masked / agree.mean() if cautious == "mean" else masked * plain.norm() / masked.norm()
    torch.testing.assert_close(steps[cautious], expected, rtol=1e-12, atol=1e-15)


def test_cautious_must_name_its_rescaling():
    layer, _, _ = _layer_and_batch()
    with pytest.raises(ValueError, match="cautious"):
        WhiteningVariant([layer], lr=1e-2, cautious=True)


def test_split_heads_orthogonalises_each_heads_rows_on_their_own():
    """``head_dim=4`` on a ``q_proj`` ``[8, 8]``: with an identity input whitener (every layer's
    input side skipped), no momentum and the exact polar factor, the step is each head's rows'
    polar factor, ``-lr · 0.2 · sqrt(8) · polar(∇W[h])`` per head, written out with an SVD; the
    whole matrix's polar factor differs."""
    import kron_precond.whitened_muon as wm

    def polar(m):
        u, _, vh = torch.linalg.svd(m.double(), full_matrices=False)
        return (u @ vh).to(m.dtype)

    torch.manual_seed(0)
    model = nn.Module()
    model.q_proj = nn.Linear(IN, OUT, bias=False).double()
    before = model.q_proj.weight.detach().clone()
    original, wm.msign = wm.msign, lambda m, *args, **kwargs: torch.stack([polar(x) for x in m])
    try:
        optimizer = WhiteningVariant(model, lr=1e-2, momentum=0.0, nesterov=False, statistics_rows=None,
                                     input_skip_names=r".", head_dim=4, ns_dtype=torch.float64,
                                     output_side=False)
        x, c = torch.randn(ROWS, IN, dtype=torch.float64), torch.randn(ROWS, OUT, dtype=torch.float64)
        (model.q_proj(x) * c).sum().backward()
        grad = model.q_proj.weight.grad.detach().clone()
        optimizer.step()
    finally:
        wm.msign = original
    step = (model.q_proj.weight.detach() - before) / (-1e-2 * 0.2 * 8 ** 0.5)
    torch.testing.assert_close(step, torch.cat([polar(grad[:4]), polar(grad[4:])]), rtol=1e-9, atol=1e-12)
    assert not torch.allclose(step, polar(grad), atol=1e-3)
    with pytest.raises(ValueError, match="matches no whitened weight"):
        WhiteningVariant(nn.Sequential(nn.Linear(4, 4)), lr=1e-2, head_dim=2, output_side=False)


def test_spread_statistics_average_the_rows_of_every_step_since_the_last_refresh():
    """``SpreadStatistics``: the refresh at step 5 folds in the mean product of the first rows of
    steps 1-5 (written out in float64), where the library folds in step 5's alone."""
    from benchmarks.whitening_levers import SpreadStatistics
    from kron_precond import WhitenedMuon
    torch.manual_seed(0)
    xs = [torch.randn(10, 6, dtype=torch.float64) * torch.arange(1, 7) for _ in range(6)]
    first = [x[:4] for x in xs]  # statistics_rows=4
    mean_product = [sum(r.T @ r for r in rows) / (4 * len(rows)) for rows in (first[:1], first[1:6], first[5:6])]
    factors = {}
    for cls in (SpreadStatistics, WhitenedMuon):
        layer = nn.Linear(6, 3, bias=False).double()
        optimizer = cls([layer], lr=1e-2, statistics_every=5, statistics_rows=4, factor_decay=0.8,
                        center_inputs=False, ns_dtype=torch.float64)
        for x in xs:
            optimizer.zero_grad()
            layer(x).square().sum().backward()
            optimizer.step()
        factors[cls] = optimizer.state[layer.weight]["input_factor"].reshape(6, 6)
    torch.testing.assert_close(factors[SpreadStatistics], 0.8 * mean_product[0] + 0.2 * mean_product[1])
    torch.testing.assert_close(factors[WhitenedMuon], 0.8 * mean_product[0] + 0.2 * mean_product[2])
