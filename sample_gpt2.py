"""Sample text from a GPT-2 checkpoint (ours or llm.c's), with a KV cache, on the GPU or the CPU.

    python sample_gpt2.py -o out --prompt "ROMEO:"          # the newest model that `make train` wrote
    python sample_gpt2.py -e out/model_00000500.bin --prompt "ROMEO:" --max-new-tokens 200 \\
        --temperature 0.8 --top-k 40 --seed 1337 --device auto
    python sample_gpt2.py -e gpt2_124M.bin --prompt-file prompt.txt --num-samples 4 --stop-at-eot
    echo "The meaning of life is" | python sample_gpt2.py -e gpt2_124M.bin --prompt-file -
    python sample_gpt2.py -e gpt2_124M.bin --temperature 0      # greedy
    python sample_gpt2.py --help

The code is llmc/sample_cli.py (also the llmc-sample command of an installed package).
"""
import sys

from llmc.sample_cli import cli

if __name__ == "__main__":
    sys.exit(cli())
