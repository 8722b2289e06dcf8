#!/usr/bin/env bash
# The kit's GPU figures in one command: install, a one-step check, then the measurements.
#
# On the GPU machine (Python 3.12, jax 0.11.2 with CUDA 13, its own flax, optax and orbax;
# no network), from the repository root, with .whl/ carried there:
#
#     bash benchmarks/gpu_suite.sh                 # everything, measurements in <= 5 minutes
#     bash benchmarks/gpu_suite.sh --only lm_1b    # re-measure part, in <= 3 minutes
#     bash benchmarks/gpu_suite.sh --dry-run       # here, on the CPU: every stage, tiny shapes
#
# 1. Installs the wheels in .whl/ (the kit's packages the GPU image lacks) and the kit itself,
#    both with --no-deps and no index, into a folder of their own on PYTHONPATH: the image's
#    jax, flax, optax and orbax stay as they are. --dry-run installs the same, and checks at
#    the end that every module the stages imported comes from the standard library, the
#    image's package list or .whl/ (benchmarks/gpu_suite.py, IMAGE).
# 2. benchmarks/gpu_suite.py: the kit imports and takes one step on this jax (fail fast);
#    lm_125m, lm_350m and lm_1b in bfloat16 with cudnn and xla attention at the largest
#    per-device batch that fits, the kit against gpu_lm125m.py's hand loop (tokens/s, MFU,
#    HFU, memory); a two-step train.profile_steps trace of the fastest lm_125m and lm_1b
#    runs, copied flat to $OUT/<config>-trace.json.gz (each under 16 MiB); every figure in
#    $OUT/gpu_suite.json, the console in $OUT/gpu_suite.log: at most 8 files. Without $OUT,
#    --out DIR or a new folder it names.
#
# .whl/ (ignored by git) is filled here, on a machine with pip and a network, by:
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
#       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#       --platform manylinux1_x86_64 -d .whl ml_collections==1.1.0 tensorboardX==2.6.5
#
# (their own needs, absl-py, PyYAML, numpy, packaging and protobuf, are on the image). With
# the device tool: run "bash benchmarks/gpu_suite.sh" with carry [".whl"] and timeout_s 600.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
site=${JAXKIT_SUITE_SITE:-/tmp/jaxkit-suite-site}
rm -rf "$site"
shopt -s nullglob
wheels=(.whl/*.whl)
if [[ ${#wheels[@]} == 0 ]]; then
  echo "gpu_suite: no wheels in .whl/: fill it as this script's header says" >&2
  exit 2
fi
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$site" "${wheels[@]}"
# Built by the interpreter's own setuptools (the image has it; no index to fetch one from).
if ! "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
  --no-cache-dir --target "$site" . 2>"$site.kit-install.log"; then
  echo "gpu_suite: pip could not build the kit here (see $site.kit-install.log: setuptools" \
    ">= 70, or the wheel package, is needed); the checkout runs from PYTHONPATH" >&2
fi
# The checkout after the install: where the kit could not be installed, it is imported from
# there (the stages' processes start in the repository root and find it first anyway).
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n ${OUT:-} ]]; then
  mkdir -p "$OUT"
  "$python" benchmarks/gpu_suite.py "$@" 2>&1 | tee "$OUT/gpu_suite.log"
else
  "$python" benchmarks/gpu_suite.py "$@"
fi
