"""Hugging Face Llama weights in (model.init_from=hf:DIR) and out (`jaxkit export --hf`):
small random HF directories written here with safetensors.numpy, nothing downloaded.

The params a load gives are checked against names.from_hf (the whole tensors, in memory)
cast by numpy, bit for bit: loading renames, transposes and casts, it computes nothing.
"""

import functools
import json
import shutil
import types

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from cli_run import jaxkit
from token_dirs import prompt_completion_docs, write_prepared

from jaxkit.batch.schedule import plan_from_config
from jaxkit.config import ConfigError, apply_overrides, load_config, run_config
from jaxkit.data.sources import Position
from jaxkit.hf import load as hf_load
from jaxkit.hf import names
from jaxkit.mesh import make_mesh, mesh_shape
from jaxkit.records.metrics import read_metrics
from jaxkit.step.train_step import build
from jaxkit.train.checkpoint import Checkpointer
from jaxkit.train.loop import train
from jaxkit.train.resume import initial_state

BF16 = np.dtype(ml_dtypes.bfloat16)
# A Llama with GQA (4 query heads on 2 key/value heads), every dimension divisible by the
# fsdp=2 × tensor=2 mesh; the data's sizes shrink the step to milliseconds.
SMALL = [
    "model.vocab_size=256",
    "model.d_model=32",
    "model.num_layers=2",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "data.seq_len=16",
    "data.max_bytes=60000",
]


def small_config(*overrides):
    config = load_config("llama_tiny")
    apply_overrides(config, [*SMALL, *overrides])
    return config


def write_hf(directory, m, dtype=BF16, files=1, seed=0):
    """A random HF Llama directory for the model section `m`: config.json and its tensors in
    `files` safetensors files (with model.safetensors.index.json when more than one)."""
    rng = np.random.default_rng(seed)
    tensors = {
        t.name: rng.normal(0, 0.02, t.shape).astype(np.float32).astype(dtype)
        for t in names.hf_tensors(m)
    }
    directory.mkdir(parents=True, exist_ok=True)
    cfg = names.hf_config_from_model(m, torch_dtype=str(dtype))
    (directory / "config.json").write_text(json.dumps(cfg))
    if files == 1:
        safetensors.numpy.save_file(tensors, directory / "model.safetensors")
        return tensors
    order = list(tensors)
    weight_map = {}
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {name: tensors[name] for name in order[i::files]}
        safetensors.numpy.save_file(part, directory / file)
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


def paths_and_leaves(tree):
    return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def loaded_state(config, mesh_axes):
    config = run_config(config)
    mesh = make_mesh(mesh_axes)
    setup = build(config, plan_from_config(config, mesh_shape(mesh)), mesh)
    return setup, initial_state(config, setup)


@pytest.mark.parametrize(("scan", "files"), [(False, 1), (True, 3)])
def test_a_load_gives_from_hf_params_bitwise_on_a_sharded_mesh(tmp_path, scan, files):
    source = small_config(f"model.scan_layers={scan}")
    tensors = write_hf(tmp_path / "hf", source.model, files=files)
    config = small_config(f"model.init_from=hf:{tmp_path / 'hf'}", f"model.scan_layers={scan}")
    hf_load.apply_init_from(config)
    setup, state = loaded_state(config, {"data": 2, "fsdp": 2, "tensor": 2})
    # bfloat16 → float32 is exact: numpy's cast of the whole tensors is the reference.
    expected = jax.tree.map(lambda x: x.astype(np.float32), names.from_hf(tensors, config.model))
    got, want = paths_and_leaves(state.params), paths_and_leaves(expected)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == np.float32 and a.shape == b.shape, path
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=path)
    for (path, a), (_, s) in zip(got, paths_and_leaves(setup.state_shardings.params), strict=True):
        assert a.sharding == s, path  # born in the state's layout, fsdp and tensor sharded
    # The optimizer starts fresh: no step taken, zero moments and accumulator.
    assert int(state.step) == 0 and int(state.micro_step) == 0
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state.opt_state.acc_grads))


