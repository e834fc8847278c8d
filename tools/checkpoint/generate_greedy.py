"""Load a checkpoint with our setup at any TP/PP and write its logits and greedy continuations of prompts.

    torchrun --nproc_per_node 4 tools/checkpoint/generate_greedy.py $(cat OUT/model_args.txt) \
        --seq-length 64 --prompts-json prompts.json --max-new-tokens 16 --output result.pt

prompts.json is a list of strings of the same token count (no padding without a KV cache). The
last stage's first tensor-parallel rank writes ``{"tokens", "logits"}`` (the prompts' logits over
the tokenizer's vocabulary) with torch.save.
"""

import json
import sys

import torch

import megatron.training  # noqa: F401  first: quiets megatron-core's import notices

# isort: split
from megatron.core import parallel_state

import pretrain_gpt
from megatron.inference.greedy import greedy_generate, logits
from megatron.inference.model_setup import setup_for_generation
from megatron.training.atomic_file import replaced_on_success
from megatron.training.errors import UserError, exit_on_user_error
from megatron.training.initialize import shutdown
from megatron.training.peer_watch import now_doing
from megatron.training.save_dir.writable import check_new_file_writable

_PROMPTS_FORM = 'give a JSON list of strings, e.g. ["The cat sat", "A dog ran"]'


def _generation_args(parser):
    g = parser.add_argument_group("generation")
    g.add_argument("--prompts-json", required=True, help="a JSON list of prompts of the same token count")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--output", required=True, help="where to torch.save {'tokens', 'logits'}")


def read_prompts(path: str) -> list[str]:
    """The prompts of --prompts-json, refused in one line unless they are a non-empty JSON list of strings."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise UserError(f"--prompts-json {path}: no such file; {_PROMPTS_FORM}") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise UserError(f"--prompts-json {path}: cannot be read ({reason}); {_PROMPTS_FORM}") from None
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError as error:
        where = f"{path}:{error.lineno}"
        raise UserError(f"--prompts-json {where}: not valid JSON ({error.msg}); {_PROMPTS_FORM}") from None
    if not isinstance(prompts, list) or not prompts or not all(isinstance(one, str) for one in prompts):
        raise UserError(f"--prompts-json {path}: holds no list of prompts; {_PROMPTS_FORM}")
    return prompts


def _check_inputs_and_output(args, prompts):
    """Before anything is loaded: a mistake in the prompts or the output path used to surface only after the
    checkpoint had loaded (the output's only after generating), as a trace."""
    prompts.extend(read_prompts(args.prompts_json))
    check_new_file_writable(args.output, "--output")


def _prompt_tokens(path, prompts, tokenizer, device):
    ids = [tokenizer.tokenize(prompt) for prompt in prompts]
    if len({len(one) for one in ids}) != 1:
        raise UserError(f"--prompts-json {path}: the prompts have {sorted({len(one) for one in ids})} tokens; "
                        f"give prompts of one length")
    return torch.tensor(ids, dtype=torch.long, device=device)


@exit_on_user_error
def main():
    texts = []
    args, model, tokenizer = setup_for_generation(sys.argv[1:], "generate_greedy.py", pretrain_gpt.model_provider,
                                                  extra_args_provider=_generation_args,
                                                  check_args=lambda args: _check_inputs_and_output(args, texts))
    prompts = _prompt_tokens(args.prompts_json, texts, tokenizer, torch.device(args.device))
    now_doing("generation")  # named if a peer rank dies meanwhile
    prompt_logits = logits(model, prompts)
    tokens = greedy_generate(model, prompts, args.max_new_tokens, tokenizer.vocab_size)
    if prompt_logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        with replaced_on_success(args.output) as temporary:  # a run cut short leaves no partial --output
            torch.save({"tokens": tokens.cpu(), "logits": prompt_logits[..., :tokenizer.vocab_size].float().cpu()},
                       temporary)
        print(f"wrote {args.output}: {tokens.shape[0]} sequences of {tokens.shape[1]} tokens", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
