import json

import jax
import numpy as np
import pytest
from cli_run import jaxkit
from jax.sharding import PartitionSpec as P
from small_configs import SMALL_LM

from jaxkit import mesh as mesh_lib
from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.mesh import MeshError, make_mesh, mesh_shape, resolve_mesh_shape
from jaxkit.step.train_step import build


@pytest.mark.parametrize(
    "sizes,devices,expected",
    [
        ({"data": -1, "fsdp": 1, "tensor": 1}, 8, (8, 1, 1)),
        ({"data": 2, "fsdp": -1, "tensor": 2}, 8, (2, 2, 2)),
        ({"data": 1, "fsdp": 4, "tensor": -1}, 8, (1, 4, 2)),
        ({"data": 2, "fsdp": 2, "tensor": 2}, 8, (2, 2, 2)),
    ],
)
def test_one_axis_fills_the_devices(sizes, devices, expected):
    assert tuple(resolve_mesh_shape(sizes, devices).values()) == expected


@pytest.mark.parametrize(
    "sizes,match",
    [
        ({"data": 3, "fsdp": 1, "tensor": 1}, "= 3 devices, but 8 are available"),
        ({"data": -1, "fsdp": 3, "tensor": 1}, "multiply to 3, which does not divide the 8"),
        ({"data": -1, "fsdp": -1, "tensor": 1}, "at most one may be -1"),
        ({"data": 0, "fsdp": 1, "tensor": 1}, "mesh.data=0"),
    ],
)
def test_mismatched_mesh_is_a_clear_error(sizes, match):
    with pytest.raises(MeshError, match=match):
        resolve_mesh_shape(sizes, 8)


@pytest.mark.parametrize(
    "sizes,expected",
    [
        # The sizes are a slice's (-1: the rest of a slice); the slices multiply data, fsdp.
        ({"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 2}, (8, 1, 1)),
        ({"data": 2, "fsdp": -1, "tensor": 1, "dcn_data": 1, "dcn_fsdp": 2}, (2, 4, 1)),
        ({"data": 1, "fsdp": 1, "tensor": -1, "dcn_data": 2, "dcn_fsdp": 2}, (2, 2, 2)),
        ({"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 1, "dcn_fsdp": 1}, (8, 1, 1)),
    ],
)
def test_slices_multiply_the_batch_axes_of_a_slice(sizes, expected):
    assert tuple(resolve_mesh_shape(sizes, 8).values()) == expected


@pytest.mark.parametrize(
    "sizes,match",
    [
        ({"dcn_data": 3}, "= 3 slices do not divide the 8 devices; the slices must be one of "),
        ({"data": 3, "dcn_data": 2}, "= 3 devices, but each of the 2 slices has 4; set one axis"),
        ({"data": -1, "fsdp": 3, "dcn_fsdp": 2}, "does not divide the 4 devices of a slice"),
        ({"dcn_fsdp": 0}, "mesh.dcn_fsdp=0: each is a number of slices"),
    ],
)
def test_sizes_that_do_not_fit_the_slices_are_one_line(sizes, match):
    with pytest.raises(MeshError, match=match):
        resolve_mesh_shape({"data": -1, "fsdp": 1, "tensor": 1, **sizes}, 8)


def test_processes_are_the_slices_on_cpu():
    """This process's 8 CPU devices are one slice: two slices need two processes
    (tests/test_multiprocess.py runs them)."""
    assert [len(s) for s in mesh_lib.device_slices(jax.devices())] == [8]
    with pytest.raises(MeshError) as refused:
        make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 2})
    assert str(refused.value) == (
        "mesh.dcn_data × mesh.dcn_fsdp = 2 × 1 = 2 slices, but the 8 cpu devices are one "
        "process, each process a slice (as on CPU): give mesh.dcn_data=1 and mesh.dcn_fsdp=1"
    )


@pytest.fixture(scope="module")
def two_v5e_slices():
    """Two described v5e 2x2 slices (libtpu's compile-only devices carry slice_index)."""
    from jaxkit.plan.targets import parse_target, target_devices

    return target_devices(parse_target("v5e:2x2", 2))


def test_two_tpu_slices_are_laid_out_as_the_hybrid_mesh(two_v5e_slices):
    from jax.experimental import mesh_utils

    devices = two_v5e_slices
    assert [len(s) for s in mesh_lib.device_slices(devices)] == [4, 4]
    for sizes, ici, dcn in (
        ({"data": -1, "dcn_data": 2}, (4, 1, 1), (2, 1, 1)),
        ({"data": 2, "fsdp": 1, "tensor": 2, "dcn_fsdp": 2}, (2, 1, 2), (1, 2, 1)),
    ):
        mesh = make_mesh({"data": -1, "fsdp": 1, "tensor": 1, **sizes}, devices)
        hybrid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, allow_split_physical_axes=True
        )
        assert (mesh.devices == hybrid).all(), sizes
        assert mesh.axis_names == ("data", "fsdp", "tensor")
        assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    # data = 2 slices × 4: the first half of the data axis is slice 0, the second slice 1.
    mesh = make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 2}, devices)
    assert [d.slice_index for d in mesh.devices[:, 0, 0]] == [0, 0, 0, 0, 1, 1, 1, 1]


