#!/usr/bin/env bash
# GPU checks, part by part; exit 0 only when every part this machine can run ran and passed.
#   bash tests/gpu/run_gpu_checks.sh                # budget: <= 8 minutes on one GPU
#   bash tests/gpu/run_gpu_checks.sh --allow-skip   # accept parts skipped for a package that does not import
# Needs a CUDA machine with the GPU extra installed (bash launch/install.sh picks it).
# Stage 1 (first; torch + megatron-core only, <= 3 minutes): python tests/gpu/stage1.py --device cuda,
#   a bf16 learner step on local layers, the driver-level checkpoint round trip, a two-process CUDA IPC
#   export + digest check without vLLM, metric devices (README: "GPU stage 1 on a node without network").
# Stage 2, part by part (where TE, vLLM and Ray are installed):
#   1 TE vs local layer-spec parity (bf16)                 1 GPU + Transformer Engine
#   2 NCCL init + bf16 learner step with float/0-dim/[b] loss statistics   1 GPU (TP = GPUs, up to 2)
#   3 checkpoint save + resume with TE's FusedAdam         1 GPU + Transformer Engine
#   4 colocated IPC publication (verify-before-commit) around vLLM sleep/wake, engine logprobs after refit   1 GPU + vLLM, Ray
#   5 tiny recipe trained colocated in bf16: transport ipc and sleep mode chosen at start-up, refit check each step   1 GPU + vLLM, Ray
#   5b top_p 0.9: vLLM's sampled tokens and logprobs against the learner's top-p rule (reconcile)   1 GPU + vLLM, Ray
#   6 NCCL disaggregated publication + engine logprobs after refit   2 GPUs + vLLM, Ray
#   7 tiny recipe colocated on two GPUs: IPC refit to both (a learner rank holds a copy on GPU 1), and an
#     engine GPU without a learner rank refused at start-up   2 GPUs + vLLM, Ray
# vLLM engines start eager in these checks (tests/gpu/engine_options.py): seconds, not minutes, each.
#
# Exit 1 (the reason printed) when: the python does not import torch; nvidia-smi lists GPUs torch does
# not see; torch sees no GPU (nothing would run); stage 1 fails or prints no passing summary; a part
# fails; a part's pytest ran no test or skipped one (a check that skipped tested nothing); or a part is
# left out because a package it needs does not import, unless --allow-skip.  Parts that need more
# GPUs than the machine has are not run and are listed at the end (the machine cannot run them).
# The end lists what ran, what was skipped and why.
set -uo pipefail
cd "$(dirname "$0")/../.."
allow_skip=0
for arg in "$@"; do
  case "$arg" in
    --allow-skip) allow_skip=1 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "run_gpu_checks.sh: unknown argument '$arg' (known: --allow-skip)" >&2; exit 2 ;;
  esac
done
python=".venv/bin/python"
[ -x "$python" ] || python=python3
start=$(date +%s)

if ! probe=$("$python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0, torch.__version__, torch.version.cuda)" 2>&1); then
  echo "run_gpu_checks.sh: FAILED: $python does not import torch (install the GPU build: bash launch/install.sh):" >&2
  echo "$probe" | tail -n 3 >&2
  exit 1
fi
read -r gpus torch_version torch_cuda <<< "$(echo "$probe" | tail -n 1)"
smi_gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  smi_gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
fi
echo "torch $torch_version (CUDA $torch_cuda) sees $gpus GPU(s); nvidia-smi lists $smi_gpus"
if [ "$gpus" -lt "$smi_gpus" ]; then
  echo "run_gpu_checks.sh: FAILED: nvidia-smi lists $smi_gpus GPU(s) but torch sees $gpus: a driver older than torch's CUDA $torch_cuda build, or CUDA_VISIBLE_DEVICES hides them" >&2
  exit 1
fi
if [ "$gpus" -lt 1 ]; then
  echo "run_gpu_checks.sh: FAILED: no GPU visible to torch, so no check can run (this script is for a CUDA machine)" >&2
  exit 1
fi
nvidia-smi -L 2>/dev/null

declare -A imports=()
imports_ok() {  # imports_ok "mod1 mod2": every module imports with $python (checked once each)
  local mod
  for mod in $1; do
    if [ -z "${imports[$mod]:-}" ]; then
      if "$python" -c "import $mod" >/dev/null 2>&1; then imports[$mod]=yes; else imports[$mod]=no; fi
    fi
    if [ "${imports[$mod]}" != yes ]; then missing=$mod; return 1; fi
  done
}

# How many tests pytest's JUnit report counts, and how many of them it skipped: "tests skipped".
junit_count() {  # junit_count ATTRIBUTE FILE: the first ATTRIBUTE="N" (the suite's total), 0 without a report
  local n
  n=$(grep -o " $1=\"[0-9]*\"" "$2" 2>/dev/null | head -n 1 | tr -dc '0-9')
  echo "${n:-0}"
}

