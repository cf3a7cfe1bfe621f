"""The examples' cheap-curvature wiring: the ``ikfac_muon`` / ``muon2`` / ``ikfac_muon2`` methods of the
examples and the interpolated crossing of a target (``RunResult.first_reaching``)."""
from __future__ import annotations

import pytest

from example_modules import load


@pytest.fixture(scope="module")
def examples():
    return load("examples/char_lm.py"), load("examples/kron_examples_common.py")


def test_first_reaching_interpolates_between_evaluations(examples):
    char_lm, _ = examples
    run = char_lm.RunResult("r", 1e-3, eval_steps=[0, 10, 20, 30], eval_losses=[3.0, 2.0, 1.0, 0.5],
                            eval_train_seconds=[0.0, 4.0, 8.0, 14.0])
    # 1.5 lies halfway between the evaluations at steps 10 (2.0) and 20 (1.0)
    assert run.first_reaching(1.5) == pytest.approx((15.0, 6.0))
    # 0.6 lies 4/5 of the way from step 20 (1.0) to step 30 (0.5)
    assert run.first_reaching(0.6) == pytest.approx((28.0, 12.8))
    assert run.first_reaching(2.0) == pytest.approx((10.0, 4.0))  # an evaluation exactly on it
    assert run.first_reaching(3.5) == pytest.approx((0.0, 0.0))
    assert run.first_reaching(0.4) is None
    # a bump: the first crossing counts, interpolated from the evaluation just before it
    bumpy = char_lm.RunResult("b", 1e-3, eval_steps=[0, 5, 10, 15], eval_losses=[2.0, 0.9, 1.2, 0.8],
                              eval_train_seconds=[0.0, 1.0, 2.0, 3.0])
    assert bumpy.first_reaching(1.0) == pytest.approx((0 + 5 * (1.0 / 1.1), 1.0 / 1.1))


def test_cheap_curvature_methods_build_what_they_name(examples):
    char_lm, common = examples
    model_config = char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8)
    config = common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, ikfac_every=7, ikfac_damping=0.3,
                                  ikfac_statistics_rows=5, moment_decay=0.8)
    hidden = {"blocks.0.attn.q_proj", "blocks.0.attn.k_proj", "blocks.0.attn.v_proj",
              "blocks.0.attn.out_proj", "blocks.0.mlp.0", "blocks.0.mlp.2"}
    for method, precond_method, moment in (("ikfac_muon", "ikfac", None), ("ikfac_muon2", "ikfac", 0.8),
                                           ("muon2", "second_moment", 0.8)):
        model = char_lm.CharTransformer(model_config)
        chain, precond = common.build_method(method, model, 8e-3, 0.0, config)
        assert precond.method == precond_method
        assert set(precond.layers) == hidden  # lm_head and embeddings are left alone
        assert precond._spec.settings["moment_decay"] == moment
        if precond_method == "ikfac":
            s = precond._spec.settings
            assert (s["factor_update_steps"], s["inv_update_steps"], s["damping"], s["statistics_rows"]) == \
                (7, 7, 0.3, 5)
        muon_params = {id(p) for g in chain.optimizers[0].param_groups for p in g["params"]}
        assert muon_params == {id(m.weight) for n, m in model.named_modules() if n in hidden}
        precond.remove()


def test_char_lm_flags_reach_the_config(examples):
    char_lm, _ = examples
    args = char_lm.parse_args(["--ikfac-every", "16", "--ikfac-damping", "0.1", "--ikfac-decay", "0.9",
                               "--ikfac-rows", "1024", "--moment-decay", "0.99"])
    _, _, precond = char_lm.configs_from_args(args)
    assert (precond.ikfac_every, precond.ikfac_damping, precond.ikfac_factor_decay,
            precond.ikfac_statistics_rows, precond.moment_decay) == (16, 0.1, 0.9, 1024, 0.99)


def test_precond_until_hands_the_last_steps_to_the_base_optimizer(examples):
    """``precond_until=0.5`` of 6 steps: the preconditioner steps 3 times, then is removed
    (hooks included), and the run goes on with the base optimizer alone."""
    import torch

    char_lm, common = examples
    model_config = char_lm.ModelConfig(d_model=16, n_layers=1, n_heads=2, seq_len=8)
    config = common.PrecondConfig(skip_layers=char_lm.SKIP_LAYERS, factor_update_steps=1, inv_update_steps=1,
                                  kfac_grafting=True, precond_until=0.5)
    kept = {}

    def build(model, scaler):
        optimizer, precond = common.build_method("kfac_muon", model, 8e-3, 0.0, config)
        kept["precond"], kept["model"] = precond, model
        return optimizer, precond

    contender = char_lm.Contender("kfac_muon", 8e-3, build, precond_until=config.precond_until)
    train = char_lm.TrainConfig(steps=6, batch_size=4, warmup_steps=1, eval_every=3, eval_seqs=4)
    corpus = char_lm.ByteCorpus(torch.randint(0, 256, (4096,), dtype=torch.uint8), model_config.seq_len)
    ctx = common.DistContext(0, 1, torch.device("cpu"))
    result, = char_lm.train_round_robin([contender], model_config, train, ctx, corpus=corpus, progress=False)
    precond = kept["precond"]
    assert precond.steps == 3
    assert all(layer.method.grafting for layer in precond.layers.values())
    for name, module in kept["model"].named_modules():  # removed: no hook of the library left
        assert not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks), name
    assert len(result.step_seconds) == 6 and result.eval_steps == [0, 3, 6]
    assert result.state_bytes["preconditioner"] > 0, "the removed preconditioner's memory is still reported"
    # the full-length default keeps it to the end
    assert char_lm.method_contender("kfac_muon", 8e-3, 0.0, common.PrecondConfig()).precond_until == 1.0
