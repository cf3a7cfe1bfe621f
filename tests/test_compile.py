"""``torch.compile(model)`` (default inductor backend) with K-FAC's hooks and with PSGD.

Reference: the same model, run eagerly from the same weights on the same batches with its
own preconditioner. After a warm-up that covers both kinds of K-FAC step (statistics
gathered or not), the compiler is put in ``fail_on_recompile``: no step may recompile.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kron_precond import KronPreconditioner

SETTINGS = {"kfac": dict(factor_update_steps=2, inv_update_steps=2, damping=1e-2, lr=0.1),
            "psgd": dict(preconditioner_update_probability=0.5)}
STEPS, WARMUP = 6, 2


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_compiled_model_matches_eager_without_recompiling(method):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    source = copy.deepcopy(eager)
    runs = []
    for model in (eager, source):
        precond = KronPreconditioner(model, method=method, **SETTINGS[method])
        runs.append((model, precond, torch.optim.SGD(model.parameters(), lr=0.1)))
    compiled = torch.compile(source)
    forwards = (eager, compiled)
    graphs_after_warmup = None
    try:
        for step in range(STEPS):
            if step == WARMUP:
                graphs_after_warmup = counters["stats"]["unique_graphs"]
                torch.compiler.set_stance("fail_on_recompile")
            x, y = _batch(step)
            for forward, (_model, precond, optimizer) in zip(forwards, runs):
                optimizer.zero_grad()
                F.mse_loss(forward(x), y).backward()
                precond.step()
                optimizer.step()
            for (name, p_eager), p_compiled in zip(eager.named_parameters(), source.parameters()):
                torch.testing.assert_close(p_compiled, p_eager, rtol=1e-5, atol=1e-5,
                                           msg=lambda m, step=step, name=name: f"step {step}, {name}: {m}")
    finally:
        torch.compiler.set_stance("default")
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup
    if method == "kfac":
        for name, layer in runs[0][1].layers.items():
            other = runs[1][1].layers[name]
            torch.testing.assert_close(other.a_factor, layer.a_factor, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(other.g_factor, layer.g_factor, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["kfac", "whitened_muon"])
def test_the_hooks_are_not_recompiled_per_module_dtype_or_width(kind):
    """Dynamo compiles no frame of the library's forward hooks: one code object serves every
    registered module, and compiling what is left of it around the eager statistics recompiled
    it per hook, input dtype and width until dynamo's recompile limit (a warning on a correct
    use). Layers of three widths and dtypes under bf16 autocast, compiled with aot_eager."""
    from torch._dynamo.utils import counters

    from kron_precond import WhitenedMuon

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(),
                          nn.Linear(12, 4))
    built = (WhitenedMuon(model, lr=1e-2, statistics_every=1) if kind == "whitened_muon"
             else KronPreconditioner(model, method="kfac", factor_update_steps=1, inv_update_steps=1, lr=0.1))
    compiled = torch.compile(model, backend="aot_eager")
    frames_before = counters["frames"]["ok"]  # counters outlive torch._dynamo.reset()
    captured = []
    import logging

    class Keep(logging.Handler):
        def emit(self, record):
            captured.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("torch._dynamo").addHandler(handler)
    try:
        for step in range(4):
            tokens = torch.randint(0, 11, (6, 3), generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = compiled(tokens).float().square().mean()
            loss.backward()
            built.step()
            model.zero_grad()
    finally:
        logging.getLogger("torch._dynamo").removeHandler(handler)
    assert not [m for m in captured if "recompile_limit" in m or "cache_size_limit" in m], captured
    # torch's own Linear.forward frames between the hooks, compiled per dtype and width (4 for
    # K-FAC, 8 for WhitenedMuon here); with the hooks' frames compiled too: 13 and 25
    assert counters["frames"]["ok"] - frames_before <= 10, (frames_before, dict(counters["frames"]))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        for block in self.layers.values():
            x = block(x)
        return self.out(x)


def _build(kind, model):
    from kron_precond import WhitenedMuon
    if kind == "whitened_muon":
        return WhitenedMuon(model, lr=1e-2)
    return KronPreconditioner(model, method=kind, lr=0.1)


@pytest.mark.parametrize("how", ["module.compile", "torch.compile"])
@pytest.mark.parametrize("kind", ["whitened_muon", "kfac", "ikfac"])
def test_blocks_compiled_with_fullgraph_are_refused_at_construction_by_name(kind, how):
    """The statistics hooks run outside the compiled graph, a graph break at each hooked module,
    which ``fullgraph=True`` forbids (torchtitan compiles each block so): refused when built,
    naming the block, not a tracing error at the first forward."""
    torch.manual_seed(0)
    model = _Blocks()
    if how == "module.compile":
        model.layers["1"].compile(fullgraph=True)
    else:
        model.layers["1"] = torch.compile(model.layers["1"], fullgraph=True)
    with pytest.raises(ValueError, match=r"layers\.1.*fullgraph=True"):
        _build(kind, model)
    # compiled without fullgraph, the same blocks are accepted and train
    plain = _Blocks()
    plain.layers["1"].compile()
    _build(kind, plain)


@pytest.mark.parametrize("kind", ["whitened_muon", "kfac", "ikfac"])
def test_a_whole_model_compiled_with_fullgraph_is_refused_at_construction(kind):
    """The compiled wrapper itself (``torch.compile(model, fullgraph=True)``) is refused as a
    compiled block is, not taken apart first and then failing at the first forward."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"fullgraph=True"):
        _build(kind, torch.compile(_Blocks(), fullgraph=True))


