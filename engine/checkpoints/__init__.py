"""Where a model's weights come from: a GGUF converted once into a cached folder (`gguf_convert`), the packaged
Gemma 3 270M (`real_model`), and random-weight models for demos and benchmarks (`random_model`).

`python -m engine.checkpoints [file.gguf]` converts from the command line.
"""
