"""The README's main job and the examples run end to end (tiny sizes, a few steps).

These guard the commands a new user types, including the torchrun/DDP path on gloo;
whether the methods beat AdamW is measured by the benchmarks, not asserted here.
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys

import pytest

from example_modules import ROOT, load

TINY_LM = ["--steps", "4", "--d-model", "32", "--n-layers", "1", "--n-heads", "2",
           "--batch-size", "4", "--seq-len", "16", "--eval-every", "2", "--eval-seqs", "4",
           "--corpus-mb", "0.2", "--warmup-steps", "1", "--threads", "1"]


def _run(args, tmp_path, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_main_job_runs_and_reports_every_method(tmp_path):
    DEFAULT_METHODS = load("examples/char_lm.py").DEFAULT_METHODS

    out = _run([sys.executable, "examples/char_lm.py", *TINY_LM, "--out", str(tmp_path)], tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert [run["name"] for run in results["runs"]] == DEFAULT_METHODS.split(",")
    for run in results["runs"]:
        assert len(run["step_seconds"]) == 4
        assert all(loss == loss for loss in run["eval_losses"])  # no NaN
    assert any(run["state_bytes"]["preconditioner"] > 0 for run in results["runs"])
    assert (tmp_path / "char_lm.png").stat().st_size > 0
    assert "final loss" in out


@pytest.mark.parametrize("flags", [
    ["--steps", "0"], ["--eval-every", "0"], ["--eval-seqs", "0"], ["--n-heads", "0"], ["--grad-accum", "0"],
    ["--seq-len", "0"], ["--threads", "-1"], ["--warmup-steps", "-5"], ["--corpus-mb", "0"],
    ["--methods", "muon,muon"], ["--stop-after", "9"], ["--device", "foo"], ["--grad-accum", "3"],
    ["--d-model", "31"],
], ids=lambda flags: " ".join(flags))
def test_main_job_refuses_a_bad_flag_before_training(flags, tmp_path, capsys):
    """A value the job cannot run is a command-line error (SystemExit, no traceback from deep
    inside), before any training: nothing is written."""
    char_lm = load("examples/char_lm.py")
    with pytest.raises(SystemExit) as refusal:
        char_lm.main([*TINY_LM, "--methods", "muon", *flags, "--out", str(tmp_path / "out")])
    assert refusal.value.code != 0
    assert not (tmp_path / "out").exists()


def test_main_job_table_names_its_reference_and_survives_a_target_reached_at_step_zero(tmp_path, capsys):
    """Without AdamW the ratio columns name the run they divide by; a reference whose loss never
    falls (lr 0: its target is reached at step 0, in 0 s) leaves its ratios "-", and the runs
    are saved."""
    char_lm = load("examples/char_lm.py")
    char_lm.main([*TINY_LM, "--methods", "muon,wmuon", "--out", str(tmp_path / "a")])
    header = capsys.readouterr().out.split("held-out target")[1].splitlines()[1]
    assert "x muon time" in header and "x muon step" in header and "AdamW" not in header
    char_lm.main([*TINY_LM, "--methods", "adamw,muon", "--lr-adamw", "0", "--out", str(tmp_path / "b")])
    assert (tmp_path / "b" / "results.json").exists()
    rows = capsys.readouterr().out.split("held-out target")[1].splitlines()
    assert "x AdamW time" in rows[1]
    for name in ("adamw", "muon"):  # columns: run, lr, final loss, steps, s, x AdamW time, ...
        assert next(r for r in rows if r.startswith(name + " ")).split()[5] == "-"


def test_main_job_under_torchrun_with_accumulation(tmp_path):
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
          "examples/char_lm.py", *TINY_LM, "--methods", "kfac,psgd_adamw,wmuon", "--grad-accum", "2",
          "--out", str(tmp_path)], tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["world_size"] == 2


def test_digits_cnn_example_runs(tmp_path):
    out = _run([sys.executable, "examples/digits_cnn.py", "--method", "kfac", "--epochs", "1",
                "--device", "cpu"], tmp_path)
    assert "accuracy" in out.lower()


def test_muon_split_and_chain_follow_one_schedule():
    # The usual Muon split: hidden nn.Linear weights to Muon; embeddings, the output layer,
    # norms and biases to AdamW; one LR scheduler drives both halves.
    import torch

    char_lm = load("examples/char_lm.py")
    SKIP_LAYERS, CharTransformer, ModelConfig = char_lm.SKIP_LAYERS, char_lm.CharTransformer, char_lm.ModelConfig
    build_muon = load("examples/kron_examples_common.py").build_muon

    model = CharTransformer(ModelConfig(d_model=16, n_layers=2, n_heads=2, seq_len=8))
    chain = build_muon(model, lr=8e-3, weight_decay=0.0, exclude=SKIP_LAYERS)
    muon, adamw = chain.optimizers
    hidden = {id(p) for g in muon.param_groups for p in g["params"]}
    expected = {id(m.weight) for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and "lm_head" not in name}
    assert hidden == expected and len(hidden) == 12  # q, k, v, out, fc1, fc2 per block
    rest = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert rest.isdisjoint(hidden) and len(rest | hidden) == len(list(model.parameters()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(chain, char_lm.warmup_cosine(2, 10))
    model(torch.randint(0, 256, (2, 8))).sum().backward()
    chain.step()
    scheduler.step()
    assert muon.param_groups[0]["lr"] == adamw.param_groups[0]["lr"] == 8e-3  # end of warm-up
    assert chain.state  # both halves' state is visible through the chain


def test_rest_lr_gives_the_adamw_half_its_own_peak_lr_under_the_one_schedule():
    """``rlr=`` (``muon_rest_lr``): AdamW's half of Muon's split (and of WhitenedMuon's) starts
    at its own peak lr; one scheduler scales both halves by the same factor."""
    import torch

    char_lm = load("examples/char_lm.py")
    common = load("examples/kron_examples_common.py")
    convergence = load("benchmarks/convergence.py")
    model = char_lm.CharTransformer(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    for method in ("muon", "wmuon", "kfac_muon"):
        _, name, overrides, _ = convergence.parse_family(f"{method}{{rlr=2e-3}}=8e-2")
        optimizer, _ = common.build_method(name, model, 8e-2, 0.0,
                                           common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, **overrides))
        if method == "wmuon":  # one optimizer: its AdamW group is the rest
            hidden_group, rest_group = optimizer.param_groups
            assert rest_group["algorithm"] == "adamw"
        else:
            hidden, rest = optimizer.optimizers
            assert isinstance(rest, torch.optim.AdamW)
            hidden_group, rest_group = hidden.param_groups[0], rest.param_groups[0]
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
        assert hidden_group["lr"] == 4e-2 and rest_group["lr"] == 1e-3, method
        del scheduler
    default, _ = common.build_method("muon", model, 8e-2, 0.0, common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS))
    assert default.optimizers[1].param_groups[0]["lr"] == 8e-2  # None: the same lr for both halves


@pytest.fixture
def foreign_examples_env(tmp_path):
    """An environment whose PYTHONPATH starts with a folder holding a regular top-level
    ``examples`` package, as another wheel (kfac-pytorch's) installs one, then the checkout."""
    fake = tmp_path / "site" / "examples"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("# stands in for another wheel's top-level `examples`\n")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]),
                OMP_NUM_THREADS="1")


