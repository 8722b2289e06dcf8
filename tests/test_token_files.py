"""data.source=tokens: rows of token files, read by memory map or in ranges, with weights,
segments and the errors a user meets before training."""

import json

import fsspec
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from small_configs import SMALL_LM
from token_dirs import write_prepared

from jaxkit import token_files
from jaxkit.config import ConfigError, apply_overrides, load_config, validate
from jaxkit.data import DataError, make_sources
from jaxkit.models import build_model


def lm_config(*overrides, name="lm_tiny"):
    config = load_config(name)
    apply_overrides(config, [*SMALL_LM, "data.seq_len=8", *overrides])
    return config


def test_foreign_bin_files_are_one_stream_of_windows_across_files(tmp_path):
    """nanoGPT's layout: flat uint16 files. Rows are windows of L + 1 tokens at r·L,
    across the boundary between two files, exactly the concatenation's slices."""
    stream = np.random.default_rng(0).integers(0, 256, size=1000).astype("<u2")
    stream[:600].tofile(tmp_path / "a.bin")
    stream[600:].tofile(tmp_path / "b.bin")
    config = lm_config("data.source=tokens", f"data.path={tmp_path}", "data.eval_fraction=0.2")
    train, held_out = make_sources(config)
    assert len(train) == (800 - 1) // 8 and len(held_out) == (200 - 1) // 8
    rows = train[np.arange(len(train))]
    for r in range(len(train)):
        np.testing.assert_array_equal(rows["inputs"][r], stream[r * 8 : r * 8 + 8])
        np.testing.assert_array_equal(rows["targets"][r], stream[r * 8 + 1 : r * 8 + 9])
    assert "weights" not in rows  # unmasked text weighs 1 everywhere
    np.testing.assert_array_equal(train.row_weight_sums(np.arange(3)), [8, 8, 8])
    np.testing.assert_array_equal(held_out[np.array([0])]["inputs"][0], stream[800:808])
    assert 74 * 8 < 600 < 74 * 8 + 9  # row 74 crosses from a.bin into b.bin: checked above


def test_a_glob_an_npy_file_and_uint32(tmp_path):
    big = np.arange(300, dtype=np.uint32) * 1000  # ids above 2**16 need uint32
    big.astype("<u4").tofile(tmp_path / "part-0.bin")
    np.save(tmp_path / "other.npy", np.arange(400, dtype=np.uint16))
    config = lm_config(
        "data.source=tokens",
        f"data.path={tmp_path}/part-*.bin",
        "data.token_dtype=uint32",
        "model.vocab_size=300000",
    )
    train, _ = make_sources(config)
    np.testing.assert_array_equal(train[np.array([1])]["inputs"][0], big[8:16])
    config = lm_config(
        "data.source=tokens", f"data.path={tmp_path}/other.npy", "model.vocab_size=400"
    )
    train, _ = make_sources(config)
    np.testing.assert_array_equal(train[np.array([2])]["targets"][0], np.arange(17, 25))


def test_token_files_behind_a_url_are_read_in_ranges(tmp_path):
    """A URL (gs:// in practice) is read through fsspec, a range per row: fsspec's memory
    filesystem stands in for the bucket, and it cannot be memory-mapped."""
    stream = np.arange(2000, dtype="<u2") % 251
    fs = fsspec.filesystem("memory")
    with fs.open("/bucket/data/train-0.bin", "wb") as f:
        f.write(stream[:1500].tobytes())
    with fs.open("/bucket/data/train-1.bin", "wb") as f:
        f.write(stream[1500:].tobytes())
    config = lm_config("data.source=tokens", "data.path=memory://bucket/data")
    train, _ = make_sources(config)
    assert isinstance(train.split.tokens.shards[0], token_files._RangeFile)
    row = 187  # tokens 1496..1504: across the two objects
    np.testing.assert_array_equal(train[np.array([row])]["inputs"][0], stream[1496:1504])