def test_each_device_reads_only_its_own_slice(tmp_path, monkeypatch):
    source = small_config()
    tensors = write_hf(tmp_path / "hf", source.model)
    config = small_config(f"model.init_from=hf:{tmp_path / 'hf'}")
    hf_load.apply_init_from(config)
    returned: dict[str, list[int]] = {}  # bytes each get_slice(name)[index] gave back
    opened = safetensors.safe_open

    class Recording:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            self.inner = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            part = self.inner.get_slice(name)

            class Slice:
                def get_shape(self):
                    return part.get_shape()

                def get_dtype(self):
                    return part.get_dtype()

                def __getitem__(self, index):
                    value = part[index]
                    returned.setdefault(name, []).append(value.nbytes)
                    return value

            return Slice()

    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: Recording(opened(*a, **k)))
    loaded_state(config, {"data": 1, "fsdp": 8, "tensor": 1})
    assert set(returned) == set(tensors)
    for name, reads in returned.items():
        whole = tensors[name].nbytes
        if tensors[name].ndim == 1:  # norm scales are replicated: read once, whole
            assert reads == [whole], name
        else:  # each of the 8 devices read its eighth, and nothing else was read
            assert reads == [whole // 8] * 8, name


def run_cli(*args):
    done = jaxkit(*args)
    return done.returncode, done.stdout, done.stderr.splitlines()


def refused(*args, says):
    code, _, err = run_cli(*args)
    assert code == 2 and len(err) == 1 and err[0].startswith("jaxkit: error: "), (code, err)
    for fragment in says:
        assert fragment in err[0], (fragment, err[0])


def test_refusals_are_one_line_exit_2_before_any_work(tmp_path):
    m = small_config().model
    write_hf(tmp_path / "good", m)
    plan = ["plan", "llama_tiny", *SMALL]
    good = f"model.init_from=hf:{tmp_path / 'good'}"
    refused(*plan, good, "model.num_layers=3", says=["model.num_layers=3", "config.json: 2"])
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((tmp_path / "good" / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    refused(*plan, f"model.init_from=hf:{pickled}", says=["pickled", "pytorch_model.bin"])
    biased = tmp_path / "biased"
    write_hf(biased, m)
    cfg = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps(cfg | {"attention_bias": True}))
    refused(*plan, f"model.init_from=hf:{biased}", says=["attention_bias"])
    refused(*plan, f"model.init_from=hf:{tmp_path / 'none'}", says=["no such directory"])
    refused(*plan, "model.init_from=gs://x", says=["model.init_from", "hf:DIR"])


def test_the_architecture_replaces_the_config_files_and_may_be_repeated(tmp_path):
    m = small_config("model.tie_embeddings=true", "model.rope_theta=500000").model
    write_hf(tmp_path / "hf", m)
    config = load_config("llama_tiny")  # d_model 128, untied, theta 1e4
    given = [f"model.init_from=hf:{tmp_path / 'hf'}", "model.num_layers=2"]  # as config.json
    apply_overrides(config, given)
    hf_load.apply_init_from(config, given)
    assert (config.model.d_model, config.model.num_layers) == (32, 2)
    assert (config.model.tie_embeddings, config.model.rope_theta) == (True, 500000.0)
    extra = tmp_path / "hf" / "extra.safetensors"  # a tensor a plain Llama has no place for
    safetensors.numpy.save_file({"model.layers.0.self_attn.q_proj.bias": np.zeros(4)}, extra)
    with pytest.raises(ConfigError, match=r"q_proj\.bias' has no place"):
        hf_load.apply_init_from(config)


def source_config(m):
    """config.json for the model section `m` as transformers writes one (Llama 3.2's
    fields): besides what the kit reads, what it does not (token ids, the position table's
    size, ...), which an export carries back. No head_dim (older files have none), an int
    rope_theta and llama3 rope_scaling, as written."""
    cfg = names.hf_config_from_model(m, torch_dtype="bfloat16")
    del cfg["head_dim"]
    return cfg | {
        "bos_token_id": 1,
        "eos_token_id": [2, 3],
        "max_position_embeddings": 131072,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "transformers_version": "4.45.0",
        "rope_theta": 500000,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    }


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A run from a bfloat16 HF directory stopped half-way through its first optimizer
    step (K=2: its checkpoint at step 0 holds the params as loaded), an uninterrupted run
    beside it, and then the directory deleted, as people delete multi-GB downloads."""
    tmp = tmp_path_factory.mktemp("hf_run")
    tensors = write_hf(tmp / "hf", small_config().model)
    cfg = source_config(small_config().model)
    (tmp / "hf" / "config.json").write_text(json.dumps(cfg))
    args = [
        *SMALL,
        f"model.init_from=hf:{tmp / 'hf'}",
        "train.steps=2",
        "train.log_every=1",
        "checkpoint.every=1",
        "batch.global_batch_size=16",  # 2 micro-steps of one row per device
        "batch.per_device_batch_size=1",
        "train.eval_examples=8",
    ]
    config = small_config(*args[len(SMALL) :])
    hf_load.apply_init_from(config)
    quiet = functools.partial(train, config, progress=False, echo=lambda line: None)
    quiet(tmp / "whole")
    assert quiet(tmp / "stopped", stop_after_micro_steps=1).stopped
    shutil.rmtree(tmp / "hf")
    return types.SimpleNamespace(
        args=args,
        config=config,
        tensors=tensors,
        cfg=cfg,
        whole=tmp / "whole",
        stopped=tmp / "stopped",
    )


def losses(workdir):
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(workdir) if "loss" in r]


def test_a_resume_reads_the_checkpoint_not_init_from(stopped_run, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(stopped_run.stopped, workdir)
    line = ["train", "llama_tiny", *stopped_run.args, "--workdir", str(workdir), "--no-progress"]
    # The checkpoint's shape holds: an override that contradicts it is refused, as at
    # any resume, and the run is left as it was.
    code, _, err = run_cli(*line, "model.num_layers=3")
    assert code == 2 and "  model.num_layers: 2 (saved) -> 3" in err, err
    code, printed, err = run_cli(*line)
    assert code == 0, err
    (said,) = [line for line in printed.splitlines() if "init_from" in line]
    assert said.startswith("model.init_from=hf:") and "is not read" in said
    # Resumed mid-step on the same devices: the numbers of the uninterrupted run, bit for
    # bit (the accumulator was saved and continued, nothing recomputed otherwise).
    assert losses(workdir) == losses(stopped_run.whole)
    assert [s for s, _, _ in losses(workdir)] == [1, 2]


def test_export_gives_the_source_back_without_its_directory(stopped_run, tmp_path):
    from transformers import LlamaConfig

    out = tmp_path / "out"
    code, printed, err = run_cli("export", str(stopped_run.stopped), "--hf", str(out))
    assert code == 0, err
    assert "tensors in bfloat16, as hf:" in printed
    written = read_safetensors(out / "model.safetensors")
    assert sorted(written) == sorted(stopped_run.tensors)
    for name, value in stopped_run.tensors.items():
        # In the source's dtype by default, though the params were float32.
        assert written[name].dtype == BF16, name
        assert written[name].tobytes() == value.tobytes(), name
    # The source's config.json whole: the fields the kit does not read (token ids, the
    # position table, transformers_version: the format's, unchanged) and the ones it does,
    # as written (an int rope_theta, no head_dim).
    out_cfg = json.loads((out / "config.json").read_text())
    assert out_cfg == stopped_run.cfg
    hf = LlamaConfig.from_dict(out_cfg)
    assert (hf.bos_token_id, hf.eos_token_id, hf.max_position_embeddings) == (1, [2, 3], 131072)
    assert hf.rope_scaling["rope_type"] == "llama3" and hf.head_dim == 32 // 4
    # --dtype still decides: float32 widens bfloat16 exactly, and config.json says so.
    code, printed, err = run_cli(
        "export", str(stopped_run.stopped), "--hf", str(tmp_path / "f32"), "--dtype", "float32"
    )
    assert code == 0, err
    widened = read_safetensors(tmp_path / "f32" / "model.safetensors")
    for name, value in stopped_run.tensors.items():
        assert widened[name].dtype == np.float32, name
        np.testing.assert_array_equal(widened[name], value.astype(np.float32), err_msg=name)
    f32_cfg = json.loads((tmp_path / "f32" / "config.json").read_text())
    assert f32_cfg == stopped_run.cfg | {"torch_dtype": "float32"}


def read_safetensors(path):
    with safetensors.safe_open(str(path), framework="numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def save_untouched(config, workdir, tokenizer=None, source=None):
    """A checkpoint at step 0 of params as loaded, as a run's would be, and its record
    (with `source`, hf_load.source_record's, as a run from model.init_from records it)."""
    _, state = loaded_state(config, {"data": 2, "fsdp": 2, "tensor": 2})
    meta = {"config": config.to_dict(), "loop": {"step": 0, "micro": 0, "examples_seen": 0}}
    if source is not None:
        meta["hf_source"] = source
    if tokenizer is not None:
        meta["data"] = {"fingerprint": {"tokenizer": str(tokenizer)}}
    checkpointer = Checkpointer(workdir / "checkpoints", keep=1, warn=print)
    checkpointer.save(Position(), state, meta, wait=True)
    checkpointer.close()


# A float32 tied source, scanned, with its record as runs saved it before they kept their
# source (bfloat16 untied, recorded, is test_export_gives_the_source_back_without_its_directory).
@pytest.mark.parametrize(("dtype", "tied"), [(np.dtype(np.float32), True)])
def test_export_gives_the_source_back_bitwise(tmp_path, dtype, tied):
    source = small_config(f"model.tie_embeddings={str(tied).lower()}", "model.scan_layers=true")
    tensors = write_hf(tmp_path / "hf", source.model, dtype=dtype)
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tok" / name).write_text(json.dumps({"name": name}))
    config = small_config(f"model.init_from=hf:{tmp_path / 'hf'}", "model.scan_layers=true")
    hf_load.apply_init_from(config)
    save_untouched(config, tmp_path / "run", tokenizer=tmp_path / "tok" / "tokenizer.json")
    out = tmp_path / "out"
    code, printed, err = run_cli(
        "export", str(tmp_path / "run"), "--hf", str(out), "--dtype", str(dtype)
    )
    assert code == 0, err
    assert f"wrote {out}: step 0" in printed
    with safetensors.safe_open(str(out / "model.safetensors"), framework="numpy") as f:
        written = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert sorted(written) == sorted(tensors)
    assert ("lm_head.weight" in written) is not tied  # a tied head is the table
    for name, value in tensors.items():
        assert written[name].dtype == dtype, name
        assert written[name].tobytes() == value.tobytes(), name  # bit for bit
    source_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    out_cfg = json.loads((out / "config.json").read_text())
    assert names.model_keys_from_hf_config(out_cfg) == names.model_keys_from_hf_config(source_cfg)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_text() == (tmp_path / "tok" / name).read_text()
    # Not over a directory already there, nor from a step the run has no checkpoint of.
    refused("export", str(tmp_path / "run"), "--hf", str(out), says=["--hf", "not an empty"])
    refused(
        "export",
        str(tmp_path / "run"),
        "--hf",
        str(tmp_path / "o2"),
        "--step",
        "5",
        says=["--step 5", "steps 0"],
    )


def test_a_float16_export_loads_back_as_written(tmp_path):
    # A float32 source: float16 rounds most of its values (10 of float32's 23 fraction bits).
    tensors = write_hf(tmp_path / "hf", small_config().model, dtype=np.dtype(np.float32))
    config = small_config(f"model.init_from=hf:{tmp_path / 'hf'}")
    hf_load.apply_init_from(config)
    save_untouched(config, tmp_path / "run")
    out = tmp_path / "f16"
    code, printed, err = run_cli(
        "export", str(tmp_path / "run"), "--hf", str(out), "--dtype", "float16"
    )
    assert code == 0, err
    assert "tensors in float16" in printed
    written = read_safetensors(out / "model.safetensors")
    assert sorted(written) == sorted(tensors)
    for name, value in tensors.items():
        # Rounded to nearest, as numpy's own cast rounds.
        assert written[name].dtype == np.float16, name
        np.testing.assert_array_equal(written[name], value.astype(np.float16), err_msg=name)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    # Loaded back: float32 params holding the file's values exactly (float16 → float32 is
    # exact).
    back = small_config(f"model.init_from=hf:{out}")
    hf_load.apply_init_from(back)
    _, state = loaded_state(back, {"data": 2, "fsdp": 2, "tensor": 2})
    expected = names.from_hf(written, back.model)
    for (path, a), (_, b) in zip(
        paths_and_leaves(state.params), paths_and_leaves(expected), strict=True
    ):
        assert a.dtype == np.float32, path
        np.testing.assert_array_equal(np.asarray(a), b.astype(np.float32), err_msg=path)
    # A value float16 cannot hold is refused, not written as an infinity.
    big = tmp_path / "big"
    tensors["model.layers.0.mlp.down_proj.weight"][1, 2] = 1e5
    safetensors.numpy.save_file(tensors, tmp_path / "hf" / "model.safetensors")
    save_untouched(config, big)
    refused(
        "export",
        str(big),
        "--hf",
        str(tmp_path / "f16c"),
        "--dtype",
        "float16",
        says=["model.layers.0.mlp.down_proj.weight holds values up to 100000", "largest (65504)"],
    )
    assert not (tmp_path / "f16c").exists()


def test_a_run_fine_tuned_past_its_sources_context_takes_its_rows_everywhere(tmp_path):
    """A run on data.seq_len=16 from a config.json of max_position_embeddings=8: its
    context is 16 for `sample` (which held it to 8) and in its export's config.json (which
    wrote 8), and the exported directory takes 16 as hf:OUT."""
    write_hf(tmp_path / "hf", small_config().model)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg | {"max_position_embeddings": 8}))
    config = small_config(f"model.init_from=hf:{tmp_path / 'hf'}")
    hf_load.apply_init_from(config)
    source = hf_load.source_record(tmp_path / "hf", config.model)
    save_untouched(config, tmp_path / "run", source=source)
    why = (
        "the run's data.seq_len=16, longer than the max_position_embeddings=8 of the "
        "config.json it was fine-tuned from"
    )
    over = ["--prompt", "ab", "--max-new-tokens", "16"]
    refused("sample", str(tmp_path / "run"), *over, says=[f"context is 16 positions ({why})"])
    code, _, err = run_cli("export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"))
    assert code == 0, err
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written == cfg | {"max_position_embeddings": 16}
    why = "config.json's max_position_embeddings=16"
    refused("sample", f"hf:{tmp_path / 'out'}", *over, says=[f"context is 16 positions ({why})"])
    # A source's context longer than the rows stays the context, and its config.json as was.
    source["config"]["max_position_embeddings"] = 24
    save_untouched(config, tmp_path / "longer", source=source)
    why = "the max_position_embeddings=24 of the config.json it was fine-tuned from"
    over = ["--prompt", "ab", "--max-new-tokens", "24"]
    refused("sample", str(tmp_path / "longer"), *over, says=[f"context is 24 positions ({why})"])
    code, _, err = run_cli("export", str(tmp_path / "longer"), "--hf", str(tmp_path / "o24"))
    assert code == 0, err
    assert json.loads((tmp_path / "o24" / "config.json").read_text()) == source["config"]


