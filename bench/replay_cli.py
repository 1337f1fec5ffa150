"""The whole `kvstore analytics replay` command on a large trace: replays side by side against one at a time.

    python bench/replay_cli.py [--requests 1000000] [--capacity 5%] [--jobs 2] [--json out.json]

Writes the seeded trace of `bench/replay_speed.py` (--requests of them), then runs the command as a user
would, every policy and Belady at each --capacity, twice: with --jobs 1 (the replays one after the other,
as before) and with --jobs N (side by side, one process each). Prints each run's wall time, the peak memory
of its whole process tree (sampled every 0.2 s: the command and its workers together), and
`jobs_speedup` = wall time at --jobs 1 / at --jobs N; checks that both runs report the same figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

from replay_speed import generate  # noqa: E402


def run(trace: Path, capacity: str, jobs: int, out: Path) -> dict:
    """One run of the command: wall seconds and the peak RSS of its process tree, in MiB."""
    command = [sys.executable, "-m", "kvstore.cli", "analytics", "replay", str(trace), "--capacity", capacity,
               "--jobs", str(jobs), "--json", str(out)]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=Path(__file__).resolve().parent.parent)
    root, peak = psutil.Process(process.pid), 0
    while process.poll() is None:
        try:
            tree = [root, *root.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in tree))
        except psutil.Error:
            pass  # a worker ended between the listing and the reading
        time.sleep(0.2)
    wall = time.perf_counter() - started
    stdout, stderr = process.communicate()
    if process.returncode != 0:
        raise SystemExit(f"the command failed ({process.returncode}):\n{stderr}")
    print(stderr.rstrip(), flush=True)
    return {"jobs": jobs, "wall_s": wall, "peak_tree_mib": peak / 2**20, "table": stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--capacity", default="5%", help="as the command takes it")
    parser.add_argument("--jobs", type=int, default=2, help="replays side by side in the second run")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "generated.jsonl"
        generate(trace, args.requests)
        print(f"{args.requests:,} requests, {trace.stat().st_size / 2**20:,.0f} MiB of JSON", flush=True)
        runs = [run(trace, args.capacity, jobs, Path(scratch) / f"jobs{jobs}.json") for jobs in (1, args.jobs)]
        figures = [json.loads((Path(scratch) / f"jobs{r['jobs']}.json").read_text())["rows"] for r in runs]
    for r in runs:
        print(f"--jobs {r['jobs']}: {r['wall_s'] / 60:5.1f} min, peak {r['peak_tree_mib']:,.0f} MiB over the "
              f"command and its workers")
    report = {"requests": args.requests, "capacity": args.capacity,
              "runs": [{k: v for k, v in r.items() if k != "table"} for r in runs],
              "jobs_speedup": runs[0]["wall_s"] / runs[1]["wall_s"], "same_figures": figures[0] == figures[1]}
    print(f"jobs_speedup = {report['jobs_speedup']:.2f} (--jobs {args.jobs} against 1); "
          f"same figures: {report['same_figures']}")
    print(runs[1]["table"])
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
