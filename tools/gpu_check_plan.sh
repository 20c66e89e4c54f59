# What tools/gpu_check.sh runs, in one place: sourced by it and by its dry
# run (tools/gpu_check_dry_run.sh), which lists the plan without a GPU.
# The GPU_CHECK_* environment variables override the defaults.
gc_parts=(tests diag train bench attn fsdp2 sanitize)
gc_test_timeout=${GPU_CHECK_TEST_TIMEOUT:-120}  # seconds, each test binary
gc_diag_timeout=120
gc_steps=${GPU_CHECK_STEPS:-40}
gc_models=${GPU_CHECK_MODELS:-"small_moe:1 small_qwen3_moe:3"}
gc_train_timeout=300  # each model on each device
gc_tokens=${GPU_CHECK_TOKENS:-4096,16384,65536}
gc_bench_timeout=240  # each benchmark and its torch twin
gc_fsdp2_model=tests/data/bench_qwen3_moe.json
gc_fsdp2_shapes=("16 1024" "64 256")  # micro-batch sequences, tokens each
gc_sanitize_timeout=150