def test_a_tied_run_exports_as_a_tied_llama_and_loads_back(tmp_path):
    """A run from random weights with a tied head, exported through the CLI: config.json says
    tie_word_embeddings: true (as transformers reads it), no lm_head is written, and each
    kernel is the run's param transposed, compared by value, the non-square ones (k and v
    32 -> 16, gate and up 32 -> 64, down 64 -> 32) as well as the square. Loaded back, the
    export gives the run's params bit for bit (float32 both ways)."""
    from test_hf_names import HF_KERNELS
    from transformers import LlamaConfig

    steps = ["train.steps=1", "train.eval_every=0", "checkpoint.every=0"]
    # One step of two micro-batches of 4 rows on one device, 8 held-out rows in the eval:
    # the export is under test, not the training.
    rows = ["batch.global_batch_size=8", "batch.per_device_batch_size=4", "train.eval_examples=8"]
    config = small_config("model.tie_embeddings=true", *steps, *rows)
    result = train(
        config, tmp_path / "run", devices=jax.devices()[:1], progress=False, echo=lambda line: None
    )
    params = jax.tree.map(np.asarray, result.state.params)
    out = tmp_path / "out"
    code, _, err = run_cli("export", str(tmp_path / "run"), "--hf", str(out))
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True
    assert LlamaConfig.from_dict(cfg).tie_word_embeddings is True
    written = read_safetensors(out / "model.safetensors")
    assert "lm_head.weight" not in written  # the head is the table
    np.testing.assert_array_equal(
        written["model.embed_tokens.weight"], params["embed"]["embedding"]
    )
    shapes = set()
    for layer in range(2):
        for name, module in HF_KERNELS.items():
            kernel = params["blocks"][layer][module]["kernel"]
            tensor = written[f"model.layers.{layer}.{name}"]
            assert tensor.dtype == np.float32 and tensor.shape == kernel.shape[::-1], name
            np.testing.assert_array_equal(tensor, kernel.T, err_msg=name)
            shapes.add(kernel.shape)
    assert {(32, 16), (32, 64), (64, 32), (32, 32)} == shapes
    back = small_config(f"model.init_from=hf:{out}")
    hf_load.apply_init_from(back)
    assert back.model.tie_embeddings is True
    _, state = loaded_state(back, {"data": 2, "fsdp": 2, "tensor": 2})
    got, want = paths_and_leaves(state.params), paths_and_leaves(params)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, a), (_, b) in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=path)


