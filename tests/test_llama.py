"""The Llama-style family: sizes in closed form, grouped-query attention, rotary positions,
and scanned or rematerialised blocks computing exactly what unrolled ones do."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import ConfigError, apply_overrides, load_config, run_config, validate
from jaxkit.models import build_model, check_mesh_divides, contract
from jaxkit.models import llama_net as llama
from jaxkit.plan import costs
from jaxkit.plan.flops import param_count
from jaxkit.step.optimizer import decays
from jaxkit.step.train_step import abstract_params

TINY = [
    "model.d_model=32",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=48",
    "model.num_layers=3",
    "data.seq_len=16",
    "data.max_bytes=60000",
]

# Llama 3.1's rope_scaling, its original context shrunk to this test's rows.
LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# For the training runs whose claims hold at any depth: one block compiles in about a third
# of three's time (the blocks are unrolled: each is compiled apart).
ONE_BLOCK = "model.num_layers=1"


def tiny(*overrides):
    config = load_config("llama_tiny")
    apply_overrides(config, TINY + list(overrides))
    validate(config)
    return config


def model_of(config):
    with nnx.use_eager_sharding(False):
        return build_model(run_config(config), nnx.Rngs(0))


def pure(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def with_params(model, params):
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


def stacked(params, num_layers):
    """Unrolled params ({"blocks": {0: ..., 1: ...}}) in the scanned layout."""
    layers = [params["blocks"][i] for i in range(num_layers)]
    return {**params, "blocks": jax.tree.map(lambda *xs: jnp.stack(xs), *layers)}


def tokens(config, rows=2):
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.integers(0, config.model.vocab_size, (rows, config.data.seq_len)))


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("lm_125m", 120e6, 130e6), ("lm_350m", 340e6, 370e6), ("lm_1b", 1.0e9, 1.2e9)],
)
def test_each_size_has_the_params_its_name_says_in_closed_form(name, low, high):
    config = load_config(name)
    m = config.model
    D, F, V, L = m.d_model, m.mlp_dim, m.vocab_size, m.num_layers
    K = D // m.num_heads
    # Per block: q and o are D × D, k and v D × (kv heads · K); SwiGLU's three D × F; two
    # RMSNorm scales. Then the final norm, the table and (untied) the head.
    block = 2 * D * D + 2 * D * m.num_kv_heads * K + 3 * D * F + 2 * D
    expected = L * block + D + V * D * (1 if m.tie_embeddings else 2)
    typed = run_config(config)
    assert param_count(typed) == expected == sum(llama.parameter_count(typed.model).values())
    assert low < expected < high
    apply_overrides(config, [f"model.scan_layers={not m.scan_layers}"])
    assert param_count(run_config(config)) == expected  # the layer axis only regroups them


def test_lm_1b_compiles_from_shapes_and_its_model_flops_follow_palm():
    """Compile-only on 8 CPU devices, fsdp over all: nothing allocated or run."""
    config = load_config("lm_1b")
    split = costs.split_config(run_config(config), 1, 1)
    plan = plan_from_config(split, {"data": 1, "fsdp": 8, "tensor": 1})
    cost = costs.step_cost(split, plan, jax.devices())
    m, seq = config.model, config.data.seq_len
    # Per token: 6 × params in matmuls (all but the untied input table) + attention's
    # 12 · layers · d_model · seq_len; one row of seq tokens per device.
    K = m.d_model // m.num_heads
    per_layer = 2 * m.d_model**2 + 2 * m.d_model * m.num_kv_heads * K + 3 * m.d_model * m.mlp_dim
    matmul_params = m.num_layers * per_layer + m.d_model * m.vocab_size  # the untied head
    per_token = 6 * matmul_params + 12 * m.num_layers * m.d_model * seq
    assert cost.model_flops_per_step == pytest.approx(per_token * seq, rel=1e-12)
    # Full remat recomputes each block's forward matmuls: more executed than the model needs,
    # at most the 4/3 of recomputing every forward matmul.
    assert 1.1 < cost.hardware_flops_per_step / cost.model_flops_per_step < 4 / 3
    assert 0 < cost.memory_bytes < 16 * 2**30


def test_scanned_blocks_compute_what_unrolled_blocks_compute():
    unrolled = model_of(tiny())
    scanned = with_params(model_of(tiny("model.scan_layers=true")), stacked(pure(unrolled), 3))
    x = tokens(tiny())

    def loss(model):
        return jnp.mean(model(x) ** 2)

    # Each model's logits and gradient in one compiled program, not an op at a time.
    @nnx.jit
    def logits_and_grads(model):
        return model(x), nnx.grad(loss)(model)

    logits_scanned, grads_scanned = logits_and_grads(scanned)
    logits_unrolled, grads_unrolled = logits_and_grads(unrolled)
    np.testing.assert_allclose(logits_scanned, logits_unrolled, rtol=1e-5, atol=1e-6)
    g_unrolled = stacked(nnx.to_pure_dict(grads_unrolled), 3)
    g_scanned = nnx.to_pure_dict(grads_scanned)
    for a, b in zip(jax.tree.leaves(g_scanned), jax.tree.leaves(g_unrolled), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("scan", [False, True])
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_changes_memory_not_numbers(remat, scan):
    """Recomputation repeats the same operations on the same inputs: equal gradients."""
    base = model_of(tiny(f"model.scan_layers={scan}"))
    again = with_params(
        model_of(tiny(f"model.scan_layers={scan}", f"model.remat={remat}")), pure(base)
    )
    x = tokens(tiny())

    def loss(model):
        return jnp.mean(model(x) ** 2)

    # Each gradient in one compiled program, not an op at a time (where every rematerialised
    # block compiled apart).
    grad = nnx.jit(nnx.grad(loss))
    for a, b in zip(jax.tree.leaves(grad(again)), jax.tree.leaves(grad(base)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)


def test_grouped_query_attention_is_attention_with_shared_key_value_heads():
    """2 key/value heads for 4 query heads = 4 heads whose k and v kernels repeat in pairs."""
    grouped = model_of(tiny())
    full = model_of(tiny("model.num_kv_heads=4"))
    params, K = pure(grouped), 32 // 4
    for i in range(3):
        block = params["blocks"][i]
        for name in ("key", "value"):
            kernel_DxGK = block[name]["kernel"]
            heads = kernel_DxGK.reshape(32, 2, K)
            block[name]["kernel"] = jnp.repeat(heads, 2, axis=1).reshape(32, 4 * K)
    full = with_params(full, params)
    x = tokens(tiny())
    forward = nnx.jit(lambda model: model(x))  # one compiled program, not an op at a time
    np.testing.assert_allclose(forward(full), forward(grouped), rtol=1e-5, atol=1e-6)


def test_rotary_positions_make_attention_scores_depend_on_offsets_only():
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32) for _ in range(2))
    L = 12

    def at(x, pos):  # x placed at position `pos` of a sequence of L
        seq = jnp.zeros((1, L, 1, 8)).at[:, pos].set(x[:, 0])
        return llama.rotary(seq, 10000.0)[0, pos, 0]

    score = lambda i, j: float(at(q, i) @ at(k, j))  # noqa: E731
    assert score(5, 2) == pytest.approx(score(9, 6), rel=1e-5)
    assert score(5, 2) == pytest.approx(score(3, 0), rel=1e-5)
    assert abs(score(5, 2) - score(5, 4)) > 1e-3  # a different offset scores differently
    assert score(0, 0) == pytest.approx(float(q[0, 0, 0] @ k[0, 0, 0]), rel=1e-6)


def test_bfloat16_compute_keeps_float32_where_it_counts():
    config = tiny("model.compute_dtype=bfloat16", "model.scan_layers=true")
    model = model_of(config)
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(pure(model)))
    forward = nnx.jit(lambda model, x: model(x))  # compiled programs, not an op at a time
    logits = forward(model, tokens(config))
    assert logits.dtype == jnp.bfloat16
    # The same params in float32 compute: bf16 has an 8-bit significand, so each matmul
    # output carries a relative error up to 2^-8; through 3 blocks the logits stay within a
    # few percent of their scale.
    exact = forward(
        with_params(model_of(tiny("model.scan_layers=true")), pure(model)), tokens(config)
    )
    scale = float(jnp.max(jnp.abs(exact)))
    assert float(jnp.max(jnp.abs(logits.astype(jnp.float32) - exact))) < 0.05 * scale
    stored = abstract_params(run_config(tiny("model.param_dtype=bfloat16")))
    assert {leaf.dtype for leaf in jax.tree.leaves(stored)} == {jnp.dtype(jnp.bfloat16)}


def test_weight_decay_skips_stacked_vectors():
    unrolled = abstract_params(run_config(tiny()))
    scanned = abstract_params(run_config(tiny("model.scan_layers=true")))
    mask_unrolled, mask_scanned = decays(False)(unrolled), decays(True)(scanned)
    assert mask_scanned["blocks"]["attn_norm"]["scale"] is False
    assert mask_scanned["blocks"]["query"]["kernel"] is True
    assert mask_scanned["blocks"] == mask_unrolled["blocks"][0]
    assert mask_scanned["final_norm"]["scale"] is False
    assert mask_scanned["embed"]["embedding"] is True
    # Without the layer axis taken off, a stacked norm scale would read as a matrix.
    assert decays(False)(scanned)["blocks"]["attn_norm"]["scale"] is True


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.num_kv_heads=3"], "model.num_heads=4 is not divisible by model.num_kv_heads=3"),
        (["model.d_model=36", "model.num_heads=4", "model.num_kv_heads=4"], "rotary"),
        (["model.remat=some"], "model.remat='some': must be one of none, full, dots"),
        (["model.compute_dtype=float16"], "must be one of float32, bfloat16"),
        (["model.scan_layers=1"], "model.scan_layers='1': expected bool"),
        (["model.head_dim=7"], "model.head_dim=7 is odd: rotary positions rotate pairs"),
        (["model.norm_eps=0"], "model.norm_eps=0.0: must be > 0"),
        (['model.rope_scaling={"factor": 8.0}'], "model.rope_scaling=.*must be null or a dict"),
        # {} leaves no dotted key behind: it once passed as null and failed at the first use.
        (["model.rope_scaling={}"], r"model.rope_scaling=\{\}: must be null or a dict of"),
        ([f"model.rope_scaling={json.dumps({**LLAMA3, 'factor': 0.5})}"], "must give factor ≥ 1"),
        (['model.rope_scaling={"factor": 8'], "model.rope_scaling='{.*' is not valid JSON"),
        (['model.d_model={"a": 1}'], "model.d_model=.*: expected int, got a JSON object"),
    ],
)
def test_bad_llama_values_name_their_key(overrides, message):
    config = load_config("llama_tiny")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        apply_overrides(config, TINY + overrides)
        validate(config)


def test_the_checkpoint_keys_default_to_what_runs_before_them_ran_as():
    from jaxkit.config import ADDED_DEFAULTS
    from jaxkit.train.checkpoint import config_conflicts

    # flax's own RMSNorm epsilon, which every Llama before model.norm_eps used.
    assert nnx.RMSNorm(4, rngs=nnx.Rngs(0)).epsilon == ADDED_DEFAULTS["model.norm_eps"]
    assert ADDED_DEFAULTS["model.head_dim"] is None is ADDED_DEFAULTS["model.rope_scaling"]
    current = tiny()
    older = current.to_dict()
    for key in ("norm_eps", "head_dim", "rope_scaling"):
        del older["model"][key]
    assert config_conflicts(older, current.to_dict()) == []
    # A config saved before them builds the same model: same params, same logits, bit for bit.
    new_model, old_model = model_of(current), model_of(ml_collections.ConfigDict(older))
    assert jax.tree.all(jax.tree.map(np.array_equal, pure(new_model), pure(old_model)))
    forward = nnx.jit(lambda model, x: model(x))  # one compiled program, not an op at a time
    np.testing.assert_array_equal(
        forward(new_model, tokens(current)), forward(old_model, tokens(current))
    )


@pytest.mark.parametrize("in_file", [True, False])
def test_rope_scaling_is_set_on_the_command_line_as_json_and_back_to_null(in_file):
    config = tiny()
    if not in_file:  # a config file that leaves it out: the kind declares it
        del config.model["rope_scaling"]
    apply_overrides(config, [f"model.rope_scaling={json.dumps(LLAMA3)}"])
    assert config.model.rope_scaling.to_dict() == LLAMA3
    apply_overrides(config, ["model.rope_scaling.factor=16.0"])
    assert config.model.rope_scaling.factor == 16.0
    apply_overrides(config, ["model.rope_scaling=null"])
    assert config.model.rope_scaling is None
    validate(config)


def test_head_dim_sets_the_head_width_apart_from_d_model_and_the_sizes_follow():
    # d_model 36 does not divide over 4 heads: with head_dim set it need not.
    config = tiny("model.d_model=36", "model.head_dim=10")
    typed = run_config(config)
    with nnx.use_eager_sharding(False):  # shapes only: nothing initialised or run
        model = nnx.eval_shape(lambda: build_model(typed, nnx.Rngs(0)))
    params = pure(model)
    block = params["blocks"][0]
    assert block["query"]["kernel"].shape == (36, 4 * 10)
    assert block["key"]["kernel"].shape == block["value"]["kernel"].shape == (36, 2 * 10)
    assert block["attn_out"]["kernel"].shape == (4 * 10, 36)
    built = sum(leaf.size for leaf in jax.tree.leaves(params))
    assert param_count(typed) == built == sum(llama.parameter_count(typed.model).values())
    # Attention's FLOPs (PaLM's 12 × layers × width × seq_len per token) use heads × head_dim.
    kernels = sum(
        x.size
        for path, x in jax.tree_util.tree_leaves_with_path(params)
        if path[-1].key == "kernel"
    )
    seq, layers = config.data.seq_len, config.model.num_layers
    assert (
        contract(typed).flops_per_example(typed, kernels)
        == (6 * kernels + 12 * layers * 40 * seq) * seq
    )
    logits = nnx.eval_shape(lambda m, x: m(x), model, tokens(config))
    assert logits.shape == (2, seq, config.model.vocab_size)


def test_key_value_heads_must_split_over_the_tensor_axis():
    message = r"model.num_kv_heads=2 is not divisible by mesh.tensor=4"
    with pytest.raises(ConfigError, match=message):
        check_mesh_divides(
            run_config(tiny("model.num_heads=8")), {"data": 2, "fsdp": 1, "tensor": 4}
        )


def _run(config, workdir, **kw):
    """Trains on one device: the resume is under test, not the mesh (no collectives to
    compile)."""
    from jaxkit.train.loop import train

    return train(
        config, workdir, devices=jax.devices()[:1], progress=False, echo=lambda *a: None, **kw
    )


def test_remat_may_change_at_a_resume_scan_layers_may_not(tmp_path):
    from jaxkit.train.checkpoint import CheckpointError

    steps = [
        *("train.steps=4", "train.log_every=1", "checkpoint.every=2", "optimizer.warmup_steps=1"),
        # Two micro-batches of 4 rows a step; 8 held-out rows in the end-of-run eval.
        *("batch.global_batch_size=8", "batch.per_device_batch_size=4", "train.eval_examples=8"),
        ONE_BLOCK,
    ]
    whole = _run(tiny(*steps, "checkpoint.every=0"), tmp_path / "whole")  # the reference
    _run(tiny(*steps), tmp_path / "cut", stop_after_micro_steps=4)  # two optimizer steps
    with pytest.raises(
        CheckpointError,
        match=r"(?s)model.scan_layers: False \(saved\) -> True.*"
        "does not load into the other",
    ):
        _run(tiny(*steps, "model.scan_layers=true"), tmp_path / "cut")
    # Recomputing activations trains the same model: the resumed run ends where the
    # uninterrupted one did.
    resumed = _run(tiny(*steps, "model.remat=full"), tmp_path / "cut")
    assert int(resumed.state.step) == 4
    records = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").open()]
    changes = [r for r in records if r.get("event") == "remat_change"]
    assert changes == [
        {
            "event": "remat_change",
            "step": 2,
            "examples_seen": 2 * 8,  # two steps of the global batch
            "from_remat": "none",
            "to_remat": "full",
        }
    ]
    for a, b in zip(
        jax.tree.leaves(resumed.state.params), jax.tree.leaves(whole.state.params), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_run_saved_before_the_precision_keys_resumes_with_their_defaults():
    from jaxkit.train.checkpoint import config_conflicts

    current = tiny().to_dict()
    older = tiny().to_dict()
    for key in ("param_dtype", "compute_dtype", "remat", "scan_layers"):
        del older["model"][key]
    assert config_conflicts(older, current) == []
    changed = tiny("model.compute_dtype=bfloat16").to_dict()
    assert config_conflicts(older, changed) == [
        "  model.compute_dtype: 'float32' (saved) -> 'bfloat16'"
    ]


def _llama_splits(monkeypatch, splits, overrides):
    import test_equivalence

    monkeypatch.setitem(test_equivalence.SMALL, "llama_tiny", TINY)
    return test_equivalence.run_splits("llama_tiny", splits, overrides)


def test_llama_splits_match_a_full_batch_reference_in_float32(monkeypatch):
    """The central promise on the new family, with remat on: the tolerances of
    test_equivalence (float32 round-off of sums in another order), with its allowance for
    the few elements Adam turns round-off into steps for (te.assert_adam_params_match)."""
    import test_equivalence as te

    overrides = ["model.remat=dots", ONE_BLOCK]
    runs = _llama_splits(monkeypatch, [(4, 8, 1), (1, 8, 4)], overrides)
    ref_losses, ref_norms, trajectory = te.reference_for("llama_tiny", overrides)
    config = te.small_config("llama_tiny", 1, 32)
    for split, (losses, norms, params) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=te.LOSS_RTOL, err_msg=str(split))
        np.testing.assert_allclose(norms, ref_norms, rtol=te.GRAD_NORM_RTOL, err_msg=str(split))
        te.assert_adam_params_match(params, trajectory[-1], config, str(split))


# bfloat16 has an 8-bit significand: unit round-off u = 2^-9. Splits round matmul outputs
# and partial gradient sums at other places (other batch shapes, other groupings), so:
# - a loss (a mean of float32 log-sum-exps of bf16 logits) differs by about one rounding
#   of its scale: rtol u (measured: 2.4e-5 over five steps, an 80x margin);
# - a gradient sums bf16 products over rows grouped per device and per micro-step, each
#   group rounded: its norm moves by a few u, rtol 4u (measured 9.7e-4, an 8x margin); a
#   sum instead of a mean is off by K - 1 = 100% or more;
# - Adam moves each param by at most about lr per step whatever the gradient's size, so
#   a param whose gradient is round-off-sized may go either way: atol = the sum of the
#   rates of the steps (8.4e-3 here; measured 3.0e-3).
BF16_U = 2.0**-9


def test_bfloat16_splits_agree_within_its_round_off(monkeypatch):
    import optax

    steps = 5  # test_equivalence's run: warmup 2, cosine to 0.1 × peak over 5 steps
    overrides = ["model.compute_dtype=bfloat16", "model.scan_layers=true"]
    # One device against four, with K = 1 and K = 2: the two 4-device splits share their
    # init and eval programs (a 2-device split would compile both again).
    runs = _llama_splits(monkeypatch, [(1, 32, 1), (4, 8, 1), (4, 4, 2)], overrides)
    peak = load_config("llama_tiny").optimizer.learning_rate
    rates = optax.warmup_cosine_decay_schedule(peak / 2, peak, 2, steps, peak * 0.1)
    param_atol = sum(float(rates(i)) for i in range(steps))
    ref_losses, ref_norms, ref_params = runs[(1, 32, 1)]
    for split in [(4, 8, 1), (4, 4, 2)]:
        losses, norms, params = runs[split]
        np.testing.assert_allclose(losses, ref_losses, rtol=BF16_U, err_msg=str(split))
        np.testing.assert_allclose(norms, ref_norms, rtol=4 * BF16_U, err_msg=str(split))
        worst = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params), strict=True)
        )
        assert worst < param_atol, (split, worst, param_atol)


@pytest.mark.parametrize("accumulation", ["multisteps", "fused"])
def test_bfloat16_params_keep_a_float32_accumulator_and_optimizer_state(accumulation):
    from jaxkit.train.loop import train

    config = tiny(
        "model.param_dtype=bfloat16",
        "model.compute_dtype=bfloat16",
        f"train.accumulation={accumulation}",
        # Two micro-batches of 2 rows a step on one device (the dtypes are under test, not
        # the mesh), 8 held-out rows in the end-of-run eval.
        "batch.global_batch_size=4",
        "batch.per_device_batch_size=2",
        "train.eval_examples=8",
        "train.steps=2",
        "train.log_every=1",
        ONE_BLOCK,
    )
    result = train(config, devices=jax.devices()[:1], progress=False, echo=lambda *a: None)
    state = result.state
    assert {p.dtype for p in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
    floats = [x for x in jax.tree.leaves(state.opt_state) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
    losses = [r["loss"] for r in result.records if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
