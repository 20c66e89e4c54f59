#!/usr/bin/env bash
# The GPU checks, in one call on a GPU machine that has no Bazel (the device
# tool): unpacks gpu_bundle/bundle.tar.xz (tools/gpu_bundle.sh), then
#   1. runs every gpu-tagged test binary (then, diag, the model margins),
#   2. trains tests/data/small_moe.json and small_qwen3_moe.json (or
#      $GPU_CHECK_MODELS, "name:order ...") with one worker
#      on cuda:0 (NCCL, world size 1) and then on the CPU (Gloo), same seed
#      and batches,
#   3. runs the grouped-experts benchmark and its torch._grouped_mm twin,
#   4. (attn) runs the attention benchmark and its torch SDPA twin,
#   5. (fsdp2) one shardd GPU step against a PyTorch FSDP2 step,
#   6. (sanitize) runs the kernel tests under compute-sanitizer memcheck.
# Full logs go to $OUT/gpu-check-logs.tgz; a summary is printed last.
#
#   tools/gpu_check.sh [tests] [diag] [train] [bench] [attn] [fsdp2]
#   [sanitize]   (default: all)
#   tools/gpu_check.sh --dry-run   on any machine, GPU or not: checks the
#   bundle (present, at most 64 MiB, every gpu-tagged test and binary in
#   it, their libraries resolvable) and the files the parts read, lists what
#   would run, and exits non-zero if anything is missing (tools/test.sh runs
#   it after tools/gpu_bundle.sh).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--dry-run" ]]; then
  exec tools/gpu_check_dry_run.sh
