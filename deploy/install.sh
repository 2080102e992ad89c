#!/bin/sh
# Install iota-subnet into a new virtual environment: the Dockerfile's install step, also usable on a
# bare host (systemd, pm2). Usage: deploy/install.sh VENV_DIR
#   VARIANT=cpu|cuda   which torch build (cpu by default)
#   TORCH_SPEC         the torch requirement (default torch==2.13.0)
#   TORCH_INDEX        a pip index to take torch from (e.g. PyTorch's CPU-only wheel index for a small
#                      CPU image); empty: the default index (on Linux x86-64 that build includes CUDA)
#   PYTHON             the interpreter that creates the environment (default python3)
set -eu
VENV=${1:?usage: deploy/install.sh VENV_DIR}
VARIANT=${VARIANT:-cpu}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
SRC=$(cd "$(dirname "$0")/.." && pwd)
case "$VARIANT" in
  cpu|cuda) ;;
  *) echo "VARIANT must be cpu or cuda, not '$VARIANT'" >&2; exit 2 ;;
esac
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "iota-subnet needs Python 3.11 or newer")'
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
if [ -n "$TORCH_INDEX" ]; then
  "$VENV/bin/python" -m pip install -q --index-url "$TORCH_INDEX" "$TORCH_SPEC"
else
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC"
fi
"$VENV/bin/python" -m pip install -q "$SRC"
"$VENV/bin/python" -c 'import torch, iota_subnet.cli; print("torch", torch.__version__, "cuda", torch.version.cuda)'
"$VENV/bin/iota-subnet" --help >/dev/null
echo "iota-subnet installed in $VENV ($VARIANT)"
