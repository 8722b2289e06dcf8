import math

import doc_blocks
import pytest
from cli_run import jaxkit

from jaxkit.batch import plan as batch_plan
from jaxkit.batch.plan import BatchPlanError, make_batch_plan, splits_table


def plan(devices, global_=None, per_device=None, accum=None, **kw):
    return make_batch_plan(
        mesh_shape={"data": devices, "fsdp": 1, "tensor": 1},
        global_batch_size=global_,
        per_device_batch_size=per_device,
        grad_accum_steps=accum,
        **kw,
    )


# (devices, per-device, accumulation) -> global, from the seed articles' tables.
SEED_ROWS = [
    (1, 32, 1, 32),
    (4, 8, 1, 32),
    (2, 8, 2, 32),
    (1, 8, 4, 32),
    (4, 8, 2, 64),
    (16, 7, 2, 224),
]


@pytest.mark.parametrize("devices,b,k,g", SEED_ROWS)
def test_seed_tables_every_direction(devices, b, k, g):
    for p in (
        plan(devices, None, b, k),
        plan(devices, g, None, k),
        plan(devices, g, b, None),
        plan(devices, g, b, k),
    ):
        assert (
            p.data_parallel_size,
            p.per_device_batch_size,
            p.grad_accum_steps,
            p.global_batch_size,
        ) == (devices, b, k, g)
        assert p.micro_batch_size == devices * b


def test_seed_tokens_per_step():
    # batch 2 × seq 2048 × 4 ranks = 16,384 tokens per step.
    p = plan(4, None, 2, 1, seq_len=2048)
    assert p.tokens_per_step == 16_384
    assert "16,384" in p.table()
    assert plan(4, None, 2, 1).tokens_per_step is None


def test_data_parallel_size_is_data_times_fsdp_not_tensor():
    p = make_batch_plan(
        mesh_shape={"data": 2, "fsdp": 2, "tensor": 2},
        global_batch_size=32,
        per_device_batch_size=4,
        grad_accum_steps=None,
    )
    assert p.data_parallel_size == 4 and p.grad_accum_steps == 2


def test_table_and_splits_table_show_the_seed_example():
    rows = [plan(d, 32, b, None) for d, b in ((1, 32), (4, 8), (2, 8), (1, 8))]
    text = splits_table(rows)
    for line, (d, b, k) in zip(
        text.splitlines()[2:], ((1, 32, 1), (4, 8, 1), (2, 8, 2), (1, 8, 4)), strict=True
    ):
        assert [c.strip() for c in line.split("|")] == [str(d), str(b), str(k), "32"]
    assert "= 2 × 8 × 2" in plan(2, 32, 8, None).table()


def test_indivisible_global_names_formula_and_nearest_valid():
    with pytest.raises(BatchPlanError) as err:
        plan(8, 30, 4, None)
    msg = str(err.value)
    assert (
        "global_batch_size = data_parallel_size × per_device_batch_size × grad_accum_steps" in msg
    )
    assert "30" in msg and "8 × 4" in msg
    assert "32, 64" in msg  # the valid globals around 30 for 8 × 4 × k


def test_indivisible_per_device_suggests_globals_and_accumulations():
    with pytest.raises(BatchPlanError) as err:
        plan(4, 40, None, 3)  # 40 / (4 × 3) is not whole
    msg = str(err.value)
    assert "36, 48" in msg  # multiples of 4 × 3 around 40
    assert "grad_accum_steps in 1, 2, 5, 10" in msg  # divisors d of 40 with 4·d | 40


def test_global_not_divisible_by_devices_says_so():
    with pytest.raises(BatchPlanError, match="not divisible by data_parallel_size=4"):
        plan(4, 30, None, 1)


def test_inconsistent_three_values_show_all_fixes():
    with pytest.raises(BatchPlanError) as err:
        plan(4, 32, 8, 2)
    msg = str(err.value)
    assert "4 × 8 × 2 = 64" in msg and "global_batch_size=64" in msg and "null" in msg


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_zero_negative_and_non_integer_values_are_refused(bad):
    for kwargs in (
        {"global_": bad, "per_device": 4},
        {"per_device": bad, "accum": 1},
        {"global_": 32, "accum": bad},
    ):
        with pytest.raises(BatchPlanError, match="positive integer"):
            plan(4, **kwargs)


def test_fewer_than_two_given_is_an_error():
    with pytest.raises(BatchPlanError, match="give two of"):
        plan(4, 32, None, None)


@pytest.mark.parametrize("rule,expected", [("none", 1e-3), ("linear", 4e-3), ("sqrt", 2e-3)])
def test_learning_rate_scaling(rule, expected):
    p = plan(4, 128, 8, None, learning_rate=1e-3, lr_scaling=rule, reference_batch_size=32)
    assert math.isclose(p.learning_rate, expected, rel_tol=1e-12)
    assert p.to_json()["learning_rate"] == p.learning_rate
    assert rule in p.table()


def test_learning_rate_scaling_needs_a_reference_and_a_known_rule():
    with pytest.raises(BatchPlanError, match="reference_batch_size"):
        plan(4, 32, 8, None, lr_scaling="linear", reference_batch_size=None)
    with pytest.raises(BatchPlanError, match="none, linear, sqrt"):
        plan(4, 32, 8, None, lr_scaling="cubic")


def test_json_has_the_contract_keys():
    j = plan(2, 32, 8, None, seq_len=128).to_json()
    assert j["mesh_shape"] == {"data": 2, "fsdp": 1, "tensor": 1}
    assert (j["data_parallel_size"], j["per_device_batch_size"], j["grad_accum_steps"]) == (2, 8, 2)
    assert (j["global_batch_size"], j["micro_batch_size"], j["seq_len"], j["tokens_per_step"]) == (
        32,
        16,
        128,
        4096,
    )


