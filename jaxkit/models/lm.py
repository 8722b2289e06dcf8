"""What the built-in language models (transformer, llama) share: the data they read, their
sizes and options (precision, remat, scanned layers, the token files' rows) as config keys,
the checks between those keys, the sizes the partition rules shard, the heads the tensor
axis splits, and the model FLOPs of a decoder.

Light on purpose, as every contract module: the config reads the contracts before JAX starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jaxkit.batch import mixture
from jaxkit.keys import (
    COUNT,
    POSITIVE,
    REQUIRED,
    ConfigError,
    Key,
    Rule,
    boolean,
    one_of,
    show,
    text,
)
from jaxkit.models.common import BYTES, EVAL_FRACTION
from jaxkit.sections import LlamaModel, RunConfig, TransformerModel

if TYPE_CHECKING:
    from jaxkit.models.common import Params, Sizes

READS_LM_OPTIONS = True  # model.remat, the dtypes, scan_layers and the token files' row options

DATA_KEYS: tuple[Key, ...] = (
    Key(
        "data.source",
        REQUIRED,
        one_of("text", "synthetic", "tokens"),
        "`text` (bytes of a file), `tokens` (token files: `jaxkit data prepare`) or `synthetic`",
    ),
    Key("data.seq_len", REQUIRED, POSITIVE, "tokens per row"),
    EVAL_FRACTION,
)
_SIZES = {
    "vocab_size": "the vocabulary (≥ 256 for text: bytes; null with token files: the one "
    "their meta.json records)",
    "d_model": "the residual stream's width",
    "num_layers": "blocks",
    "num_heads": "attention heads (d_model / num_heads dimensions each)",
    "mlp_dim": "the MLP's hidden width",
}


def sizes(*names: str) -> tuple[Key, ...]:
    """The size keys `model.NAME` of a language model: required positive integers."""
    return tuple(Key(f"model.{name}", REQUIRED, POSITIVE, _SIZES[name]) for name in names)


# Precision, rematerialisation and scanned layers (layers.py): optional, with defaults (and
# those defaults are what runs saved before them ran as).
_DTYPE = one_of("float32", "bfloat16")
LM_OPTION_KEYS: tuple[Key, ...] = (
    Key("model.param_dtype", "float32", _DTYPE, "the stored params", added="float32"),
    Key("model.compute_dtype", "float32", _DTYPE, "the matmuls", added="float32"),
    # Recomputes activations; the params and their updates are the same.
    Key(
        "model.remat",
        "none",
        one_of("none", "full", "dots"),
        "activation recompute per block: `none`, `dots` (matmul outputs kept) or `full`",
        added="none",
        resumable=True,
    ),
    # The same attention by another kernel (jaxkit/models/attention.py); a run records the one that
    # ran, and runs saved before the key ran xla.
    Key(
        "model.attention",
        "auto",
        one_of("auto", "xla", "cudnn", "splash"),
        "attention kernel: `auto` (splash on TPU, cudnn on NVIDIA GPUs in bfloat16, else "
        "xla), `xla`, `cudnn` or `splash`",
        added="xla",
        resumable=True,
    ),
    # The same loss and gradients but for the order of their sums (models/loss.py). 256:
    # lm_125m's compiled step on v5e held 0.9 GiB less per chip at 8 rows with 128, 256 or
    # 512 alike (benchmarks/chunked_loss.py), and rows of 256 or fewer (lm_tiny's 128) take
    # the loss whole, as before.
    Key(
        "model.loss_chunk_tokens",
        256,
        COUNT,
        "positions per row whose logits the loss holds at once (0: all); rows are cut into "
        "the fewest equal chunks of at most this many, the last padded at weight 0",
        added=0,
        resumable=True,
    ),
    Key(
        "model.scan_layers",
        False,
        boolean(),
        "stack the blocks on a layer axis and scan them (a checkpoint does not load across a "
        "change)",
        added=False,
    ),
    # Token files (token_files.py): read where data.source=tokens, checked wherever present.
    Key(
        "data.rows",
        "windows",
        one_of("windows", "documents"),
        "`tokens`: `windows` (packed across documents) or `documents` (one per row, padded "
        "at weight 0)",
        added="windows",
    ),
    Key(
        "data.document_mask",
        False,
        boolean(),
        "`tokens` windows: attention stays inside each document, positions restart",
        added=False,
    ),
    Key(
        "data.mixture",
        None,
        # checked field by field
        Rule("null, or {NAME: {path, weight}}", lambda value: None, "dict[str, Any] | None"),
        '`tokens`: several sources in place of data.path, {NAME: {"path": PATH, '
        '"weight": W}} (NAME `[a-z0-9_]+`, W > 0, normalised); JSON on the command line. '
        "Rows come in 32-row blocks, each holding every source's share (a small weight is "
        "never rounded away; docs/data.md)",
        type=dict,
        added=None,
    ),
    Key(
        "data.mixture_stages",
        "",
        text(nullable=False),
        '`tokens` with data.mixture: weights that change at a position, e.g. `"0:web=0.9+'
        'code=0.1,20Mt:web=0.5+code=0.5"` (positions as batch.schedule writes them, moved to '
        "the next 32-row block); a resume may add a stage after its position",
        added="",
        resumable=True,
    ),
    Key(
        "data.token_dtype",
        "uint16",
        one_of("uint16", "uint32"),
        "`tokens` without `meta.json`: `uint16` (nanoGPT's) or `uint32`",
        added="uint16",
    ),
)


def check_values(flat: Mapping[str, Any]) -> None:
    """Constraints between a language model's keys, once each holds a value of its kind."""
    d_model, heads = flat["model.d_model"], flat["model.num_heads"]
    width = flat.get("model.head_dim")  # llama's; null: d_model / num_heads
    if width is None and d_model % heads:
        raise ConfigError(
            f"model.d_model={d_model} is not divisible by model.num_heads={heads}: each head "
            "takes d_model / num_heads dimensions"
        )
    kv_heads = flat.get("model.num_kv_heads")
    if kv_heads is not None and heads % kv_heads:
        raise ConfigError(
            f"model.num_heads={heads} is not divisible by model.num_kv_heads={kv_heads}: each "
            "key/value head serves an equal group of query heads"
        )
    if kv_heads is not None and width is None and (d_model // heads) % 2:
        raise ConfigError(
            f"model.d_model / model.num_heads = {d_model // heads} is odd: rotary positions "
            "rotate pairs of a head's dimensions"
        )
    if width is not None and width % 2:
        raise ConfigError(
            f"model.head_dim={width} is odd: rotary positions rotate pairs of a head's dimensions"
        )
    mixture.check_flat(flat)
    if flat["data.source"] != "tokens":
        for key, off in (("data.document_mask", False), ("data.rows", "windows")):
            if flat.get(key, off) != off:
                raise ConfigError(
                    f"{key}={show(flat[key])} reads document ends from token files that "
                    "`jaxkit data prepare` wrote: set data.source=tokens"
                )
    if flat["data.source"] == "text" and flat["model.vocab_size"] < BYTES:
        raise ConfigError(
            f"model.vocab_size={flat['model.vocab_size']}: data.source='text' feeds bytes, "
            f"so it must be at least {BYTES}"
        )


def lm_model(config: RunConfig) -> TransformerModel | LlamaModel:
    """The config's model section, a built-in language model's: the contracts of this module
    are asked only of those kinds."""
    m = config.model
    assert isinstance(m, TransformerModel | LlamaModel), type(m)
    return m


def lm_seq_len(config: RunConfig) -> int:
    """data.seq_len, which every language model's config gives (config.check_values)."""
    assert config.data.seq_len is not None
    return config.data.seq_len


def is_lm(config: RunConfig) -> bool:
    del config
    return True


def sharded_sizes(config: RunConfig) -> Sizes:
    """d_model is the fsdp side of every kernel, embedding and head, and, as heads·head_dim,
    the tensor side of the attention projections; mlp_dim is the tensor side of the MLP."""
    m = lm_model(config)
    return [
        ("model.d_model", m.d_model, ("fsdp", "tensor")),
        ("model.mlp_dim", m.mlp_dim, ("tensor",)),
    ]


def check_shards(config: RunConfig, mesh_shape: dict[str, int]) -> None:
    """Fails where the tensor axis would cut an attention head in parts."""
    m, tensor = lm_model(config), mesh_shape["tensor"]
    counts = {"num_heads": m.num_heads}
    if isinstance(m, LlamaModel):  # key/value heads: llama's
        counts["num_kv_heads"] = m.num_kv_heads
    for key, heads in counts.items():
        if not heads % tensor:
            continue
        # Attention runs head by head: a head split over devices is gathered whole again at
        # every layer (XLA's "involuntary full rematerialization"), the work repeated.
        raise ConfigError(
            f"model.{key}={heads} is not divisible by mesh.tensor={tensor}: attention "
            "heads are split over the tensor axis (jaxkit/mesh.py ACTIVATIONS), and a head "
            f"cut in parts is gathered whole at every layer. Use a multiple of {tensor} "
            "heads, or a smaller mesh.tensor"
        )


def check_model(config: RunConfig) -> None:
    del config  # its values say all: config.check_values checked them


def kernel_params(params: Params, *, tied_table: bool = False) -> int:
    """Params that take part in a matmul: the kernels, and a tied embedding table (it is the
    head); not biases or norm scales (no matmul), nor tables read by lookup."""
    weights = {"kernel", "embedding"} if tied_table else {"kernel"}
    return sum(size for name, size in params if name in weights)


def flops_per_example(config: RunConfig, matmul_params: int) -> float:
    """6 × the matmul params per token, plus attention's 12 × layers × heads × head_dim ×
    seq_len (scores and weighted values, forward and backward, over the whole square);
    heads × head_dim is d_model unless model.head_dim says otherwise."""
    m, seq_len = lm_model(config), lm_seq_len(config)
    head_dim = m.head_dim if isinstance(m, LlamaModel) else None  # null: d_model / num_heads
    width = m.d_model if head_dim is None else m.num_heads * head_dim
    per_token = 6.0 * matmul_params + 12.0 * m.num_layers * width * seq_len
    return per_token * seq_len


def facts(config: RunConfig) -> dict[str, Any]:
    """Its precision, remat and layer layout, as a run's records give them (a config saved
    before a key ran at its default, which its section holds)."""
    return {
        key.leaf: getattr(config.model, key.leaf)
        for key in LM_OPTION_KEYS
        if key.section == "model"
    }