def test_prepared_windows_carry_mask_weights_and_documents_pad(tmp_path):
    docs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]), ([18], [19])]
    write_prepared(tmp_path, {"train": docs * 4, "eval": docs}, shard_docs=5)
    config = lm_config("data.source=tokens", f"data.path={tmp_path}", "model.vocab_size=257")
    train, held_out = make_sources(config)
    stream = np.concatenate([[*p, *c, 256] for p, c in docs * 4])
    mask = np.concatenate([[0] * len(p) + [1] * (len(c) + 1) for p, c in docs * 4])
    rows = train[np.arange(len(train))]
    for r in range(len(train)):
        np.testing.assert_array_equal(rows["targets"][r], stream[r * 8 + 1 : r * 8 + 9])
        np.testing.assert_array_equal(rows["weights"][r], mask[r * 8 + 1 : r * 8 + 9])
    np.testing.assert_array_equal(
        train.row_weight_sums(np.arange(len(train))), rows["weights"].sum(axis=1)
    )
    # documents: one per row, the first L + 1 tokens, padded with the eod id at weight 0.
    config.data.rows = "documents"
    train, held_out = make_sources(config)
    assert len(train) == 12 and len(held_out) == 3
    rows = train[np.arange(3)]
    np.testing.assert_array_equal(rows["inputs"][0], [1, 2, 3, 4, 5, 256, 256, 256])
    np.testing.assert_array_equal(rows["weights"][0], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(rows["inputs"][1], [6, 7, 8, 9, 10, 11, 12, 13])  # cut at L+1
    np.testing.assert_array_equal(rows["targets"][1], [7, 8, 9, 10, 11, 12, 13, 14])
    np.testing.assert_array_equal(rows["weights"][1], [1] * 8)
    np.testing.assert_array_equal(train.row_weight_sums(np.arange(3)), [3, 8, 2])


def test_segments_restart_positions_after_each_end_of_document():
    inputs = np.array([[5, 6, 9, 7, 9, 9, 1, 2], [9, 1, 2, 3, 4, 5, 6, 7]])
    segment_ids, positions = token_files.segments(inputs, eod_id=9)
    np.testing.assert_array_equal(segment_ids[0], [0, 0, 0, 1, 1, 2, 3, 3])
    np.testing.assert_array_equal(positions[0], [0, 1, 2, 0, 1, 0, 0, 1])
    np.testing.assert_array_equal(segment_ids[1], [0, 1, 1, 1, 1, 1, 1, 1])
    np.testing.assert_array_equal(positions[1], [0, 0, 1, 2, 3, 4, 5, 6])


@pytest.mark.parametrize("kind", ["lm_tiny", "llama_tiny"])
@pytest.mark.parametrize("scan", [False, True])
def test_document_mask_makes_each_packed_document_see_only_itself(kind, scan):
    """A document packed after another gives the logits it gives alone: attention does
    not cross the boundary and positions restart (learned positions and rotary)."""
    config = lm_config(f"model.scan_layers={scan}", "model.remat=dots", name=kind)
    with nnx.use_eager_sharding(False):
        model = build_model(config, nnx.Rngs(0))
    first, second = [3, 4, 5, 9], [6, 7, 8, 10]  # 9 ends the first document
    packed = jnp.array([first + second])
    segment_ids, positions = token_files.segments(np.asarray(packed), eod_id=9)
    together = model(packed, jnp.asarray(segment_ids), jnp.asarray(positions))
    alone = model(jnp.array([second]))
    np.testing.assert_allclose(together[0, 4:], alone[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(together[0, :4], model(jnp.array([first]))[0], atol=2e-5)
    unmasked = model(packed)
    assert float(jnp.max(jnp.abs(unmasked[0, 4:] - alone[0]))) > 1e-2


def test_training_with_a_document_mask_and_padded_documents(tmp_path):
    docs = [([1, 2, 3], [4, 5, 6]), ([7, 8], [9, 10, 11, 12])] * 40
    write_prepared(tmp_path, {"train": docs, "eval": docs[:6]})
    from jaxkit.loop import train

    for extra in (["data.document_mask=true"], ["data.rows=documents"]):
        config = lm_config(
            "data.source=tokens",
            f"data.path={tmp_path}",
            "model.vocab_size=257",
            "train.steps=3",
            "batch.global_batch_size=16",
            "batch.per_device_batch_size=1",
            *extra,
        )
        result = train(config, progress=False, echo=lambda *a: None)
        assert np.isfinite(result.summary["eval_loss"]), extra


def test_bad_token_files_are_clear_errors(tmp_path):
    base = ["data.source=tokens", "model.vocab_size=257"]
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")  # 3 bytes: not whole uint16 ids
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        make_sources(lm_config(*base, f"data.path={tmp_path}/odd.bin"))
    with pytest.raises(DataError, match="matches no token file"):
        make_sources(lm_config(*base, f"data.path={tmp_path}/nothing-*.bin"))
    (tmp_path / "odd.bin").unlink()
    np.full(100, 300, dtype="<u2").tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match=r"token id 300, not below model.vocab_size=257"):
        make_sources(lm_config(*base, f"data.path={tmp_path}/big.bin"))
    with pytest.raises(DataError, match="needs the document index"):
        make_sources(lm_config(*base, f"data.path={tmp_path}/big.bin", "model.vocab_size=301",
                               "data.rows=documents"))  # fmt: skip
    prepared = tmp_path / "prepared"
    write_prepared(prepared, {"train": [([1], [2])] * 30, "eval": [([1], [2])] * 3},
                   vocab_size=1000, eod_id=999)  # fmt: skip
    with pytest.raises(DataError, match=r"1000-token vocabulary, above model\.vocab_size=257"):
        make_sources(lm_config(*base, f"data.path={prepared}"))
    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "meta.json").write_text(json.dumps(meta | {"version": 99}))
    with pytest.raises(DataError, match=r"not a jaxkit\.tokens version 1 meta\.json"):
        make_sources(lm_config(*base, f"data.path={prepared}", "model.vocab_size=1000"))
    with pytest.raises(ConfigError, match=r"data\.document_mask=True reads document ends"):
        validate(lm_config("data.document_mask=true"))
    with pytest.raises(ConfigError, match=r"data\.path"):
        validate(lm_config("data.source=tokens"))  # null: no files named


def test_foreign_files_state_no_vocabulary_so_every_id_is_checked(tmp_path):
    """The largest id is read once, in chunks, from both splits: one bad id in the held-out
    tail is found too."""
    stream = np.zeros(5000, dtype="<u2")
    stream[-3] = 512
    stream.tofile(tmp_path / "t.bin")
    assert token_files.token_range(token_files.Stream([np.asarray(stream)]), chunk=64)[:2] == (
        0,
        512,
    )
    with pytest.raises(DataError, match="token id 512"):
        make_sources(lm_config("data.source=tokens", f"data.path={tmp_path}/t.bin"))


def test_uint32_ids_read_as_uint16_are_refused(tmp_path):
    """uint32 ids below 65,536 read as uint16 give [id, 0, id, 0, ...]: ids in range, so only
    the zeros at every odd position of the files show it, in both splits wherever they cut."""
    ids = (np.arange(3001) % 200 + 1).astype("<u4")  # 3001: the held-out split cuts oddly
    ids.tofile(tmp_path / "t.bin")
    parts = [
        token_files.Stream([np.fromfile(tmp_path / "t.bin", "<u2")], lo, hi)
        for lo, hi in ((0, 5401), (5401, 6002))
    ]
    assert [token_files.token_range(p, chunk=64)[2] for p in parts] == [True, True]
    with pytest.raises(DataError, match=r"every second uint16 id is 0.*data\.token_dtype=uint32"):
        make_sources(lm_config("data.source=tokens", f"data.path={tmp_path}/t.bin"))
    make_sources(
        lm_config("data.source=tokens", f"data.path={tmp_path}/t.bin", "data.token_dtype=uint32")
    )
    # Real uint16 ids: one nonzero id at an odd position is enough to tell.
    ids.astype("<u2").tofile(tmp_path / "t.bin")
    make_sources(lm_config("data.source=tokens", f"data.path={tmp_path}/t.bin"))


def test_a_prepared_directory_is_checked_against_its_meta(tmp_path):
    """A directory whose meta.json is gone is not read as foreign files (its eval shards
    and document offsets would become training tokens); a shard cut short, a missing
    document index and a meta.json without its entries are refused before training."""
    docs = [([1, 2], [3, 4, 5])] * 40
    base = ["data.source=tokens", "model.vocab_size=257", "data.rows=documents"]

    def fresh(name):
        write_prepared(tmp_path / name, {"train": docs, "eval": docs[:4]})
        return tmp_path / name

    assert len(make_sources(lm_config(*base, f"data.path={fresh('ok')}"))[0]) == 40
    no_meta = fresh("no_meta")
    (no_meta / "meta.json").unlink()
    with pytest.raises(DataError, match=r"prepared directory.s shards but no meta\.json"):
        make_sources(lm_config("data.source=tokens", "model.vocab_size=257",
                               f"data.path={no_meta}"))  # fmt: skip
    cut = fresh("cut")
    shard = cut / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-20])  # ten uint16 tokens fewer
    with pytest.raises(DataError, match=r"230 tokens .* but meta\.json says 240"):
        make_sources(lm_config(*base, f"data.path={cut}"))
    gone = fresh("gone")
    (gone / "train-00000.docs.npy").unlink()
    with pytest.raises(DataError, match="a shard of the train split cannot be read"):
        make_sources(lm_config(*base, f"data.path={gone}"))
    past = fresh("past")
    np.save(past / "train-00000.docs.npy", np.array([0, 5, 500]))
    with pytest.raises(DataError, match="document starts do not lie in order"):
        make_sources(lm_config(*base, f"data.path={past}"))
    broken = fresh("broken")
    meta = json.loads((broken / "meta.json").read_text())
    del meta["shards"]
    (broken / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="no valid 'shards' entry"):
        make_sources(lm_config(*base, f"data.path={broken}"))


