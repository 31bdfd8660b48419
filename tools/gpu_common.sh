# What the GPU tools share (sourced by tools/gpu_check.sh, tools/gpu_step_matrix.sh,
# tools/gpu_kernel_profile.sh and tools/gpu_dp_check.sh, with `root` set to the repository): the
# binary, the models and the steps' medians.

# megatrain_bin: `bin` (MEGATRAIN_BIN, else the bundle of tools/build_gpu_bundle.sh, else the
# release build) and its bundled libraries on the loader's path; exits 2 when there is none.
megatrain_bin() {
  bin="${MEGATRAIN_BIN:-}"
  if [ -z "$bin" ]; then
    for c in "$root/dist/megatrain-cuda/megatrain" "$root/target/release/megatrain"; do
      [ -x "$c" ] && { bin="$c"; break; }
    done
  fi
  [ -n "$bin" ] && [ -x "$bin" ] || {
    echo "error: no megatrain binary (set MEGATRAIN_BIN, or build one: tools/build_gpu_bundle.sh)" >&2; exit 2; }
  bindir="$(cd "$(dirname "$bin")" && pwd)"
  [ -d "$bindir/lib" ] && export LD_LIBRARY_PATH="$bindir/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  return 0
}

# step_median KEY METRICS.jsonl: the median of KEY over the steps after the first (start-up), as
# megatrain wrote it; nothing when there is none.
step_median() {
  grep -o "\"$1\": *[0-9.eE+-]*" "$2" 2>/dev/null | sed 's/.*: *//' | tail -n +2 | sort -g \
    | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }'
}

# llama_config LAYERS HIDDEN FFN HEADS KV VOCAB → config.json
llama_config() {
  cat <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $2,
 "intermediate_size": $3, "num_hidden_layers": $1, "num_attention_heads": $4,
 "num_key_value_heads": $5, "vocab_size": $6, "max_position_embeddings": 131072,
 "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": false, "hidden_act": "silu"}
EOF
}
# qwen3_moe_config LAYERS HIDDEN EXPERT_FFN EXPERTS TOP_K HEADS KV HEAD_DIM VOCAB → config.json
qwen3_moe_config() {
  cat <<EOF
{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": $2,
 "intermediate_size": $(( 8 * $3 )), "moe_intermediate_size": $3, "num_experts": $4,
 "num_experts_per_tok": $5, "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
 "num_hidden_layers": $1, "num_attention_heads": $6, "num_key_value_heads": $7, "head_dim": $8,
 "vocab_size": $9, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
 "tie_word_embeddings": false, "hidden_act": "silu", "output_router_logits": false}
EOF
}

# profile_model moe|step DIR: the profiled models' config.json into DIR/config.json and their
# micro-batch into `batch` (sequences of 4096 tokens, one micro-batch a step).
#   moe   2 layers as wide as Qwen3-30B-A3B's (128 experts of 768, top-8), 8 × 4096 tokens
#   step  4 layers of Llama-3-8B's width, 8 × 4096 tokens
profile_model() {
  case "$1" in
    moe) qwen3_moe_config 2 2048 768 128 8 32 4 128 151936 > "$2/config.json"; batch=8 ;;
    step) llama_config 4 4096 14336 32 8 128256 > "$2/config.json"; batch=8 ;;
    *) echo "error: unknown model $1 (moe or step)" >&2; return 2 ;;
  esac
}