# SmolLM2-135M's config.json with the sizes cut down: the same keys, grouping (3 query heads
# per key/value head), tied head, rope base and epsilon.
SMOLLM2_SHAPED = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 48,
    "intermediate_size": 128,
    "num_attention_heads": 3,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "vocab_size": 512,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000,
    "rope_scaling": None,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "torch_dtype": "bfloat16",
}


def write_smollm2_shaped(directory):
    """SMOLLM2_SHAPED's config.json and zero weights of its shapes."""
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(SMOLLM2_SHAPED))
    keys = names.model_keys_from_hf_config(SMOLLM2_SHAPED)
    config = load_config("smollm2_sft")
    for key, value in keys.items():
        config.model[key.split(".", 1)[1]] = value
    tensors = {t.name: np.zeros(t.shape, BF16) for t in names.hf_tensors(config.model)}
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")


def test_the_smollm2_config_takes_its_architecture_and_plans(tmp_path):
    directory = tmp_path / "SmolLM2-135M"
    write_smollm2_shaped(directory)
    docs = prompt_completion_docs(64, seed=0)  # byte ids: inside SmolLM2's vocabulary too
    write_prepared(tmp_path / "data", {"train": docs, "eval": docs[:8]}, vocab_size=512)
    code, out, err = run_cli(
        "plan",
        "smollm2_sft",
        f"model.init_from=hf:{directory}",
        f"data.path={tmp_path / 'data'}",
        "--json",
    )
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["global_batch_size"], plan["tokens_per_step"]) == (32, 32 * 256)
    # The params config.json implies, none of the config file's: 512 × 48 tied, 2 blocks.
    d, f, k = 48, 128, 16
    block = 2 * d * 3 * k + 2 * d * k + 3 * d * f + 2 * d  # q, o; k, v; the MLP; 2 norms
    assert plan["model"]["kind"] == "llama"
    assert plan["model"]["param_count"] == 512 * d + 2 * block + d


