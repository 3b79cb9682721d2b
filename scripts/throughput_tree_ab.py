"""The 128-request all-at-t=0 throughput of an older source tree against this one, interleaved
(old, new, old, new, ...), each run a fresh process with its own PYTHONPATH, the load average
taken before and after each; writes one JSON through the shared writer.

    git worktree add /tmp/old 01217f4
    PYTHONPATH=src python scripts/throughput_tree_ab.py --old-tree /tmp/old \
        --out benchmarks/results/redesign_throughput_ab.json

The old tree runs its own `benchmarks/throughput.py` (before the benchmarks were folded into
`everystop bench`), the new one `everystop bench throughput`, both with bf16 weights and
activations throughout (the old tree had no --quantization: it always converted to --dtype) on
the same committed workload file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from everystop.results import write_result

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ROOT / "benchmarks/workloads/perf-mixed-128.json"
KEPT = ("output_tok_s", "total_tok_s", "elapsed_s", "num_steps", "ttft_p50_s", "ttft_p99_s",
        "startup_s", "threads", "output_tokens", "prompt_tokens")


def side_command(side: str, old_tree: Path, workload: Path, out: Path
                 ) -> tuple[list[str], dict[str, str]]:
    flags = ["--dtype", "bfloat16", "--workload", str(workload), "--out", str(out)]
    if side == "old":
        cmd = [sys.executable, str(old_tree / "benchmarks/throughput.py"), *flags]
        src = old_tree / "src"
    else:
        cmd = [sys.executable, "-m", "everystop", "bench", "throughput", *flags,
               "--quantization", "none"]
        src = ROOT / "src"
    return cmd, dict(os.environ, PYTHONPATH=str(src))


def run_side(side: str, old_tree: Path, workload: Path, tmp: Path, k: int) -> dict:
    out = tmp / f"{side}_{k}.json"
    cmd, env = side_command(side, old_tree, workload, out)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    r = json.loads(out.read_text())
    row = {"side": side, "command": " ".join(cmd[1:]), "process_wall_s": round(wall, 1),
           "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
           **{key: r.get(key) for key in KEPT}}
    print(json.dumps({k: row[k] for k in ("side", "output_tok_s", "load_avg_before",
                                          "load_avg_after")}), flush=True)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old-tree", type=Path, required=True, help="a checkout of the old commit")
    ap.add_argument("--pairs", type=int, default=2, help="(old, new) pairs, run in turn")
    ap.add_argument("--workload", type=Path, default=WORKLOAD,
                    help="workload JSON (default: the committed perf-mixed-128)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    old_commit = subprocess.run(["git", "-C", str(args.old_tree), "rev-parse", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            for side in ("old", "new"):
                runs.append(run_side(side, args.old_tree, args.workload, Path(tmp), k))
    best = {side: max(r["output_tok_s"] for r in runs if r["side"] == side)
            for side in ("old", "new")}
    pairs = [new["output_tok_s"] / old["output_tok_s"] for old, new in zip(runs[0::2],
                                                                             runs[1::2])]
    write_result({"benchmark": "throughput_tree_ab",
                  "workload": f"{args.workload.name}, every request at t=0",
                  "old_commit": old_commit, "runs": runs,
                  "output_tok_s_best": best, "new_over_old_best": best["new"] / best["old"],
                  "new_over_old_per_pair": pairs}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