@pytest.mark.parametrize("script", ["examples/digits_cnn.py", "examples/char_lm.py",
                                    "benchmarks/step_overhead.py"])
def test_scripts_ignore_an_installed_top_level_examples_package(foreign_examples_env, script):
    """kfac-pytorch's wheel installs a regular top-level package named ``examples``; it used
    to shadow the checkout's folder (``No module named 'examples.common'``). ``--help`` runs
    every import of the script."""
    done = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=foreign_examples_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    assert "usage" in done.stdout.lower()


# Tests of this file that load examples/ and benchmarks/ modules (char_lm, kron_examples_common,
# convergence): the main job's (it runs a tiny main job, ~10-40 s)
# and three that spawn nothing.
LOADING_TESTS = ["test_main_job_runs_and_reports_every_method",
                 "test_muon_split_and_chain_follow_one_schedule",
                 "test_sweep_variants_keep_the_usual_muon_split_and_reach_the_preconditioner",
                 "test_sweep_best_point_is_the_first_to_reach_the_target"]


def test_the_suite_collects_and_runs_under_an_installed_top_level_examples_package(foreign_examples_env):
    """The README's test command (``pytest tests``) for a user who also has kfac-pytorch
    installed, in one run: every test module is collected with a foreign ``examples`` package
    first on the path (an import by package name at a module's top, ``from examples.x import
    ...``, would end collection with an error and pytest would run nothing), and the tests that
    load the checkout's scripts run and pass (they load them by path). The control shows that
    the foreign package does shadow the folder for an import by package name."""
    control = subprocess.run([sys.executable, "-c", "import examples.char_lm"], cwd=ROOT,
                             env=foreign_examples_env, capture_output=True, text=True, timeout=60)
    assert control.returncode != 0 and "No module named 'examples.char_lm'" in control.stderr, control.stderr
    selected = f"test_examples and ({' or '.join(LOADING_TESTS)})"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests", "-k", selected],
                          cwd=ROOT, env=foreign_examples_env, capture_output=True, text=True, timeout=300)
    report = f"{done.stdout[-4000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 0, f"the suite failed under a foreign `examples`:\n{report}"
    summary = done.stdout.strip().splitlines()[-1]
    # exactly these tests ran ("14 passed" would also contain "4 passed")
    assert re.match(rf"{len(LOADING_TESTS)} passed\b", summary) and "error" not in summary, report
    assert not re.search(r"^ERROR ", done.stdout, re.MULTILINE), report


