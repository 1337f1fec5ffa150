"""Convert a Gemma 3 GGUF once into the engine's model folder, and print the folder.

    python -m engine.checkpoints [file.gguf] [--cache-dir DIR]    # default: the packaged Gemma 3 270M
"""

from __future__ import annotations

import argparse
import sys

from engine.checkpoints.gguf_convert import CACHE_ENV, convert
from engine.checkpoints.real_model import converted_real_model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.checkpoints", description=__doc__.split("\n")[0])
    parser.add_argument("gguf", nargs="?", help="the .gguf file (default: the packaged Gemma 3 270M)")
    parser.add_argument("--cache-dir", help=f"cache folder (default ${CACHE_ENV} or ~/.cache/kvstore/models)")
    args = parser.parse_args(argv)
    try:
        folder = convert(args.gguf, args.cache_dir) if args.gguf else converted_real_model(args.cache_dir)
    except ValueError as error:
        sys.exit(f"error: {error}")
    print(folder)


if __name__ == "__main__":
    main()