@pytest.mark.parametrize(
    "dcn,words",
    [
        ({}, "= 1 slice, but the 8 tpu devices are 2 slices: give mesh.dcn_data × "),
        ({"dcn_data": 4}, "= 4 slices, but the 8 tpu devices are 2 slices: give mesh.dcn_data "),
        ({"dcn_data": 2, "dcn_fsdp": 2}, "2 × 2 = 4 slices, but the 8 tpu devices are 2 slices"),
    ],
)
def test_a_dcn_product_that_is_not_the_slice_count_names_it(two_v5e_slices, dcn, words):
    with pytest.raises(MeshError) as refused:
        make_mesh({"data": -1, "fsdp": 1, "tensor": 1, **dcn}, two_v5e_slices)
    assert words in str(refused.value)
    assert str(refused.value).endswith(
        "give mesh.dcn_data × mesh.dcn_fsdp = 2 (e.g. mesh.dcn_data=2)"
    )


def test_slices_of_unequal_sizes_are_refused(two_v5e_slices):
    with pytest.raises(MeshError, match=r"are 2 slices, of unequal sizes \(4, 2 devices\)"):
        make_mesh({"data": -1, "fsdp": 1, "tensor": 1, "dcn_data": 2}, two_v5e_slices[:6])


@pytest.mark.parametrize(
    "dcn,words",
    [
        ("mesh.dcn_data=2", "give mesh.dcn_data=1 and mesh.dcn_fsdp=1"),
        ("mesh.dcn_fsdp=3", "3 slices do not divide the 8 devices"),
    ],
)
def test_train_refuses_a_bad_slice_layout_with_exit_2(tmp_path, dcn, words):
    out = jaxkit("train", "mlp_digits", dcn, "--workdir", str(tmp_path / "run"), "--no-progress")
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.startswith("jaxkit: error: ") and words in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_mesh_axes_are_auto():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    assert mesh_shape(mesh) == {"data": 2, "fsdp": 2, "tensor": 2}


def test_state_shardings_on_2x2x2_follow_the_rules():
    config = load_config("lm_tiny")
    apply_overrides(config, ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "data.max_bytes=20000"])
    mesh = make_mesh(config.mesh.to_dict())
    setup = build(run_config(config), plan_from_config(run_config(config), mesh_shape(mesh)), mesh)
    state = setup.init(jax.random.key(0))
    params, block = state.params, state.params["blocks"][0]
    expected = {
        "embed": (params["embed"]["embedding"], P(None, "fsdp")),
        "query": (block["query"]["kernel"], P("fsdp", "tensor")),
        "query bias": (block["query"]["bias"], P("tensor")),
        "attn_out": (block["attn_out"]["kernel"], P("tensor", "fsdp")),
        "mlp_in": (block["mlp_in"]["kernel"], P("fsdp", "tensor")),
        "mlp_out": (block["mlp_out"]["kernel"], P("tensor", "fsdp")),
        "ln scale": (block["ln_attn"]["scale"], P(None)),
        "head": (params["head"]["kernel"], P("fsdp", None)),
    }
    for name, (array, spec) in expected.items():
        assert array.sharding.spec == spec, name
    # Each device holds 1/(fsdp·tensor) of a kernel sharded on both axes.
    q = block["query"]["kernel"]
    assert q.addressable_shards[0].data.shape == (q.shape[0] // 2, q.shape[1] // 2)

    # Optimizer state inherits the params' layout: Adam moments and MultiSteps' accumulator.
    adam = state.opt_state.inner_opt_state[2][0]  # (norm, clip, adamw) -> ScaleByAdamState
    for tree in (adam.mu, adam.nu, state.opt_state.acc_grads):
        assert tree["blocks"][0]["query"]["kernel"].sharding.spec == P("fsdp", "tensor")
        assert tree["embed"]["embedding"].sharding.spec == P(None, "fsdp")
    assert state.opt_state.mini_step.sharding.spec == P()
    assert state.micro_step.sharding.spec == P()


def _small_lm(*overrides):
    config = load_config("lm_tiny")
    apply_overrides(
        config,
        [
            *SMALL_LM,
            "batch.global_batch_size=32",
            "batch.per_device_batch_size=4",
            "train.steps=4",
            "train.log_every=1",
            "train.eval_examples=32",
            *overrides,
        ],
    )
    return config


def _bytes_per_device(state) -> int:
    """Bytes of params + optimizer state held by one device, from the arrays' shardings:
    the state of every split (MultiSteps' accumulator is held only at K > 1, which data=8
    does not take here and the others do)."""
    held = (state.params, state.opt_state.inner_opt_state)
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(held))


