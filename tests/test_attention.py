"""Attention kernels (model.attention): splash in Pallas's interpreter against xla, sharded
and inside both networks; the choice per backend and its refusals; splash compiled for a
TPU target; the kernel that ran in the plan, the summary and at a resume.

cuDNN's kernel needs an NVIDIA GPU, so nothing here runs it (benchmarks/gpu_lm125m.py
--attention cudnn does).
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_run import jaxkit
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxkit import mesh as mesh_lib
from jaxkit.config import ConfigError, apply_overrides, load_config, run_config
from jaxkit.models import attention, build_model

# Splash's blocks are 128 positions: the shortest row it takes.
B, L, H, G, K = 2, 128, 4, 2, 16


def qkv_and_segments():
    keys = jax.random.split(jax.random.key(0), 3)
    q_BxLxHxK = jax.random.normal(keys[0], (B, L, H, K))
    k_BxLxGxK = jax.random.normal(keys[1], (B, L, G, K))
    v_BxLxGxK = jax.random.normal(keys[2], (B, L, G, K))
    # Three documents in row 0, two in row 1, cut off block boundaries (packed windows).
    ends = [(0, 50, 90), (0, 77)]
    segment_ids_BxL = np.zeros((B, L), np.int32)
    for row, starts in enumerate(ends):
        for doc, start in enumerate(starts):
            segment_ids_BxL[row, start:] = doc
    return q_BxLxHxK, k_BxLxGxK, v_BxLxGxK, jnp.asarray(segment_ids_BxL)


def xla(q, k, v, segment_ids):
    return attention.attend(q, k, v, segment_ids, "xla")


splash = functools.partial(attention.splash_attention, interpret=True)


def value_and_grads_fn(fn):
    """(q, k, v, segment ids, w) -> the output, and the gradients of Σ w × output."""

    def loss(q, k, v, segment_ids, w):
        return jnp.sum(w * fn(q, k, v, segment_ids))

    def both(q, k, v, segment_ids, w):
        return fn(q, k, v, segment_ids), jax.grad(loss, (0, 1, 2))(q, k, v, segment_ids, w)

    return both


def output_weights():
    """Every output weighs differently in the loss, so every gradient entry is tested."""
    return jax.random.normal(jax.random.key(1), (B, L, H, K))


def value_and_grads(fn, q, k, v, segment_ids):
    return jax.jit(value_and_grads_fn(fn))(q, k, v, segment_ids, output_weights())


def assert_close(got, want):
    # float32 throughout. Splash sums a row's keys block by block with a running maximum and
    # rescales (online softmax); xla takes one maximum and one sum. The orders differ by
    # float32 round-off, about eps (1.2e-7) × √(terms) of the largest entry for sums of up
    # to 256 terms (dk and dv sum 2 query heads × 128 queries): ~2e-6. Measured: at most
    # 4.6e-7 of each array's largest entry. 4e-6 still fails on any real error (a query
    # attending across a document or to the future moves outputs by more than 0.1).
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(jnp.max(jnp.abs(w)))
        assert float(jnp.max(jnp.abs(g - w))) <= 4e-6 * scale


@pytest.mark.parametrize("segments", [False, True], ids=["one document", "packed documents"])
def test_splash_computes_causal_grouped_query_attention_as_xla_does(segments):
    q, k, v, segment_ids = qkv_and_segments()
    segment_ids = segment_ids if segments else None
    want = value_and_grads(xla, q, k, v, segment_ids)
    assert_close(value_and_grads(splash, q, k, v, segment_ids), want)
    if segments:  # the documents matter: attention across them gives other numbers
        across = value_and_grads(xla, q, k, v, None)
        assert float(jnp.max(jnp.abs(across[0] - want[0]))) > 0.1


def test_splash_runs_on_each_devices_rows_and_heads():
    """On a data × tensor mesh, one kernel per device on its rows and heads: the same
    numbers, and no collective moves q, k, v or their gradients."""
    q, k, v, segment_ids = qkv_and_segments()
    mesh = mesh_lib.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    heads = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
    rows = NamedSharding(mesh, P(("data", "fsdp"), None))
    fn = value_and_grads_fn(splash)

    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)

    step = jax.jit(traced, in_shardings=(heads, heads, heads, rows, heads))
    args = (q, k, v, segment_ids, output_weights())
    text = step.lower(*args).compile().as_text()
    assert not any(op in text for op in ("all-gather", "all-to-all", "all-reduce"))
    assert_close(step(*args), value_and_grads(xla, q, k, v, segment_ids))


# Both families at the smallest size splash takes: rows of 128, 4 heads of 8 (Llama: 2
# key/value heads), one block.
NETWORKS = {
    "llama": ("llama_tiny", ["model.num_kv_heads=2", "model.mlp_dim=48"]),
    "transformer": ("lm_tiny", ["model.mlp_dim=64"]),
}


def network(kind, *overrides):
    name, own = NETWORKS[kind]
    config = load_config(name)
    shape = ["model.d_model=32", "model.num_heads=4", "model.num_layers=1", "data.seq_len=128"]
    apply_overrides(config, [*own, *shape, *overrides])
    return config


@pytest.mark.parametrize("kind", list(NETWORKS))
def test_each_network_runs_splash_on_packed_documents_as_xla(kind, monkeypatch):
    """The networks hand segment ids and their kernel to attention: logits and gradients of
    both LMs with splash (interpreted) are xla's, documents and (Llama) shared heads kept."""
    calls = []
    monkeypatch.setattr(attention, "splash_attention", lambda *a: calls.append(1) or splash(*a))
    tokens = jax.random.randint(jax.random.key(2), (B, L), 0, 256)
    _, _, _, segment_ids = qkv_and_segments()
    # Positions restart at each document, as the token files' loader gives them.
    starts = np.maximum.accumulate(
        np.where(np.diff(np.asarray(segment_ids), prepend=-1) != 0, np.arange(L), 0), axis=1
    )
    positions = jnp.asarray(np.arange(L) - starts)

    def logits_and_grads(kernel):
        with nnx.use_eager_sharding(False):
            model = build_model(run_config(network(kind, f"model.attention={kernel}")), nnx.Rngs(0))
        graphdef, params = nnx.split(model)

        def loss(params):
            logits = nnx.merge(graphdef, params)(tokens, segment_ids, positions)
            return jnp.mean(jnp.sin(logits)), logits

        return jax.jit(jax.grad(loss, has_aux=True))(params)

    want = logits_and_grads("xla")
    assert not calls
    assert_close(logits_and_grads("splash"), want)
    assert calls  # traced once per block


