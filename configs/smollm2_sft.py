"""SmolLM2-135M, Hugging Face's pretrained Llama, fine-tuned on sft_tiny's prompt/completion
pairs (the stdlib's function signatures, their docstrings' first paragraphs); only the
completions are scored.

Fetch:    huggingface-cli download HuggingFaceTB/SmolLM2-135M \\
              --local-dir checkpoints/SmolLM2-135M
          (yours to run: jaxkit downloads nothing; it reads config.json and *.safetensors)
Prepare:  python -m jaxkit.data.docstrings docstrings.jsonl
          jaxkit data prepare docstrings.jsonl --out data/docstrings-smollm2 \\
              --tokenizer checkpoints/SmolLM2-135M/tokenizer.json --eval-fraction 0.05
Run:      jaxkit train smollm2_sft --workdir runs/smollm2_sft
Export:   jaxkit export runs/smollm2_sft --hf runs/smollm2_sft/hf --dtype bfloat16
Hardware: one GPU or TPU chip; 8 simulated CPU devices run it too, slowly (135M params and
          their Adam moments on every device).
Time:     not measured.
Expect:   not measured: the eval loss starts at the pretrained model's on these pairs and falls.

The architecture (30 blocks, d_model 576, 9 query and 3 key/value heads, tied embeddings,
rope theta 1e5, RMSNorm epsilon 1e-5) comes from the directory's config.json and replaces
any model size here; a command-line override that contradicts it is refused. SmolLM2's
GPT-2-style tokenizer is prepared without `--bos`; for Llama 2/3 or TinyLlama add `--bos`
(prepare refuses it where the tokenizer adds no beginning-of-sequence token). A resume
reads the checkpoint, not the directory's weights.
"""

import pathlib

import ml_collections

from jaxkit.config import load_config


def get_config() -> ml_collections.ConfigDict:
    c = load_config(str(pathlib.Path(__file__).with_name("sft_tiny.py")))
    c.model = ml_collections.ConfigDict()
    c.model.kind = "llama"  # what config.json's model_type "llama" is here
    c.model.init_from = "hf:checkpoints/SmolLM2-135M"  # `huggingface-cli download` wrote it
    c.model.param_dtype = "float32"  # the bfloat16 weights load exactly into float32
    c.model.compute_dtype = "bfloat16"  # the matmuls, as the model was trained
    c.model.remat = "none"  # none | dots | full
    c.model.scan_layers = False  # true: one scanned block, compile time flat in depth
    c.data.path = "data/docstrings-smollm2"  # `data prepare --out` with SmolLM2's tokenizer
    c.data.seq_len = 256  # tokens: SmolLM2's BPE fits most pairs whole (bytes needed 128+)
    c.batch.global_batch_size = 32  # pairs per optimizer step, on any number of devices
    c.batch.per_device_batch_size = None  # derived: 32 / (data × fsdp) per micro-step
    c.batch.grad_accum_steps = 1  # raise it if a micro-batch does not fit
    c.optimizer.learning_rate = 5e-5  # fine-tuning: a small step from the pretrained weights
    c.optimizer.reference_batch_size = 32
    c.optimizer.warmup_steps = 10
    c.optimizer.weight_decay = 0.0
    c.optimizer.b2 = 0.999
    c.train.steps = 200  # about two passes over the 3,100 training pairs
    c.train.log_every = 10
    c.train.eval_every = 50
    return c