def test_fsdp_and_tensor_meshes_train_like_data_parallel_with_less_memory():
    from jaxkit.train.loop import train

    runs = {}
    for shape in ((8, 1, 1), (2, 2, 2), (1, 4, 2)):
        data, fsdp, tensor = shape
        config = _small_lm(f"mesh.data={data}", f"mesh.fsdp={fsdp}", f"mesh.tensor={tensor}")
        result = train(config, progress=False, echo=lambda *a: None)
        losses = np.array([r["loss"] for r in result.records if "loss" in r])
        params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(result.state.params))]
        runs[shape] = (losses, params, _bytes_per_device(result.state))
    dp_losses, dp_params, dp_bytes = runs[(8, 1, 1)]
    for shape in ((2, 2, 2), (1, 4, 2)):
        losses, params, _ = runs[shape]
        # float32 round-off only, as in test_equivalence (sharded matmuls sum in other orders).
        np.testing.assert_allclose(losses, dp_losses, rtol=2e-6, err_msg=str(shape))
        for a, b in zip(params, dp_params, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=0, err_msg=str(shape))
    # Memory per device falls as the fsdp and tensor axes grow (vectors stay replicated).
    assert runs[(2, 2, 2)][2] < 0.5 * dp_bytes
    assert runs[(1, 4, 2)][2] < 0.7 * runs[(2, 2, 2)][2]


# lm_tiny widened: d_model 512, MLP 2048, 8 heads, 1 layer; 4 rows per device, 8 devices.
# (The ratios below, measured while a K = 1 state still held MultiSteps' accumulator: 0.61
# and 1.25 with 1 layer, 0.61 and 1.32 with 2, 0.61 and 1.35 with
# 4, each fewer layers about half the compile. Without the activation constraints, 1.20 and
# 2.58 with 1 layer, 1.10 and 2.47 with 2.)
WIDE = [
    "model.d_model=512",
    "model.mlp_dim=2048",
    "model.num_heads=8",
    "model.num_layers=1",
    "batch.global_batch_size=32",
    "batch.per_device_batch_size=4",
    "batch.grad_accum_steps=null",
]


def compiled_cost(*overrides):
    from jaxkit.plan.costs import compile_setup_step

    config = load_config("lm_tiny")
    apply_overrides(config, [*WIDE, *overrides])
    mesh = make_mesh(config.mesh.to_dict())
    plan = plan_from_config(run_config(config), mesh_shape(mesh))
    return compile_setup_step(run_config(config), plan, build(run_config(config), plan, mesh))[1]


def test_fsdp_saves_memory_on_a_wider_model():
    """Activations stay sharded by rows under fsdp: params shrink 8×, temporaries do not
    grow with the model dimension (before activation constraints, fsdp=8 needed more
    memory per device than data parallel: 341 against 336 MiB with 4 layers)."""
    data_parallel = compiled_cost("mesh.data=-1")
    fsdp = compiled_cost("mesh.data=1", "mesh.fsdp=-1")
    # The state (params, Adam's moments) an eighth, but for the replicated vectors: 0.127.
    assert fsdp.argument_bytes <= 0.14 * data_parallel.argument_bytes
    # 0.71 measured: a K = 1 state holds no accumulator, so data parallel's state is 3
    # params' worth, not 4, and fsdp saves 7/8 of less (0.61 while states held one).
    assert fsdp.memory_bytes <= 0.75 * data_parallel.memory_bytes
    # 1.36 measured: without MultiSteps at K = 1 data parallel's temporaries fell 12% (42.0
    # -> 36.8 MB: the masked update's buffers), fsdp's 5% (52.6 -> 50.1 MB); 1.25 before.
    assert fsdp.temp_bytes <= 1.45 * data_parallel.temp_bytes


def test_a_data_fsdp_tensor_mesh_compiles_without_involuntary_rematerialization(capfd):
    """XLA warns when it must replicate a tensor to reshard it (the embedding lookup from
    a table sharded on d_model did, on 2×2×2); the warning goes to the process's stderr,
    its file descriptor, where capfd reads it. One split of one layer (a per-device batch
    of 1 on the 4 data-parallel devices) compiled afresh, since a program read from the
    compile cache would not warn: the lookup is in every split's program. With the table
    sharded on d_model at the lookup, this warns."""
    out = jaxkit(
        "plan",
        "lm_tiny",
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
        "batch.global_batch_size=4",
        "batch.per_device_batch_size=1",
        "model.num_layers=1",
        "data.seq_len=16",
        "data.max_bytes=20000",
        "--all-splits",
        "--device-counts",
        "8",
        "--json",
        "--no-compile-cache",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(json.loads(out.stdout)["splits"]) == 1
    assert "Involuntary full rematerialization" not in capfd.readouterr().err


@pytest.mark.parametrize(
    "trained",
    [
        ["mesh.data=1", "mesh.fsdp=-1"],  # fsdp took the rest: it takes it here too
        ["mesh.data=1", "mesh.fsdp=-1", "mesh.dcn_fsdp=2"],  # 2 slices, read in one process
    ],
)
def test_a_run_opened_to_sample_or_evaluate_keeps_the_axis_that_took_the_rest(trained):
    from jaxkit.config import apply_overrides, load_config
    from jaxkit.generate.source import make_mesh as run_mesh

    config = load_config("lm_tiny")
    apply_overrides(config, trained)
    mesh = run_mesh(config, [])
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