@pytest.mark.parametrize(
    "backend,dtype,seq_len,fused,kernel",
    [
        ("tpu", "bfloat16", 1024, False, "splash"),
        ("tpu", "float32", 128, False, "splash"),
        ("tpu", "bfloat16", 100, False, "xla"),  # not whole blocks of 128
        ("tpu", "bfloat16", 1024, True, "xla"),  # the fused step (see choose)
        ("nvidia", "bfloat16", 1024, False, "cudnn"),
        ("nvidia", "bfloat16", 100, True, "cudnn"),
        ("nvidia", "float32", 1024, False, "xla"),  # cuDNN takes no float32
        ("gpu", "bfloat16", 1024, False, "xla"),  # a ROCm GPU
        ("cpu", "bfloat16", 1024, False, "xla"),
    ],
)
def test_auto_picks_per_backend_and_dtype(backend, dtype, seq_len, fused, kernel):
    assert attention.auto_kernel(backend, dtype, seq_len, fused) == kernel
    chosen = attention.choose(
        "auto", backend=backend, compute_dtype=dtype, seq_len=seq_len, document_mask=False,
        fused=fused,
    )  # fmt: skip
    assert chosen == (kernel, None)


def test_the_backend_of_live_and_described_devices():
    from jaxkit.plan.targets import parse_target, target_devices

    assert attention.backend_of(jax.devices()[0]) == "cpu"
    assert attention.backend_of(target_devices(parse_target("v5litepod-8"))[0]) == "tpu"


@pytest.mark.parametrize(
    "choice,backend,dtype,seq_len,fused,words",
    [
        ("splash", "cpu", "float32", 128, False, "a TPU kernel .* on cpu devices: use "
         "model.attention=auto \\(xla here\\) or xla$"),
        ("splash", "nvidia", "bfloat16", 128, False, "on nvidia devices: use "
         "model.attention=auto \\(cudnn here\\) or xla, cudnn$"),
        ("splash", "tpu", "bfloat16", 1000, False, "data.seq_len a multiple of 128 .* not "
         "1000: use model.attention=auto \\(xla here\\) or xla, or a data.seq_len of 896 or "
         "1024$"),
        ("splash", "tpu", "bfloat16", 1024, True, "does not run in the fused step .* or "
         "train.accumulation=multisteps$"),
        ("cudnn", "tpu", "bfloat16", 1024, False, "for NVIDIA GPUs .* on tpu devices: use "
         "model.attention=auto \\(splash here\\) or xla, splash$"),
        ("cudnn", "cpu", "bfloat16", 1024, False, "on cpu devices: use model.attention=auto "
         "\\(xla here\\) or xla$"),
        ("cudnn", "nvidia", "float32", 1024, False, "needs model.compute_dtype='bfloat16' .* "
         "or set model.compute_dtype=bfloat16$"),
    ],
)  # fmt: skip
def test_a_kernel_the_backend_cannot_run_is_refused_naming_the_alternatives(
    choice, backend, dtype, seq_len, fused, words
):
    with pytest.raises(ConfigError, match=f"^model.attention='{choice}' .*{words}") as err:
        attention.choose(
            choice, backend=backend, compute_dtype=dtype, seq_len=seq_len, document_mask=False,
            fused=fused,
        )  # fmt: skip
    assert "\n" not in str(err.value)