def test_throughput_times_random_params_of_the_shape_without_the_directory(stopped_run, tmp_path):
    """The experiments that compare training (equivalence, normalisation, batch size, noise
    scale, batch ramp) train with the loop, which starts from model.init_from's params
    (test_hf_reference.py's split check runs them so). Throughput's numbers cannot depend
    on the params' values: its points train random params of the directory's shape, so a
    sweep of many points does not load a large checkpoint for each."""
    from jaxkit.experiments import throughput
    from jaxkit.experiments.common import Report, train_unit

    config = stopped_run.config  # its directory is deleted: a read would fail
    remat = config.model.remat
    point = throughput._unit_config(config, (1, 2, remat))  # the run's own plan, 8 x 1 x 2
    timed = train_unit(point, jax.devices(), 1)
    # The same rows at the same first step as the run from the loaded params, another loss.
    first = [loss for step, loss, _ in losses(stopped_run.whole) if step == 1]
    assert timed.records[0]["step"] == 1 and [timed.records[0]["loss"]] != first
    sweep = throughput._Sweep(config, jax.devices(), {"data": 8}, 2, 1, remat)
    report = Report(tmp_path / "report", "throughput")
    throughput._render(sweep, report)
    assert any("random params of the shape `hf:" in block for block in report.blocks)


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path):
    m = small_config().model
    tensors = write_hf(tmp_path / "hf", m)
    # A stray file that sorts after model.safetensors, with other values for one tensor.
    name = "model.layers.0.self_attn.q_proj.weight"
    stray = {name: np.zeros_like(tensors[name])}
    safetensors.numpy.save_file(stray, tmp_path / "hf" / "stray.safetensors")
    refused(
        "plan",
        "llama_tiny",
        *SMALL,
        f"model.init_from=hf:{tmp_path / 'hf'}",
        says=[name, "model.safetensors", "stray.safetensors"],
    )


