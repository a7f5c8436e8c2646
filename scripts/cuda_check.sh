#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (CI has no GPU): the CUDA tests, then decode timings on a
# Llama-3.1-8B-shaped model with random weights (timing only) against plain transformers (the `hf` row every
# `zoomkv bench` table carries), sekv (its fresh adapter: a trained one does the same work per step) beside
# full and the recallable baselines; last, the GPU issue's targets read from those tables (targets.md).
#
#   bash scripts/cuda_check.sh [OUT_DIR] [PARTS]
#
# PARTS, run in the order named (default: all, in this order): a comma list of tests, long (32K tokens x 8
# sequences; 4 under 100 GB of GPU memory), every (the same reading every recalled row each step,
# ZOOMKV_RECALL_MISSES=0, against the default that reads only the rows not already held), chunked (the same,
# prefilled 4K tokens at a time), fit (32 x 32K: more KV than the GPU holds), profile (16K x 1 with phases and
# host syncs), graphs (16K x 1 with the decode steps uncaptured, ZOOMKV_CUDA_GRAPHS=0, beside hf), train
# (distillation steps of the quickstart recipe on the GPU: SmolLM2's shape, random weights, bf16), small (the
# SmolLM2 shape at 8K, batch 4).
# SMOLLM2_DIR must hold SmolLM2's config.json and tokenizer files (default: the converted cache that
# `zoomkv models` / `make demo` writes). The 8B shape reuses that tokenizer: only its vocabulary size matters
# for timing. Each part has a timeout (TEST_TIMEOUT, LONG_TIMEOUT, CHUNKED_TIMEOUT, FIT_TIMEOUT, PROFILE_TIMEOUT,
# TRAIN_TIMEOUT, SMALL_TIMEOUT, EVERY_TIMEOUT, GRAPHS_TIMEOUT) inside the device tool's 600 s per command.
# The warm-ups run 4,608-token prompts: past sekv's stage one at B=1024 (4,092 candidates), where its step takes
# fixed shapes and is captured in a CUDA graph, so its kernels compile before the timed runs.
set -uo pipefail
out=${1:-${OUT:-cuda-check}}
parts=${2:-tests,long,every,chunked,fit,profile,graphs,train,small}
mkdir -p "$out"
src=${SMOLLM2_DIR:-$HOME/.cache/zoomkv/models/smollm2-135m}
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"

nvidia-smi -L | tee "$out/gpu.txt"
$py -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"

# test_cuda.py runs the decode steps under torch.cuda.set_sync_debug_mode("error"), the compiled kernels against
# their references, and the GPU's selections against the CPU's; -rxX lists what is still expected to synchronise.
part_tests() {
  timeout "${TEST_TIMEOUT:-200}" $py -m pytest -q -rxX -p no:cacheprovider tests/test_cuda.py 2>&1 \
    | tail -40 | tee "$out/cuda_tests.log"
}

shapes=$(mktemp -d)
mkdir -p "$shapes/smollm2-135m" "$shapes/llama-3.1-8b"
for f in config.json tokenizer.json tokenizer_config.json generation_config.json chat_template.jinja; do
  [ -f "$src/$f" ] && cp "$src/$f" "$shapes/smollm2-135m/" && [ "$f" != config.json ] && cp "$src/$f" "$shapes/llama-3.1-8b/"
done
cat > "$shapes/llama-3.1-8b/config.json" <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
 "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "vocab_size": 128256,
 "hidden_act": "silu", "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2}
JSON

# 8 sequences of 32K where the GPU holds plain transformers' KV for them beside the weights (an H200's 141 GB; it
# peaked at 77.8 GB there), 4 on a smaller one (an H100's 80 GB); LONG_BATCH sets it. The targets' table says which.
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
long_batch=${LONG_BATCH:-$([ "${mib:-0}" -ge 100000 ] 2>/dev/null && echo 8 || echo 4)}

bench() {  # name, seconds, then zoomkv bench arguments
  local name=$1 secs=$2; shift 2
  echo "== zoomkv bench $*" | tee "$out/$name.md"
  timeout "$secs" $py -m zoomkv bench --random-weights --device cuda --dtype bfloat16 "$@" 2>&1 \
    | grep -v "Warning\|warn(" | tee -a "$out/$name.md"
}
# 32K tokens x 8 sequences, one-shot prefill (sekv's layers wait for the surprisal in pinned host memory, so its
# CUDA peak shows what the prompt's KV leaving the device buys).
part_long() { bench llama8b_32k_b8 "${LONG_TIMEOUT:-240}" --model "$shapes/llama-3.1-8b" --length 32768 --batch-size "$long_batch" \
  --methods full,sekv,quest --budgets 1024 --new-tokens 16 --repeats 1 --warmup-length 4608; }
