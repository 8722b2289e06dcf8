"""Planning for a Cloud TPU slice from this CPU machine: the TPU compiler, no TPU.

Expected topologies, chip and host counts are Cloud TPU's published ones (v5litepod-8 is
one host of 2x4 chips; v5litepod-16 four hosts of 4; v4 and v5p names count TensorCores,
two per chip), and libtpu's own description of each slice (its devices' process indices)
checks the host count jaxkit computes.
"""

import json

import pytest
from cli_run import jaxkit  # in-process: these claims are about what a plan prints
from small_configs import SMALL_LM
from test_cli import jaxkit as jaxkit_process

from jaxkit.config import run_config
from jaxkit.plan import targets
from jaxkit.plan.targets import TargetError, parse_target, target_devices

# The tiny LM shrunk further, at a global batch of 16: two splits on 8 chips (b = 2, 1).
TINY = ["lm_tiny", *SMALL_LM, "batch.global_batch_size=16", "batch.per_device_batch_size=2"]

GiB = 2**30


@pytest.mark.parametrize(
    "name,topology,chips,hosts,hbm_gib",
    [
        ("v5litepod-8", "v5e:2x4", 8, 1, 16),
        ("v5e-16", "v5e:4x4", 16, 4, 16),  # the short spelling of v5litepod-16
        ("v5litepod-256", "v5e:16x16", 256, 64, 16),
        ("v4-8", "v4:2x2x1", 4, 1, 32),
        ("v4-32", "v4:2x2x4", 16, 4, 32),
        ("v5p-32", "v5p:2x2x4", 16, 4, 95),
        ("v6e-8", "v6e:2x4", 8, 1, 32),
        ("v6e-64", "v6e:8x8", 64, 16, 32),
        ("v5e:4x4", "v5e:4x4", 16, 4, 16),
        ("v4:2x2x2", "v4:2x2x2", 8, 2, 32),
        (" v5e:2x4 ", "v5e:2x4", 8, 1, 16),  # as pasted, spaces and all
    ],
)
def test_accelerator_types_and_topologies_name_their_slices(name, topology, chips, hosts, hbm_gib):
    target = parse_target(name)
    assert (target.topology, target.chips, target.hosts) == (topology, chips, hosts)
    assert target.name == name.strip()  # printed and in --json as given, trimmed
    assert target.generation.hbm_bytes == hbm_gib * GiB


@pytest.mark.parametrize(
    "name,words",
    [
        ("v5litepod-12", ["v5litepod-8", "v5litepod-16"]),  # the sizes that exist
        ("v4-6", ["v4-8", "v4-16"]),
        ("v9-8", ["unknown TPU generation 'v9'", "v5litepod-1", "v5e:4x4"]),
        ("tpu", ["v4-8", "v6e:4x4"]),
        ("v5e:2x2x2", ["2 sides", "v5e:4x4"]),
        ("v4:4x4", ["3 sides", "v4:2x2x4"]),
        ("v5e:32x32", ["1024 chips; the largest v5e slice has 256"]),
    ],
)
def test_an_unknown_target_lists_what_is_valid(name, words):
    with pytest.raises(TargetError) as err:
        parse_target(name)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("name", ["v5litepod-8", "v5litepod-16", "v4-32", "v5p-8", "v6e-16"])
def test_the_described_slice_has_the_chips_and_hosts_computed(name):
    target = parse_target(name)
    devices = target_devices(target)
    assert len(devices) == target.chips  # one JAX device per chip, megacore included
    assert len({d.process_index for d in devices}) == target.hosts
    assert {d.device_kind for d in devices} == {target.generation.device_kind}


