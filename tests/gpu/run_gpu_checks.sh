#!/usr/bin/env bash
# GPU checks, part by part, each reported as ran (passed/FAILED) or skipped with the reason.
#   bash tests/gpu/run_gpu_checks.sh            # budget: <= 8 minutes on one GPU
# Needs a CUDA machine with the GPU extra installed (bash launch/install.sh picks it).
#   1 TE vs local layer-spec parity (bf16)                 1 GPU + Transformer Engine
#   2 NCCL init + bf16 learner step with float/0-dim/[b] loss statistics   1 GPU (TP = GPUs, up to 2)
#   3 checkpoint save + resume with TE's FusedAdam         1 GPU + Transformer Engine
#   4 colocated IPC publication (verify-before-commit) around vLLM sleep/wake, engine logprobs after refit   1 GPU
#   5 tiny recipe trained colocated in bf16: transport ipc and sleep mode chosen at start-up, refit check each step   1 GPU
#   6 NCCL disaggregated publication + engine logprobs after refit   2 GPUs
#   7 tiny recipe colocated on two GPUs: IPC refit to both (a learner rank holds a copy on GPU 1), and an
#     engine GPU without a learner rank refused at start-up   2 GPUs
set -uo pipefail
cd "$(dirname "$0")/../.."
python=".venv/bin/python"
[ -x "$python" ] || python=python3
start=$(date +%s)
gpus=$("$python" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
te=$("$python" -c "import transformer_engine.pytorch" >/dev/null 2>&1 && echo yes || echo no)
echo "GPUs: $gpus; transformer_engine.pytorch imports: $te"
[ "$gpus" -ge 1 ] && nvidia-smi -L
failed=0
part() {  # part NAME NEED_GPUS NEED_TE TEST_PATH
  local name=$1 need=$2 need_te=$3 path=$4
  if [ "$gpus" -lt "$need" ]; then echo "== $name: skipped (needs $need GPU(s), found $gpus)"; return; fi
  if [ "$need_te" = yes ] && [ "$te" != yes ]; then echo "== $name: skipped (transformer_engine.pytorch does not import)"; return; fi
  local t0=$(date +%s)
  if "$python" -m pytest "$path" -m gpu -q -rs -s -p no:warnings -p no:cacheprovider; then
    echo "== $name: ran, passed ($(( $(date +%s) - t0 )) s)"
  else
    echo "== $name: ran, FAILED ($(( $(date +%s) - t0 )) s)"; failed=1
  fi
}
part "TE vs local parity" 1 yes tests/gpu/test_gpu_te_parity.py
part "NCCL learner step with metrics" 1 no tests/gpu/test_gpu_nccl.py
part "checkpoint save + resume (TE FusedAdam)" 1 yes tests/gpu/test_gpu_checkpoint_te.py
part "colocated IPC publication around sleep/wake + logprobs after refit" 1 no tests/gpu/test_gpu_colocated_ipc.py
part "tiny recipe colocated bf16 with IPC refit and sleep/wake" 1 no tests/gpu/test_gpu_train_colocated.py
part "NCCL disaggregated publication + logprobs after refit" 2 no tests/gpu/test_gpu_publish_nccl.py
part "colocated IPC on two GPUs (a copy per engine GPU)" 2 no tests/gpu/test_gpu_colocated_ipc_multi.py
echo "total $(( $(date +%s) - start )) s"
exit $failed
