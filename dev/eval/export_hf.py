"""Export an llm.c / llmc-py GPT-2 checkpoint as a Hugging Face model directory (no torch needed).

    python dev/eval/export_hf.py -i out/model_00005000.bin -o out/hf            # dtype of the file
    python dev/eval/export_hf.py -i gpt2_124M.bin -o gpt2_hf --dtype bfloat16
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('out/hf')"
    python train_gpt2.py -e out/hf ; python sample_gpt2.py -e out/hf            # and back

Writes DIR/config.json and DIR/model.safetensors (vocab unpadded, embeddings tied), plus GPT-2's
tokenizer files (vocab.json, merges.txt) when a local copy of them exists. The format and the
tensor mapping are described in llmc/hf.py. llm.c's own export_hf.py defaults to bfloat16; this one
keeps the checkpoint's precision unless --dtype says otherwise, so by default nothing is rounded.
"""
import argparse
import sys

from llmc.errors import LLMCError  # llmc installed (pip install -e .) or PYTHONPATH=. from the repo root


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("-i", "--input", required=True, help="llm.c model file (model_XXXXXXXX.bin, v3 fp32 or v5 bf16)")
    p.add_argument("-o", "--output", required=True, help="output directory (created)")
    p.add_argument("-d", "--dtype", default=None, choices=["float32", "bfloat16", "fp32", "bf16"],
                   help="tensor type in model.safetensors (default: the checkpoint's own)")
    p.add_argument("--no-tokenizer", action="store_true", help="do not write vocab.json / merges.txt")
    args = p.parse_args(argv)
    from llmc.hf import export_hf
    try:
        r = export_hf(args.input, args.output, args.dtype, tokenizer=not args.no_tokenizer)
    except LLMCError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    tok = " + tokenizer (vocab.json, merges.txt)" if r["tokenizer"] else ""
    print(f"wrote {args.output}/config.json + model.safetensors ({r['dtype']}){tok}: {r['cfg'].describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