def test_a_topology_libtpu_cannot_lay_out_is_refused_in_its_words():
    with pytest.raises(TargetError, match="JAX cannot describe topology v5e:3x3"):
        target_devices(parse_target("v5e:3x3"))


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
    monkeypatch.setattr(targets.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(TargetError, match=r'pip install -e "\.\[tpu-plan\]"'):
        target_devices(parse_target("v5litepod-8"))


def test_plan_for_a_single_host_slice():
    out = jaxkit("plan", "lm_tiny", "--target", "v5litepod-8", "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["target"] == "v5litepod-8"
    assert plan["device_kind"] == "TPU v5 lite"
    assert (plan["num_devices"], plan["num_hosts"]) == (8, 1)
    assert plan["memory_budget_bytes"] == 16 * GiB
    # lm_tiny's mesh (data=-1) resolved on the slice's 8 chips.
    assert plan["data_parallel_size"] == 8
    assert plan["rows_per_host"] == plan["micro_batch_size"]


def test_plan_for_a_multi_host_slice_splits_rows_over_hosts():
    out = jaxkit(
        "plan", "lm_tiny", "batch.global_batch_size=128", "--target", "v5litepod-16", "--json"
    )
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["num_devices"], plan["num_hosts"]) == (16, 4)
    assert plan["data_parallel_size"] == 16
    # 16 data-parallel chips, 4 per host: each host loads a quarter of every micro-batch.
    assert plan["rows_per_host"] == plan["micro_batch_size"] // 4
    text = jaxkit("plan", "lm_tiny", "batch.global_batch_size=128", "--target", "v5litepod-16")
    assert text.returncode == 0, text.stderr
    assert "v5litepod-16 (v5e:4x4" in text.stdout and "on 4 hosts" in text.stdout
    assert f"rows per host per micro-step: {plan['rows_per_host']}" in text.stdout


def test_all_splits_on_a_target_use_its_hbm_and_the_tpu_compiler():
    # Two TPU compiles (b = 2, 1; lm_tiny's own batch of 64 took four, b = 8, 4, 2, 1);
    # the second plan reads them back from the plan cache.
    out = jaxkit("plan", *TINY, "--target", "v5litepod-8", "--all-splits", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["target"] == "v5litepod-8" and result["num_hosts"] == 1
    assert result["memory_budget_bytes"] == 16 * GiB
    splits = result["splits"]
    assert {s["devices"] for s in splits} == {8}  # the slice, not pieces of it
    assert sorted(s["per_device_batch_size"] for s in splits) == [1, 2]
    # Every split fits 16 GiB for a model this small: the largest per-device batch wins.
    largest = max(splits, key=lambda s: s["per_device_batch_size"])
    assert result["recommended"]["per_device_batch_size"] == largest["per_device_batch_size"]
    # A budget between two splits' needs: the recommendation is the largest that fits.
    needs = sorted(s["memory_bytes"] for s in splits)
    budget = (needs[0] + needs[-1]) // 2
    out = jaxkit(
        "plan", *TINY, "--target", "v5litepod-8", "--all-splits", "--json",
        f"--memory-budget={budget}",
    )  # fmt: skip
    result = json.loads(out.stdout)
    fitting = [s for s in result["splits"] if s["memory_bytes"] <= budget]
    assert result["memory_budget_bytes"] == budget
    assert result["recommended"]["per_device_batch_size"] == max(
        s["per_device_batch_size"] for s in fitting
    )


def test_max_per_device_batch_on_a_target_searches_with_the_tpu_compiler():
    # A budget between mlp_digits' step at b=1 and at b=2 on a v5e chip, as the TPU compiler
    # gives them: two TPU compiles settle it. (64 MiB took ~35, b=1 to 2^17: a v5e step of
    # this MLP hardly grows with the batch, whose rows are 64 pixels.) The figures depend on
    # libtpu: about 1.0 and 2.6 MiB with jax 0.10's, 2.60 and 2.73 MiB with jax 0.12's
    # (docs/contributing.md#jax-012), so the budget is taken from them.
    from jaxkit.batch.schedule import plan_from_config
    from jaxkit.config import load_config
    from jaxkit.plan import costs

    config = load_config("mlp_digits")
    devices = target_devices(parse_target("v5litepod-8"))
    at = {}
    for b in (1, 2):
        split = costs.split_config(run_config(config), b, 1)
        plan = plan_from_config(split, {"data": 8, "fsdp": 1, "tensor": 1})
        at[b] = costs.step_cost(split, plan, devices).memory_bytes
    assert at[1] < at[2]
    budget = (at[1] + at[2]) // 2
    out = jaxkit(
        "plan", "mlp_digits", "--target", "v5litepod-8", "--max-per-device-batch",
        "--memory-budget", str(budget), "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["target"], result["num_devices"]) == ("v5litepod-8", 8)
    assert result["memory_budget_bytes"] == budget
    assert result["max_per_device_batch_size"] == 1
    tried = {int(b): m for b, m in result["tried"].items()}
    assert tried[1] == at[1] and tried[2] == at[2]
    assert all(m > budget for b, m in tried.items() if b > 1)
    # The batch found gets its predicted step (K = 1); priced, per example for a classifier.
    assert result["predicted_step_time_s"] > 0 and "usd_per_billion_examples" not in result
    search = ("plan", "mlp_digits", "--target", "v5litepod-8", "--max-per-device-batch")
    text = jaxkit(*search, "--memory-budget", str(budget), "--usd-per-chip-hour", "2")
    assert text.returncode == 0, text.stderr
    assert "predicted step (K = 1): at least" in text.stdout
    assert "USD per billion examples" in text.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--target", "v5litepod-12"], "v5litepod slices come as"),
        (["--target", "v5litepod-8", "--host-devices", "8"], "--host-devices"),
        (["--target", "v5litepod-8", "--all-splits", "--device-counts", "4"], "--device-counts"),
        (["--target", "v5litepod-8", "mesh.tensor=3"], "tensor=3"),
        (["--target", "v4-8", "mesh.data=8"], "--target v4-8 has 4 chips: mesh data=8"),
    ],
)
def test_bad_target_requests_are_refused_before_compiling(args, message):
    run = jaxkit_process if "--host-devices" in args else jaxkit
    out = run("plan", "lm_tiny", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "error:" in out.stderr and message in out.stderr and "Traceback" not in out.stderr


def test_memory_experiment_on_a_target(tmp_path, monkeypatch):
    from jaxkit.experiments import memory

    # What the report says of the slice is the claim: one batch and K = 1 (a TPU compile of
    # MultiSteps' step and one of the fused step), not seven compiles of a wider sweep.
    monkeypatch.setattr(memory, "ACCUM_SWEEP", (1,))
    out = jaxkit(
        "experiment", "memory", "mlp_digits", "--target", "v5litepod-8",
        "--max-per-device-batch", "1", "--out", str(tmp_path / "m"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "m" / "report.md").read_text()
    assert "v5litepod-8" in report and "TPU v5 lite" in report and "16 GiB" in report
    assert "Resident memory is measured only on CPU" in report


def test_target_is_refused_for_experiments_that_run():
    out = jaxkit("experiment", "equivalence", "mlp_digits", "--target", "v5litepod-8")
    assert out.returncode == 2
    assert "--target applies to experiment memory, not equivalence" in out.stderr


# 32768² float32 weights are 4 GiB; with their gradient, Adam's two moments and the
# MultiSteps accumulator no v5e chip (16 GiB) can hold the step, whatever the batch.
TOO_BIG = ("mlp_digits", "model.hidden_size=32768", "--target", "v5litepod-8")


def test_splits_the_tpu_compiler_refuses_are_shown_as_not_fitting():
    out = jaxkit("plan", *TOO_BIG, "--all-splits", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["recommended"] is None
    assert result["splits"] and all(s["memory_bytes"] is None for s in result["splits"])
    for split in result["splits"]:
        assert "RESOURCE_EXHAUSTED" in split["out_of_memory"]
        assert split["needed_bytes"] > 15 * GiB  # the compiler's own figure, over HBM
    out = jaxkit("plan", *TOO_BIG, "--all-splits")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "no split on 8 devices fits 16.00 GiB" in out.stdout
    assert "| > " in out.stdout and "| no   |" in out.stdout


def test_a_batch_search_the_tpu_compiler_refuses_says_so():
    out = jaxkit("plan", *TOO_BIG, "--max-per-device-batch", "--json")
    assert out.returncode == 2
    result = json.loads(out.stdout)
    assert result["max_per_device_batch_size"] == 0 and result["tried"] == {"1": None}
    assert "RESOURCE_EXHAUSTED" in result["out_of_memory"]["1"]
    assert "even per_device_batch_size=1 needs more than the device has" in out.stderr


def test_the_memory_experiment_lists_what_the_tpu_compiler_refused(tmp_path):
    out = jaxkit(
        "experiment", "memory", *TOO_BIG, "--max-per-device-batch", "1",
        "--out", str(tmp_path / "m"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = (tmp_path / "m" / "report.md").read_text()
    assert "The compiler refused these (out of memory on the device)" in report
    assert "per_device_batch_size=1 (RESOURCE_EXHAUSTED" in report