def test_negative_ids_in_a_signed_npy_are_refused(tmp_path):
    ids = np.arange(400, dtype=np.int32) % 200
    ids[::7] = -1
    np.save(tmp_path / "neg.npy", ids)
    with pytest.raises(DataError, match="token id -1: ids are ≥ 0"):
        make_sources(lm_config("data.source=tokens", f"data.path={tmp_path}/neg.npy"))


def test_held_out_rows_that_score_nothing_are_refused_before_training(tmp_path):
    docs = [([1, 2, 3, 4, 5, 6], [7])] * 80  # seq_len 2: every row is prompt only
    write_prepared(tmp_path, {"train": docs, "eval": docs[:4]})
    from jaxkit.loop import train

    config = lm_config("data.source=tokens", f"data.path={tmp_path}", "model.vocab_size=257",
                       "data.rows=documents", "data.seq_len=2")  # fmt: skip
    with pytest.raises(DataError, match="held-out rows an eval reads score no target"):
        train(config, progress=False, echo=lambda *a: None)


def test_a_resume_on_other_data_is_refused(tmp_path):
    """The data position counts examples: on re-prepared data it would name other rows."""
    from jaxkit.checkpoint import CheckpointError
    from jaxkit.loop import train

    data = tmp_path / "data"
    write_prepared(data, {"train": [([1], [2, 3])] * 80, "eval": [([1], [2])] * 8})
    config = lm_config("data.source=tokens", f"data.path={data}", "model.vocab_size=257",
                       "data.rows=documents", "train.steps=4", "batch.global_batch_size=16",
                       "batch.per_device_batch_size=1", "checkpoint.every=2")  # fmt: skip
    train(config, tmp_path / "run", progress=False, echo=lambda *a: None,
          stop_after_micro_steps=4)  # fmt: skip
    write_prepared(data, {"train": [([1], [2, 3])] * 96, "eval": [([1], [2])] * 8})
    with pytest.raises(CheckpointError, match=r"train_rows 80 \(saved\) -> 96"):
        train(config, tmp_path / "run", progress=False, echo=lambda *a: None)
