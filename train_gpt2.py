"""Train GPT-2 on our own CUDA kernels (or the numpy backend without a GPU).

    python train_gpt2.py                                   # the main job (see README)
    python train_gpt2.py --softmax-kernel 5 --matmul-kernel 5
    python train_gpt2.py --device cpu -e L2C64H2 -b 4 -t 64 -x 50
    python train_gpt2.py --list-kernels
    python train_gpt2.py --help                            # every flag; llm.c's letters are aliases
"""
import sys

from llmc.train import cli

if __name__ == "__main__":
    sys.exit(cli())
