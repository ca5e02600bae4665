# Sourced by the one-shot GPU scripts (gpu_check.sh, gpu_train.sh) after `cd` to the repository root:
# sets PY (PYTHON, default .venv/bin/python) and DEVICE (default cuda), and exits 2 with the fix where
# $PY lacks torch or, for DEVICE=cuda, sees no CUDA device. NAME: the calling script's name.
PY=${PYTHON:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
"$PY" -c "import torch" || { echo "$NAME: $PY cannot import torch; run scripts/setup.sh first" >&2; exit 2; }
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "$NAME needs a CUDA device: torch.cuda.is_available() is False with $PY; run it on a GPU machine" \
         "(scripts/setup.sh there installs a CUDA build of torch), or DEVICE=cpu for a dry run of the script" >&2
    exit 2
fi