def test_an_index_that_puts_a_tensor_in_the_wrong_file_is_refused(tmp_path):
    write_hf(tmp_path / "hf", small_config().model, files=2)
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = "model.norm.weight"
    held = index["weight_map"][name]
    other = next(f for f in index["weight_map"].values() if f != held)
    index["weight_map"][name] = other
    index_path.write_text(json.dumps(index))
    refused(
        "plan", "llama_tiny", *SMALL, f"model.init_from=hf:{tmp_path / 'hf'}", says=[name, other]
    )


LLAMA3_SCALING = (
    'model.rope_scaling={"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, '
    '"original_max_position_embeddings": 8192}'
)


def test_an_override_of_a_field_of_a_model_key_is_held_against_config_json(tmp_path):
    write_hf(tmp_path / "hf", small_config(LLAMA3_SCALING).model)
    init_from = f"model.init_from=hf:{tmp_path / 'hf'}"
    for factor, agrees in (("16.0", False), ("32", True)):
        config = small_config(LLAMA3_SCALING)  # the config file's own dict
        given = [init_from, f"model.rope_scaling.factor={factor}"]
        apply_overrides(config, given)
        if agrees:
            hf_load.apply_init_from(config, given)
            assert config.model.rope_scaling.factor == 32.0
            continue
        with pytest.raises(ConfigError) as err:
            hf_load.apply_init_from(config, given)
        assert "model.rope_scaling.factor=16.0 (config.json: 32.0)" in str(err.value)


