#!/usr/bin/env bash
# Create (or reuse) a virtual environment with the project and its library installed for development.
#
#   bash scripts/setup.sh            # .venv in the repository
#   bash scripts/setup.sh /some/env  # elsewhere
#
# Where no NVIDIA GPU is present, the CPU build of torch is installed first, so that the
# project's own requirement (torch>=2.4) is already met and pip fetches no multi-GB CUDA wheels.
# With a GPU, torch comes from PyPI with CUDA. TORCH_VERSION picks the release (default below).
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${1:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip

has_nvidia_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: torch $("$PY" -c 'import torch; print(torch.__version__)') already installed"
elif has_nvidia_gpu; then
    echo "setup: NVIDIA GPU found; torch with CUDA comes from PyPI"
elif [ "$(uname -s)" = Darwin ]; then
    echo "setup: macOS; PyPI's torch is the CPU/MPS build"
else
    echo "setup: no NVIDIA GPU; installing the CPU build of torch ${TORCH_VERSION} first"
    # A local wheel or mirror may already carry the +cpu build; otherwise PyTorch's CPU index has it.
    "$PY" -m pip install -q "torch==${TORCH_VERSION}+cpu" 2>/dev/null ||
        "$PY" -m pip install -q "torch==${TORCH_VERSION}+cpu" \
            --index-url "$CPU_INDEX" --extra-index-url https://pypi.org/simple
fi

# The machinery: the lightning-runkit library, vendored in lib/runkit (`copier update` keeps it
# current). To use a published release instead, delete this line.
"$PY" -m pip install -q -e lib/runkit
"$PY" -m pip install -q -e ".[dev]"
echo "setup: done; activate with: . $VENV/bin/activate"