@pytest.mark.parametrize("kind", ["whitened_muon", "kfac"])
def test_compiled_with_fullgraph_after_construction_fails_with_our_explanation(kind):
    """Compiled with ``fullgraph=True`` only after the hooks are in place, the model cannot be
    refused at construction: the first forward's tracing error must then say what to change
    (compile without fullgraph, or leave the module out with skip_layers), not only dynamo's
    "remove the torch.compiler.disable call"."""
    torch._dynamo.reset()  # no cached frame of the blocks from the tests before: this one is traced
    torch.manual_seed(0)
    model = _Blocks()
    built = _build(kind, model)  # kept alive: a collected optimizer or preconditioner removes its hooks
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"(?s)outside the compiled graph.*without fullgraph=True.*skip_layers"):
        compiled(torch.randn(4, 8)).sum().backward()
    del built


def _deep(seed: int = 0) -> nn.Sequential:
    """Hidden weights of one shape (most models have them): a compiled step must keep apart
    the states of parameters that its traced code would treat alike."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


def _optimizer(kind, model):
    from kron_precond import Kron, WhitenedMuon
    if kind == "whitened_muon":
        return WhitenedMuon(model, lr=1e-2, statistics_every=2)
    return Kron(model.parameters(), lr=1e-2, preconditioner_update_probability=0.5)


@pytest.mark.parametrize("kind", ["kron", "whitened_muon"])
def test_a_compiled_optimizer_step_equals_the_eager_step(kind):
    """``torch.compile(optimizer.step)``, torch's recipe for compiling an optimizer: the step runs
    as the eager one does (bitwise, every parameter with its own state), not with the states of
    same-shaped parameters crossed or a tracing error at the first step."""
    torch._dynamo.reset()
    eager, compiled = _deep(), _deep()
    opt_eager, opt_compiled = _optimizer(kind, eager), _optimizer(kind, compiled)
    step = torch.compile(opt_compiled.step, backend="eager")  # no inductor: no rounding of its own
    for s in range(4):
        x, y = _batch(s)
        for model, opt, do in ((eager, opt_eager, opt_eager.step), (compiled, opt_compiled, step)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            do()
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            assert torch.equal(a, b), f"step {s}, {name}"
    for a, b in zip(eager.parameters(), compiled.parameters()):
        for key, value in opt_eager.state[a].items():
            if torch.is_tensor(value):
                assert torch.equal(value, opt_compiled.state[b][key]), key


@pytest.mark.parametrize("kind", ["kfac", "whitened_muon"])
def test_compiled_autograd_gathers_the_statistics_the_eager_backward_gathers(kind):
    """Compiled autograd (``torch._dynamo.config.compiled_autograd``, a backward inside a
    compiled function) runs the hooks on the calls' outputs that add a call's input rows and
    read its output gradients: parameters match the eager run's over statistics and plain
    steps, where a hook it dropped would leave a whitener or factor at the identity."""
    from torch._dynamo.utils import counters

    def train(compiled_autograd):
        torch._dynamo.reset()
        torch.manual_seed(0)
        # float64 throughout: the compiled backward's gradients differ from the eager one's by
        # rounding, which Newton-Schulz in a lower precision can turn into a jump
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).double()
        if kind == "kfac":
            precond = KronPreconditioner(model, method="kfac", **SETTINGS["kfac"])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            step = lambda: (precond.step(), optimizer.step())  # noqa: E731
        else:
            from kron_precond import WhitenedMuon
            optimizer = WhitenedMuon(model, lr=1e-2, statistics_every=2, output_side=True, ns_dtype=torch.float64)
            step = optimizer.step

        def forward_backward(x, y):
            F.mse_loss(model(x), y).backward()

        torch._dynamo.config.compiled_autograd = compiled_autograd  # read when compiling
        if compiled_autograd:
            forward_backward = torch.compile(forward_backward)
        try:
            for s in range(5):
                forward_backward(*(t.double() for t in _batch(s)))
                step()
                optimizer.zero_grad()
        finally:
            torch._dynamo.config.compiled_autograd = False
        return [p.detach().clone() for p in model.parameters()], counters["compiled_autograd"]["captures"]

    eager, _ = train(False)
    compiled, captures = train(True)
    assert captures > 0, "the backward did not run through compiled autograd"
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_run_eagerly_takes_a_torch_whose_disable_has_no_reason(monkeypatch):
    """Before torch 2.8, ``torch.compiler.disable`` takes no ``reason``: the library still
    imports and its decorated code still runs eagerly under compile."""
    import importlib

    import kron_precond.compiled as compiled

    original = torch.compiler.disable

    def disable_without_reason(fn=None, recursive=True):
        return original(fn, recursive=recursive)

    monkeypatch.setattr(torch.compiler, "disable", disable_without_reason)
    try:
        old = importlib.reload(compiled)
        assert not old._TAKES_REASON
        calls = []

        @old.run_eagerly("why")
        def count(x):
            calls.append(torch.compiler.is_compiling())
            return x + 1

        torch._dynamo.reset()
        out = torch.compile(lambda x: count(x) * 2, backend="eager")(torch.ones(2))
        assert torch.equal(out, torch.full((2,), 4.0)) and calls == [False]
    finally:
        monkeypatch.undo()
        importlib.reload(compiled)


def test_a_kron_unpickled_where_none_was_built_steps_eagerly_under_compile(tmp_path):
    """A process that only unpickles a ``Kron`` (a resumed job) gets the same eager step under
    ``torch.compile(optimizer.step)`` as one that built it: every parameter keeps its own state."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    save = ("import torch, pickle, torch.nn as nn\nfrom kron_precond import Kron\n"
            "torch.manual_seed(0)\n"
            "m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))\n"
            "opt = Kron(m.parameters(), lr=1e-2, preconditioner_update_probability=0.5)\n"
            f"pickle.dump((m, opt), open({str(tmp_path / 'k.pkl')!r}, 'wb'))\n")
    load = ("import torch, pickle, torch.nn.functional as F\n"
            f"path = {str(tmp_path / 'k.pkl')!r}\n"
            "(a, oa), (b, ob) = pickle.load(open(path, 'rb')), pickle.load(open(path, 'rb'))\n"
            "step = torch.compile(ob.step, backend='eager')\n"
            "for s in range(4):\n"
            "    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(s))\n"
            "    for m, o, do in ((a, oa, oa.step), (b, ob, step)):\n"
            "        o.zero_grad(); m(x).square().mean().backward(); do()\n"
            "print(max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters())))\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(root)}
    for code in (save, load):
        proc = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.strip().splitlines()[-1]) == 0.0, proc.stdout
