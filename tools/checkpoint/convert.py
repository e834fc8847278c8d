"""Convert checkpoints between Hugging Face and megatron-core, with Megatron-LM's command and flags.

    python tools/checkpoint/convert.py --model-type GPT --loader llama_mistral --saver core \
        --checkpoint-type hf --model-size llama3-8B --load-dir HF_DIR --save-dir OUT \
        --tokenizer-model HF_DIR [--bf16] [--target-tensor-parallel-size N] [--target-pipeline-parallel-size M]
    python tools/checkpoint/convert.py --model-type GPT --loader core --saver hf \
        --load-dir OUT --save-dir HF_OUT
"""

import argparse
import importlib
import os
import signal
import sys

from host_memory import peak_line

import megatron.training  # noqa: F401  first of megatron's: quiets megatron-core's import notices
from megatron.training.errors import ArgumentError, error_line, exit_on_user_error
from megatron.training.host_memory import resident_bytes

CONVERSIONS = {("llama_mistral", "core"): "hf_to_core", ("core", "hf"): "core_to_hf"}


class ConvertArgumentParser(argparse.ArgumentParser):
    def error(self, message):
        raise ArgumentError(message)


def parse(argv):
    parser = ConvertArgumentParser(prog="convert.py", allow_abbrev=False, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-type", choices=["GPT"], required=True)
    parser.add_argument("--loader", choices=["llama_mistral", "core"], required=True)
    parser.add_argument("--saver", choices=["core", "hf"], required=True)
    parser.add_argument("--checkpoint-type", choices=["hf"], default="hf",
                        help="with --loader llama_mistral: a Hugging Face checkpoint (the only kind read)")
    parser.add_argument("--model-size", default=None,
                        help="accepted for Megatron-LM compatibility (e.g. llama3-8B, mistral): the "
                             "architecture is read from the checkpoint's config.json")
    parser.add_argument("--load-dir", required=True)
    parser.add_argument("--save-dir", required=True, help="a new (or empty) directory")
    parser.add_argument("--tokenizer-model", default=None,
                        help="the Hugging Face tokenizer: its folder or tokenizer.json (default: --load-dir)")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1)
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1)
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                        help="pad the vocabulary to a multiple of this x the tensor-parallel size")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="save the weights in bfloat16")
    precision.add_argument("--fp16", action="store_true", help="save the weights in float16")
    parser.add_argument("--hf-config-dir", default=None,
                        help="with --saver hf: the folder with the model's config.json (default: <load-dir>/hf, "
                             "where the conversion from Hugging Face keeps it)")
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0, help="with --saver hf")
    options = parser.parse_args(argv)
    if (options.loader, options.saver) not in CONVERSIONS:
        raise ArgumentError(f"--loader {options.loader} --saver {options.saver}: supported are "
                            + ", ".join(f"--loader {a} --saver {b}" for a, b in CONVERSIONS))
    if options.target_tensor_parallel_size < 1 or options.target_pipeline_parallel_size < 1:
        raise ArgumentError("--target-tensor-parallel-size and --target-pipeline-parallel-size must be >= 1")
    if options.make_vocab_size_divisible_by < 1:
        raise ArgumentError(f"--make-vocab-size-divisible-by must be >= 1, got {options.make_vocab_size_divisible_by}")
    if not options.max_shard_size_gb > 0:  # 0, -1 and nan used to pass, each writing one file per tensor
        raise ArgumentError(f"--max-shard-size-gb must be a positive size in GB (e.g. 5), "
                            f"got {options.max_shard_size_gb:g}")
    if options.loader == "llama_mistral" and options.tokenizer_model is None:
        options.tokenizer_model = options.load_dir
    if not os.path.isdir(options.load_dir):
        raise ArgumentError(f"--load-dir {options.load_dir} is not a directory")
    return options


@exit_on_user_error
def main():
    options = parse(sys.argv[1:])
    conversion = importlib.import_module(CONVERSIONS[(options.loader, options.saver)])
    before = resident_bytes("VmRSS")  # the imports: what any run of ours holds
    conversion.convert(options)
    line = peak_line(before)
    if line:
        print(line, flush=True)


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C before or after the writing, which says itself what it removed
        sys.stderr.write(error_line("interrupted by SIGINT") + "\n")
        sys.exit(128 + signal.SIGINT)