def test_a_field_override_is_held_against_config_json_on_the_command_line(tmp_path):
    """docs/pretrained.md's field override with model.init_from: llama_tiny and smollm2_sft
    leave model.rope_scaling null, and the overrides were applied before config.json was
    read, so `model.rope_scaling.factor=...` was an unknown key, agreeing or not. It is held
    against the same field of config.json's value, and applied to it."""
    write_hf(tmp_path / "hf", small_config(LLAMA3_SCALING).model)  # factor 32
    plan = ["plan", "llama_tiny", *SMALL, f"model.init_from=hf:{tmp_path / 'hf'}"]
    refused(*plan, "model.rope_scaling.factor=16.0", says=["factor=16.0 (config.json: 32.0)"])
    code, printed, err = run_cli(*plan, "model.rope_scaling.factor=32", "--json")
    assert code == 0, err
    assert json.loads(printed)["model"]["kind"] == "llama"
    # SmolLM2's config.json says null: a field of it contradicts config.json.
    directory = tmp_path / "SmolLM2-135M"
    write_smollm2_shaped(directory)
    smollm2 = ["plan", "smollm2_sft", f"model.init_from=hf:{directory}"]
    refused(*smollm2, "model.rope_scaling.factor=16.0", says=["factor=16.0 (config.json: None)"])


def test_an_override_giving_the_default_head_width_agrees(tmp_path):
    m = small_config().model  # d_model 32 over 4 heads: a width of 8
    write_hf(tmp_path / "hf", m)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["head_dim"] == 8  # written out, as transformers writes it
    init_from = f"model.init_from=hf:{tmp_path / 'hf'}"
    config = small_config()
    given = [init_from, "model.head_dim=8"]
    apply_overrides(config, given)
    hf_load.apply_init_from(config, given)
    assert config.model.head_dim is None  # the default width, as config.json's keys say
    config = small_config()
    given = [init_from, "model.head_dim=16"]
    apply_overrides(config, given)
    with pytest.raises(ConfigError, match=r"model\.head_dim=16 \(config\.json: None, a width of 8"):
        hf_load.apply_init_from(config, given)


