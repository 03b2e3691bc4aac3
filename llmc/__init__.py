"""llmc: GPT-2 training in Python on hand-written CUDA kernels (and a numpy reference backend)."""