def _package_imports(source: str) -> list[str]:
    """Every import of the checkout's ``examples/`` by package name in ``source`` (``import
    examples.x``, ``from examples import x``, ``from examples.x import y``), at any depth: the
    collection run above only executes module tops, not the imports inside tests and workers."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names if name.split(".")[0] == "examples"]
    return found


def _dotted_names(source: str) -> list[str]:
    """String constants that name a module under ``examples`` (``"examples.x.f"``), which
    torchtitan's ``--override.imports`` resolves with an import by name."""
    return [f"line {node.lineno}: {node.value}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and re.fullmatch(r"examples(?:\.\w+)+", node.value)]


def test_package_import_finder_sees_nested_imports_and_dotted_names():
    source = ("import os\nfrom example_modules import load\ndef f():\n    from examples.op import g\n"
              "    import examples.char_lm, json\n    from examples import x\n    from benchmarks import y\n"
              "    return ['--override.imports', 'examples.mod.fn', 'examples/x.py']\n")
    assert _package_imports(source) == ["line 4: examples.op", "line 5: examples.char_lm", "line 6: examples"]
    assert _dotted_names(source) == ["line 8: examples.mod.fn"]


def test_no_test_file_imports_examples_by_package_name():
    """The same guard for imports that collection does not run (inside tests and workers):
    tests load ``examples/`` scripts by path (``example_modules.load``)."""
    offenders = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        source = path.read_text()
        found = _package_imports(source) + _dotted_names(source)
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"load these by path with example_modules.load: {offenders}"


@pytest.mark.parametrize("script,framework,args", [
    ("hf_trainer.py", "transformers", ["--max-steps", "4", "--batch-size", "4", "--seq-len", "16",
                                       "--grad-accum", "2"]),
    ("lightning_digits.py", "lightning", ["--max-steps", "4", "--epochs", "1"]),
    ("accelerate_digits.py", "accelerate", ["--epochs", "1", "--cpu"]),
])
@pytest.mark.parametrize("method", ["kfac", "psgd"])
def test_trainer_framework_examples_run(tmp_path, monkeypatch, script, framework, args, method):
    """The examples/ scripts for each trainer framework, in-process with tiny settings."""
    import importlib.util

    from integration_common import require

    require(framework)
    if framework == "accelerate":
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    monkeypatch.chdir(tmp_path)  # runs/ and checkpoints land here
    spec = importlib.util.spec_from_file_location(f"kron_example_{script[:-3]}", ROOT / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    metrics = module.main(["--method", method, *args])
    assert metrics and all(value == value for value in metrics.values()), metrics  # no NaN


def test_step_cost_benchmark_reports_every_configuration(tmp_path):
    out = _run([sys.executable, "benchmarks/step_cost.py", "--d-model", "32", "--steps", "3",
                "--factor-update-steps", "2", "--inv-update-steps", "3", "--threads", "1"], tmp_path)
    CONFIGS = load("benchmarks/step_cost.py").CONFIGS

    rows = {line[:30].strip(): line.split() for line in out.splitlines()[2:]}
    assert set(rows) == set(CONFIGS)
    assert float(rows["muon"][-1]) == 1.0  # the ratio column is against Muon


def test_step_cost_benchmark_times_a_model_built_from_a_transformers_config(tmp_path):
    pytest.importorskip("transformers")
    out = _run([sys.executable, "benchmarks/step_cost.py", "--arch", "llama", "--d-model", "32", "--batch-size", "4",
                "--steps", "2", "--only", "wmuon (defaults)", "--threads", "1"], tmp_path)
    assert "llama, d_model=32, 256 tokens/step" in out
    rows = {line[:30].strip(): line.split() for line in out.splitlines()[2:]}
    assert set(rows) == {"muon", "wmuon (defaults)"}
    assert float(rows["muon"][-1]) == 1.0


def test_sweep_variants_keep_the_usual_muon_split_and_reach_the_preconditioner():
    """``skip=`` changes what the preconditioner takes, never Muon's split; ``mom`` sets
    Muon's momentum; ``rows``, ``cm`` and ``p`` reach the layers and the PSGD schedule of a
    preconditioner in front of Muon."""

    import torch

    convergence = load("benchmarks/convergence.py")
    parse_family, sweep_contenders = convergence.parse_family, convergence.sweep_contenders
    PrecondConfig = load("examples/kron_examples_common.py").PrecondConfig
    char_lm = load("examples/char_lm.py")
    SKIP_LAYERS, CharTransformer, ModelConfig = char_lm.SKIP_LAYERS, char_lm.CharTransformer, char_lm.ModelConfig
    grid = [parse_family("kfac_muon{skip=Embedding,rows=7,cm=inverse,mom=0.85}=8e-3"),
            parse_family("psgd_muon{p=0.25,maxtri=12,msm=one_diag}=8e-3"), parse_family("muon_kron=8e-3")]
    base = PrecondConfig(skip_layers=SKIP_LAYERS, precond_update_probability=0.5)
    kfac_run, psgd_run, kron_run = sweep_contenders(grid, {}, (), 0.0, base)
    model = CharTransformer(ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    chain, precond = kfac_run.build(model, None)
    assert "lm_head" in precond.layers and len(precond.layers) == 7  # 6 hidden + the head
    muon_params = {id(p) for g in chain.optimizers[0].param_groups for p in g["params"]}
    assert id(model.lm_head.weight) not in muon_params and len(muon_params) == 6
    assert chain.optimizers[0].param_groups[0]["momentum"] == 0.85  # mom= reaches Muon
    layer = precond.layers["blocks.0.mlp.0"]
    assert layer.statistics_rows == 7 and layer.compute_method.value == "inverse"
    precond.remove()
    _, precond = psgd_run.build(model, None)
    settings = precond._spec.settings
    assert settings["preconditioner_update_probability"] == 0.25  # not 0.5
    assert settings["max_size_triangular"] == 12 and settings["memory_save_mode"] == "one_diag"
    precond.remove()
    chain, precond = kron_run.build(model, None)
    assert precond is None and type(chain.optimizers[1]).__name__ == "Kron"
    assert isinstance(chain.optimizers[0], torch.optim.Muon)
    assert chain.optimizers[0].param_groups[0]["momentum"] == PrecondConfig.muon_momentum


def test_muon_momentum_warmup_rises_linearly_and_steps_like_plain_muon():
    """``momw=START:STEPS``: Muon's momentum goes START -> ``mom`` over STEPS steps; a step
    taken at momentum m is the step of a plain ``torch.optim.Muon(momentum=m)``."""
    import copy

    import torch

    convergence = load("benchmarks/convergence.py")
    common = load("examples/kron_examples_common.py")
    char_lm = load("examples/char_lm.py")
    _, _, overrides, _ = convergence.parse_family("muon{mom=0.95,momw=0.85:4}=8e-3")
    assert overrides["muon_momentum_warmup"] == (0.85, 4)
    config = common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, **overrides)
    torch.manual_seed(0)
    model = char_lm.CharTransformer(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    twin = copy.deepcopy(model)
    chain = common.build_muon(model, 8e-3, 0.0, char_lm.SKIP_LAYERS, "adamw", config)
    plain = common.build_muon(twin, 8e-3, 0.0, char_lm.SKIP_LAYERS, "adamw",
                              common.PrecondConfig(muon_momentum=0.85))
    seen = []
    tokens = torch.randint(0, 256, (2, 8))
    for step in range(6):
        for net, optimizer in ((model, chain), (twin, plain)):
            optimizer.zero_grad()
            net(tokens).square().mean().backward()
            optimizer.step()
        seen.append(chain.optimizers[0].param_groups[0]["momentum"])
        if step == 0:  # both at 0.85: the same update
            for a, b in zip(model.parameters(), twin.parameters()):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert not torch.equal(model.blocks[0].mlp[0].weight, twin.blocks[0].mlp[0].weight)  # then they part


def test_precond_momentum_feeds_the_nesterov_momentum_to_the_preconditioner():
    """``pm=1``: Muon runs at momentum 0 and the preconditioner sees torch.optim.Muon's own
    Nesterov momentum in ``.grad``. With a preconditioner that changes nothing the run is a
    plain ``torch.optim.Muon``; with one that rewrites, it sees exactly that momentum."""
    import copy

    import torch

    convergence = load("benchmarks/convergence.py")
    common = load("examples/kron_examples_common.py")
    char_lm = load("examples/char_lm.py")
    _, _, overrides, _ = convergence.parse_family("kfac_muon{pm=1,mom=0.8}=8e-3")
    assert overrides["precond_momentum"] is True
    config = common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, **overrides)
    torch.manual_seed(0)
    model = char_lm.CharTransformer(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    twin = copy.deepcopy(model)
    chain, wrapped = common.build_method("kfac_muon", model, 8e-3, 0.0, config)
    assert chain.optimizers[0].param_groups[0]["momentum"] == 0.0
    wrapped.precond.remove()

    class Recorder:  # changes nothing, keeps what it was shown
        def __init__(self):
            self.seen = []

        def step(self, lr=None):
            self.seen.append([p.grad.clone() for p in params])

    params = [p for g in chain.optimizers[0].param_groups for p in g["params"]]
    wrapped.precond = Recorder()
    plain = common.build_muon(twin, 8e-3, 0.0, char_lm.SKIP_LAYERS, "adamw", common.PrecondConfig(muon_momentum=0.8))
    twin_params = [p for g in plain.optimizers[0].param_groups for p in g["params"]]
    buffers = [torch.zeros_like(p) for p in twin_params]
    tokens = torch.randint(0, 256, (2, 8))
    for _ in range(4):
        for net, optimizer in ((model, chain), (twin, plain)):
            optimizer.zero_grad()
            net(tokens).square().mean().backward()
        expected = []
        for p, buf in zip(twin_params, buffers):  # Nesterov momentum written out: b = 0.8 b + 0.2 g
            buf.mul_(0.8).add_(p.grad, alpha=0.2)
            expected.append(0.2 * p.grad + 0.8 * buf)
        wrapped.step()
        chain.step()
        plain.step()
        for got, want in zip(wrapped.precond.seen[-1], expected):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for a, b in zip(model.parameters(), twin.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="precond_momentum"):
        common.build_method("muon", model, 8e-3, 0.0, config)


@pytest.mark.parametrize("method", ["kfac_muon", "ekfac"])
def test_the_examples_kl_clip_reads_the_scheduled_lr_not_the_peak(method):
    """The main job's loop (``train_step``) under a warm-up schedule: K-FAC's and EK-FAC's
    ``kl_clip`` reads the optimizer's current lr, as the docs tell a user to pass it. The
    reference is the same preconditioner given the schedule as a callable ``lr`` at
    construction, stepped by hand; a clip fed the peak lr clips warm-up steps too hard."""
    import copy

    import torch

    common = load("examples/kron_examples_common.py")
    char_lm = load("examples/char_lm.py")
    peak, factors = 1.6e-2, [0.05, 0.3, 0.7, 1.0]
    config = common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, kl_clip=1e-7,
                                  factor_update_steps=1, inv_update_steps=2)
    torch.manual_seed(0)
    model = char_lm.CharTransformer(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    twin = copy.deepcopy(model)
    optimizer, precond = common.build_method(method, model, peak, 0.0, config)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factors[min(step, len(factors) - 1)])
    amp = common.AmpState.create(False, torch.device("cpu"))
    base = method.removesuffix("_muon")
    hand_optimizer, _ = common.build_method("muon" if method.endswith("_muon") else "adamw", twin, peak, 0.0, config)
    hand_schedule = torch.optim.lr_scheduler.LambdaLR(hand_optimizer,
                                                      lambda step: factors[min(step, len(factors) - 1)])
    hand = common.build_preconditioner(base, twin, lambda step: peak * factors[min(step, len(factors) - 1)], config)
    generator = torch.Generator().manual_seed(1)
    for _ in range(len(factors)):
        tokens = torch.randint(0, 256, (4, 9), generator=generator)
        common.train_step(model, optimizer, precond, [(tokens[:, :-1], tokens[:, 1:])], char_lm.lm_loss, amp)
        schedule.step()
        hand_optimizer.zero_grad(set_to_none=True)
        char_lm.lm_loss(twin, tokens[:, :-1], tokens[:, 1:]).backward()
        hand.step()
        hand_optimizer.step()
        hand_schedule.step()
    for (name, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    precond.remove()
    hand.remove()


def test_the_examples_loop_steps_a_foreign_preconditioner_without_an_lr():
    """``train_step`` also steps preconditioners of other libraries (benchmarks/curvature_pays.py's
    kfac-pytorch contender), whose ``step()`` takes no lr: they are called as they are."""
    import torch

    common = load("examples/kron_examples_common.py")

    class NoArgumentStep:  # kfac-pytorch's KFACPreconditioner.step(self)
        calls = 0

        def step(self):
            NoArgumentStep.calls += 1

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = common.AmpState.create(False, torch.device("cpu"))
    batch = (torch.randn(4, 3), torch.randn(4, 2))
    common.train_step(model, optimizer, NoArgumentStep(), [batch],
                      lambda net, x, y: torch.nn.functional.mse_loss(net(x), y), amp)
    assert NoArgumentStep.calls == 1


def test_whitened_muon_methods_take_muons_split_and_their_sweep_settings():
    """``wmuon`` / ``wmuon_pre``: one WhitenedMuon (or its pre-only control) built from the model
    whitens exactly Muon's hidden weights and steps the rest with AdamW; ``we=``, ``wdamp=``,
    ``wboth=``, ``wrows=``, ``wdecay=`` and ``mom=`` reach it."""
    import torch

    from kron_precond import WhitenedMuon

    convergence = load("benchmarks/convergence.py")
    common = load("examples/kron_examples_common.py")
    char_lm = load("examples/char_lm.py")
    _, method, overrides, _ = convergence.parse_family(
        "wmuon{we=7,wdamp=0.3,wodamp=0.2,wboth=1,wrows=all,wdecay=0.6,mom=0.85}=1.6e-2")
    config = common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, **overrides)
    model = char_lm.CharTransformer(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    optimizer, precond = common.build_method(method, model, 1.6e-2, 0.0, config)
    assert precond is None and isinstance(optimizer, WhitenedMuon)
    assert (optimizer.statistics_every, optimizer.damping, optimizer.output_damping, optimizer.output_side,
            optimizer.statistics_rows, optimizer.factor_decay) == (7, 0.3, 0.2, True, None, 0.6)
    assert optimizer.param_groups[0]["momentum"] == 0.85
    _, _, wide, _ = convergence.parse_family("wmuon{wboth=wide}=1.6e-2")
    assert wide == {"wmuon_both_sides": "wide"}
    _, _, auto, _ = convergence.parse_family("wmuon{wboth=auto}=1.6e-2")
    assert auto == {"wmuon_both_sides": "auto"}
    _, _, off, _ = convergence.parse_family("wmuon{wboth=0}=1.6e-2")
    assert off == {"wmuon_both_sides": False}
    plain, _ = common.build_method("muon", model, 1.6e-2, 0.0, common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS))
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [
        id(p) for p in plain.optimizers[0].param_groups[0]["params"]]
    assert [g["algorithm"] for g in optimizer.param_groups] == ["whitened_muon", "adamw"]
    assert [id(p) for p in optimizer.param_groups[1]["params"]] == [
        id(p) for p in plain.optimizers[1].param_groups[0]["params"]]
    pre, _ = common.build_method("wmuon_pre", model, 1.6e-2, 0.0, config)
    assert type(pre).__name__ == "PreWhitenedMuon"
    tokens = torch.randint(0, 256, (2, 8))
    for opt in (optimizer, pre):  # both step and move every hidden weight
        before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
        opt.zero_grad()
        model(tokens).square().mean().backward()
        opt.step()
        assert all(not torch.equal(b, p) for b, p in zip(before, opt.param_groups[0]["params"]))
    optimizer.remove()
    pre.remove()


def test_the_examples_wmuon_is_the_librarys_defaults():
    """The benchmarks measure what a user gets: every WhitenedMuon setting the examples' default
    ``wmuon`` passes (all but lr) is the library's default. The one exception is ``ns_dtype``,
    pinned to ``torch.optim.Muon``'s bfloat16 so that the two compare like for like; it is the
    library's default on the CPUs with bfloat16 kernels that the records come from."""
    import inspect

    from kron_precond import WhitenedMuon

    common = load("examples/kron_examples_common.py")
    char_lm = load("examples/char_lm.py")
    model = char_lm.CharTransformer(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    built, _ = common.build_method("wmuon", model, 1.6e-2, 0.0, common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS))
    default = WhitenedMuon(model, skip_layers=char_lm.SKIP_LAYERS)
    for name in inspect.signature(WhitenedMuon.__init__).parameters:
        if name in ("self", "params", "lr", "weight_decay", "skip_layers", "adamw_lr", "grad_scaler",
                    "process_group"):
            continue
        if name == "ns_dtype":
            assert str(built.ns_dtype) == "torch.bfloat16"
            continue
        if name.startswith("adamw_"):  # the AdamW group's settings
            key = name.removeprefix("adamw_")
            ours, theirs = built.param_groups[1][key], default.param_groups[1][key]
        elif hasattr(built, name):
            ours, theirs = getattr(built, name), getattr(default, name)
        else:  # the whitened group's settings (momentum, nesterov)
            ours, theirs = built.param_groups[0][name], default.param_groups[0][name]
        assert ours == theirs, (name, ours, theirs)
    built.remove()
    default.remove()


# gpt2: c_attn (q, k, v fused), c_proj, c_fc, c_proj; mixtral: q, k, v, o and the two fused expert weights;
# torch: nn.MultiheadAttention's in_proj_weight and out_proj, linear1, linear2; seq2seq: the
# encoder layer's 4 and the decoder layer's 6 (a cross-attention's in_proj and out_proj more), 5 per layer
PROJECTIONS_PER_BLOCK = {"gpt": 6, "llama": 7, "gpt2": 4, "mixtral": 6, "torch": 4, "seq2seq": 5, "qwen2": 7}


@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt2", "mixtral", "torch", "seq2seq", "qwen2"])
def test_char_lm_builds_each_architecture_and_whitens_its_hidden_weights(arch):
    """``--arch llama``: Llama's RMSNorm / rotary / SwiGLU / grouped-query model from a
    transformers config, on bytes; ``--arch gpt2``: Hugging Face's GPT-2 (``Conv1D``);
    ``--arch mixtral``: fused experts; ``--arch torch``: nn.TransformerEncoderLayer (its
    attention's weights held by nn.MultiheadAttention); ``--arch seq2seq``: an encoder and a
    decoder layer (cross-attention); ``--arch qwen2``: Llama's layout with biased q, k, v. The
    examples' skip_layers leave embeddings and head to AdamW; WhitenedMuon whitens every
    projection, and the Muon baseline takes the same weights (``Conv1D``'s too; the fused
    experts through ExpertMuon)."""
    import torch

    if arch not in ("gpt", "torch", "seq2seq"):
        pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    from kron_precond import WhitenedMuon

    char_lm = load("examples/char_lm.py")
    common = load("examples/kron_examples_common.py")
    model = char_lm.build_model(char_lm.ModelConfig(d_model=16, n_layers=2, n_heads=4, seq_len=8, arch=arch))
    logits = model(torch.randint(0, 256, (3, 8)))
    assert logits.shape == (3, 8, 256)
    optimizer = WhitenedMuon(model, lr=1e-2, skip_layers=char_lm.SKIP_LAYERS)
    names = optimizer.param_groups[0]["param_names"]
    assert len(names) == PROJECTIONS_PER_BLOCK[arch] * 2, names
    if arch == "llama":
        k_proj = model.get_submodule("inner.model.layers.0.self_attn.k_proj")
        assert k_proj.weight.shape == (8, 16)  # 2 key/value heads of 4 for 4 query heads: grouped
    if arch == "gpt2":
        c_attn = model.get_submodule("inner.transformer.h.0.attn.c_attn")
        assert type(c_attn).__name__ == "Conv1D" and c_attn.weight.shape == (16, 48)  # [in, out]
        assert c_attn.bias is not None and model.inner.config.resid_pdrop == 0.0
    if arch == "mixtral":
        experts = model.get_submodule("inner.model.layers.0.mlp.experts")
        assert experts.gate_up_proj.shape == (4, 64, 16) and experts.down_proj.shape == (4, 16, 32)
    if arch == "torch":  # the packed in_proj whitened as three parts, out_proj (no hook sees its input) unwhitened
        attn = model.get_submodule("blocks.0.self_attn")
        assert isinstance(attn, torch.nn.MultiheadAttention) and attn.in_proj_weight.shape == (48, 16)
        assert optimizer._views[id(attn.in_proj_weight)].parts == 3 and id(attn.out_proj.weight) in optimizer._plain
    if arch == "qwen2":  # Llama's layout with biased query, key and value projections
        attention = model.get_submodule("inner.model.layers.0.self_attn")
        assert all(getattr(attention, f"{n}_proj").bias is not None for n in "qkv") and attention.o_proj.bias is None
    if arch == "seq2seq":  # the decoder's cross-attention: a whitener per part (query, key, value) from the start
        cross = model.get_submodule("decoder.0.multihead_attn")
        assert optimizer._views[id(cross.in_proj_weight)].part_inputs
        assert not optimizer._views[id(model.get_submodule("decoder.0.self_attn").in_proj_weight)].part_inputs
    assert not any("embed" in n or "wte" in n or "wpe" in n or "lm_head" in n for n in names)
    chain = common.build_muon(model, 1e-2, 0.0, char_lm.SKIP_LAYERS)
    muon = [p for o in chain.optimizers if not isinstance(o, torch.optim.AdamW)
            for g in o.param_groups for p in g["params"]]
    assert {id(p) for p in muon} == {id(p) for p in optimizer.param_groups[0]["params"]}
    assert len(muon) == len(names)
    assert sum(len(g["params"]) for g in chain.param_groups) == len(list(model.parameters()))
    assert any(type(o).__name__ == "ExpertMuon" for o in chain.optimizers) == (arch == "mixtral")
    settings = [{k: g[k] for k in ("lr", "momentum", "weight_decay", "nesterov", "adjust_lr_fn", "ns_steps")}
                for o in chain.optimizers if not isinstance(o, torch.optim.AdamW) for g in o.param_groups]
    assert all(s == settings[0] for s in settings), settings  # the experts' Muon steps as the 2-D weights' does
    optimizer.remove()
    with pytest.raises(ValueError, match="arch"):
        char_lm.build_model(char_lm.ModelConfig(arch="rnn"))


def test_sweep_best_point_is_the_first_to_reach_the_target():
    """The sweep ranks a family's points by the step that first reaches the target (one
    family costs the same per step), final loss breaking ties and ranking points that never
    reach it; the AdamW reference is its lowest final loss, which defines the target."""
    convergence = load("benchmarks/convergence.py")
    _best_per_family, best_of, grid_edges = convergence._best_per_family, convergence.best_of, convergence.grid_edges
    RunResult = load("examples/char_lm.py").RunResult

    def run(name, lr, losses, seconds):
        return RunResult(name=f"{name} lr={lr:g}", lr=lr, eval_steps=list(range(len(losses))),
                         eval_losses=losses, eval_train_seconds=seconds, step_seconds=[1.0])

    results = [
        run("adamw", 1e-3, [3, 2.0, 1.5, 1.2], [0, 1, 2, 3]),
        run("adamw", 2e-3, [3, 1.8, 1.4, 1.0], [0, 1, 2, 3]),
        run("muon", 4e-3, [3, 0.9, 0.8, 0.7], [0, 1, 2, 3]),  # first to 1.0 (step 1)
        run("muon", 8e-3, [3, 1.1, 0.9, 0.5], [0, 1, 2, 3]),  # lowest final loss, step 2 to 1.0
        run("muon", 1.6e-2, [3, 2.5, 2.0, 1.9], [0, 1, 2, 3]),  # never reaches it
    ]
    assert best_of(results, "adamw").lr == 2e-3
    assert best_of(results, "muon", target=1.0).lr == 4e-3
    assert best_of(results, "muon", target=0.9).lr == 4e-3  # step 1 against step 2
    ties = [run("sgd", 0.1, [3, 0.9, 0.8], [0, 1.0, 2]), run("sgd", 0.2, [3, 0.9, 0.7], [0, 1.1, 2])]
    assert best_of(ties, "sgd", target=1.0).lr == 0.2  # both at step 1: the final loss decides
    assert best_of(results, "muon").lr == 8e-3
    assert [r.lr for r in _best_per_family(results, 1.0)] == [2e-3, 4e-3]
    assert grid_edges(results, 1.0) == {"adamw": "high edge", "muon": "low edge"}


def test_muon_adjust_lr_fn_and_rest_lr_reach_muon_and_whitened_muon():
    """``--muon-adjust-lr-fn original --muon-rest-lr``: torch's default scaling (lr on Muon's
    spectral scale) for Muon and WhitenedMuon alike, and the AdamW half at its own lr."""
    char_lm = load("examples/char_lm.py")
    common = load("examples/kron_examples_common.py")
    parser = char_lm.argparse.ArgumentParser()
    char_lm.add_training_args(parser)
    _, _, precond = char_lm.configs_from_args(parser.parse_args(
        ["--d-model", "16", "--n-heads", "2", "--muon-adjust-lr-fn", "original", "--muon-rest-lr", "3e-3"]))
    assert (precond.muon_adjust_lr_fn, precond.muon_rest_lr) == ("original", 3e-3)
    model = char_lm.build_model(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8))
    for method in ("muon", "wmuon"):
        optimizer, _ = common.build_method(method, model, 0.05, 0.0, precond)
        groups = [g for o in getattr(optimizer, "optimizers", [optimizer]) for g in o.param_groups]
        # torch's Muon groups and WhitenedMuon's whitened group carry adjust_lr_fn; AdamW's do not,
        # or (in WhitenedMuon) are marked algorithm="adamw"
        adamw = [g for g in groups if "adjust_lr_fn" not in g or g.get("algorithm") == "adamw"]
        hidden = [g for g in groups if all(g is not a for a in adamw)]
        assert hidden and all(g["adjust_lr_fn"] == "original" and g["lr"] == 0.05 for g in hidden), (method, hidden)
        assert adamw and all(g["lr"] == 3e-3 for g in adamw), (method, adamw)
        if hasattr(optimizer, "remove"):
            optimizer.remove()
    default = common.PrecondConfig()
    assert (default.muon_adjust_lr_fn, default.muon_rest_lr) == ("match_rms_adamw", None)


def test_muon_with_torchs_original_scaling_refuses_conv1d_weights():
    """``"original"`` scales by the stored shape, which GPT-2's ``Conv1D`` holds transposed:
    the Muon baseline refuses it there instead of scaling ``c_fc`` as its transpose."""
    pytest.importorskip("transformers", reason="transformers is an optional extra ([trainers])")
    char_lm = load("examples/char_lm.py")
    common = load("examples/kron_examples_common.py")
    model = char_lm.build_model(char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8, arch="gpt2"))
    config = common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, muon_adjust_lr_fn="original")
    with pytest.raises(ValueError, match="Conv1D"):
        common.build_method("muon", model, 0.05, 0.0, config)
    common.build_method("muon", model, 0.05, 0.0, common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS))


def test_the_encoder_decoder_predicts_each_byte_from_the_bytes_before_it_alone():
    """``--arch seq2seq`` reads a window's first half as the source and its second half as the
    target: changing byte ``j`` changes no logit before position ``j`` (the target's first byte
    included, which sees the whole source through cross-attention) and does change logits from
    ``j`` on. A leak would make its loss incomparable with the other architectures'."""
    import torch

    char_lm = load("examples/char_lm.py")
    torch.manual_seed(0)
    model = char_lm.build_model(char_lm.ModelConfig(d_model=16, n_layers=2, n_heads=4, seq_len=8, arch="seq2seq"))
    tokens = torch.randint(0, 256, (2, 8))
    base = model(tokens)
    for j in range(8):
        changed = tokens.clone()
        changed[:, j] = (changed[:, j] + 1) % 256
        logits = model(changed)
        assert torch.equal(logits[:, :j], base[:, :j]), j
        assert (logits[:, j:] - base[:, j:]).abs().amax() > 0, j
    with pytest.raises(ValueError, match="n_layers=3"):
        char_lm.build_model(char_lm.ModelConfig(d_model=16, n_layers=3, n_heads=4, seq_len=8, arch="seq2seq"))