def test_divisors_match_a_brute_force_count():
    for n in [*range(1, 2000), 2**16, 3**10, 720720, 999_983 * 2, 10**6]:
        assert batch_plan.divisors(n) == [d for d in range(1, n + 1) if n % d == 0], n


class _CountingInt(int):
    """An int that counts the remainders taken of it."""

    remainders = 0

    def __mod__(self, other):
        _CountingInt.remainders += 1
        return int(self) % other


def test_divisors_take_square_root_many_trials():
    n = _CountingInt(1_000_003)  # prime: the trials cannot stop early
    _CountingInt.remainders = 0
    assert batch_plan.divisors(n) == [1, 1_000_003]
    assert _CountingInt.remainders <= math.isqrt(1_000_003) + 1  # not 1,000,003


def test_a_large_prime_global_batch_gets_its_suggestions():
    g = 10**8 + 7  # prime: only 1 × g splits it; every number up to g was tried before
    with pytest.raises(BatchPlanError) as err:
        plan(1, g, None, 2)
    msg = str(err.value)
    assert f"({g} / (1 × 2) = 50000003.5)" in msg  # ".4g" printed 5e+07, as if it divided
    assert "100000004, 100000006, 100000008, 100000010" in msg  # multiples of 2 around g
    assert f"or keep {g} with grad_accum_steps in 1, {g}" in msg
    with pytest.raises(BatchPlanError, match=f"{g} is not divisible by data_parallel_size=8"):
        plan(8, g, None, 2)


def test_inconsistent_large_values_print_exact_quotients():
    with pytest.raises(BatchPlanError) as err:
        plan(4, 100_000_000, 8, 2)
    msg = str(err.value)
    assert "per_device_batch_size=12500000," in msg and "grad_accum_steps=3125000" in msg


class _BoundedInt(int):
    """An int whose remainders are counted and give up past a bound (a test that would
    otherwise run for minutes fails at once)."""

    remainders = 0

    def __mod__(self, other):
        _BoundedInt.remainders += 1
        if _BoundedInt.remainders > 2 * batch_plan.KEEP_TRIALS:
            raise AssertionError("more than 2 × KEEP_TRIALS remainders")
        return int(self) % other

    def __floordiv__(self, other):
        return _BoundedInt(int(self) // other)


def test_a_huge_global_batch_is_refused_in_bounded_trials_with_its_exact_quotient():
    # 8 × 10^18 (a digit or two too many): the √G trials behind "or keep G with ..." took
    # minutes before the refusal, at `jaxkit plan`, `train` and `experiment batch-size`.
    g = _BoundedInt(8 * 10**18)
    _BoundedInt.remainders = 0
    with pytest.raises(BatchPlanError) as err:
        plan(8, g, 3, None)  # 8 × 10^18 / 24 is not whole
    msg = str(err.value)
    # Exact: a float's 53 bits wrote 333333333333333312, a number that looks whole.
    assert f"({g} / (8 × 3) = 333333333333333333.3333)" in msg
    # The divisors d of 10^18 (= G / 8) up to 10^6, then their partners down from 10^18.
    assert "per_device_batch_size in 1, 2, 4, 5, 8, 10, 16, 20, 25, " in msg
    assert ", 500000000000000000, 1000000000000000000 (any between 1,000,000 and " in msg
    assert "1,000,000,000,000 not listed)" in msg
    with pytest.raises(BatchPlanError, match="not divisible by data_parallel_size=8 at all"):
        plan(8, _BoundedInt(10**20 + 1), 3, None)  # odd: no trials at all


def test_slices_count_in_the_data_parallel_size_and_the_plan_says_so():
    """Over 2 slices of 4 (mesh.dcn_data=2): the mesh's data axis already holds the slices;
    the plan shows the product slice by slice. On one slice the plan is as before."""
    two = plan(8, 32, 2, None, dcn_shape={"data": 2, "fsdp": 1})
    assert two.data_parallel_size == 8 and two.grad_accum_steps == 2
    rows = two.table().splitlines()
    assert rows[2].split("|")[0].strip() == "devices (dcn_data × dcn_fsdp × data × fsdp)"
    assert "data-parallel ranks = 2 × 1 × 4 × 1 over 2 slices; mesh data=8" in rows[2]
    assert two.to_json()["dcn_shape"] == {"data": 2, "fsdp": 1}
    fsdp = make_batch_plan(
        mesh_shape={"data": 2, "fsdp": 4, "tensor": 1},
        global_batch_size=32,
        per_device_batch_size=4,
        grad_accum_steps=None,
        dcn_shape={"data": 1, "fsdp": 2},
    )
    assert "= 1 × 2 × 2 × 2 over 2 slices" in fsdp.table()
    one = plan(8, 32, 2, None, dcn_shape={"data": 1, "fsdp": 1})
    assert one == plan(8, 32, 2, None) and one.table() == plan(8, 32, 2, None).table()
    assert "dcn_shape" not in one.to_json()


def test_the_plan_over_two_slices_is_as_the_docs_show():
    """docs/batch-plan.md's plan over 2 slices of 4, as `jaxkit plan` prints it: a plan
    resolves the mesh over the devices' count (8 here, in this process) without building it."""
    command = "jaxkit plan mlp_digits batch.per_device_batch_size=2 mesh.dcn_data=2"
    out = jaxkit(*command.split()[1:])
    assert out.returncode == 0, out.stderr
    expected = doc_blocks.shown("docs/batch-plan.md", command)
    assert not doc_blocks.mismatches(expected, out.stdout.splitlines(), rel=0)
