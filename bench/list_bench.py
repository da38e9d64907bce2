"""How fast the CLI answers: `import offline_plugins` and `offline-plugins list`.

Side by side in one run with the anchor `python -c "import torch"` (what listing would
cost if discovery imported the losses). Target: `offline-plugins list` under 3 s here.

    python bench/list_bench.py [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import time


def wall(cmd: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def import_time_us(module: str) -> tuple[int, list[str]]:
    """Cumulative import time of ``module`` from ``-X importtime``, and heavy modules it pulled."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True, text=True, check=True
    )
    total = 0
    names = []
    for line in proc.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if m:
            names.append(m.group(4))
            if m.group(4) == module:
                total = int(m.group(2))
    heavy = [n for n in ("torch", "torchrl", "lightning", "transformers", "minari") if n in names]
    return total, heavy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    exe = shutil.which("offline-plugins") or "offline-plugins"
    us, heavy = import_time_us("offline_plugins")
    res = {
        "import_offline_plugins_ms": us / 1000,
        "import_pulled_heavy_modules": heavy,
        "list_s": wall([exe, "list"], args.repeats),
        "list_json_s": wall([exe, "list", "--json"], args.repeats),
        "anchor_import_torch_s": wall([sys.executable, "-c", "import torch"], args.repeats),
        "anchor_python_startup_s": wall([sys.executable, "-c", "pass"], args.repeats),
    }
    res["list_over_import_torch"] = res["list_s"] / res["anchor_import_torch_s"]
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"import offline_plugins       {res['import_offline_plugins_ms']:8.1f} ms (heavy modules: {heavy or 'none'})")
    print(f"offline-plugins list         {res['list_s']:8.3f} s  (target < 3 s)")
    print(f"offline-plugins list --json  {res['list_json_s']:8.3f} s")
    print(f"anchor: python -c 'import torch' {res['anchor_import_torch_s']:8.3f} s")
    print(f"anchor: python startup       {res['anchor_python_startup_s']:8.3f} s")
    print(f"list / import torch          {res['list_over_import_torch']:8.2f}x")


if __name__ == "__main__":
    main()
