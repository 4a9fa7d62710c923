#!/usr/bin/env bash
# One GPU session's checks (docs/gpu_benchmark.md), in the order that matters, each under its own time
# cap, every result saved as it comes: a step that fails or runs out of time does not stop the next.
#
#   tools/gpu_session.sh OUT_DIR [STEP ...]      (default: every step, in the order below)
#
# Writes OUT_DIR/<step>.log per step, OUT_DIR/json/*.json (+ PNG charts), OUT_DIR/summary.txt (one line
# per step: rc, seconds) and, after each step, OUT_DIR.tgz (or $TGZ) of all of it (so a run cut short still hands
# back what it finished). CAPS="step=seconds ..." overrides caps. Runs from any directory; FLOWRL / PYTEST name the commands (default: this
# Python's `-P -m flowrl` / `-P -m pytest`, so the checkout's folders never shadow the installed package).
set -u
OUT=${1:?usage: tools/gpu_session.sh OUT_DIR [STEP ...]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
FLOWRL=${FLOWRL:-"$PY -P -m flowrl"}
PYTEST=${PYTEST:-"$PY -P -m pytest"}
mkdir -p "$OUT/json"
export FLOWRL_HOME=${FLOWRL_HOME:-$OUT/home} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cd "$ROOT" || exit 1

step_env() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
  $PY - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(),
      "sm", torch.cuda.get_device_capability())
for m in ("diffusers", "transformers", "accelerate", "peft", "modelopt", "flowrl"):
    try:
        mod = importlib.import_module(m)
        print(m, getattr(mod, "__version__", "?"), mod.__file__)
    except Exception as e:  # noqa: BLE001 - a report, not a check
        print(m, "NOT IMPORTABLE:", e)
EOF
}

step_pytest() {  # the GPU tests, and the CUDA-gated tests of other files
  $PYTEST -q -rs -p no:cacheprovider tests/test_gpu.py \
    tests/test_host_overhead.py::test_cuda_noise_is_drawn_on_the_device_per_seed \
    tests/test_host_overhead.py::test_cuda_rollout_and_update_sync_per_step_not_per_row \
    tests/test_quant.py::test_cuda_backends_quantize_close_and_batch_independent
}

arch() {  # arch PIPELINE BACKENDS RESOLUTIONS NAME [more flags]
  local pipe=$1 backends=$2 res=$3 name=$4
  shift 4
  $FLOWRL bench precision --pipeline "$pipe" --backends "$backends" --resolutions "$res" \
    --batch 4 --steps 6 --repeats 3 --json "$OUT/json/$name.json" "$@"
}
FP8=full,fp8
step_sd35m() { arch sd35m-arch "$FP8" "${SD35M_RES:-512,1024}" gpu_sd35m_arch; }
step_flux() { arch flux-arch "$FP8" "${FLUX_RES:-512,1024}" gpu_flux_arch; }
step_nvfp4() { arch sd35m-arch full,nvfp4 1024 gpu_sd35m_nvfp4; }
step_variants() {
  arch sd35m-arch full,fp8,fp8:fuse_qkv=true,fp8:weight=per_tensor,fp8:fast_accum=false 512,1024 \
    gpu_sd35m_fp8_variants
}

step_train() {  # a few bf16 iterations of the tiny SD3 recipe; the first minibatch's ratio must be 1
  local tiny=$OUT/tiny_sd3 run=$OUT/run_bf16
  $FLOWRL make-tiny sd3 "$tiny" --overwrite || return 1
  $FLOWRL train --config recipes/sd3_group_pickscore.yaml --output-dir "$run" \
    model.path="$tiny" model.device="${DEVICE:-cuda}" model.options.dtype=bfloat16 train.mixed_precision=bf16 \
    model.options.resolution=64 model.options.max_sequence_length=16 model.options.gradient_checkpointing=true \
    sampler.group_size=4 sampler.num_steps=6 sampler.max_batch=null train.iterations=4 train.batch_size=8 \
    train.minibatch_size=64 train.checkpoint_every=2 data.eval_seeds_per_prompt=2 \
    "reward.weights={jpeg_compressibility: 1.0}" "reward.options={}" "reward.heldout={}" "logging.trackers=[]" \
    logging.eval_every=2 logging.image_every=100 data.prompts=flowgrpo-pickscore-sample \
    "data.eval_prompts=[a photo of a cat, a red apple on a table]" logging.progress=false || return 1
  cp "$run/metrics.jsonl" "$OUT/json/gpu_train_bf16_metrics.jsonl"
  $PY - "$run/metrics.jsonl" <<'EOF'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if "ratio_mean" in l]
for r in recs:
    print({k: r.get(k) for k in ("iteration", "ratio_mean", "loss", "grad_norm", "reward_mean")})
first = recs[0]["ratio_mean"]
print(f"first iteration's ratio_mean {first:.6f}: {'OK' if abs(first - 1) < 1e-3 else 'NOT within 1e-3 of 1'}")
sys.exit(0 if abs(first - 1) < 1e-3 else 1)
EOF
}

step_plan() {  # the planner against torch.cuda.max_memory_allocated (random weights: no download here)
  $FLOWRL plan --config recipes/sd3_group_pickscore.yaml --measure --json "$OUT/json/gpu_plan_sd35m.json"
  $FLOWRL plan --config recipes/sd3_group_pickscore.yaml --measure --json "$OUT/json/gpu_plan_sd35m_ckpt.json" \
    model.options.gradient_checkpointing=true
}
step_plan_flux() {  # on torch 2.11 flowrl turns cuDNN attention off (flowrl.utils.cuda_quirks)
  $FLOWRL plan --config recipes/flux_group_pickscore.yaml --measure --json "$OUT/json/gpu_plan_flux.json"
}
step_iteration() {
  $FLOWRL bench precision --pipeline sd35m-arch --backends full,fp8 --resolutions 512 --iteration-timing \
    --json "$OUT/json/gpu_sd35m_iteration.json"
}
step_host() {
  $FLOWRL bench host --pipeline sd35m --device cuda --dtype bfloat16 --resolution 512 --prompts 6 \
    --group-size 24 --num-steps 10 --max-batch 9 --guidance 4.5 --minibatch 9 --grad-accum 72 \
    --json "$OUT/json/gpu_bench_host_sd35m.json"
}

declare -A CAP=([env]=60 [pytest]=150 [sd35m]=90 [flux]=150 [train]=60 [plan]=90 [plan_flux]=90
                [nvfp4]=90 [variants]=120 [iteration]=150 [host]=120)
for kv in ${CAPS:-}; do CAP[${kv%%=*}]=${kv#*=}; done  # CAPS="pytest=80 flux=110": tighter caps for a rerun
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env pytest sd35m flux train plan plan_flux variants nvfp4 iteration host)
for s in "${STEPS[@]}"; do
  t0=$(date +%s)
  echo "=== $s (cap ${CAP[$s]:-120} s) $(date -u +%T)"
  timeout -k 10 "${CAP[$s]:-120}" bash -c "$(declare -f arch "step_$s"); $(declare -p FP8); $(declare -p OUT PY FLOWRL PYTEST DEVICE 2>/dev/null); step_$s" \
    >"$OUT/$s.log" 2>&1
  rc=$?
  echo "$s rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$s.log"
  tar czf "${TGZ:-$OUT.tgz}" --exclude=home --exclude=tiny_sd3 --exclude=run_bf16 -C "$(dirname "$OUT")" \
    "$(basename "$OUT")" 2>/dev/null
done
