"""data.source=tokens: rows of token files, read by memory map or in ranges, with weights,
segments and the errors a user meets before training."""

import json
import os
import shutil

import fsspec
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_run import jaxkit
from flax import nnx
from small_configs import SMALL_LM
from token_dirs import write_prepared

from jaxkit.config import ConfigError, apply_overrides, load_config, run_config, validate
from jaxkit.data import token_files
from jaxkit.data.sources import DataError, make_sources
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
    train, held_out = make_sources(run_config(config))
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
    train, _ = make_sources(run_config(config))
    np.testing.assert_array_equal(train[np.array([1])]["inputs"][0], big[8:16])
    config = lm_config(
        "data.source=tokens", f"data.path={tmp_path}/other.npy", "model.vocab_size=400"
    )
    train, _ = make_sources(run_config(config))
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
    train, _ = make_sources(run_config(config))
    assert isinstance(train.split.tokens.shards[0], token_files._RangeFile)
    row = 187  # tokens 1496..1504: across the two objects
    np.testing.assert_array_equal(train[np.array([row])]["inputs"][0], stream[1496:1504])


def test_prepared_windows_carry_mask_weights_and_documents_pad(tmp_path):
    docs = [([1, 2, 3], [4, 5]), ([6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]), ([18], [19])]
    write_prepared(tmp_path, {"train": docs * 4, "eval": docs}, shard_docs=5)
    config = lm_config("data.source=tokens", f"data.path={tmp_path}", "model.vocab_size=257")
    train, held_out = make_sources(run_config(config))
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
    train, held_out = make_sources(run_config(config))
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
        graphdef, params = nnx.split(build_model(run_config(config), nnx.Rngs(0)))
    first, second = [3, 4, 5, 9], [6, 7, 8, 10]  # 9 ends the first document
    packed = np.array([first + second])
    segment_ids, positions = token_files.segments(packed, eod_id=9)

    @jax.jit  # the four calls in one compiled program, not an op at a time
    def logits(p):
        model = nnx.merge(graphdef, p)
        together = model(jnp.asarray(packed), jnp.asarray(segment_ids), jnp.asarray(positions))
        alone = [model(jnp.array([doc])) for doc in (first, second)]
        return together, *alone, model(jnp.asarray(packed))

    together, first_alone, alone, unmasked = logits(params)
    np.testing.assert_allclose(together[0, 4:], alone[0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(together[0, :4], first_alone[0], atol=2e-5)
    assert float(jnp.max(jnp.abs(unmasked[0, 4:] - alone[0]))) > 1e-2


def test_training_with_a_document_mask_and_padded_documents(tmp_path):
    docs = [([1, 2, 3], [4, 5, 6]), ([7, 8], [9, 10, 11, 12])] * 40
    write_prepared(tmp_path, {"train": docs, "eval": docs[:6]})
    from jaxkit.train.loop import train

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
        make_sources(run_config(lm_config(*base, f"data.path={tmp_path}/odd.bin")))
    with pytest.raises(DataError, match="matches no token file"):
        make_sources(run_config(lm_config(*base, f"data.path={tmp_path}/nothing-*.bin")))
    (tmp_path / "odd.bin").unlink()
    np.full(100, 300, dtype="<u2").tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match=r"token id 300, not below model.vocab_size=257"):
        make_sources(run_config(lm_config(*base, f"data.path={tmp_path}/big.bin")))
    with pytest.raises(DataError, match="needs the document index"):
        make_sources(
            run_config(
                lm_config(
                    *base,
                    f"data.path={tmp_path}/big.bin",
                    "model.vocab_size=301",
                    "data.rows=documents",
                )
            )
        )
    prepared = tmp_path / "prepared"
    write_prepared(prepared, {"train": [([1], [2])] * 30, "eval": [([1], [2])] * 3},
                   vocab_size=1000, eod_id=999)  # fmt: skip
    with pytest.raises(DataError, match=r"1000-token vocabulary, above model\.vocab_size=257"):
        make_sources(run_config(lm_config(*base, f"data.path={prepared}")))
    meta = json.loads((prepared / "meta.json").read_text())
    (prepared / "meta.json").write_text(json.dumps(meta | {"version": 99}))
    with pytest.raises(DataError, match=r"not a jaxkit\.tokens version 1 meta\.json"):
        make_sources(run_config(lm_config(*base, f"data.path={prepared}", "model.vocab_size=1000")))
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
        make_sources(run_config(lm_config("data.source=tokens", f"data.path={tmp_path}/t.bin")))


def test_uint32_ids_read_as_uint16_are_refused(tmp_path):
    """uint32 ids below 65,536 read as uint16 give [id, 0, id, 0, ...]: ids in range, so only
    the zeros at every odd position of the files show it, in both splits wherever they cut."""
    ids = (np.arange(3001) % 200 + 1).astype("<u4")  # 3001: the held-out split cuts oddly
    ids.tofile(tmp_path / "t.bin")
    parts = [
        token_files.Stream([np.fromfile(tmp_path / "t.bin", "<u2")], lo, hi)
        for lo, hi in ((0, 5401), (5401, 6002))
    ]
    assert [token_files.token_range(p, chunk=64).odd_top for p in parts] == [0, 0]
    with pytest.raises(DataError, match=r"^data\.token_dtype=uint32 .*every second id is 0 "):
        make_sources(run_config(lm_config("data.source=tokens", f"data.path={tmp_path}/t.bin")))
    make_sources(
        run_config(
            lm_config(
                "data.source=tokens", f"data.path={tmp_path}/t.bin", "data.token_dtype=uint32"
            )
        )
    )
    # Real uint16 ids: one nonzero id at an odd position is enough to tell.
    ids.astype("<u2").tofile(tmp_path / "t.bin")
    make_sources(run_config(lm_config("data.source=tokens", f"data.path={tmp_path}/t.bin")))


def test_uint32_ids_above_65535_read_as_uint16_are_refused(tmp_path):
    """uint32 ids of a 100,000-token vocabulary read as uint16 give [low half, high half,
    ...]: every low half is below 65,536, so in the vocabulary, and every high half is 0 or
    1 (≤ 99,999 // 65,536). High halves at every odd position, with a low half above what a
    high half can be at an even one, are refused; real uint16 ids that are all small pass."""
    ids = np.random.default_rng(0).integers(0, 100_000, size=3001).astype("<u4")
    assert ids.max() >= 2**16 and (ids >= 2**16).mean() > 0.3  # many ids need their high half
    ids.tofile(tmp_path / "t.bin")
    base = ["data.source=tokens", f"data.path={tmp_path}/t.bin", "model.vocab_size=100000"]
    with pytest.raises(
        DataError, match=r"^data\.token_dtype=uint32 .*every second id is at most 1 "
    ):
        make_sources(run_config(lm_config(*base)))
    train, _ = make_sources(run_config(lm_config(*base, "data.token_dtype=uint32")))
    np.testing.assert_array_equal(train[np.array([1])]["inputs"][0], ids[8:16])
    # uint16 ids of 0 and 1 only: every odd id is ≤ 1, but so is every even one, which a
    # low half need not be. Inconclusive, so read as they are.
    bits = np.random.default_rng(1).integers(0, 2, size=3000).astype("<u2")
    bits.tofile(tmp_path / "t.bin")
    train, _ = make_sources(run_config(lm_config(*base)))
    np.testing.assert_array_equal(train[np.array([2])]["targets"][0], bits[17:25])


def test_uint32_ids_read_as_uint16_are_refused_whatever_model_vocab_size_says(tmp_path):
    """uint32 ids up to 70,000 read as uint16 were refused with "set model.vocab_size=65535
    (or more)"; given that (or 65,536), every high half (0 or 1) fits the vocabulary, the
    check that held high halves against it passed, and the run trained on [low half, high
    half, ...]. Tiny high halves at every odd position beside low halves above 4,095, over
    1,024 ids at least, are refused at any vocabulary size."""
    ids = np.random.default_rng(0).integers(0, 70_000, size=1024).astype("<u4")  # 2,048 halves
    ids.tofile(tmp_path / "t.bin")
    data = ["data.source=tokens", f"data.path={tmp_path / 't.bin'}", "train.steps=1"]
    for vocab in (65_535, 65_536, 1 << 20):
        done = jaxkit(
            "train", "lm_tiny", *SMALL_LM, *data, f"model.vocab_size={vocab}",
            "--workdir", str(tmp_path / "run"), "--no-progress",
        )  # fmt: skip
        err = done.stderr.splitlines()
        assert done.returncode == 2 and len(err) == 1, (vocab, done.returncode, err)
        assert err[0].startswith("jaxkit: error: data.token_dtype=uint32 "), err[0]
    # Fewer than 1,024 ids do not tell real uint16 ids from halves: read as they are.
    ids[:500].tofile(tmp_path / "t.bin")
    make_sources(run_config(lm_config(*data[:2], "model.vocab_size=65536")))


def test_with_init_from_a_larger_vocabulary_is_another_tokenizer(tmp_path):
    """With model.init_from, model.vocab_size is config.json's: data of a larger vocabulary
    was prepared with another tokenizer, which is what the refusal says (not "set
    model.vocab_size=...", which init_from would refuse as a contradiction)."""
    from test_hf_io import SMALL, small_config, write_hf

    write_hf(tmp_path / "hf", small_config().model)  # 256 ids, no tokenizer (trains as given)
    docs = [([300, 1], [2, 3])] * 40
    write_prepared(tmp_path / "data", {"train": docs, "eval": docs[:4]}, vocab_size=500)
    np.arange(400, dtype="<u2").tofile(tmp_path / "foreign.bin")
    init_from = f"model.init_from=hf:{tmp_path / 'hf'}"
    for path, says in ((tmp_path / "data", "500-token"), (tmp_path / "foreign.bin", "id 399")):
        data = ["data.source=tokens", f"data.path={path}", "train.steps=1"]
        done = jaxkit(
            "train", "llama_tiny", *SMALL, init_from, *data,
            "--workdir", str(tmp_path / "run"), "--no-progress",
        )  # fmt: skip
        err = done.stderr.splitlines()
        assert done.returncode == 2 and len(err) == 1, (path, done.returncode, err)
        assert says in err[0] and "another tokenizer" in err[0], err[0]
        assert "set model.vocab_size" not in err[0], err[0]


def test_nanogpt_layout_trains_on_train_bin_and_holds_out_val_bin(tmp_path):
    """nanoGPT's prepare.py writes train.bin and val.bin (and a meta.pkl for some corpora):
    val.bin is the held-out split whatever data.eval_fraction says, never trained on."""
    rng = np.random.default_rng(0)
    train_ids = rng.integers(0, 256, size=900).astype("<u2")
    val_ids = rng.integers(0, 256, size=300).astype("<u2")
    train_ids.tofile(tmp_path / "train.bin")
    val_ids.tofile(tmp_path / "val.bin")
    (tmp_path / "meta.pkl").write_bytes(b"\x80\x04N.")
    config = lm_config("data.source=tokens", f"data.path={tmp_path}", "data.eval_fraction=0.5")
    train, held_out = make_sources(run_config(config))
    assert (len(train), len(held_out)) == ((900 - 1) // 8, (300 - 1) // 8)
    rows = train[np.arange(len(train))]["inputs"]
    np.testing.assert_array_equal(rows.reshape(-1), train_ids[: len(train) * 8])
    held = held_out[np.arange(len(held_out))]["targets"]
    np.testing.assert_array_equal(held.reshape(-1), val_ids[1 : len(held_out) * 8 + 1])
    assert "holding out val.bin (data.eval_fraction does not apply)" in train.note


def test_a_glob_over_nanogpt_layout_is_refused_naming_the_directory(tmp_path):
    """`DIR/*.bin` read train.bin and val.bin as one stream: the held-out tail was val.bin's
    last part and the rest of val.bin was trained on. train.bin named alone is no leak."""
    (np.arange(900, dtype="<u2") % 251).tofile(tmp_path / "train.bin")
    (np.arange(300, dtype="<u2") % 251).tofile(tmp_path / "val.bin")
    for path in (f"{tmp_path}/*.bin", f"{tmp_path}/*", f"{tmp_path}/[tv]*.bin"):
        with pytest.raises(DataError, match=rf"val\.bin.*pass data\.path={tmp_path} \(trains"):
            make_sources(run_config(lm_config("data.source=tokens", f"data.path={path}")))
    config = lm_config("data.source=tokens", f"data.path={tmp_path}/train.bin")
    train, held_out = make_sources(run_config(config))
    assert len(train) + len(held_out) <= (900 - 1) // 8


def test_a_glob_into_a_prepared_directory_is_refused_and_side_files_are_no_tokens(tmp_path):
    """Read file by file, a prepared directory would train on its eval shards and drop its
    masks: a glob or a file inside one is refused, naming the directory. Among foreign
    files a glob reads only .bin and .npy (a stray json is no token ids)."""
    prepared = tmp_path / "prep"
    write_prepared(prepared, {"train": [([1], [2, 3])] * 40, "eval": [([1], [2])] * 8})
    for path in (f"{prepared}/*.bin", f"{prepared}/*", f"{prepared}/train-00000.bin"):
        with pytest.raises(
            DataError, match=rf"reaches into {prepared}, a prepared .*data\.path={prepared} inst"
        ):
            make_sources(run_config(lm_config("data.source=tokens", f"data.path={path}")))
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    stream = np.arange(1000, dtype="<u2") % 251
    stream[:600].tofile(foreign / "a.bin")
    stream[600:].tofile(foreign / "b.bin")
    (foreign / "notes.json").write_text('{"vocab_size": 251}')
    config = lm_config("data.source=tokens", f"data.path={foreign}/*", "data.eval_fraction=0.2")
    train, held_out = make_sources(run_config(config))
    assert (len(train), len(held_out)) == ((800 - 1) // 8, (200 - 1) // 8)
    np.testing.assert_array_equal(held_out[np.array([0])]["inputs"][0], stream[800:808])
    with pytest.raises(DataError, match=r"notes\.json' is a side file"):
        make_sources(run_config(lm_config("data.source=tokens", f"data.path={foreign}/notes.json")))


def test_a_prepared_directory_is_checked_against_its_meta(tmp_path):
    """A directory whose meta.json is gone is not read as foreign files (its eval shards
    and document offsets would become training tokens); a shard cut short, a missing
    document index and a meta.json without its entries are refused before training."""
    docs = [([1, 2], [3, 4, 5])] * 40
    base = ["data.source=tokens", "model.vocab_size=257", "data.rows=documents"]

    def fresh(name):
        write_prepared(tmp_path / name, {"train": docs, "eval": docs[:4]})
        return tmp_path / name

    assert len(make_sources(run_config(lm_config(*base, f"data.path={fresh('ok')}")))[0]) == 40
    no_meta = fresh("no_meta")
    (no_meta / "meta.json").unlink()
    with pytest.raises(DataError, match=r"prepared directory.s shards but no meta\.json"):
        make_sources(
            run_config(
                lm_config("data.source=tokens", "model.vocab_size=257", f"data.path={no_meta}")
            )
        )
    cut = fresh("cut")
    shard = cut / "train-00000.bin"
    shard.write_bytes(shard.read_bytes()[:-20])  # ten uint16 tokens fewer
    with pytest.raises(DataError, match=r"230 tokens .* but meta\.json says 240"):
        make_sources(run_config(lm_config(*base, f"data.path={cut}")))
    gone = fresh("gone")
    (gone / "train-00000.docs.npy").unlink()
    with pytest.raises(DataError, match="a shard of the train split cannot be read"):
        make_sources(run_config(lm_config(*base, f"data.path={gone}")))
    past = fresh("past")
    np.save(past / "train-00000.docs.npy", np.array([0, 5, 500]))
    with pytest.raises(DataError, match="document starts do not lie in order"):
        make_sources(run_config(lm_config(*base, f"data.path={past}")))
    broken = fresh("broken")
    meta = json.loads((broken / "meta.json").read_text())
    del meta["shards"]
    (broken / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="no valid 'shards' entry"):
        make_sources(run_config(lm_config(*base, f"data.path={broken}")))


def test_negative_ids_in_a_signed_npy_are_refused(tmp_path):
    ids = np.arange(400, dtype=np.int32) % 200
    ids[::7] = -1
    np.save(tmp_path / "neg.npy", ids)
    with pytest.raises(DataError, match="token id -1: ids are ≥ 0"):
        make_sources(run_config(lm_config("data.source=tokens", f"data.path={tmp_path}/neg.npy")))


def test_held_out_rows_that_score_nothing_are_refused_before_training(tmp_path):
    docs = [([1, 2, 3, 4, 5, 6], [7])] * 4  # seq_len 2: every row is prompt only
    write_prepared(tmp_path, {"train": [([1], [2, 3])] * 80, "eval": docs})
    from jaxkit.train.loop import train

    config = lm_config("data.source=tokens", f"data.path={tmp_path}", "model.vocab_size=257",
                       "data.rows=documents", "data.seq_len=2")  # fmt: skip
    with pytest.raises(DataError, match="held-out rows an eval reads score no target"):
        train(config, progress=False, echo=lambda *a: None)


def test_plan_refuses_token_data_above_the_vocabulary_as_train_does(tmp_path, capsys):
    """docs/data.md: the checks apply to `plan` too; the prepared vocabulary, and a foreign file's
    largest id, against model.vocab_size."""
    from jaxkit import cli

    write_prepared(tmp_path / "big", {"train": [([1], [2, 3])] * 80, "eval": [([1], [2])] * 8},
                   vocab_size=1000)  # fmt: skip
    np.array([1, 2, 700, 3] * 100, dtype="<u2").tofile(tmp_path / "foreign.bin")
    for path, said in (
        (tmp_path / "big", "holds ids of a 1000-token vocabulary, above model.vocab_size=257"),
        (tmp_path / "foreign.bin", "holds token id 700, not below model.vocab_size=257"),
    ):
        argv = ["plan", "lm_tiny", "data.source=tokens", f"data.path={path}", "data.seq_len=8",
                "batch.global_batch_size=8", "batch.per_device_batch_size=1",
                "model.vocab_size=257"]  # fmt: skip
        assert cli.main(argv) == 2, path
        assert said in capsys.readouterr().err
        assert cli.main([*argv[:-1], "model.vocab_size=1000"]) == 0  # fits: the plan is shown
        assert "global_batch_size" in capsys.readouterr().out


def byte_level_bpe(path):
    """A tokenizer.json of the 256 byte symbols and <|endoftext|> (id 0), no merges: a byte
    per token as `--tokenizer bytes` gives, so only the ids differ."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=257,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["abc"], trainer)
    tokenizer.save(str(path))
    assert tokenizer.get_vocab_size() == 257
    return str(path)


@pytest.fixture(scope="module")
def token_run(tmp_path_factory):
    """lm_tiny trained 2 steps through the CLI on 40 prepared byte documents of equal
    length (so any re-preparation keeps each split's row count): (inputs, DIR, workdir,
    the train command without its length)."""
    from jaxkit import cli

    root = tmp_path_factory.mktemp("token_run")
    rng = np.random.default_rng(0)
    (root / "in").mkdir()
    for i in range(40):
        (root / "in" / f"doc{i:02d}.txt").write_bytes(
            bytes(rng.integers(97, 123, size=40).tolist())
        )
    prepared = root / "tok"
    assert prepare_cli(root / "in", prepared) == 0
    overrides = [*SMALL_LM, "data.seq_len=8", "data.source=tokens", f"data.path={prepared}",
                 "model.vocab_size=257", "batch.global_batch_size=16",
                 "batch.per_device_batch_size=1"]  # fmt: skip
    args = ["train", "lm_tiny", *overrides, "--workdir", str(root / "w"), "--no-progress"]
    assert cli.main([*args, "train.steps=2"]) == 0
    return root / "in", prepared, root / "w", args


def prepare_cli(inputs, out, *options):
    from jaxkit import cli

    fixed = ["--eval-fraction", "0.2", "--workers", "1", "--no-progress"]
    return cli.main(["data", "prepare", str(inputs), "--tokenizer", "bytes", "--out", str(out),
                     *fixed, *options])  # fmt: skip


def test_a_resume_on_re_prepared_tokens_is_refused_naming_what_changed(token_run, capsys):
    """The same inputs prepared again with another seed (other documents held out) or
    another tokenizer (other ids) keep every row count: only the checkpoint's fingerprint
    of the tokens tells. Another eval fraction changes the counts too. Each resume is
    refused before anything compiles, one line per change."""
    from jaxkit import cli

    inputs, prepared, workdir, args = token_run
    tokenizer = byte_level_bpe(workdir.parent / "tokenizer.json")
    try:
        for options, changes in (
            (["--seed", "1"], ["  seed 0 (saved) -> 1"]),
            (["--tokenizer", tokenizer], [f"  tokenizer 'bytes' (saved) -> {tokenizer!r}",
                                          "  eod_id 256 (saved) -> 0"]),
            # 4 of the 40 documents of 41 tokens held out: (36·41 − 1) // 8 and (4·41 − 1) // 8
            (["--eval-fraction", "0.1"], ["  eval_fraction 0.2 (saved) -> 0.1",
                                          "  train_rows 163 (saved) -> 184",
                                          "  eval_rows 40 (saved) -> 20"]),
        ):  # fmt: skip
            assert prepare_cli(inputs, prepared, "--overwrite", *options) == 0
            capsys.readouterr()
            assert cli.main([*args, "train.steps=3", "--allow-longer"]) == 2
            out, err = capsys.readouterr()
            lines = err.splitlines()
            assert lines[0] == (
                f"jaxkit: error: {workdir} was trained on other data; its saved data "
                "position would read other rows:"
            ), err
            assert all(line in lines for line in changes), err
            assert any(line.startswith("  shard_digest '") for line in lines), err
            counted = any("rows" in line for line in lines[1:-1])
            assert counted == ("--eval-fraction" in options), err  # else the counts agree
            assert lines[-1].startswith("Restore the data the run was trained on"), err
            assert "resuming" not in out and "done:" not in out  # nothing restored or run
            assert sorted(os.listdir(workdir / "checkpoints")) == ["step_2"]
    finally:  # the fixture's data, as the run was trained on it
        assert prepare_cli(inputs, prepared, "--overwrite") == 0
    # The same inputs and options make the same fingerprint: this data resumes.
    from jaxkit.config import apply_overrides, load_config
    from jaxkit.data.sources import data_facts
    from jaxkit.train.checkpoint import data_changes

    saved = json.loads((workdir / "checkpoints" / "step_2" / "meta" / "metadata").read_text())
    config = load_config("lm_tiny")
    apply_overrides(config, [a for a in args[2:] if "=" in a])
    assert "fingerprint" in saved["data"]
    assert data_changes(saved["data"], data_facts(*make_sources(run_config(config)))) == []


def test_another_config_on_a_workdir_lists_the_config_differences(token_run, capsys):
    """`jaxkit train mlp_digits --workdir W` on lm_tiny's W: the configs are compared
    first, so the message lists their differences (as docs/checkpoints.md promises), not
    the data's."""
    from jaxkit import cli

    *_, workdir, _ = token_run
    capsys.readouterr()
    assert cli.main(["train", "mlp_digits", "--workdir", str(workdir), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{workdir} holds a run with a different config" in err, err
    assert "  model.kind: 'transformer' (saved) -> 'mlp'" in err.splitlines(), err
    assert "other data" not in err


def test_a_checkpoint_without_a_fingerprint_resumes_with_one_warning(token_run, tmp_path, capsys):
    """Checkpoints saved before fingerprints resume on their row counts, with one warning
    line; the checkpoints the resumed run saves carry the fingerprint again."""
    from jaxkit import cli

    *_, workdir, args = token_run
    old = tmp_path / "old"
    shutil.copytree(workdir, old)
    meta_file = old / "checkpoints" / "step_2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    fingerprint = meta["data"].pop("fingerprint")
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    args = [a if a != str(workdir) else str(old) for a in args]
    assert cli.main([*args, "train.steps=3", "--allow-longer"]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in (out + err).splitlines() if "warning" in line]
    assert len(warnings) == 1 and "records no fingerprint of its token data" in warnings[0], out
    assert "resuming from" in out and "step      3" in out
    resumed = json.loads((old / "checkpoints" / "step_3" / "meta" / "metadata").read_text())
    assert resumed["data"]["fingerprint"] == fingerprint


def test_a_train_bin_rewritten_past_its_first_block_is_refused_at_a_resume(tmp_path, capsys):
    """The fingerprint reads both ends of every shard: train.bin's last 4,096 ids rewritten
    (the same size) are other data, and a resume on them is refused. lm_tiny's shapes are
    token_run's, so its compile is shared."""
    from jaxkit import cli

    rng = np.random.default_rng(1)
    block = token_files.FINGERPRINT_BLOCK
    # More than two blocks: the last is not the first.
    ids = rng.integers(0, 256, size=2 * block + 1000).astype("<u2")
    ids.tofile(tmp_path / "train.bin")
    rng.integers(0, 256, size=300).astype("<u2").tofile(tmp_path / "val.bin")
    overrides = [*SMALL_LM, "data.seq_len=8", "data.source=tokens", f"data.path={tmp_path}",
                 "model.vocab_size=257", "batch.global_batch_size=16",
                 "batch.per_device_batch_size=1"]  # fmt: skip
    workdir = tmp_path / "w"
    args = ["train", "lm_tiny", *overrides, "--workdir", str(workdir), "--no-progress"]
    assert cli.main([*args, "train.steps=1"]) == 0
    ids[-block:] = (ids[-block:] + 1) % 256
    ids.tofile(tmp_path / "train.bin")
    capsys.readouterr()
    assert cli.main([*args, "train.steps=2", "--allow-longer"]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert lines[0] == (
        f"jaxkit: error: {workdir} was trained on other data; its saved data position would "
        "read other rows:"
    ), err
    assert len(lines) == 3 and lines[1].startswith("  shard_digest '"), err
    assert "resuming" not in out


def test_an_id_beyond_the_vocabulary_names_token_dtype_only_where_it_applies(tmp_path):
    """A .npy file states its dtype, which data.token_dtype does not change: its refusal
    suggested checking that key all the same. A .bin file's still does."""
    ids = np.arange(301, dtype=np.uint16)  # up to 300, beyond a vocabulary of 257
    np.save(tmp_path / "t.npy", ids)
    ids.tofile(tmp_path / "t.bin")
    for name, names_dtype in (("t.npy", False), ("t.bin", True)):
        done = jaxkit(
            "train", "lm_tiny", *SMALL_LM, "data.source=tokens",
            f"data.path={tmp_path / name}", "model.vocab_size=257",
            "--workdir", str(tmp_path / "run"), "--no-progress",
        )  # fmt: skip
        err = done.stderr.splitlines()
        assert done.returncode == 2 and len(err) == 1, (name, done.returncode, err)
        assert "token id 300, not below model.vocab_size=257" in err[0], err[0]
        assert ("data.token_dtype" in err[0]) == names_dtype, err[0]


def test_a_null_vocabulary_takes_a_mixtures_largest_and_refuses_files_that_record_none(tmp_path):
    """model.vocab_size=null: a mixture's largest meta.json vocabulary, named source by
    source; foreign files, which record none, a missing path and other sources are refused
    naming what the user gave (the run's own test is test_token_run's)."""
    docs = [([1], [2, 3])] * 20
    write_prepared(tmp_path / "a", {"train": docs, "eval": docs[:4]}, vocab_size=300)
    write_prepared(tmp_path / "b", {"train": docs, "eval": docs[:4]}, vocab_size=257)
    np.array([1, 2, 3] * 100, dtype="<u2").tofile(tmp_path / "foreign.bin")
    mix = {name: {"path": str(tmp_path / name), "weight": 1} for name in ("a", "b")}
    config = lm_config("data.source=tokens", "data.mixture=" + json.dumps(mix),
                       "model.vocab_size=null")  # fmt: skip
    said = token_files.take_vocabulary(config)
    assert config.model.vocab_size == 300
    assert said == (
        f"model.vocab_size=300: the vocabulary of data.mixture.a.path={tmp_path / 'a'}, "
        f"data.mixture.b.path={tmp_path / 'b'} (meta.json), as model.vocab_size=null asks"
    )
    validate(config)
    for overrides, refusal in [
        (["data.source=text"], "with data.source='text', give a number (at least 256: bytes)"),
        (
            ["data.source=tokens", f"data.path={tmp_path / 'foreign.bin'}"],
            f"data.path={str(tmp_path / 'foreign.bin')!r} names token files without one",
        ),
        (
            ["data.source=tokens", f"data.path={tmp_path / 'gone'}"],
            f"data.path={str(tmp_path / 'gone')!r} matches no token file",
        ),
    ]:
        config = lm_config(*overrides, "model.vocab_size=null")
        with pytest.raises(ConfigError) as e:
            token_files.take_vocabulary(config)
        assert refusal in str(e.value), e.value
        assert config.model.vocab_size is None
    assert token_files.take_vocabulary(lm_config("data.source=tokens")) is None  # 256 given