report_dir=$(mktemp -d)
trap 'rm -rf "$report_dir"' EXIT
passed=() failed=() skipped=() not_run=()
part() {  # part NAME NEED_GPUS "MODULES" TEST_PATH
  local name=$1 need=$2 modules=$3 path=$4 missing="" t0 rc tests skips xml
  if [ "$gpus" -lt "$need" ]; then
    echo "== $name: not run (needs $need GPUs, found $gpus)"; not_run+=("$name (needs $need GPUs)"); return
  fi
  if ! imports_ok "$modules"; then
    if [ "$allow_skip" = 1 ]; then
      echo "== $name: skipped ($missing does not import; --allow-skip)"; skipped+=("$name ($missing does not import)")
    else
      echo "== $name: FAILED, not run: $missing does not import (--allow-skip accepts that)"
      failed+=("$name ($missing does not import)")
    fi
    return
  fi
  t0=$(date +%s)
  xml="$report_dir/part$(( ${#passed[@]} + ${#failed[@]} + 1 )).xml"
  "$python" -m pytest "$path" -m gpu -q -rs -s -p no:warnings -p no:cacheprovider --junitxml="$xml"
  rc=$?
  tests=$(junit_count tests "$xml"); skips=$(junit_count skipped "$xml")
  if [ "$rc" -eq 0 ] && [ "$tests" -gt 0 ] && [ "$skips" -eq 0 ]; then
    echo "== $name: ran $tests test(s), passed ($(( $(date +%s) - t0 )) s)"; passed+=("$name")
  elif [ "$rc" -eq 0 ]; then
    echo "== $name: FAILED: pytest ran $tests test(s) and skipped $skips of them: a skipped check tested nothing"
    failed+=("$name (pytest skipped $skips of $tests)")
  else
    echo "== $name: ran, FAILED (pytest exit $rc, $(( $(date +%s) - t0 )) s)"; failed+=("$name (pytest exit $rc)")
  fi
}
# Stage 1: torch and megatron-core only (tests/gpu/stage1.py; its last line is a JSON summary).
echo "== stage 1 (torch + megatron-core only): $python tests/gpu/stage1.py --device cuda"
t0=$(date +%s)
"$python" tests/gpu/stage1.py --device cuda | tee "$report_dir/stage1.log"
rc=${PIPESTATUS[0]}
stage1_summary=$(tail -n 1 "$report_dir/stage1.log")
if [ "$rc" -eq 0 ] && [[ "$stage1_summary" == *'"passed": true'* ]]; then
  stage1="passed ($(( $(date +%s) - t0 )) s)"
else
  stage1_failed=$(echo "$stage1_summary" | grep -o '"failed": \[[^]]*\]' | sed 's/"failed": //')
  stage1="FAILED (exit $rc, failed parts ${stage1_failed:-unknown: no summary line})"
fi
echo "== stage 1: $stage1"

echo "== stage 2: the parts that need Transformer Engine, vLLM or Ray"
part "TE vs local parity" 1 "transformer_engine.pytorch" tests/gpu/test_gpu_te_parity.py
part "NCCL learner step with metrics" 1 "" tests/gpu/test_gpu_nccl.py
part "checkpoint save + resume (TE FusedAdam)" 1 "transformer_engine.pytorch" tests/gpu/test_gpu_checkpoint_te.py
part "colocated IPC publication around sleep/wake + logprobs after refit" 1 "vllm ray" tests/gpu/test_gpu_colocated_ipc.py
part "tiny recipe colocated bf16 with IPC refit and sleep/wake" 1 "vllm ray" tests/gpu/test_gpu_train_colocated.py
part "top-p 0.9 samples reconcile with the learner's semantics" 1 "vllm ray" tests/gpu/test_gpu_top_p.py
part "NCCL disaggregated publication + logprobs after refit" 2 "vllm ray" tests/gpu/test_gpu_publish_nccl.py
part "colocated IPC on two GPUs (a copy per engine GPU)" 2 "vllm ray" tests/gpu/test_gpu_colocated_ipc_multi.py

echo "== summary ($(( $(date +%s) - start )) s): stage 1 ${stage1%% *}; stage 2: ${#passed[@]} passed, ${#failed[@]} failed, ${#skipped[@]} skipped, ${#not_run[@]} not run"
echo "   stage 1: $stage1"
for line in "${passed[@]}"; do echo "   passed:  $line"; done
for line in "${failed[@]}"; do echo "   FAILED:  $line"; done
for line in "${skipped[@]}"; do echo "   skipped: $line"; done
for line in "${not_run[@]}"; do echo "   not run: $line"; done
if [ "${#passed[@]}" -eq 0 ]; then echo "run_gpu_checks.sh: FAILED: no part ran" >&2; exit 1; fi
if [ "${#failed[@]}" -gt 0 ] || [ "${stage1%% *}" != passed ]; then exit 1; fi
exit 0
