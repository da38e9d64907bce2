#!/usr/bin/env bash
# Resolve the newest releases that pyproject.toml's ranges admit in a scratch venv, run the
# whole suite on them, and rewrite constraints.txt with that venv's versions when it passes.
# When it fails, constraints.txt is left as it was and the failures are printed: the suite
# does not pass on today's releases, which is the drift to fix before the pins move.
#
#   bash scripts/update_constraints.sh [SCRATCH_DIR]     (about 10 minutes on 2 cores)
#
# Run it before a release, when a dependency ships a release the project wants, and
# whenever a fresh install without -c constraints.txt is reported to fail.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
scratch=${1:-$(mktemp -d -t offline-plugins-constraints-XXXX)}
extras=$(sed -n 's/^# extras: //p' constraints.txt)
extras=${extras:-test,mujoco}

python3 -m venv "$scratch/venv"
. "$scratch/venv/bin/activate"
python -m pip install --quiet --upgrade pip
# torch is the one pin kept: the CPU build on this machine; the rest resolve to their newest
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet --no-cache-dir -e ".[$extras]" -e ./examples/third_party_plugin

set +e
python -m pytest -q -ra -p no:cacheprovider
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "update_constraints: the suite failed on the newest releases (pytest exit $rc); constraints.txt unchanged" >&2
  exit "$rc"
fi
{
  echo "# The exact versions the whole suite last passed with (scripts/update_constraints.sh,"
  echo "# $(date -u +%Y-%m-%d), Python $(python -c 'import platform; print(platform.python_version())'))."
  echo "# Install with: pip install -c constraints.txt -e '.[test,mujoco]'"
  echo "# extras: $extras"
  # editable installs are the project itself; torch is kept without its local build label
  python -m pip freeze --exclude-editable | grep -v -i '^offline[-_]plugins' | sed -E 's/^(torch==[^+]+)\+.*/\1/' | sort -f
} > "$repo/constraints.txt.new"
mv "$repo/constraints.txt.new" "$repo/constraints.txt"
echo "update_constraints: suite passed; constraints.txt rewritten ($(grep -vc '^#' constraints.txt) pins)"
