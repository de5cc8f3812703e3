#!/usr/bin/env bash
# Create or refresh .venv at the repository root with everything the project needs.
# torch 2.13.0 comes first (pip takes the CPU wheel for Python 3.11 from the local disk) so that
# nothing later pulls a CUDA build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$python_bin" -m venv .venv
fi
stamp=.venv/.megatron-hcp-installed
want="$(cat setup.py scripts/setup_env.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi
