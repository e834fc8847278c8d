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
from megatron.training.errors import UserError, exit_on_user_error
from megatron.training.initialize import shutdown


def _generation_args(parser):
    g = parser.add_argument_group("generation")
    g.add_argument("--prompts-json", required=True, help="a JSON list of prompts of the same token count")
    g.add_argument("--max-new-tokens", type=int, default=16)
    g.add_argument("--output", required=True, help="where to torch.save {'tokens', 'logits'}")


def _prompt_tokens(path, tokenizer, device):
    with open(path) as f:
        prompts = json.load(f)
    ids = [tokenizer.tokenize(prompt) for prompt in prompts]
    if len({len(one) for one in ids}) != 1:
        raise UserError(f"--prompts-json {path}: the prompts have {sorted({len(one) for one in ids})} tokens; "
                        f"give prompts of one length")
    return torch.tensor(ids, dtype=torch.long, device=device)


@exit_on_user_error
def main():
    args, model, tokenizer = setup_for_generation(sys.argv[1:], "generate_greedy.py", pretrain_gpt.model_provider,
                                                  extra_args_provider=_generation_args)
    prompts = _prompt_tokens(args.prompts_json, tokenizer, torch.device(args.device))
    prompt_logits = logits(model, prompts)
    tokens = greedy_generate(model, prompts, args.max_new_tokens, tokenizer.vocab_size)
    if prompt_logits is not None and parallel_state.get_tensor_model_parallel_rank() == 0:
        torch.save({"tokens": tokens.cpu(), "logits": prompt_logits[..., :tokenizer.vocab_size].float().cpu()},
                   args.output)
        print(f"wrote {args.output}: {tokens.shape[0]} sequences of {tokens.shape[1]} tokens", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
