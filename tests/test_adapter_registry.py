"""The adapter registry's guard rails: what ``register_adapter`` accepts, how a registration is
taken back, which registration wins, what ``ConvAdapter`` checks when it is built, and the
warning that names a Linear-like module no adapter describes (left to the optimizer as it is,
which a user would otherwise only learn from an INFO log)."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner, WhitenedMuon, register_adapter
from kron_precond import modules as adapter_registry
from kron_precond.modules import ConvAdapter, KFACAdapter


@pytest.fixture(autouse=True)
def restore_adapters(monkeypatch):
    monkeypatch.setattr(adapter_registry, "_ADAPTERS", list(adapter_registry._ADAPTERS))


class MyLinear(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(d_out))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class ScaledLinear(nn.Linear):
    def forward(self, x):
        return super().forward(2 * x)


class Net(nn.Module):
    def __init__(self, make=MyLinear):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.a, self.b = make(6, 8), nn.Linear(8, 3)

    def forward(self, idx):
        return self.b(torch.tanh(self.a(self.emb(idx))))


def layer_names(precond):
    return sorted(precond.layers)


def unhandled_warnings(build):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build()
    return [str(w.message) for w in caught if "no adapter" in str(w.message)]


def test_a_module_instance_as_matches_is_refused():
    """An ``nn.Module`` instance is callable: taken as a predicate, every later construction
    ran that module on each candidate and failed naming neither."""
    with pytest.raises(TypeError, match="matches"):
        register_adapter(nn.Linear(2, 2), KFACAdapter)
    KronPreconditioner(Net(nn.Linear), method="kfac")  # the registry is unchanged


def test_a_registration_is_taken_back_with_its_handle():
    handle = register_adapter(MyLinear, KFACAdapter)
    assert layer_names(KronPreconditioner(Net(), method="kfac")) == ["a", "b"]
    handle.remove()
    handle.remove()  # twice is harmless, as torch's hook handles
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert layer_names(KronPreconditioner(Net(), method="kfac")) == ["b"]


def test_a_base_class_registered_after_its_subclass_warns_that_it_takes_over():
    class Sub(MyLinear):
        pass

    class Other(KFACAdapter):
        pass

    register_adapter(Sub, KFACAdapter)
    with pytest.warns(UserWarning, match=r"MyLinear.*Sub"):
        register_adapter(MyLinear, Other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a subclass after its base: the usual order, no warning
        register_adapter(Sub, KFACAdapter)


class UserConv(nn.Module):
    """A convolution written by hand, holding nn.Conv2d's settings."""

    def __init__(self, groups=1):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4 // groups, 3, 3) * 0.1)
        self.bias = nn.Parameter(torch.zeros(4))
        self.kernel_size, self.stride, self.dilation = (3, 3), (1, 1), (1, 1)
        self.padding, self.padding_mode, self.groups = (1, 1), "zeros", groups

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class BareConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4, 3, 3) * 0.1)

    def forward(self, x):
        return F.conv2d(x, self.weight, padding=1)


class ConvNet(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.conv, self.head = conv, nn.Linear(4 * 5 * 5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def test_a_user_conv_under_conv_adapter_matches_nn_conv2d():
    """The reference: the same weights in ``nn.Conv2d``, preconditioned by the built-in adapter."""
    register_adapter(UserConv, ConvAdapter)
    torch.manual_seed(0)
    ours = ConvNet(UserConv()).double()
    twin = ConvNet(nn.Conv2d(4, 4, 3, padding=1)).double()
    twin.load_state_dict(ours.state_dict())
    grads = []
    for model in (ours, twin):
        precond = KronPreconditioner(model, method="kfac", lr=0.1, damping=1e-2)
        torch.manual_seed(1)
        for _ in range(2):
            model.zero_grad()
            model(torch.randn(6, 4, 5, 5, dtype=torch.float64)).square().mean().backward()
            precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_conv_adapter_skips_a_grouped_user_conv_at_construction_naming_the_groups(caplog):
    register_adapter(UserConv, ConvAdapter)
    with caplog.at_level("INFO", logger="kron_precond"):
        precond = KronPreconditioner(ConvNet(UserConv(groups=2)), method="kfac")
    assert layer_names(precond) == ["head"]
    assert any("groups=2" in r.getMessage() for r in caplog.records)


def test_conv_adapter_refuses_a_module_without_a_convs_settings_at_construction():
    register_adapter(BareConv, ConvAdapter)
    with pytest.raises(TypeError, match=r"BareConv has no kernel_size") as caught:
        KronPreconditioner(ConvNet(BareConv()), method="kfac")
    assert any("'conv'" in note for note in getattr(caught.value, "__notes__", ["'conv'"]))


class IntSettingsConv(UserConv):
    def __init__(self):
        super().__init__()
        self.kernel_size, self.stride, self.dilation, self.padding = 3, 1, 1, 1


class NoGroupsConv(UserConv):
    def __init__(self):
        super().__init__()
        del self.groups


@pytest.mark.parametrize("make,message", [(IntSettingsConv, r"kernel_size=3: expected a tuple of 2 ints"),
                                          (NoGroupsConv, r"has no groups"),
                                          (lambda: nn.ConvTranspose2d(4, 4, 3, padding=1), r"transposed")])
def test_conv_adapter_refuses_settings_it_cannot_read_at_construction(make, message):
    """Settings of another form (ints where torch holds tuples), a missing ``groups``, or a
    transposed convolution (whose weight does not multiply its input's patches: taken, it would
    be whitened by the wrong rows without an error where its widths match) are refused when the
    preconditioner is built, not at the first backward."""
    module = make()
    register_adapter(type(module), ConvAdapter)
    with pytest.raises(TypeError, match=message):
        KronPreconditioner(ConvNet(module), method="kfac")


class ShapeError(ValueError):
    pass


def test_an_error_a_factory_raises_keeps_its_class_and_names_the_module():
    def factory(module):
        raise ShapeError("bad layout")

    register_adapter(MyLinear, factory)
    with pytest.raises(ShapeError, match="bad layout") as caught:
        KronPreconditioner(Net(), method="kfac")
    if hasattr(caught.value, "add_note"):  # Python 3.11+
        assert any("'a'" in note and "MyLinear" in note for note in caught.value.__notes__)


class TiedHead(MyLinear):
    pass


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc, self.head = nn.Linear(6, 6), TiedHead(6, 11)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.emb(idx))))


