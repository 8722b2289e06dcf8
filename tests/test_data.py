import numpy as np
import pytest

from jaxkit.batch.plan import make_batch_plan
from jaxkit.config import apply_overrides, load_config, run_config
from jaxkit.data.sources import (
    DataError,
    TokenWindows,
    global_batch_rows,
    load_micro_batch,
    make_sources,
    micro_batch_rows,
    process_row_range,
    stdlib_corpus,
    stream_rows,
)
from jaxkit.mesh import batch_sharding, make_mesh


def plan(dp, b, k):
    return make_batch_plan(
        mesh_shape={"data": dp, "fsdp": 1, "tensor": 1},
        global_batch_size=None,
        per_device_batch_size=b,
        grad_accum_steps=k,
    )


@pytest.mark.parametrize("step", [0, 3, 56, 57, 200])  # 56 full batches of 32 in 1800 rows
def test_every_split_of_a_global_batch_reads_the_same_rows(step):
    rows = global_batch_rows(step, 32, 1800, seed=7)
    assert len(rows) == 32 and len(set(rows.tolist())) == 32
    for dp, b, k in [(1, 32, 1), (4, 8, 1), (2, 8, 2), (1, 8, 4), (8, 1, 4)]:
        p = plan(dp, b, k)
        micro = [micro_batch_rows(step * 32, m, p, 1800, seed=7) for m in range(k)]
        np.testing.assert_array_equal(np.concatenate(micro), rows)


def test_order_depends_on_seed_and_covers_each_epoch_once():
    epoch = np.concatenate([global_batch_rows(i, 32, 100, seed=0) for i in range(3)])
    assert len(set(epoch.tolist())) == 96  # 3 batches of 32 from 100 rows, no repeats
    assert not np.array_equal(global_batch_rows(3, 32, 100, 0), global_batch_rows(0, 32, 100, 0))
    assert not np.array_equal(global_batch_rows(0, 32, 100, 0), global_batch_rows(0, 32, 100, 1))
    with pytest.raises(ValueError, match="exceeds the 10 training rows"):
        global_batch_rows(0, 32, 10, 0)


def test_the_stream_runs_through_epochs_whatever_the_batch_sizes():
    """Batches of changing sizes read consecutive examples: no row skipped or repeated."""
    n, seed = 100, 3
    # Independently of jaxkit: each epoch a seeded permutation, epochs end to end.
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(4)])
    position, read = 0, []
    for size in [32, 32, 64, 16, 48, 8, 96]:  # a batch that doubles, halves, straddles epochs
        read.append(stream_rows(position, size, n, seed))
        position += size
    np.testing.assert_array_equal(np.concatenate(read), stream[:position])
    for epoch in range(3):
        assert sorted(stream[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))


def test_a_process_holding_rows_in_several_blocks_reads_them_in_order():
    """fsdp across 2 slices with data = 2 over them: process 0 holds rows 0-3 and 8-11 of
    16 (data index × fsdp 4 + its fsdp 0-1). make_array_from_process_local_data takes a
    process's rows block by block, in order of where they start."""

    class Held:  # the blocks a sharding's addressable devices hold, one device each
        def __init__(self, *blocks):
            self.blocks = blocks

        def addressable_devices_indices_map(self, shape):
            return {i: (slice(a, b),) for i, (a, b) in enumerate(self.blocks)}

    picked = process_row_range(Held((8, 10), (0, 2), (2, 4), (10, 12)), 16)
    np.testing.assert_array_equal(picked, [0, 1, 2, 3, 8, 9, 10, 11])
    assert process_row_range(Held((2, 4), (0, 2), (0, 2)), 16) == slice(0, 4)  # tensor: twice


def test_each_device_gets_its_slice_of_the_micro_batch():
    mesh = make_mesh({"data": 4, "fsdp": 2, "tensor": 1})
    sharding = batch_sharding(mesh)
    assert process_row_range(sharding, 16) == slice(0, 16)  # one process holds every row
    tokens = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)
    source = TokenWindows(tokens, seq_len=8)
    p = make_batch_plan(
        mesh_shape={"data": 4, "fsdp": 2, "tensor": 1},
        global_batch_size=32,
        per_device_batch_size=2,
        grad_accum_steps=None,
    )
    batch = load_micro_batch(source, 5, 1, p, 0, sharding)
    rows = micro_batch_rows(5, 1, p, len(source), 0)
    assert batch["inputs"].shape == (16, 8)
    for shard in batch["inputs"].addressable_shards:
        lo = shard.index[0].start
        np.testing.assert_array_equal(np.asarray(shard.data), source[rows[lo : lo + 2]]["inputs"])