fi
# Logs are written here and packed into one file under $OUT at the end (the
# device tool brings back at most 8 files).
out=/tmp/gpu-check-logs
rm -rf "$out" && mkdir -p "$out"
dest=${OUT:-/tmp}
source tools/gpu_check_plan.sh
parts=("$@")
((${#parts[@]} == 0)) && parts=("${gc_parts[@]}")
want() { [[ " ${parts[*]} " == *" $1 "* ]]; }

root=/tmp/shardd-gpu
rm -rf "$root" && mkdir -p "$root"
tar -C "$root" -xJf gpu_bundle/bundle.tar.xz || exit 1
# The target's own CUDA libraries: the toolkit's, else the pip wheels'.
cuda_dirs=()
for lib in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  found=$(find /usr/local/cuda/lib64/ /usr/local/cuda/targets/ /opt /usr/lib \
    -name "$lib" 2>/dev/null | head -n 1)
  [[ -n "$found" ]] && cuda_dirs+=("$(dirname "$found")")
done
# cuDNN 9 (kernels/cuda/cudnn_attention.h opens it at run time): the pip
# wheel nvidia-cudnn-cu13 of the target's Python, else the toolkit's.
cudnn_dir=$(python3 -c 'import nvidia.cudnn, os; print(os.path.join(os.path.dirname(nvidia.cudnn.__file__), "lib"))' 2>/dev/null)
[[ -z "$cudnn_dir" || ! -e "$cudnn_dir/libcudnn.so.9" ]] &&
  cudnn_dir=$(dirname "$(find /usr/local/cuda/lib64/ /opt /usr/lib -name libcudnn.so.9 2>/dev/null | head -n 1)" 2>/dev/null)
[[ -n "$cudnn_dir" && "$cudnn_dir" != "." ]] && cuda_dirs+=("$cudnn_dir")
ld_path="$root/lib"
for d in $(printf '%s\n' "${cuda_dirs[@]}" | sort -u); do ld_path+=":$d"; done
export LD_LIBRARY_PATH="$ld_path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  nvidia-smi -L
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  for b in $(find "$root/bin" -type f); do
    missing=$(ldd "$b" | grep 'not found' || true)
    [[ -n "$missing" ]] && echo "MISSING for $b: $missing"
  done
} >"$out/env.log" 2>&1
cat "$out/env.log" | grep -v '^LD_LIBRARY_PATH' | head -20
summary=()

if want tests; then
  : >"$out/tests.log"
  for t in $(find "$root/bin" -name '*_test' -type f | sort); do
    name=${t#"$root/bin/"}
    start=$SECONDS
    timeout "$gc_test_timeout" "$t" >"$out/t.log" 2>&1
    rc=$?
    {
      echo "===== $name rc=$rc ($((SECONDS - start)) s)"
      cat "$out/t.log"
    } >>"$out/tests.log"
    passed=$(grep -c '^\[       OK \]' "$out/t.log")
    # Per-test lines end in "(N ms)"; the closing list repeats the names.
    failed=$(grep -c '^\[  FAILED  \] .* ms)$' "$out/t.log")
    skipped=$(grep -c '^\[  SKIPPED \] .* ms)$' "$out/t.log")
    summary+=("$(printf '%-45s rc=%-3s ok=%-3s failed=%-3s skipped=%s' "$name" "$rc" "$passed" "$failed" "$skipped")")
    grep -E '^\[  FAILED  \] [A-Za-z]|Failure|error:' "$out/t.log" | head -n 6 |
      sed 's/^/      /' >>"$out/failures.txt"
  done
  rm -f "$out/t.log"
fi

if want diag; then
  # The GPU model's margins against the CPU model as the parameter scale
  # grows and with GPT-OSS features taken out (device_moe_model_hf_test's
  # DISABLED_MarginSweep; its lines are read, not asserted).
  timeout "$gc_diag_timeout" "$root/bin/worker/model/device_moe_model_hf_test" \
    --gtest_also_run_disabled_tests --gtest_filter='*MarginSweep*' \
    >"$out/diag.log" 2>&1
  summary+=("diag rc=$? (may fail at large scales)")
  echo "===== margins"
  grep -E '^---|: loss ' "$out/diag.log"
fi

if want train; then
  steps=$gc_steps
  # The attention-free toy on order-1 data, and a Qwen3-MoE (attention,
  # q/k norms, RoPE) on order-3 data, which only attention can predict.
  models=$gc_models
  for entry in $models; do
    model=${entry%%:*}
    order=${entry##*:}
    for device in cuda cpu; do
      SHARDD_MODEL=tests/data/$model.json SHARDD_ORDER=$order \
        SHARDD_BIN="$root/bin" SHARDD_DEVICE=$device SHARDD_WORKERS=1 SHARDD_TLS=0 \
        SHARDD_STEPS=$steps SHARDD_TRAIN_ARGS=--json \
        SHARDD_PICTURES="$root/pictures-$model-$device" \
        timeout "$gc_train_timeout" deploy/local/run.sh >"$out/train_${model}_$device.log" 2>&1
      rc=$?
      summary+=("train $model $device rc=$rc")
      if ((rc != 0)); then
        echo "  train $model $device:" >>"$out/failures.txt"
        tail -n 25 "$out/train_${model}_$device.log" | sed 's/^/      /' >>"$out/failures.txt"
      fi
    done
    echo "===== train $model (order $order), cuda:0 vs cpu"
    /usr/bin/env python3 - "$out/train_${model}_cuda.log" "$out/train_${model}_cpu.log" <<'PY' | tee "$out/train_${model}_compare.txt"
import json, sys
def report(path):
    """The summary line of `shardctl train --json` (after a line per step)."""
    for line in open(path, errors="replace"):
        if line.startswith('{"event":"summary"'):
            return json.loads(line)
    return {}
gpu, cpu = report(sys.argv[1]), report(sys.argv[2])
for key in ("steps", "first_loss", "final_loss", "step_seconds",
            "tokens_per_second", "peak_unsharded_bytes",
            "planned_peak_unsharded_bytes", "peak_activation_bytes",
            "planned_peak_activation_bytes", "incidents"):
    print(f"{key:30s} gpu {gpu.get(key)!s:24s} cpu {cpu.get(key)}")
g, c = gpu.get("losses", []), cpu.get("losses", [])
worst = 0.0
for i, (a, b) in enumerate(zip(g, c)):
    rel = abs(a - b) / abs(b)
    worst = max(worst, rel)
    if i < 3 or i >= len(g) - 2:
        print(f"step {i + 1:4d} gpu {a:.6f} cpu {b:.6f} rel {rel:.2e}")
print(f"largest relative loss difference over {min(len(g), len(c))} steps: {worst:.2e}")
# The step driver's activation ledger against the plan: the job's plan
# counts the device its workers registered with (a GPU worker's storage
# dtype and kernel state; 1.0000 is exact).
for name, r in (("gpu", gpu), ("cpu", cpu)):
    m, p = r.get("peak_activation_bytes"), r.get("planned_peak_activation_bytes")
    if m and p:
        print(f"{name} activation ledger / plan: {m} / {p} = {m / p:.4f}")
PY
  done
fi

if want bench; then
  tokens=$gc_tokens
  timeout "$gc_bench_timeout" "$root/bin/bench/grouped_experts_cuda_bench" --tokens="$tokens" \
    >"$out/bench_shardd.log" 2>&1
  summary+=("grouped_experts_cuda_bench rc=$?")
  timeout "$gc_bench_timeout" python3 bench/torch_grouped_mm.py --tokens "$tokens" \
    >"$out/bench_torch.log" 2>&1
  summary+=("torch_grouped_mm rc=$?")
  tail -n 12 "$out/bench_shardd.log" "$out/bench_torch.log"
fi

if want attn; then
  timeout "$gc_bench_timeout" "$root/bin/bench/attention_cuda_bench" >"$out/attn_shardd.log" 2>&1
  summary+=("attention_cuda_bench rc=$?")
  timeout "$gc_bench_timeout" python3 bench/torch_sdpa.py >"$out/attn_torch.log" 2>&1
  summary+=("torch_sdpa rc=$?")
  tail -n 4 "$out/attn_shardd.log" "$out/attn_torch.log"
fi

if want fsdp2; then
  # A shardd GPU step against a PyTorch FSDP2 step of the same model.
  for shape in "${gc_fsdp2_shapes[@]}"; do
    read -r b sq <<<"$shape"
    SHARDD_BIN="$root/bin" timeout "$gc_bench_timeout" bench/gpu_vs_fsdp2.sh \
      "$gc_fsdp2_model" "$b" "$sq" 12 >"$out/fsdp2_${b}x$sq.log" 2>&1
    summary+=("gpu_vs_fsdp2 ${b}x$sq rc=$?")
    echo "===== gpu_vs_fsdp2 ${b}x$sq"
    tail -n 5 "$out/fsdp2_${b}x$sq.log"
  done
fi

if want sanitize; then
  # compute-sanitizer memcheck over the kernel tests, in parallel (one GPU
  # holds them all); works where the machine's runtime lets it read the
  # device (Firecracker, not gVisor).
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
  if [[ -z "$san" ]]; then
    summary+=("sanitize: no compute-sanitizer")
  else
    pids=()
    for t in attention_test grouped_experts_test rope_test router_test \
      cross_entropy_test rms_norm_test embedding_test adamw_test bias_test \
      router_aux_loss_test dense_mlp_test bf16_cast_test \
      ../../worker/model/device_moe_model_gemma_test; do
      timeout "$gc_sanitize_timeout" "$san" --tool memcheck --error-exitcode 9 \
        "$root/bin/kernels/cuda/$t" >"$out/san_${t##*/}.log" 2>&1 &
      pids+=("$!:$t")
    done
    for entry in "${pids[@]}"; do
      wait "${entry%%:*}"
      rc=$?
      t=${entry#*:}
      summary+=("$(printf 'memcheck %-28s rc=%-3s %s' "${t##*/}" "$rc" "$(grep -m1 'ERROR SUMMARY' "$out/san_${t##*/}.log")")")
    done
  fi
fi

echo "===== failures"
cat "$out/failures.txt" 2>/dev/null | head -n 60
echo "===== summary"
printf '%s\n' "${summary[@]}"
tar -C "$out" -czf "$dest/gpu-check-logs.tgz" . && echo "logs: $dest/gpu-check-logs.tgz"
