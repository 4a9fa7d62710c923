#!/usr/bin/env bash
# One GPU session's checks (docs/gpu_benchmark.md), in the order that matters, each under its own time
# cap, every result saved as it comes: a step that fails or runs out of time does not stop the next.
#
#   tools/gpu_session.sh OUT_DIR [STEP ...]      (default: every step, in the order below)
#   tools/gpu_session.sh OUT_DIR compiled        (issue 39: compiled rollouts, 9 minutes of caps: the steps c_*)
#   DRY=1 tools/gpu_session.sh OUT_DIR compiled  (the same commands on a CPU in ~2.5 min: tiny configs, aot_eager)
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
for m in ("diffusers", "transformers", "accelerate", "peft", "modelopt", "torchao", "flowrl"):
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

arch() {  # arch PIPELINE BACKENDS RESOLUTIONS NAME [more flags]   (later flags win: ARCH_EXTRA last)
  local pipe=$1 backends=$2 res=$3 name=$4
  shift 4
  # shellcheck disable=SC2086
  $FLOWRL bench precision --pipeline "$pipe" --backends "$backends" --resolutions "$res" \
    --batch 4 --steps 6 --repeats 3 --json "$OUT/json/$name.json" "$@" ${ARCH_EXTRA:-}
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
# issue 39, compiled rollouts (docs/gpu_benchmark.md, "Compiled rollouts"): eager and compiled side by side per
# backend, the targets first; each JSON is written after every backend, so a cap keeps what was measured.
# `compiled` = the c_* steps below (540 s of caps: 9 minutes); `compiled_more` = the rest of the matrix.
CB=full,fp8:kernel=torchao,fp8 CT=full,fp8:kernel=torchao EXPLORE=fp8:kernel=torchao  # bf16, torchao's, hand-written
PX_LO=512 PX_HI=1024
if [ -n "${DRY:-}" ]; then  # the same commands on a CPU: tiny configs, dynamo without inductor's C++ build
  export FLOWRL_COMPILE_BACKEND=aot_eager
  CB=full,fp8:simulate_on_cpu=true CT=full,fp8:simulate_on_cpu=true EXPLORE=fp8:simulate_on_cpu=true
  PX_LO=32 PX_HI=48 ARCH_EXTRA="--tiny --device cpu --steps 1 --repeats 1"
  ITER_EXTRA="--pool-size 4 --preview-steps 2 --keep 2 --train-steps 2 --minibatch 2 --lora-rank 2"
fi
step_c_flux() { arch flux-arch "$CB" "$PX_HI" gpu_flux_compiled_${PX_HI}_b4 --compile default --repeats 2; }
step_c_sd35m() { arch sd35m-arch "$CB" "$PX_HI" gpu_sd35m_compiled_${PX_HI}_b8 --compile default --batch 8; }
step_c_cudagraphs() {  # 512 px is host-bound: CUDA graphs
  arch sd35m-arch "$CT" "$PX_LO" gpu_sd35m_cudagraphs_${PX_LO}_b4 --compile reduce-overhead
}
step_c_iteration() {  # Sol-RL (torchao's FP8 exploration) vs flat GRPO, rollouts compiled, nothing else timed
  # shellcheck disable=SC2086
  arch sd35m-arch full "$PX_LO" gpu_sd35m_compiled_iteration --compile default --iteration-only \
    --explore-backend "$EXPLORE" --iteration-resolution "$PX_LO" ${ITER_EXTRA:-}
}
step_c_pytest() { $PYTEST -q -rs -p no:cacheprovider tests/test_gpu.py -k "compiled or torchao"; }
step_cm_flux() {
  arch flux-arch "$CB" "$PX_LO" gpu_flux_compiled_${PX_LO}_b4 --compile default --repeats 2
  arch flux-arch "$CB" "$PX_LO,$PX_HI" gpu_flux_compiled_b8 --compile default --batch 8 --repeats 2
}
step_cm_sd35m() {
  arch sd35m-arch "$CB" "$PX_LO" gpu_sd35m_compiled_${PX_LO}_b4 --compile default
  arch sd35m-arch "$CB" "$PX_LO" gpu_sd35m_compiled_${PX_LO}_b8 --compile default --batch 8
  arch sd35m-arch "$CB" "$PX_HI" gpu_sd35m_compiled_${PX_HI}_b4 --compile default
  arch sd35m-arch "$CT" "$PX_LO" gpu_sd35m_cudagraphs_${PX_LO}_b8 --compile reduce-overhead --batch 8
}
step_host() {
  $FLOWRL bench host --pipeline sd35m --device cuda --dtype bfloat16 --resolution 512 --prompts 6 \
    --group-size 24 --num-steps 10 --max-batch 9 --guidance 4.5 --minibatch 9 --grad-accum 72 \
    --json "$OUT/json/gpu_bench_host_sd35m.json"
}

declare -A CAP=([env]=60 [pytest]=150 [sd35m]=90 [flux]=150 [train]=60 [plan]=90 [plan_flux]=90
                [nvfp4]=90 [variants]=120 [iteration]=150 [host]=120
                [c_flux]=230 [c_sd35m]=120 [c_iteration]=120 [c_cudagraphs]=40 [c_pytest]=30
                [cm_flux]=420 [cm_sd35m]=400)
for kv in ${CAPS:-}; do CAP[${kv%%=*}]=${kv#*=}; done  # CAPS="pytest=80 flux=110": tighter caps for a rerun
STEPS=("$@")
[ ${#STEPS[@]} -eq 0 ] && STEPS=(env pytest sd35m flux train plan plan_flux variants nvfp4 iteration host)
EXPANDED=()
for s in "${STEPS[@]}"; do
  case $s in
    compiled) EXPANDED+=(c_flux c_sd35m c_iteration c_cudagraphs c_pytest) ;;
    compiled_more) EXPANDED+=(cm_flux cm_sd35m) ;;
    *) EXPANDED+=("$s") ;;
  esac
done
for s in "${EXPANDED[@]}"; do
  t0=$(date +%s)
  echo "=== $s (cap ${CAP[$s]:-120} s) $(date -u +%T)"
  timeout -k 10 "${CAP[$s]:-120}" bash -c "$(declare -f arch "step_$s"); $(declare -p FP8 CB CT EXPLORE PX_LO PX_HI); $(declare -p OUT PY FLOWRL PYTEST DEVICE ARCH_EXTRA ITER_EXTRA 2>/dev/null); step_$s" \
    >"$OUT/$s.log" 2>&1
  rc=$?
  echo "$s rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/summary.txt"
  tail -n 4 "$OUT/$s.log"
  tar czf "${TGZ:-$OUT.tgz}" --exclude=home --exclude=tiny_sd3 --exclude=run_bf16 -C "$(dirname "$OUT")" \
    "$(basename "$OUT")" 2>/dev/null
done