def test_export_finds_a_tokenizer_prepare_was_given_relative_to_another_cwd(tmp_path, monkeypatch):
    from test_prepare import CORPUS, train_bpe

    from jaxkit.data.prepare import prepare
    from jaxkit.data.sources import make_sources
    from jaxkit.generate.hf_export import export_hf

    (tmp_path / "a" / "tok").mkdir(parents=True)
    docs = "".join(json.dumps({"text": text}) + "\n" for text in CORPUS)
    (tmp_path / "docs.jsonl").write_text(docs)
    monkeypatch.chdir(tmp_path / "a")
    train_bpe(tmp_path / "a" / "tok" / "tokenizer.json", ["<|endoftext|>"])
    meta = prepare(
        [str(tmp_path / "docs.jsonl")],
        "tok/tokenizer.json",
        tmp_path / "data",
        eval_fraction=0.5,
        workers=1,
        progress=False,
    )
    data = ["data.source=tokens", f"data.path={tmp_path / 'data'}", "data.seq_len=4"]
    vocab = f"model.vocab_size={meta['vocab_size']}"
    # The fingerprint is the one of the same data prepared before meta.json held the
    # absolute path: that meta.json is this one without it.
    fingerprint = make_sources(run_config(small_config(vocab, *data)))[0].fingerprint
    written = json.loads((tmp_path / "data" / "meta.json").read_text())
    older = {k: v for k, v in written.items() if k != "tokenizer_file"}
    (tmp_path / "data" / "meta.json").write_text(json.dumps(older))
    assert make_sources(run_config(small_config(vocab, *data)))[0].fingerprint == fingerprint
    assert fingerprint["tokenizer"] == "tok/tokenizer.json"  # as typed, as before
    (tmp_path / "data" / "meta.json").write_text(json.dumps(written))
    write_hf(tmp_path / "hf", small_config(vocab).model)
    config = small_config(vocab, *data, f"model.init_from=hf:{tmp_path / 'hf'}")
    hf_load.apply_init_from(config)
    save_untouched(config, tmp_path / "run", tokenizer="tok/tokenizer.json")
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "b")  # where tok/tokenizer.json is not
    warned = []
    export_hf(tmp_path / "run", tmp_path / "out", echo=warned.append)
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (
        tmp_path / "a" / "tok" / "tokenizer.json"
    ).read_bytes(), warned


def test_config_jsons_rope_scaling_pasted_with_its_rope_type_agrees(tmp_path):
    """docs/pretrained.md: an override may repeat config.json's value. config.json's
    rope_scaling names its rope_type, which model.rope_scaling refused, with model.init_from
    (as a contradiction) and without; HF's older "type" likewise. Another type is refused."""
    write_hf(tmp_path / "hf", small_config(LLAMA3_SCALING).model)
    pasted = json.loads((tmp_path / "hf" / "config.json").read_text())["rope_scaling"]
    assert pasted["rope_type"] == "llama3"
    plan = ["plan", "llama_tiny", *SMALL]
    init_from = f"model.init_from=hf:{tmp_path / 'hf'}"
    older = {k: v for k, v in pasted.items() if k != "rope_type"} | {"type": "llama3"}
    for given in (pasted, older):
        override = f"model.rope_scaling={json.dumps(given)}"
        for line in ([*plan, init_from], plan):
            code, _, err = run_cli(*line, override)
            assert code == 0, err
        config = small_config(override)  # held as the four fields, as config.json's is
        assert config.model.rope_scaling.to_dict() == LLAMA3_FIELDS
    dynamic = pasted | {"rope_type": "dynamic"}
    refused(
        *plan,
        f"model.rope_scaling={json.dumps(dynamic)}",
        says=["model.rope_scaling: rope_type 'dynamic' is not supported"],
    )


LLAMA3_FIELDS = json.loads(LLAMA3_SCALING.split("=", 1)[1])


def test_a_mixed_dtype_export_says_how_many_tensors_each_dtype_holds(tmp_path):
    """`21 tensors in bfloat16 (6 in float16, ...)` read as if all 21 were bfloat16."""
    m = small_config().model  # 21 tensors: 2 layers of 9, the table, the norm, the head
    tensors = write_hf(tmp_path / "hf", m)
    order = list(tensors)
    for name in order[:5]:
        tensors[name] = tensors[name].astype(np.float32)
    for name in order[5:8]:
        tensors[name] = tensors[name].astype(np.float16)
    safetensors.numpy.save_file(tensors, tmp_path / "hf" / "model.safetensors")
    config = small_config(f"model.init_from=hf:{tmp_path / 'hf'}")
    hf_load.apply_init_from(config)
    save_untouched(config, tmp_path / "run", source=hf_load.source_record(tmp_path / "hf", m))
    code, printed, err = run_cli("export", str(tmp_path / "run"), "--hf", str(tmp_path / "out"))
    assert code == 0, err
    said = f"21 tensors: 13 in bfloat16, 5 in float32, 3 in float16, as hf:{tmp_path / 'hf'}"
    assert said in printed, printed
