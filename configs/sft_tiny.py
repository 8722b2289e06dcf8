"""Prompt/completion fine-tuning data, padded: the stdlib's function signatures as prompts,
their docstrings' first paragraphs as completions; only completions are scored.

Prepare:  python -m jaxkit.data.docstrings docstrings.jsonl
          jaxkit data prepare docstrings.jsonl --tokenizer bytes --out data/docstrings \\
              --eval-fraction 0.05
Run:      jaxkit train sft_tiny   (8 simulated devices on a CPU-only machine)
Hardware: any; on 2 CPU cores the 150 optimizer steps take about 1 minute.
Expect:   eval loss near 2.04 nats per scored byte (completions and their end of document).

Each row is one document (data.rows=documents): its first seq_len + 1 tokens, padded with
the end-of-document id. Prompt bytes and padding weigh 0, so rows weigh from a handful of
targets to seq_len, and the loss of a step is Σ weight × loss / Σ weight over its whole
global batch, whatever the split (`jaxkit experiment normalisation sft_tiny` shows what
the mean of micro-batch means would do instead).
"""

import pathlib

import ml_collections

from jaxkit.config import load_config


def get_config() -> ml_collections.ConfigDict:
    c = load_config(str(pathlib.Path(__file__).with_name("lm_tiny.py")))
    c.model.vocab_size = 257  # the 256 bytes and the end-of-document token
    c.data.source = "tokens"
    c.data.path = "data/docstrings"  # the directory `data prepare --out` wrote
    c.data.rows = "documents"  # padded: one document per row, padding weighs 0
    c.data.seq_len = 128  # covers 80% of the pairs whole; longer ones are cut
    c.train.steps = 150  # about three passes over the 3,100 training pairs
    c.train.log_every = 10
    c.train.eval_every = 50
    return c
