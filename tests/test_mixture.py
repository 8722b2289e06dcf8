"""data.mixture: several token sources in one exact order (jaxkit/batch/mixture.py). The order is
checked as a function (counts per block, rows of a resume), then in training: a two-stage
mixture on the seed's four splits of its global batch and resumed on fewer devices (the
rows each reads, the model each trains), its refusals and what it records."""

import contextlib
import json
import pathlib
import threading
from fractions import Fraction

import numpy as np
import pytest
from cli_run import jaxkit
from test_equivalence import LOSS_RTOL, PARAM_ATOL, SEED_SPLITS, max_param_diff
from token_dirs import write_prepared

from jaxkit.batch import mixture
from jaxkit.config import ConfigError, apply_overrides, check_values, load_config, run_config
from jaxkit.data import sources as data_lib
from jaxkit.records.metrics import read_metrics

# A one-layer Llama, 3 steps of 32 rows of 16 tokens on 8 CPU devices, one eval at the end.
RUN = [
    "train", "llama_tiny", "model.vocab_size=64", "model.d_model=32", "model.num_layers=1",
    "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_dim=64", "data.seq_len=16",
    "data.source=tokens", "train.steps=3", "train.eval_every=3", "train.eval_examples=4",
    "batch.global_batch_size=32", "--no-progress",
]  # fmt: skip


