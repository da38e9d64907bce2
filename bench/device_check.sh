#!/usr/bin/env bash
# The device check, for a session that is lent a GPU machine (run through the `device` tool
# from the repository root; under 8 minutes on one GPU). It runs the gpu-marked tests and
# the bench scripts with --device cuda, writing logs and JSON to $OUT, and gathers the
# figures of docs/benchmarks.md's GPU table into one file, $OUT/device_check.json.
#
# What it measures on a model of a hub model's shape: the Qwen2.5-0.5B configuration built
# from a config (24 layers, 896 wide, grouped-query attention, a 151,936-row tied embedding;
# random weights, so throughput and memory only) on the built-in `small` tokenizer, in bf16:
# DPO through our loss against a bare forward/backward and TRL's DPOTrainer, GRPO's round and
# the training shell against TRL's GRPOTrainer (the same model, batch and lengths), HF
# generate against vLLM where vllm imports on that machine (it prints whether it does), and
# DDP against FSDP2 where there are two GPUs.
#
# The device image holds torch, lightning, transformers, h5py, pyarrow, matplotlib, pluggy;
# the rest travels as wheels in .whl/ (Python 3.12, x86-64; TRL 1.16.0 and the part of its
# stack the image lacks), fetched here beforehand with
#   bash bench/device_check.sh --fetch
# and carried with the call (carry: [".whl"]). Last run on one H200 on 2026-12-04, before
# TRL and the 0.5 B Qwen2 shape were added (docs/benchmarks.md, "On a GPU"); this version has
# not met a GPU yet.
set -uo pipefail
WHEELS="tensordict==0.14.3 torchrl==0.14.1 pyvers==0.2.3 hoptorch orjson importlib-metadata minari==0.5.4 gymnasium==1.4.0 farama-notifications\
  trl==1.16.0 accelerate==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 fsspec==2026.9.0"

if [ "${1:-}" = "--fetch" ]; then
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .whl "$w" || echo "could not fetch $w" >&2
  done
  exit 0
fi

OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
# our package too (its entry points register the algorithms), built offline with the image's setuptools
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$OUT/gpu.txt"

rc=0
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
timeout 60 python3 bench/offline_bench.py --device cuda --algos iql,td3-bc,cql --steps 300 --rounds 3 2>&1 \
  | tee "$OUT/offline_bench.log" || rc=1
timeout 45 python3 bench/sequence_bench.py --device cuda --rounds 3 --steps 10 --json 2>&1 \
  | tee "$OUT/sequence_bench.json" || rc=1
# DPO on the 0.5 B Qwen2 shape, bf16 autocast: ours against a bare forward+backward, the hand-written
# step and TRL's DPOTrainer (16 pairs of 64 tokens)
timeout 120 python3 bench/preference_bench.py --device cuda --model-size 500m --precision bf16 --steps 10 \
  --rounds 3 --json 2>"$OUT/preference_bench_500m.err" | tee "$OUT/preference_bench_500m.json" || rc=1
# GRPO on the same model, bf16: generation against bare generate, a round, the shell (tokens/s, peak
# memory), and TRL's GRPOTrainer on the same prompts, group and lengths
timeout 150 python3 bench/online_bench.py --device cuda --model-size 500m --precision bf16 --rounds 3 \
  --trl-steps 3 --skip-ppo --json 2>"$OUT/online_bench_500m.err" | tee "$OUT/online_bench_500m.json" || rc=1
# flow Q-learning beside IQL and ReBRAC at FQL's 4 x 512, batch 256, eager and compiled (docs/benchmarks.md,
# "Flow Q-learning"; the anchor in the same run: TorchRL's IQL loop)
timeout 120 python3 bench/flow_bench.py --device cuda --steps 300 --rounds 3 --compile 2>&1 \
  | tee "$OUT/flow_bench.json" || rc=1
# HF generate against the vLLM engine: only where vllm imports (it is not among the wheels)
if python3 -c "import vllm" >/dev/null 2>&1; then
  echo "vllm imports here: $(python3 -c 'import vllm; print(vllm.__version__)')" | tee "$OUT/vllm.txt"
  VLLM_ENABLE_V1_MULTIPROCESSING=0 timeout 90 python3 bench/generation_bench.py --sizes medium \
    --max-new-tokens 64 --rounds 3 --json 2>&1 | tee "$OUT/generation_bench.json" || rc=1
else
  echo "vllm does not import here: HF generate only" | tee "$OUT/vllm.txt"
fi
# DDP against FSDP2 on a ~0.5 B model (DPO, two ranks): only where two GPUs are
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 240 python3 bench/fsdp_bench.py --device cuda --size 500m --steps 10 --json 2>&1 \
    | tee "$OUT/fsdp_bench_500m.json" || rc=1
fi
# one file for the GPU table of docs/benchmarks.md: each bench's JSON that parsed, by name
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
gathered = {"gpu": (out / "gpu.txt").read_text().strip().splitlines()[-1], "vllm": (out / "vllm.txt").read_text().strip()}
for f in sorted(out.glob("*.json")):
    if f.name == "device_check.json":
        continue
    text = f.read_text()
    try:
        gathered[f.stem] = json.loads(text[text.index("{"):])
    except ValueError:
        gathered[f.stem] = {"error": "no JSON: see the log"}
(out / "device_check.json").write_text(json.dumps(gathered, indent=1))
print("wrote", out / "device_check.json")
PY
exit $rc