# The recall reading every row it asks for at each step (before: only the rows its buffer does not hold), with
# its own `full` for the ratio.
part_every() { ZOOMKV_RECALL_MISSES=0 bench llama8b_32k_b8_every_row "${EVERY_TIMEOUT:-200}" --model \
  "$shapes/llama-3.1-8b" --length 32768 --batch-size "$long_batch" --methods full,sekv,quest --budgets 1024 --new-tokens 16 \
  --repeats 1 --warmup-length 4608 --no-hf; }
# The same prompts prefilled 4K tokens at a time: each chunk attends to the rows its method selects (scored a block
# of positions at a time), so the CUDA peak is the weights, the compressed layers and one chunk's activations
# (the GPU issue's target: weights + 25% of full KV).
part_chunked() { bench llama8b_32k_b8_chunked "${CHUNKED_TIMEOUT:-240}" --model "$shapes/llama-3.1-8b" --length 32768 \
  --batch-size "$long_batch" --methods sekv,quest --budgets 1024 --new-tokens 8 --repeats 1 --warmup-length 4608 \
  --prefill-chunk 4096 --no-hf; }
# A batch whose full KV does not fit the GPU (32 x 32K tokens: 137 GB of bf16 KV beside 16 GB of weights): hf and
# full run out of device memory (their rows say so); sekv, prefilled in 4K pieces with its host tier at 8-bit keys
# and 4-bit values (51 GB of the machine's 128 GB), decodes. Its tokens/s is the throughput target's.
# (Its host tier is page-locked at its own size, zoomkv.memory.pinned: torch's pinned allocator would round each
# buffer up to a power of two: a layer's 8-bit keys, 1.08 GB, to 2 GiB. The machine's memory after it: gpu.txt.)
part_fit() {
  bench llama8b_32k_b32_fit "${FIT_TIMEOUT:-300}" --model "$shapes/llama-3.1-8b" --length 32768 \
    --batch-size 32 --methods full,sekv+k8v4 --budgets 1024 --new-tokens 8 --repeats 1 --no-warmup --prefill-chunk 4096
  free -g | tee -a "$out/gpu.txt"
}
part_profile() { bench llama8b_16k_profile "${PROFILE_TIMEOUT:-200}" --model "$shapes/llama-3.1-8b" --length 16384 \
  --methods full,sekv,quest,clusterkv,oracle_topk,streamingllm --budgets 1024 --new-tokens 32 --repeats 2 \
  --warmup-length 4608 --profile --sync-audit; }
# The same step uncaptured (each layer's append and selection launched op by op): what the graphs buy.
part_graphs() { ZOOMKV_CUDA_GRAPHS=0 bench llama8b_16k_uncaptured "${GRAPHS_TIMEOUT:-200}" --model \
  "$shapes/llama-3.1-8b" --length 16384 --methods full,sekv,quest --budgets 1024 --new-tokens 32 --repeats 2 \
  --warmup-length 4608; }
# steps/s: the step lines carry the seconds since the first step. The GPU machine's image has no `datasets`, through
# which the recipe's corpus loads: the samples are generated filler with the recipe's inserted tasks (`data=`; with
# random weights the text changes nothing a step does).
part_train() {
  echo "== zoomkv train (quickstart recipe, SmolLM2 shape, random weights, bf16)" | tee "$out/train.md"
  timeout "${TRAIN_TIMEOUT:-150}" $py -m zoomkv.train --recipe recipes/smollm2-135m/quickstart.yaml \
    model="$shapes/smollm2-135m" random_weights=true dtype=bfloat16 steps=40 num_samples=4 eval_samples=0 \
    data= tasks=passkey:1,kv:1,vartrack:1,aggregate:1 \
    run_name=cuda-train output_dir="$(mktemp -d)" tensorboard=false log_every=10 save_every=1000 2>&1 \
    | grep -E "step [0-9]+:|process|adapter saved|Error" | tee -a "$out/train.md"
}
part_small() { bench smollm2_8k_b4 "${SMALL_TIMEOUT:-120}" --model "$shapes/smollm2-135m" --length 8000 --batch-size 4 \
  --methods full,sekv,quest,clusterkv,snapkv --budgets 1024 --new-tokens 32 --repeats 2 --warmup-length 4608; }

# The parts in the order PARTS names them (the most wanted first when the GPU's time is short).
for part in ${parts//,/ }; do
  if declare -F "part_$part" >/dev/null; then "part_$part"; else echo "cuda_check: no part '$part'" | tee -a "$out/gpu.txt"; fi
done
# The targets, each measured or not, from the tables above.
$py scripts/gpu_targets.py "$out" | tee "$out/targets.md"
exit 0
