"""lm_tiny on token files that `jaxkit data prepare` wrote: the stdlib's top-level modules,
one document each, attention kept inside each document.

Prepare:  STDLIB=$(python -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
          jaxkit data prepare "$STDLIB/*.py" --tokenizer bytes --out data/stdlib \\
              --eval-fraction 0.05
Run:      jaxkit train lm_tiny_tokens   (8 simulated devices on a CPU-only machine)
Hardware: any; on 2 CPU cores the 300 optimizer steps take about 2 minutes.
Expect:   eval loss near 1.73 nats/token (bytes, and one end-of-document token).

The rows are windows packed across documents, as nanoGPT reads train.bin; with
data.document_mask a row's tokens attend only to their own document and positions restart
at each. The held-out split is whole documents, drawn by `data prepare`.
"""

import pathlib

import ml_collections

from jaxkit.config import load_config


def get_config() -> ml_collections.ConfigDict:
    c = load_config(str(pathlib.Path(__file__).with_name("lm_tiny.py")))
    c.model.vocab_size = 257  # the 256 bytes and the end of document (null: meta.json's)
    c.data.source = "tokens"
    c.data.path = "data/stdlib"  # the directory `data prepare --out` wrote
    c.data.rows = "windows"  # packed: no padding, every target scored
    c.data.document_mask = True
    return c