def test_token_windows_predict_the_next_byte():
    source = TokenWindows(np.frombuffer(b"abcdefghij", dtype=np.uint8), seq_len=3)
    assert len(source) == 3
    row = source[np.array([1])]
    assert bytes(row["inputs"][0].astype(np.uint8)) == b"def"
    assert bytes(row["targets"][0].astype(np.uint8)) == b"efg"
    # Targets are bytes 1..256 of 257 (row r's are r·L + 1 .. r·L + L): each byte value once.
    uniform = TokenWindows((np.arange(257) % 256).astype(np.uint8), seq_len=2)
    assert np.isclose(uniform.unigram_entropy(), np.log(256))
    # The first 2 rows score bytes 1, 2, 3, 4: the entropy of those, not of every byte.
    assert np.isclose(uniform.unigram_entropy(rows=2), np.log(4))


def test_default_corpus_is_the_stdlib_source_in_sorted_order():
    import pathlib
    import sysconfig

    # The expected corpus, built here: every .py file under the stdlib directory outside
    # site-packages, ordered by path components, their bytes concatenated, cut at the limit.
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts),
        key=lambda p: p.relative_to(root).parts,
    )
    expected, spanned = b"", 0
    while len(expected) < 100_000:
        expected += files[spanned].read_bytes()
        spanned += 1
    assert spanned >= 3  # several files, so their order shows in the bytes

    text = stdlib_corpus(20_000)
    assert len(text) == 20_000 and b"def " in text
    first = files[0].read_bytes()
    assert text[: len(first)] == first  # e.g. __future__.py, not the last file
    assert text == expected[:20_000]
    config = load_config("lm_tiny")
    apply_overrides(config, ["data.max_bytes=100000"])
    train, held_out = make_sources(run_config(config))
    assert len(train.tokens) == 95_000 and len(held_out.tokens) == 5_000
    # The held-out bytes are the corpus' tail: train then held-out is the corpus itself.
    assert bytes(train.tokens) + bytes(held_out.tokens) == expected[:100_000]


def test_digits_are_the_bundled_images():
    train, held_out = make_sources(run_config(load_config("mlp_digits")))
    assert len(train) + len(held_out) == 1797
    assert train.inputs.shape[1] == 64 and train.inputs.min() >= 0.0 and train.inputs.max() <= 1.0
    assert set(np.unique(train.targets)) == set(range(10))


def test_text_source_reads_a_local_file(tmp_path):
    text = (b"the quick brown fox jumps over the lazy dog. " * 200)[:8000]
    (tmp_path / "corpus.txt").write_bytes(text)
    config = load_config("lm_tiny")
    apply_overrides(
        config,
        [f"data.path={tmp_path / 'corpus.txt'}", "data.seq_len=16", "data.eval_fraction=0.25"],
    )
    train, held_out = make_sources(run_config(config))
    assert bytes(train.tokens) + bytes(held_out.tokens) == text
    assert len(train) == (6000 - 1) // 16
    apply_overrides(config, [f"data.path={tmp_path / 'missing.txt'}"])
    with pytest.raises(DataError, match="is not a readable file"):
        make_sources(run_config(config, checked=True))  # make_sources' own check


@pytest.mark.parametrize("name", ["lm_tiny", "mlp_digits"])
def test_synthetic_sources_are_fixed_and_shaped_for_the_model(name):
    config = load_config(name)
    apply_overrides(config, ["data.source=synthetic"])
    train, held_out = make_sources(run_config(config))
    again, _ = make_sources(run_config(config))
    np.testing.assert_array_equal(train.inputs, again.inputs)  # fixed, not re-drawn per call
    assert len(train) + len(held_out) == config.data.num_examples
    if name == "lm_tiny":
        assert train.inputs.shape[1] == config.data.seq_len
        np.testing.assert_array_equal(train.inputs[:, 1:], train.targets[:, :-1])
    else:
        assert train.inputs.shape[1] == 64 and set(np.unique(train.targets)) <= set(range(10))


def test_bad_data_settings_are_data_errors():
    for override, match in [
        ("data.source=images", "not one of text, digits, synthetic"),
        ("data.eval_fraction=1.0", "strictly in"),
    ]:
        config = load_config("mlp_digits")
        apply_overrides(config, [override])
        with pytest.raises(DataError, match=match):
            make_sources(run_config(config, checked=True))  # make_sources' own check
