# What the GPU tools share (sourced by tools/gpu_check.sh, tools/gpu_step_matrix.sh and
# tools/gpu_kernel_profile.sh, with `root` set to the repository): the binary and the models.

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