def test_cudnn_with_packed_documents_falls_back_to_xla_with_one_warning():
    for choice in ("auto", "cudnn"):
        kernel, warning = attention.choose(
            choice, backend="nvidia", compute_dtype="bfloat16", seq_len=1024, document_mask=True
        )
        assert kernel == "xla"
        assert warning.startswith("warning: ") and "document" in warning and "\n" not in warning
    # splash takes the documents as segment ids: no fallback.
    assert attention.choose(
        "splash", backend="tpu", compute_dtype="bfloat16", seq_len=1024, document_mask=True
    ) == ("splash", None)


def test_plan_names_the_kernel_and_refuses_one_the_devices_cannot_run():
    out = jaxkit("plan", "llama_tiny", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model"]["attention"] == "xla"  # auto on CPU
    # lm_tiny's rows are 128 long: a v5e slice runs splash, but not in the fused step.
    for extra, kernel in (([], "splash"), (["train.accumulation=fused"], "xla")):
        out = jaxkit("plan", "lm_tiny", *extra, "--target", "v5litepod-8", "--json")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["model"]["attention"] == kernel
    text = jaxkit("plan", "lm_tiny", "--target", "v5litepod-8")
    assert "attention splash" in text.stdout
    out = jaxkit("plan", "llama_tiny", "model.attention=splash")
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.splitlines() == [
        "jaxkit: error: model.attention='splash' is a TPU kernel (Pallas splash attention) and "
        "this run is on cpu devices: use model.attention=auto (xla here) or xla"
    ]


def test_splash_compiles_for_a_tpu_and_holds_no_attention_probabilities():
    """Compile only, for a v5litepod-8 from this CPU machine: the kit's step runs the Pallas
    kernel, and holds less than the (rows × heads × L × L) float32 probabilities that xla
    keeps for the backward pass (measured: 7.1 MiB of temporaries per chip, against
    34.7 MiB with model.attention=xla)."""
    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.plan import costs
    from jaxkit.plan.targets import parse_target, target_devices
    from jaxkit.step.train_step import build

    config = costs.split_config(run_config(network("llama", "data.seq_len=512")), 4, 1)  # auto
    plan = plan_from_config(config, {"data": 8, "fsdp": 1, "tensor": 1})
    mesh = mesh_lib.make_mesh(
        dataclasses.asdict(config.mesh), target_devices(parse_target("v5litepod-8"))
    )
    compiled, cost = costs.compile_setup_step(config, plan, build(config, plan, mesh))
    assert "tpu_custom_call" in compiled.as_text()
    probabilities = 4 * 4 * 512 * 512 * 4  # one layer's: 16 MiB per chip
    assert cost.temp_bytes < probabilities


def test_a_resume_may_change_the_kernel_and_logs_it(tmp_path, monkeypatch):
    """A run on splash (the devices taken for a TPU's) resumed where auto picks xla: the change
    is an event in the log, and summary.json names the kernel that ran. The bookkeeping is
    the claim here; xla stands in for the kernel itself, whose numbers the tests above check
    (interpreted, its train step took 12 s to compile)."""
    from jaxkit.train.loop import train

    def run(*overrides, **kw):
        # One row on one device: one step program, and no noise-scale one (it takes a row
        # of a larger batch).
        config = network("llama", "batch.global_batch_size=1", "batch.per_device_batch_size=1")
        apply_overrides(config, ["train.steps=2", "checkpoint.every=1", "train.log_every=1"])
        apply_overrides(config, ["train.eval_examples=1", *overrides])
        return train(config, tmp_path, devices=jax.devices()[:1], progress=False, echo=print, **kw)

    with monkeypatch.context() as tpu:
        tpu.setattr(attention, "backend_of", lambda device: "tpu")
        tpu.setattr(attention, "splash_attention", xla)
        first = run("model.attention=splash", stop_after_micro_steps=1)
    assert first.stopped
    assert json.loads((tmp_path / "config.json").read_text())["model"]["attention"] == "splash"
    resumed = run()  # model.attention=auto: xla on CPU
    assert int(resumed.state.step) == 2 and resumed.summary["attention"] == "xla"
    assert json.loads((tmp_path / "summary.json").read_text())["attention"] == "xla"
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").open()]
    assert [r for r in records if r.get("event") == "attention_change"] == [
        {
            "event": "attention_change",
            "step": 1,
            "examples_seen": 1,
            "from_attention": "splash",
            "to_attention": "xla",
        }
    ]
