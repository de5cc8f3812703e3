#!/usr/bin/env bash
# Optional check for GPU nodes (not a set-up command): runs the GPU suite tests/gpu (pytest marker
# `gpu`) with the Python environment it is started from - the node's own torch, megatron-core and
# Transformer Engine; it installs nothing - and prints one table: check, GPUs used, result
# (passed / failed / skipped: reason), figure. Checks that need more GPUs than the node has (or
# Transformer Engine where it does not import) are skipped with the reason, never counted as
# passed. Exit status: 1 if a check failed, 2 if the environment cannot run the suite, else 0.
#
#   ./scripts/gpu_check.sh                     # the suite (PYTHON=/path/to/python, default python3)
#   ./scripts/gpu_check.sh --benchmark         # also benchmarks/attention.py --device cuda
#   ./scripts/gpu_check.sh --record-golden     # also write golden_values_dev_gpu_nccl.json for
#                                              #   every recipe whose check passed here, and
#                                              #   tests/gpu/golden/ for the one-rank forms
#   ./scripts/gpu_check.sh -- -k one_gpu -x    # pytest arguments after --
#
# The junit XML and the table stay in $GPU_CHECK_OUT (default: a new temporary directory).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's megatron_hcp and tests
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"

benchmark=0
record_golden=0
pytest_args=()
while (($#)); do
  case "$1" in
    --benchmark) benchmark=1 ;;
    --record-golden) record_golden=1 ;;
    --) shift; pytest_args=("$@"); break ;;
    -h|--help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1'; use --benchmark, --record-golden or -- PYTEST_ARGS" >&2
       exit 2 ;;
  esac
  shift
done

if ! command -v "$py" >/dev/null 2>&1; then
  echo "gpu_check: no interpreter '$py'; set PYTHON=/path/to/python of the GPU node's environment" >&2
  exit 2
fi
out="${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")}"
mkdir -p "$out"

echo "== environment (nothing is installed)"
env_lines="$("$py" -m tests.gpu.environment)" || exit 2
echo "$env_lines" | grep -v '^gpus='
gpus="$(echo "$env_lines" | sed -n 's/^gpus=//p')"
if [ "$gpus" = "0" ]; then
  echo "no CUDA GPU here: every GPU check is skipped (with its reason) and none counts as passed"
fi

echo "== GPU suite: pytest -m gpu tests/gpu"
status=0
"$py" -m pytest -m gpu tests/gpu -q -rs -p no:cacheprovider --junitxml="$out/gpu_check.xml" \
  ${pytest_args[@]+"${pytest_args[@]}"} || status=$?
if { [ "$status" -ne 0 ] && [ "$status" -ne 1 ]; } || [ ! -s "$out/gpu_check.xml" ]; then
  # 1: some check failed (the table says which); anything else: the suite did not finish
  echo "gpu_check: pytest exited with $status before finishing the suite (no results)" >&2
  exit 2
fi

echo "== summary"
report=0
"$py" -m tests.gpu.report "$out/gpu_check.xml" | tee "$out/summary.txt" || report=$?

if [ "$benchmark" -eq 1 ]; then
  echo "== benchmarks/attention.py --device cuda"
  if [ "$gpus" = "0" ]; then
    echo "skipped: needs 1 CUDA GPU; none here"
  else
    "$py" benchmarks/attention.py --device cuda | tee "$out/attention_benchmark.txt"
  fi
fi

if [ "$record_golden" -eq 1 ]; then
  echo "== golden values for gpu_nccl (only recipes whose check passed here)"
  recorded=0
  for name in $("$py" -m tests.gpu.report "$out/gpu_check.xml" \
                --passed test_multi_gpu_recipes::test_recipe_under_gpu_nccl); do
    "$py" -m megatron_hcp.cli functional update-golden "$name" --platform gpu_nccl
    recorded=$((recorded + 1))
  done
  echo "recorded golden_values_dev_gpu_nccl.json for $recorded recipe(s)"
  families="$("$py" -m tests.gpu.report "$out/gpu_check.xml" \
              --passed test_one_gpu_training::test_one_rank_form_on_one_gpu)"
  if [ -n "$families" ]; then
    # shellcheck disable=SC2086 - one family name per word
    "$py" -m tests.gpu.record_one_rank $families
  fi
  echo "recorded tests/gpu/golden/<family>@1rank_gpu_nccl.json for $(echo "$families" | grep -c . || true) one-rank form(s)"
fi
echo "results: $out"
exit "$report"
