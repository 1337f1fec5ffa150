"""How much the conversion cache saves: the packaged Gemma 3 270M converted from its GGUF into a fresh cache,
then loaded from that cache (found by the GGUF's digest, nothing converted again).

    python bench/real_model_load.py [--repeats 3] [--json out.json]

Reported: the conversion's seconds, the median (and min..max) of the cached loads (the converted folder found
and its tokenizer read, in this process, after the first), and their ratio. The claim `make demo` and the tests
lean on: a cached load takes under half a conversion (exit 1 if not). tests/engine/checkpoints/test_gguf_convert.py
checks that a second load converts nothing; how long it takes is measured here, on a machine left alone, not in a
test under a test run's load. The fresh cache is a temporary folder, removed at the end (about 1.1 GB).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.checkpoints import gguf_convert  # noqa: E402
from engine.checkpoints.real_model import load_real_model, packaged_gguf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="cached loads timed after the conversion")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    gguf = packaged_gguf()
    with tempfile.TemporaryDirectory(prefix="real-model-load-") as scratch:
        started = time.monotonic()
        folder = gguf_convert.convert(gguf, scratch)
        conversion_s = time.monotonic() - started
        loads = []
        for _ in range(args.repeats):
            started = time.monotonic()
            found, _tokenizer = load_real_model(scratch)
            loads.append(time.monotonic() - started)
            assert found == folder, f"the cached load found {found}, not the conversion's {folder}"
    load_s = statistics.median(loads)
    figures = {"conversion_s": round(conversion_s, 2), "cached_load_s": round(load_s, 3),
               "cached_load_min_s": round(min(loads), 3), "cached_load_max_s": round(max(loads), 3),
               "load_over_conversion": round(load_s / conversion_s, 4)}
    print(f"converted in {conversion_s:.1f} s; loaded from the cache in {load_s:.2f} s "
          f"({min(loads):.2f}..{max(loads):.2f}, {args.repeats} loads): {figures['load_over_conversion']:.3f} "
          "of a conversion")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if load_s >= conversion_s / 2:
        print("a cached load took half a conversion or more", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
