import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from matplotlib.figure import Figure

from jaxkit.batch.plan import make_batch_plan
from jaxkit.data.sources import global_batch_rows
from jaxkit.mesh import bytes_per_device, make_mesh, mesh_shape
from jaxkit.records import viz


def plan_on(mesh, global_batch_size, per_device_batch_size):
    return make_batch_plan(
        mesh_shape=mesh_shape(mesh),
        global_batch_size=global_batch_size,
        per_device_batch_size=per_device_batch_size,
        grad_accum_steps=None,
    )


def test_batch_layout_reads_back_ranks_and_micro_steps():
    mesh = make_mesh({"data": -1, "fsdp": 1, "tensor": 1}, jax.devices()[:2])
    plan = plan_on(mesh, 32, 8)  # 2 × 8 × 2
    layout = viz.batch_layout(plan, mesh, num_rows=100, seed=3, step=1)
    np.testing.assert_array_equal(layout.example, global_batch_rows(1, 32, 100, 3))
    np.testing.assert_array_equal(layout.device, np.tile(np.repeat([0, 1], 8), 2))
    np.testing.assert_array_equal(layout.micro_step, np.repeat([0, 1], 16))

    ax = Figure().subplots()
    viz.plot_batch_layouts(ax, {"2×8×2": layout})
    assert [t.get_text() for t in ax.texts] == ["micro-step 0", "micro-step 1"]
    assert len(ax.patches) == 32


def test_batch_layout_on_a_tensor_axis_names_one_device_per_row():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})  # data-parallel size 4
    plan = plan_on(mesh, 16, 2)  # 4 × 2 × 2
    layout = viz.batch_layout(plan, mesh, num_rows=64, seed=0)
    assert sorted(set(layout.device)) == [0, 2, 4, 6]  # tensor partners share rows
    assert np.bincount(layout.device)[[0, 2, 4, 6]].tolist() == [4, 4, 4, 4]


def test_sharding_table_and_bytes_per_device():
    mesh = make_mesh({"data": 4, "fsdp": 1, "tensor": 2})
    x = jax.device_put(np.zeros((8, 6), np.float32), NamedSharding(mesh, P("data", "tensor")))
    y = jax.device_put(np.zeros((5,), np.float32), NamedSharding(mesh, P()))
    tree = {"x": x, "y": y}
    table = viz.sharding_table(tree)
    assert "P('data', 'tensor') | (2, 3)" in table and "P() " in table
    assert bytes_per_device(tree) == (2 * 3 + 5) * 4


def test_plots_draw_and_refuse_misaligned_curves():
    curves = {
        "a": (np.arange(1, 4), np.array([2.0, 1.0, 0.5])),
        "b": (np.arange(1, 4), np.array([2.0, 1.0 + 1e-7, 0.5])),
    }
    top, bottom = Figure().subplots(2)
    viz.plot_losses(top, curves)
    viz.plot_relative_differences(bottom, curves, "a", tolerance=2e-6)
    (line,) = [ln for ln in bottom.get_lines() if ln.get_label() == "b"]
    np.testing.assert_allclose(line.get_ydata(), [viz.FLOOR, 1e-7, viz.FLOOR], rtol=1e-6)
    with pytest.raises(ValueError, match="other steps"):
        viz.plot_relative_differences(bottom, {**curves, "c": (np.arange(3), curves["a"][1])}, "a")
