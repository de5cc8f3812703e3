#!/usr/bin/env bash
# Create or refresh the virtualenv of one supported stack and install what the project needs.
#
#   MEGATRON_HCP_STACK=py311 (default)  Python 3.11, torch 2.13.0 (the CPU wheel on this machine's
#                                       disk), megatron-core 0.16.1                 -> .venv
#   MEGATRON_HCP_STACK=py312            Python 3.12, torch 2.13.0 from the registry (its CUDA build
#                                       runs on CPU; ~2.6 GB once), megatron-core 0.19.2 and
#                                       Megatron-Bridge 0.6.2                        -> .venv-py312
#
# Prints the venv directory on stdout (the last line). Everything lives inside the repository;
# pip's cache is not used for the large py312 download.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
stack="${MEGATRON_HCP_STACK:-py311}"

find_python() {  # find_python 3.12 -> an interpreter of that version (PATH, then pyenv)
  local want="$1" exe
  for exe in "python$want" "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$want"*/bin/python"$want"; do
    if "$exe" -c "import sys; sys.exit(f'{sys.version_info[0]}.{sys.version_info[1]}' != '$want')" \
        >/dev/null 2>&1; then
      echo "$exe"
      return 0
    fi
  done
  echo "setup_env: no Python $want found (on PATH or under pyenv); install it first" >&2
  return 1
}

case "$stack" in
  py311)
    venv=.venv
    python_bin="${PYTHON:-$(find_python 3.11)}"
    ;;
  py312)
    venv=.venv-py312
    python_bin="${PYTHON:-$(find_python 3.12)}"
    ;;
  *)
    echo "setup_env: MEGATRON_HCP_STACK=$stack is not a supported stack; use py311 or py312" >&2
    exit 2
    ;;
esac

if [ ! -x "$venv/bin/python" ]; then
  "$python_bin" -m venv "$venv" >&2
fi
stamp="$venv/.megatron-hcp-installed"
want="$(cat setup.py scripts/setup_env.sh | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip=("$venv/bin/python" -m pip install -q --no-cache-dir)
  "${pip[@]}" --upgrade pip >&2
  # torch first, pinned, so that nothing later pulls another build
  "${pip[@]}" "torch==2.13.0" >&2
  if [ "$stack" = py312 ]; then
    # Megatron-Bridge's declared requirements pull CUDA-only packages (flashinfer, nvidia
    # resiliency, ...) that cannot run here: install it without them, plus what its training
    # loop imports (pretrain/finetune: modelopt needs scipy; the recipe overrides need
    # hydra-core; megatron.bridge.recipes imports its Flux recipes, which need diffusers).
    # Transformer Engine and nvidia-resiliency-ext cannot be used here (no CUDA;
    # the registry's newest nvrx breaks megatron-core 0.19.2's import): megatron-hcp puts
    # import-only stand-ins in their place (megatron_hcp/bridge/import_shims.py).
    "${pip[@]}" "megatron-core==0.19.2" >&2
    "${pip[@]}" --no-deps "megatron-bridge==0.6.2" "nvidia-modelopt==0.47.0" >&2
    "${pip[@]}" "transformers>=5.8,<=5.12.1" omegaconf "hydra-core>=1.3,<1.4" datasets \
      megatron-energon requests "pulp<4" tensorboard scipy diffusers >&2
  fi
  "${pip[@]}" -e ".[test]" >&2
  echo "$want" > "$stamp"
fi
echo "$root/$venv"
