"""The typed config a run reads: `jaxkit.config.run_config(config)` turns a checked
ConfigDict into a frozen RunConfig of these sections.

Generated from the keys' declarations (jaxkit/config.py and each model kind's) by
`python docs/generate.py`: do not edit by hand.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal


@dataclasses.dataclass(frozen=True, kw_only=True)
class Batch:
    """The `batch.*` keys."""

    global_batch_size: int | None = None
    per_device_batch_size: int | None = None
    grad_accum_steps: int | None = None
    schedule: str = ""
    max_global_batch_size: int | None = None
    auto_patience: int = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mesh:
    """The `mesh.*` keys."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    dcn_data: int = 1
    dcn_fsdp: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Optimizer:
    """The `optimizer.*` keys."""

    name: Literal["adamw", "sgd"] = "adamw"
    learning_rate: float = 0.001
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    reference_batch_size: int | None = None
    warmup_steps: int = 10
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    momentum: float = 0.9
    grad_clip_norm: float = 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Train:
    """The `train.*` keys."""

    steps: int | None = 100
    examples: int | None = None
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_examples: int = 0
    max_nonfinite_in_row: int = 10
    accumulation: Literal["multisteps", "fused"] = "multisteps"
    loss_normalisation: Literal["exact", "naive"] = "exact"
    prefetch: int = 2
    noise_scale_decay: float = 0.95
    noise_scale_every: int = 10
    profile_steps: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """The `checkpoint.*` keys."""

    every: int = 100
    keep: int = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wandb:
    """The `wandb.*` keys."""

    project: str | None = None
    entity: str | None = None
    run_name: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerModel:
    """The `model.*` keys of model.kind='transformer'."""

    kind: Literal["transformer"]
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    mlp_dim: int
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    loss_chunk_tokens: int = 256
    scan_layers: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerData:
    """The `data.*` keys of model.kind='transformer'; other sources' and kinds' are null."""

    source: Literal["text", "synthetic", "tokens"]
    seq_len: int
    eval_fraction: float
    rows: Literal["windows", "documents"] = "windows"
    document_mask: bool = False
    mixture: dict[str, Any] | None = None
    mixture_stages: str = ""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    path: str | None = None
    max_bytes: int | None = None
    num_examples: int | None = None
    num_features: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaModel:
    """The `model.*` keys of model.kind='llama'."""

    kind: Literal["llama"]
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    mlp_dim: int
    tie_embeddings: bool
    rope_theta: float
    norm_eps: float = 1e-06
    head_dim: int | None = None
    rope_scaling: dict[str, Any] | None = None
    init_from: str | None = None
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    loss_chunk_tokens: int = 256
    scan_layers: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaData:
    """The `data.*` keys of model.kind='llama'; other sources' and kinds' are null."""

    source: Literal["text", "synthetic", "tokens"]
    seq_len: int
    eval_fraction: float
    rows: Literal["windows", "documents"] = "windows"
    document_mask: bool = False
    mixture: dict[str, Any] | None = None
    mixture_stages: str = ""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    path: str | None = None
    max_bytes: int | None = None
    num_examples: int | None = None
    num_features: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpModel:
    """The `model.*` keys of model.kind='mlp'."""

    kind: Literal["mlp"]
    hidden_size: int
    num_layers: int
    num_classes: int
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    loss_chunk_tokens: int = 256
    scan_layers: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpData:
    """The `data.*` keys of model.kind='mlp'; other sources' and kinds' are null."""

    source: Literal["digits", "synthetic"]
    num_features: int
    eval_fraction: float
    seq_len: None = None
    rows: Literal["windows", "documents"] = "windows"
    document_mask: bool = False
    mixture: dict[str, Any] | None = None
    mixture_stages: str = ""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    path: str | None = None
    max_bytes: int | None = None
    num_examples: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomModel:
    """The `model.*` keys of a model of your own."""

    kind: str
    vocab_size: int | None = None
    num_classes: int | None = None
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots"] = "none"
    attention: Literal["auto", "xla", "cudnn", "splash"] = "auto"
    loss_chunk_tokens: int = 256
    scan_layers: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomData:
    """The `data.*` keys of a model of your own; other sources' and kinds' are null."""

    source: Literal["text", "synthetic", "tokens", "digits"]
    seq_len: int | None = None
    eval_fraction: float
    num_features: int | None = None
    rows: Literal["windows", "documents"] = "windows"
    document_mask: bool = False
    mixture: dict[str, Any] | None = None
    mixture_stages: str = ""
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    path: str | None = None
    max_bytes: int | None = None
    num_examples: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A checked config, section by section; `name` is the config file's (None for one
    built in code). `config` is the ConfigDict it was made from: only a model of your
    own is handed it (whole, as docs/training.md says), and code that reads the sections
    never looks at it."""

    name: str | None
    batch: Batch
    mesh: Mesh
    optimizer: Optimizer
    train: Train
    checkpoint: Checkpoint
    wandb: Wandb
    model: TransformerModel | LlamaModel | MlpModel | CustomModel
    data: TransformerData | LlamaData | MlpData | CustomData
    config: Any = dataclasses.field(default=None, compare=False, repr=False)


# Any kind's model and data sections, as a function that serves every kind takes them.
Model = TransformerModel | LlamaModel | MlpModel | CustomModel
Data = TransformerData | LlamaData | MlpData | CustomData


# The model and data sections of each built-in kind, and of a model of your own.
KINDS: dict[str, tuple[type, type]] = {
    "transformer": (TransformerModel, TransformerData),
    "llama": (LlamaModel, LlamaData),
    "mlp": (MlpModel, MlpData),
    "custom": (CustomModel, CustomData),
}
