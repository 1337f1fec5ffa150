"""What both vLLM call paths of the bench share: the CPU platform, chosen before vLLM is imported, and
the page: 8 layers of [2, 128, 8, 128] float16 (512 KiB a layer, 4 MiB a page)."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # before vLLM picks a platform

PAGE_BYTES = 4 * 2**20
LAYERS, BLOCK, HEADS, HEAD_DIM = 8, 128, 8, 128