def test_no_warning_for_a_module_that_would_be_left_out_anyway():
    """A weight tied to another module's, or (for the methods preconditioning ``[W | b]``) a
    frozen bias, leaves the module out whatever adapter reads it: registering one would change
    nothing, so the warning does not ask for it."""
    assert unhandled_warnings(lambda: KronPreconditioner(TiedNet(), method="kfac")) == []
    assert unhandled_warnings(lambda: WhitenedMuon(TiedNet(), lr=1e-2)) == []
    frozen_bias = Net()
    frozen_bias.a.bias.requires_grad_(False)
    assert unhandled_warnings(lambda: KronPreconditioner(frozen_bias, method="kfac")) == []
    # WhitenedMuon whitens the weight alone (AdamW takes the bias): that module it would take
    assert len(unhandled_warnings(lambda: WhitenedMuon(frozen_bias, lr=1e-2))) == 1


def test_a_transposed_convolution_is_named_in_the_warning():
    model = nn.Sequential(nn.ConvTranspose2d(4, 4, 3), nn.Flatten(), nn.Linear(4 * 7 * 7, 2))
    messages = unhandled_warnings(lambda: KronPreconditioner(model, method="kfac"))
    assert len(messages) == 1 and "'0'" in messages[0] and "ConvTranspose2d" in messages[0]


def test_torchtitans_row_parallel_linear_is_taken_as_its_nn_linear_twin():
    """torchtitan's ``ScaledBiasRowwiseLinear`` overrides ``forward`` with ``F.linear(input, w,
    b / tp_degree)``: its rows are its input (tensor parallelism is refused, so the degree is 1).
    The reference is the same weights in an ``nn.Linear``."""
    linear = pytest.importorskip("torchtitan.models.common.linear",
                                 reason="torchtitan is an optional extra ([torchtitan])")
    torch.manual_seed(0)
    ours = nn.Sequential(linear.ScaledBiasRowwiseLinear(linear.ScaledBiasRowwiseLinear.Config(
        in_features=6, out_features=5, bias=True)), nn.Tanh(), nn.Linear(5, 2)).double()
    twin = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    twin.load_state_dict(ours.state_dict())
    grads = []
    for model in (ours, twin):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # taken: no warning either
            precond = KronPreconditioner(model, method="kfac", lr=0.1, damping=1e-2)
        assert sorted(precond.layers) == ["0", "2"]
        torch.manual_seed(1)
        for _ in range(2):
            model.zero_grad()
            model(torch.randn(8, 6, dtype=torch.float64)).square().mean().backward()
            precond.step()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("make,what", [(MyLinear, "MyLinear"), (ScaledLinear, "overrides forward")])
@pytest.mark.parametrize("method", ["kfac", "ikfac"])
def test_a_linear_like_module_no_adapter_describes_is_named_in_a_warning(make, what, method):
    messages = unhandled_warnings(lambda: KronPreconditioner(Net(make), method=method))
    assert len(messages) == 1 and "'a'" in messages[0] and what in messages[0]
    assert "'emb'" not in messages[0]  # an embedding is a lookup, left to the optimizer by design


def test_whitened_muon_names_the_linear_like_module_it_leaves_to_adamw():
    messages = unhandled_warnings(lambda: WhitenedMuon(Net(), lr=1e-2))
    assert len(messages) == 1 and "'a'" in messages[0] and "AdamW" in messages[0]


def test_no_warning_for_a_skipped_or_taught_module_or_for_the_gradient_methods():
    assert unhandled_warnings(lambda: KronPreconditioner(Net(), method="kfac", skip_layers=["^a$"])) == []
    assert unhandled_warnings(lambda: KronPreconditioner(Net(), method="shampoo")) == []
    register_adapter(MyLinear, KFACAdapter)
    assert unhandled_warnings(lambda: KronPreconditioner(Net(), method="kfac")) == []
    assert unhandled_warnings(lambda: WhitenedMuon(Net(), lr=1e-2)) == []


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss"])
def test_the_transformers_zoo_warns_of_no_module(name):
    """Every Linear-like module of these models is read by an adapter or left out by design
    (embeddings, MoE routers), so a user of them sees no warning."""
    transformers = pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    import hf_zoo

    model = hf_zoo.build(name, transformers)
    assert unhandled_warnings(lambda: KronPreconditioner(model, method="kfac")) == []
    assert unhandled_warnings(lambda: WhitenedMuon(model, lr=1e-2)) == []
