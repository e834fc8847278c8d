"""Run under torchrun by tests/test_generation_engine.py: one tiny GPT (seeded, layout-invariant
initialization) generates with the KV-cache engine on its default path and on megatron-core's inference path,
and, for reference, with the no-cache greedy loop;
rank 0 writes the tokens as JSON to the path in GENERATION_CHECK_OUT."""

import json
import os
import sys

import torch

import megatron.training  # noqa: F401
import pretrain_gpt
from megatron.inference.engine import GenerationEngine
from megatron.inference.greedy import greedy_generate
from megatron.inference.model_setup import setup_for_generation
from megatron.inference.replicas import generate_share
from megatron.inference.sampling import SamplingParams
from megatron.training.initialize import shutdown

SAME_LENGTH = [[464, 3290, 318, 257, 1332, 286], [40, 588, 284, 1842, 546, 262]]
MIXED_LENGTHS = [[464, 3290, 318], [40, 588, 284, 1842, 546, 262, 3303], [7496, 11]]


def main():
    args, model, tokenizer = setup_for_generation(sys.argv[1:], "generation_check.py", pretrain_gpt.model_provider)
    engine = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, args.max_position_embeddings, args.device)
    new = 12
    no_cache = greedy_generate(model, torch.tensor(SAME_LENGTH, device=args.device), new, tokenizer.vocab_size)
    greedy = engine.generate(SAME_LENGTH, SamplingParams(top_k=1, tokens_to_generate=new, stop_tokens=()))
    results = {"no_cache_greedy": no_cache.tolist(), "kv_greedy": greedy.tokens}
    for name, params in {"top_k": SamplingParams(top_k=20, temperature=0.9, random_seed=7, tokens_to_generate=new),
                         "top_p": SamplingParams(top_p=0.9, random_seed=11, tokens_to_generate=new, logprobs=True),
                         "plain": SamplingParams(random_seed=3, tokens_to_generate=new, logprobs=True)}.items():
        result = engine.generate(MIXED_LENGTHS, params)
        results[name] = {"tokens": result.tokens, "finish": result.finish_reasons, "logprobs": result.logprobs}
    # The server's data-parallel path: each replica generates its share, rank 0 gathers them
    shared = generate_share(engine, MIXED_LENGTHS, SamplingParams(random_seed=3, tokens_to_generate=new,
                                                                  logprobs=True), None)
    # Prompt 1 alone, as the second prompt of its request: the tokens it has in the whole batch
    alone = engine.generate(MIXED_LENGTHS[1:2], SamplingParams(random_seed=3, tokens_to_generate=new, first_prompt=1))
    results["alone"] = alone.tokens
    # The same generations on megatron-core's inference path (the default runs on the static cache where it can).
    megatron_path = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, args.max_position_embeddings,
                                     args.device, static_cache=False)
    results["megatron_path"] = {
        "greedy": megatron_path.generate(SAME_LENGTH, SamplingParams(top_k=1, tokens_to_generate=new)).tokens}
    plain = megatron_path.generate(MIXED_LENGTHS, SamplingParams(random_seed=3, tokens_to_generate=new, logprobs=True))
    results["megatron_path"]["plain"] = {"tokens": plain.tokens, "logprobs": plain.logprobs}
    if torch.distributed.get_rank() == 0:
        results["shared"] = {"tokens": shared.tokens, "logprobs": shared.logprobs}
        with open(os.environ["GENERATION_CHECK_OUT"], "w") as f:
            json.dump(results, f)
    shutdown()


if __name__ == "__main__":
    main()