def _docs(rng, count, length):
    return [
        (rng.integers(2, 64, 3).tolist(), rng.integers(2, 64, length).tolist())
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """web: 40 documents (85 windows of 16), code: 10 (fewer rows than a global batch)."""
    tmp = tmp_path_factory.mktemp("mixture")
    rng = np.random.default_rng(0)
    web, code = _docs(rng, 40, 30), _docs(rng, 10, 20)
    write_prepared(tmp / "web", {"train": web, "eval": web[:4]}, vocab_size=64, eod_id=1)
    write_prepared(tmp / "code", {"train": code, "eval": code[:3]}, vocab_size=64, eod_id=1)
    return tmp


def _mix(dirs, web=0.9, code=0.1, **more):
    value = {"web": {"path": str(dirs / "web"), "weight": web}}
    value["code"] = {"path": str(dirs / "code"), "weight": code}
    return "data.mixture=" + json.dumps(value | more)


def _sources(dirs, *overrides):
    config = load_config("llama_tiny")
    apply_overrides(config, [*RUN[2:-1], _mix(dirs), *overrides])
    check_values(config)
    return data_lib.make_sources(run_config(config))


def _order(weights, text=""):
    value = {name: {"path": "x", "weight": w} for name, w in weights.items()}
    return mixture.Order(mixture.stages(value, text, 16))


@pytest.mark.parametrize(
    "weights",
    [
        {"code": 0.1, "web": 0.9},
        {"rare": 0.01, "web": 0.99},
        # the largest remainder alone would take a row back from a, b and c here
        {"a": 0.3, "b": 0.01, "c": 0.01, "d": 7, "e": 7},
    ],
)
def test_rows_per_source_are_exact_after_every_block(weights):
    """After n blocks each source has given n·32·w rounded by the largest remainder (NAME
    order on ties) wherever that gives no source fewer rows than the block before; every
    block holds 32 rows, none taken back, and a weight of 0.01 gives its rows."""
    order = _order(weights)
    names = sorted(weights)
    total = sum(Fraction(str(w)) for w in weights.values())
    share = [Fraction(str(weights[n])) / total for n in names]
    source, _ = order.examples(0, 32 * 400, seed=3)
    counts = np.stack(
        [np.bincount(source[b * 32 : (b + 1) * 32], minlength=len(names)) for b in range(400)]
    )
    assert (counts >= 0).all() and (counts.sum(axis=1) == 32).all()
    given = np.cumsum(counts, axis=0)
    for n in range(1, 401):
        quota = [32 * n * w for w in share]
        floor = [int(q) for q in quota]
        ranked = sorted(range(len(names)), key=lambda s: (-(quota[s] - floor[s]), s))
        exact = list(floor)
        for s in ranked[: 32 * n - sum(floor)]:
            exact[s] += 1
        if all(
            e >= g for e, g in zip(exact, given[n - 2] if n > 1 else [0] * len(names), strict=True)
        ):
            assert given[n - 1].tolist() == exact, n
        assert np.all(np.abs(given[n - 1] - np.array([float(q) for q in quota])) < 1.1)
    assert given[-1][names.index(min(weights, key=weights.get))] > 0


def test_remainders_closer_than_a_float_tells_apart_rank_exactly():
    """Weights whose common denominator passes 2**53 (a stage written with 21 significant
    digits) leave remainders a float64 rounds to one value: b's quota after 2 blocks is the
    largest by 2e-19 of a row, so b gets the extra row, not a by NAME order."""
    order = _order({"a": None, "b": None, "c": None}, "0:a=1+b=1.00000000000000000001+c=1")
    weights = order.stages[0].weights
    quota = [2 * 32 * w for w in weights]
    assert max(quota) == quota[1] and float(quota[0]) == float(quota[1])
    assert order.given_before(2).tolist() == [21, 22, 21]


def test_each_source_reads_its_own_seeded_stream_epoch_after_epoch(dirs):
    """A source's k-th row is its own permutation's, the next epoch starting where one
    runs out: code (14 rows) read 4 times over in 60 blocks gives every row each epoch."""
    train, _ = _sources(dirs)
    ids = train.stream_rows(0, 32 * 60, 5)
    code = ids[ids < train.offsets[1]]  # sources in NAME order: code first
    rows = len(train.parts[0])
    assert len(code) >= 2 * rows
    for epoch in range(len(code) // rows):
        assert sorted(code[epoch * rows : (epoch + 1) * rows]) == list(range(rows))


def test_a_mixture_of_many_sources_draws_each_epoch_order_once(monkeypatch):
    """Every source's rows come from its epochs' orders (permutations). A mixture of 70
    sources (more than the 64 kept of any sources) read chunk after chunk draws each order it
    reads once: a cache of a fixed 16 orders for all sources drew them again for every
    chunk of a mixture of more than 8 sources; and the rows are each source's own order's."""
    draws = []
    default_rng = np.random.default_rng

    def counting(seed):
        if len(seed) == 2:  # [source seed, epoch]: an epoch's order (not the blocks' shuffle)
            draws.append(tuple(seed))
        return default_rng(seed)

    monkeypatch.setattr(np.random, "default_rng", counting)
    names = [f"s{i:02d}" for i in range(70)]
    sizes = [5 + i % 7 for i in range(70)]  # small: many epochs in each chunk of reads
    rows = data_lib.MixtureRows(
        names=tuple(names),
        parts=tuple(np.zeros(n) for n in sizes),
        order=_order(dict.fromkeys(names, 1)),
    )
    seed = 4_321  # a seed no other test reads with
    chunk = data_lib._MIXTURE_CHUNK
    ids = rows.stream_rows(0, 3 * chunk, seed)  # three chunks
    source, k = rows.order.examples(0, 3 * chunk, seed)
    for s, name in enumerate(names):  # the documented rule, from numpy itself
        n, seed_s = sizes[s], mixture.source_seed(seed, name)
        want = [default_rng([seed_s, e // n]).permutation(n)[e % n] for e in k[source == s]]
        assert (ids[source == s] - rows.offsets[s]).tolist() == want, name
    assert len(draws) > 2 * len(names) and len(set(draws)) == len(draws)  # none drawn twice


def test_a_resume_reads_the_rows_of_an_uninterrupted_run(dirs):
    """Rows read in steps of 24 from a cold start at 4 positions (a new process each: new
    sources, nothing cached) are those one uninterrupted read gives, in order, across a
    stage boundary at 200 examples (moved to the block start at 224)."""
    stages = "data.mixture_stages=0:web=9+code=1,200:web=1+code=1"
    train, _ = _sources(dirs, stages)
    whole = train.stream_rows(0, 24 * 20, 7)
    for start in (0, 96, 216, 240):
        fresh, _ = _sources(dirs, stages)
        read = np.concatenate([fresh.stream_rows(e, 24, 7) for e in range(start, 24 * 20, 24)])
        np.testing.assert_array_equal(read, whole[start:])
    picked = train.order.examples(0, 24 * 20, 7)[0]
    assert np.bincount(picked[224:], minlength=2).tolist() == [128, 128]


def test_a_stage_added_later_leaves_earlier_rows_unchanged(dirs):
    train, _ = _sources(dirs)
    later, _ = _sources(dirs, "data.mixture_stages=0:web=0.9+code=0.1,1k:web=0.5+code=0.5")
    np.testing.assert_array_equal(later.stream_rows(0, 1024, 1), train.stream_rows(0, 1024, 1))
    assert not np.array_equal(later.stream_rows(1024, 64, 1), train.stream_rows(1024, 64, 1))


# One mixture spelled three ways, as a run may be started or resumed: decimal weights in
# both keys, whole weights, and data.mixture's weights left out beside data.mixture_stages.
SPELLINGS = {
    "decimals": ({"web": 0.7, "code": 0.3}, "0:web=0.7+code=0.3,64:web=0.5+code=0.5"),
    "whole": ({"web": 7, "code": 3}, "0:web=7+code=3,64:web=1+code=1"),
    "left out": ({}, "0:web=0.7+code=0.3,64:web=2+code=2"),
}


def _spelled(dirs, weights, stages):
    value = {name: {"path": str(dirs / name)} for name in ("web", "code")}
    for name, weight in weights.items():
        value[name]["weight"] = weight
    config = load_config("llama_tiny")
    mix = ["data.mixture=" + json.dumps(value), f"data.mixture_stages={stages}"]
    apply_overrides(config, [*RUN[2:-1], *mix])
    check_values(config)
    return config


def test_a_resume_compares_the_stages_as_they_draw_rows(dirs):
    """Each spelling of SPELLINGS, resumed under each other one (both ways), draws the same
    rows row for row, and neither the config nor the stages the checkpoint records count as
    a change. A changed stage is one only where the saved run trained on its rows: at a
    step boundary its position is the first row it did not; the lines say each source's
    share and the stages as data.mixture_stages takes them (a checkpoint that did not
    record how they were written: the smallest whole weights, which draw the same rows)."""
    import itertools

    from jaxkit.train.checkpoint import config_conflicts

    configs = {name: _spelled(dirs, *spelling) for name, spelling in SPELLINGS.items()}
    facts, rows = {}, {}
    for name, config in configs.items():
        train, held_out = data_lib.make_sources(run_config(config))
        facts[name] = data_lib.data_facts(train, held_out)[data_lib.MIXTURE_STAGES]
        rows[name] = train.stream_rows(0, 256, 3)
    for saved, now in itertools.permutations(configs, 2):
        np.testing.assert_array_equal(rows[now], rows[saved], err_msg=f"{saved} -> {now}")
        assert config_conflicts(configs[saved].to_dict(), configs[now].to_dict()) == []
        assert mixture.stage_changes(facts[saved], facts[now], 256) == [], (saved, now)
    changed = _spelled(dirs, {}, "0:web=0.7+code=0.3,64:web=1+code=2")
    changed_facts = data_lib.data_facts(*data_lib.make_sources(run_config(changed)))
    changed_stages = changed_facts[data_lib.MIXTURE_STAGES]
    assert mixture.stage_changes(facts["whole"], changed_stages, 64) == []
    assert mixture.stage_changes(facts["whole"], changed_stages, 65) == [
        "  data.mixture's stage from example 64, whose rows the saved run trained on (examples "
        "0-64): code draws 50% of the rows (saved) -> 66.7%, web 50% -> 33.3% "
        "(saved: 64:web=1+code=1; now: 64:web=1+code=2)"
    ]
    one = facts["whole"][:1]  # the first stage alone: the one from 64 left out, or new
    where = "  data.mixture's stage from example 64, whose rows the saved run trained on"
    assert mixture.stage_changes(facts["whole"], one, 65) == [
        f"{where} (examples 0-64), is left out (saved: 64:web=1+code=1): give it again"
    ]
    assert mixture.stage_changes(one, facts["whole"], 100) == [
        f"{where} (examples 0-99), is new (64:web=1+code=1): the saved run drew those rows "
        "under the stage before it"
    ]
    untyped = [{k: v for k, v in stage.items() if k != "typed"} for stage in facts["decimals"]]
    (line,) = mixture.stage_changes(untyped, changed_stages, 65)
    written = line.split("(saved: ", 1)[1].split(";", 1)[0]
    assert written == "64:code=1+web=1", line
    again = mixture.parse_stages(f"0:web=7+code=3,{written}", ["code", "web"], 16)
    assert again == train.order.stages  # the last spelling's: the same stages


def test_reads_of_any_length_give_each_examples_own_row(dirs):
    """The loader's reads (worked out and kept 2,048 examples at a time) give, for every
    global example, the row its (source, k) names in that source's own stream: reads of
    odd lengths across chunk and stage boundaries, repeated and out of order, from a
    prefetch thread at the same time as the main one."""
    stages = "data.mixture_stages=0:web=9+code=1,3000:web=1+code=3"
    train, _ = _sources(dirs, stages)
    first, count = 2000, 2200
    source, k = _sources(dirs, stages)[0].order.examples(first, count, 11)
    want = np.empty(count, dtype=np.int64)
    for s, name in enumerate(train.names):
        here = source == s
        seed = mixture.source_seed(11, name)
        rows = data_lib.rows_of_examples(k[here], len(train.parts[s]), seed)
        want[here] = train.offsets[s] + rows
    reads = [(2000, 57), (2057, 2143), (2040, 10), (4000, 200), (2000, 2200)]
    for at, n in reads:
        np.testing.assert_array_equal(train.stream_rows(at, n, 11), want[at - first :][:n])
    got = {}

    def read(name, at, n):
        got[name] = np.concatenate([train.stream_rows(a, 31, 11) for a in range(at, at + n, 31)])

    train, _ = _sources(dirs, stages)  # nothing kept yet: both threads work it out
    threads = [threading.Thread(target=read, args=(t, first, 31 * 70)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in range(2):
        np.testing.assert_array_equal(got[name], want[: 31 * 70])
    # no ids read nothing, as one source does (an IndexError once)
    none = train[np.zeros(0, dtype=np.int64)]
    assert none["inputs"].shape == none["targets"].shape == (0, 16)
    assert train.row_weight_sums(np.zeros(0, dtype=np.int64)).shape == (0,)


def test_the_counts_at_a_far_block_need_no_walk_kept_in_memory():
    """Where the largest remainder would take rows back (weights below 1/32), a stage's
    counts depend on the block before, so R(n) is a walk from R(0). The walk keeps R every
    4,096 blocks, not every block's: 100,000 blocks of 20 sources keep 25 counts, an order
    that jumps there gives the counts of one that walked there in steps of 997 blocks,
    and counts behind the walk (worked out again from the kept ones) are the same too."""
    weights = {f"s{i:02d}": w for i, w in enumerate([0.3, 0.01, 0.01, 7, 7] * 4)}
    jumped, walked = _order(weights), _order(weights)
    far = 100_000
    for block in range(0, far + 1, 997):
        walked.counts(block)
    for block in (far, far - 1, far + 1, 5, 4096, 4095, far // 2 + 3):
        np.testing.assert_array_equal(jumped.counts(block), walked.counts(block))
        assert jumped.counts(block).sum() == 32
    np.testing.assert_array_equal(jumped.given_before(far), walked.given_before(far))
    assert len(jumped.quotas[0].marks) == far // 4096 + 1
    # behind a walk that has moved on since: a window walked again only as far as it had
    again = _order(weights)
    for block in (10_000, 9_000, 12_000, 11_000, 8_192, 12_287):
        np.testing.assert_array_equal(again.counts(block), walked.counts(block))


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ({"Web": {"path": "x", "weight": 1}}, "data.mixture: the name 'Web' is not [a-z0-9_]+"),
        ({"web": {"path": "x", "weight": 0}}, "data.mixture.web.weight=0: must be a number > 0"),
        ({"web": {"path": "x", "weight": -1.5}}, "data.mixture.web.weight=-1.5: must be"),
        ({"web": {"path": "x", "wieght": 1}}, "data.mixture.web: unknown field 'wieght'"),
        ({"web": {"weight": 1}}, "data.mixture.web.path=null: must name token files"),
        ({}, "data.mixture={} names no source: give NAME: {path, weight} for each"),
    ],
)
def test_a_bad_source_is_refused_in_one_line(value, said):
    config = load_config("llama_tiny")
    apply_overrides(config, [*RUN[2:-1], "data.mixture=" + json.dumps(value)])
    with pytest.raises(ConfigError) as caught:
        check_values(config)
    assert str(caught.value).startswith(said), caught.value


def test_sources_of_other_tokenizers_or_unreadable_paths_are_refused(dirs, tmp_path):
    rng = np.random.default_rng(1)
    meta = write_prepared(
        tmp_path / "other",
        {"train": _docs(rng, 5, 20), "eval": _docs(rng, 2, 20)},
        vocab_size=64,
        eod_id=1,
    )
    meta["tokenizer_sha256"] = "0" * 64
    (tmp_path / "other" / "meta.json").write_text(json.dumps(meta))
    other = {"path": str(tmp_path / "other"), "weight": 1}
    done = jaxkit(*RUN, _mix(dirs, other=other), "--workdir", str(tmp_path / "a"))
    assert done.returncode == 2, done.stderr
    said = f"data.mixture.other: its tokenizer ({'0' * 64}) is not data.mixture.code's (bytes)"
    assert said in done.stderr, done.stderr
    gone = {"path": str(tmp_path / "missing"), "weight": 1}
    done = jaxkit(*RUN, _mix(dirs, gone=gone), "--workdir", str(tmp_path / "b"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    said = f"error: data.mixture.gone.path={str(tmp_path / 'missing')!r} matches no token file"
    assert said in done.stderr, done.stderr


# The trained runs below: 4 steps of 32 rows over two stages, two blocks at 0.9/0.1 (a
# stage the resume at step 1 reads half of) and two at half and half. One eval, at the end.
STAGES = "data.mixture_stages=0:web=0.9+code=0.1,64:web=0.5+code=0.5"
STAGED = ["train.steps=4", "train.log_every=1", "train.eval_every=4", "checkpoint.every=0"]
# Each source's eval on another split: the same 4 held-out rows through params that
# differ by round-off (within PARAM_ATOL), summed in another order. Measured: within
# 6.3e-8 relative (one float32 ulp at 4.14); 1e-6 keeps a 15x margin, while an eval that
# read other rows, or another source's, moves it by more than 1e-3.
EVAL_RTOL = 1e-6


def _staged(dirs, per_device, mix=None, stages=STAGES):
    config = load_config("llama_tiny")
    mix = _mix(dirs) if mix is None else mix
    apply_overrides(
        config, [*RUN[2:-1], *STAGED, mix, stages, f"batch.per_device_batch_size={per_device}"]
    )
    return config


# STAGES as another user writes them: data.mixture's weights left out (docs/data.md allows
# it beside data.mixture_stages) and whole weights in place of 0.9/0.1 and 0.5/0.5. The rows
# drawn are the same, so a resume under it is the same run.
RESPELLED = "data.mixture_stages=0:web=9+code=1,64:web=1+code=1"


def _unweighted(dirs):
    return "data.mixture=" + json.dumps(
        {name: {"path": str(dirs / name)} for name in ("web", "code")}
    )


@contextlib.contextmanager
def _reading():
    """The rows the loop reads from the training mixture, {global example: row}; each
    example must read the same row every time it is read (a prefetch, a step's weight)."""
    reads: list[tuple[int, np.ndarray]] = []
    real = data_lib.source_rows

    def source_rows(source, first, count, seed):
        rows = real(source, first, count, seed)
        if getattr(source, "order", None) is not None:  # the training mixture
            reads.append((first, rows.copy()))
        return rows

    positions: dict[int, int] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(data_lib, "source_rows", source_rows)
        yield positions
    for first, rows in reads:
        for i, row in enumerate(rows.tolist()):
            assert positions.setdefault(first + i, row) == row, first + i


def _train(config, workdir, devices, **kw):
    import jax

    from jaxkit.train.loop import train

    quiet = {"progress": False, "echo": lambda *a: None}
    return train(config, workdir, devices=jax.devices()[:devices], **quiet, **kw)


@pytest.fixture(scope="module")
def runs(dirs):
    """The two-stage mixture trained on each of the seed's four splits of 32 (4 × 8 × 1 on
    a workdir, which the CLI's resumes below continue), and one run stopped after step 1 on
    4 devices (8 rows each, K = 1) and resumed on 2 (K = 2): each with the rows it read.
    The stopped run and its resume are splits trained above, so their programs come from
    the compilation cache."""
    out = {}
    for devices, per_device, accum in SEED_SPLITS:
        workdir = dirs / "split" if (devices, per_device) == (4, 8) else None
        with _reading() as rows:
            result = _train(_staged(dirs, per_device), workdir, devices)
        assert result.plan.grad_accum_steps == accum
        out[devices, per_device, accum] = result, rows
    with _reading() as first_rows:
        first = _train(_staged(dirs, 8), dirs / "cut", 4, stop_after_micro_steps=1)
    assert first.stopped and first.plan.grad_accum_steps == 1
    with _reading() as rows:  # resumed as another user writes the same stages
        resumed = _train(_staged(dirs, 8, _unweighted(dirs), RESPELLED), dirs / "cut", 2)
    assert resumed.plan.grad_accum_steps == 2
    out["cut"] = first_rows, resumed, rows
    return out


def _losses(records):
    return [r["loss"] for r in records if "loss" in r]


def _host(params):
    import jax

    return jax.device_get(params)  # runs on other devices: compared as numpy arrays


def test_the_seed_splits_read_the_same_rows_and_train_the_same_model(runs):
    """Each split reads the same 128 rows (exactly), so the same losses and params, and each
    source's eval is the same. Tolerances as test_equivalence's, for the same reason: the
    splits sum the same per-example gradients in another order (float32 round-off, a few
    ulps a step). Measured here over four adamw steps: losses within 4.6e-7 relative,
    params within 1.6e-7 absolute; every eval within 6.3e-8 relative (EVAL_RTOL)."""
    reference, reference_rows = runs[SEED_SPLITS[0]]
    assert sorted(reference_rows) == list(range(128))
    evals = [r for r in reference.records if "eval_loss" in r]
    assert [e["step"] for e in evals] == [4]
    for split in SEED_SPLITS[1:]:
        result, rows = runs[split]
        assert rows == reference_rows, split
        np.testing.assert_allclose(
            _losses(result.records), _losses(reference.records), rtol=LOSS_RTOL, err_msg=str(split)
        )
        worst = max_param_diff(_host(result.state.params), _host(reference.state.params))
        assert worst < PARAM_ATOL, (split, worst)
        (mine,) = [r for r in result.records if "eval_loss" in r]
        for name in ("web", "code"):
            assert mine["eval_loss_by_source"][name] == pytest.approx(
                evals[0]["eval_loss_by_source"][name], rel=EVAL_RTOL
            ), (split, name)


def test_a_resume_on_2_devices_reads_the_rows_of_an_uninterrupted_run(runs, dirs):
    """Stopped after step 1 on 4 devices (inside the first stage) and resumed on 2, with the
    stages respelled (RESPELLED: whole weights, data.mixture's left out), the run crosses the
    stage boundary at 64 reading exactly the uninterrupted run's rows, in order, and trains
    the same model (test_checkpoint's tolerances for another device count;
    measured: losses within 4.0e-7 relative, params within 6.3e-8 absolute)."""
    reference, reference_rows = runs[SEED_SPLITS[0]]
    first_rows, resumed, rows = runs["cut"]
    assert set(first_rows) >= set(range(32))  # and perhaps step 2's rows, read ahead
    assert all(first_rows[i] == reference_rows[i] for i in first_rows)
    assert sorted(rows) == list(range(32, 128))  # nothing before its position
    assert [rows[i] for i in range(32, 128)] == [reference_rows[i] for i in range(32, 128)]
    records = read_metrics(dirs / "cut")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    np.testing.assert_allclose(_losses(records), _losses(reference.records), rtol=LOSS_RTOL)
    worst = max_param_diff(_host(resumed.state.params), _host(reference.state.params))
    assert worst < PARAM_ATOL, worst
    assert resumed.summary["examples_by_source"] == reference.summary["examples_by_source"]


def test_the_summary_counts_each_sources_rows_and_eval(runs, dirs):
    """128 rows: stage 0's two blocks at 0.9/0.1 give round(64 × 0.1) = 6 code rows (exact
    after each block), stage 1's two blocks 16 each; eval_loss is Σ weight × loss over both
    sources' held-out rows."""
    result, _ = runs[SEED_SPLITS[0]]
    summary = result.summary
    train, held_out = _sources(dirs)
    assert summary["examples_by_source"] == {"code": 38, "web": 90}
    assert summary["epochs_by_source"] == {
        "code": 38 / len(train.parts[0]),
        "web": 90 / len(train.parts[1]),
    }
    last = [r for r in result.records if "eval_loss" in r][-1]
    weights = [
        data_lib.row_weight_sums(part, np.arange(data_lib.eval_row_count(part, 4))).sum()
        for part in held_out.parts
    ]
    losses = [last["eval_loss_by_source"][name] for name in held_out.names]
    assert last["eval_loss"] == pytest.approx(np.dot(weights, losses) / sum(weights), rel=1e-12)
    assert summary["eval_loss_by_source"] == last["eval_loss_by_source"]
    # docs/data.md shows this run's summary: its fields, to the digits it prints
    page = (pathlib.Path(__file__).parents[1] / "docs" / "data.md").read_text()
    section = page.split("\n## Mix sources\n", 1)[1].split("\n## ", 1)[0]
    shown = json.loads("{" + section.split("```json\n", 1)[1].split("```", 1)[0] + "}")
    assert shown["examples_by_source"] == summary["examples_by_source"]
    assert shown["epochs_by_source"] == pytest.approx(summary["epochs_by_source"], abs=5e-4)
    assert shown["eval_loss_by_source"] == pytest.approx(summary["eval_loss_by_source"], abs=5e-5)
    assert shown["eval_loss"] == pytest.approx(summary["eval_loss"], abs=5e-5)


def test_a_resume_may_add_a_later_stage_but_not_change_a_past_one(runs, dirs):
    """The run at 128 examples resumed (by the CLI, on 8 devices) with a stage added from
    128, where it stopped at a step boundary (an annealing stage; no row it trained on came
    from it), is the finished run; a changed stage from 64 (inside the rows it trained on)
    is refused, naming the stage and the sources whose share moved, each stage written as
    data.mixture_stages takes it."""
    resume = [*RUN, *STAGED, _mix(dirs), "batch.per_device_batch_size=4"]
    resume += ["--workdir", str(dirs / "split")]
    done = jaxkit(*resume, STAGES + ",128:web=0.2+code=0.8")
    assert done.returncode == 0, done.stderr
    assert "holds a finished run of 4 steps" in done.stdout, done.stdout
    done = jaxkit(*resume, "data.mixture_stages=0:web=0.9+code=0.1,64:web=0.3+code=0.7")
    assert done.returncode == 2, (done.stdout, done.stderr)
    said = (
        "data.mixture's stage from example 64, whose rows the saved run trained on (examples "
        "0-127): code draws 50% of the rows (saved) -> 70%, web 50% -> 30% (saved: "
        "64:web=0.5+code=0.5; now: 64:web=0.3+code=0.7)"
    )
    assert said in done.stderr, done.stderr


def test_a_stage_whose_rows_a_mid_step_save_holds_may_not_change(runs, dirs):
    """Stopped one micro-step into step 3 (2 devices, K = 2: micro-batches of 16 rows), the
    checkpoint's position is 64, where the second stage starts, and its accumulator holds
    rows 64-79 of that stage, which a resume continues: a change to it is refused (from
    the same position at a step boundary it would not be). The programs are the
    fixture's."""
    from jaxkit.train.checkpoint import CheckpointError

    stopped = _train(_staged(dirs, 8), dirs / "mid", 2, stop_after_micro_steps=5)
    assert stopped.stopped and stopped.plan.grad_accum_steps == 2
    other = "data.mixture_stages=0:web=0.9+code=0.1,64:web=0.3+code=0.7"
    with pytest.raises(CheckpointError) as caught:
        _train(_staged(dirs, 8, stages=other), dirs / "mid", 2)
    said = (
        "data.mixture's stage from example 64, whose rows the saved run trained on (examples 0-79)"
    )
    assert said in str(caught.value), caught.value


def test_a_resume_on_other_tokens_names_the_source_that_changed(dirs, tmp_path):
    """The data facts a checkpoint records hold every source's fingerprint: code's
    directory with other tokens (same counts) is named as what changed, web is not."""
    import shutil

    from jaxkit.train.checkpoint import data_changes

    shutil.copytree(dirs / "web", tmp_path / "web")
    rng = np.random.default_rng(9)
    code = _docs(rng, 10, 20)
    write_prepared(tmp_path / "code", {"train": code, "eval": code[:3]}, vocab_size=64, eod_id=1)
    saved = data_lib.data_facts(*_sources(dirs))
    changed = data_lib.data_facts(*_sources(tmp_path))
    assert saved["fingerprint"]["eod_id"] == 1  # shared: sample and export read it here
    lines = data_changes(saved, changed)
    assert lines and all(line.startswith("  mixture.code.") for line in lines), lines
    assert any("mixture.code.shard_digest" in line for line in lines), lines


def test_each_sources_masks_score_its_rows_in_the_mixture(tmp_path):
    """A prompt/completion source (masked) mixed with plain documents: each row carries its
    own source's weights (only completions scored in the first, every target but padding
    in the second), and a step's normaliser sums them over the whole global batch."""
    rng = np.random.default_rng(4)
    sft = _docs(rng, 20, 6)
    write_prepared(tmp_path / "sft", {"train": sft, "eval": sft[:3]}, vocab_size=64, eod_id=1)
    plain = _docs(rng, 20, 6)
    write_prepared(
        tmp_path / "plain",
        {"train": plain, "eval": plain[:3]},
        vocab_size=64,
        eod_id=1,
        masked=False,
    )
    value = {
        "sft": {"path": str(tmp_path / "sft"), "weight": 1},
        "plain": {"path": str(tmp_path / "plain"), "weight": 1},
    }
    config = load_config("llama_tiny")
    apply_overrides(
        config, [*RUN[2:-1], "data.rows=documents", "data.mixture=" + json.dumps(value)]
    )
    check_values(config)
    train, _ = data_lib.make_sources(run_config(config))
    ids = train.stream_rows(0, 64, 0)
    got = train[ids]["weights"]
    for s, part in enumerate(train.parts):
        here = (ids >= train.offsets[s]) & (ids < train.offsets[s + 1])
        assert here.any()
        np.testing.assert_array_equal(got[here], part[ids[here] - train.offsets[s]]["weights"])
    # NAME order: plain's rows first. A plain document of 3 + 6 + eod tokens scores its 9
    # targets; an sft one its 6 completion tokens and the eod, never the prompt's.
    sums = got.sum(axis=1)
    assert set(sums[ids < train.offsets[1]].tolist()) == {9.0}
    assert set(sums[ids >= train.offsets[1]].tolist()) == {7.0}
    assert data_lib.step_weight(train, 0, 64, 0) == got.sum()


@pytest.mark.parametrize(
    ("stages", "said"),
    [
        ("0:web=1+rare=1", "data.mixture_stages stage '0:web=1+rare=1': 'rare=1' is not NAME"),
        ("0:web=1", "data.mixture_stages stage '0:web=1' gives no weight for code"),
        ("0:web=1+code=1", "data.mixture's weights differ from data.mixture_stages' first"),
        ("64:web=9+code=1", "data.mixture_stages must start at 0"),
        ("0:web=9+code=1,1k:web=1+code=0", "data.mixture_stages stage '1k:web=1+code=0': "),
    ],
)
def test_a_bad_stage_is_refused_in_one_line(dirs, stages, said):
    config = load_config("llama_tiny")
    apply_overrides(config, [*RUN[2:-1], _mix(dirs), f"data.mixture_stages={stages}"])
    with pytest.raises(ConfigError) as caught:
        check_values(config)
    assert str(caught.value).startswith(said), caught.value


def test_a_config_file_gives_the_mixture_as_a_dict(dirs, tmp_path):
    """configs name the sources in a dict (field names cannot hold a path's dots)."""
    (tmp_path / "mix.py").write_text(
        "from jaxkit.config import load_config\n\n"
        "def get_config():\n"
        "    c = load_config('llama_tiny')\n"
        "    c.data.source = 'tokens'\n"
        "    c.data.path = None\n"
        f"    c.data.mixture = {json.loads(_mix(dirs).split('=', 1)[1])!r}\n"
        "    return c\n"
    )
    config = load_config(str(tmp_path / "mix.py"))
    apply_overrides(config, RUN[2:-1])
    check_values(config)
    train, held_out = data_lib.make_sources(run_config(config))
    assert train.names == held_out.names == ("code", "web")
