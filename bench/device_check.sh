#!/usr/bin/env bash
# The device check, for a session that is lent a GPU machine (run through the `device` tool
# from the repository root; about 8 minutes on one GPU). It runs the gpu-marked tests and
# the bench scripts with --device cuda, writing logs and JSON to $OUT.
#
# The device image holds torch, lightning, transformers, h5py, pyarrow, matplotlib, pluggy;
# the rest travels as wheels in .whl/ (Python 3.12, x86-64), fetched here beforehand with
#   bash bench/device_check.sh --fetch
# and carried with the call (carry: [".whl"]). Run on one H200 on 2026-12-04 (docs/benchmarks.md, "On a GPU").
set -uo pipefail
WHEELS="tensordict==0.14.3 torchrl==0.14.1 pyvers==0.2.3 hoptorch orjson importlib-metadata minari==0.5.4 gymnasium==1.4.0 farama-notifications"

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
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
timeout 120 python3 bench/offline_bench.py --device cuda --algos iql,td3-bc,cql --steps 300 --rounds 5 2>&1 \
  | tee "$OUT/offline_bench.log" || rc=1
timeout 90 python3 bench/sequence_bench.py --device cuda --rounds 5 --steps 10 --json 2>&1 \
  | tee "$OUT/sequence_bench.json" || rc=1
# DPO on a ~86 M-parameter GPT-2 built from a config, bf16 autocast: ours against a bare
# forward+backward and the hand-written step (and TRL's DPOTrainer where trl is importable)
timeout 120 python3 bench/preference_bench.py --device cuda --model-size 100m --precision bf16 --steps 20 \
  --rounds 3 --json 2>&1 | tee "$OUT/preference_bench_100m.json" || rc=1
# GRPO on the same ~86 M GPT-2, bf16: generation against bare generate, a round, the shell (tokens/s,
# peak memory), and TRL's GRPOTrainer where trl and datasets are importable (not in the image's wheels)
timeout 120 python3 bench/online_bench.py --device cuda --model-size 100m --precision bf16 --rounds 3 \
  --trl-steps 3 --json 2>&1 | tee "$OUT/online_bench_100m.json" || rc=1
# DDP against FSDP2 on a ~0.5 B GPT-2 built from a config (DPO, two ranks): only where two GPUs are
# (one H200 gives one rank: FSDP has nothing to shard over). vLLM is not in the image's wheels:
# HF generate vs vLLM runs in the vllm venv (scripts/make_vllm_env.sh, bench/generation_bench.py).
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  timeout 240 python3 bench/fsdp_bench.py --device cuda --size 500m --steps 10 --json 2>&1 \
    | tee "$OUT/fsdp_bench_500m.json" || rc=1
fi
exit $rc
