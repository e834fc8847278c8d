"""Run under torchrun by tests/test_batching.py: one tiny GPT serves a set of requests submitted all at once (they
share the continuous batch: mixed prompt lengths, greedy and seeded sampling, log-probabilities, scoring, prompts
longer than a step's prefill budget), then each request again alone; rank 0 writes both as JSON to the path in
BATCHING_CHECK_OUT, with the number of batch steps run."""

import json
import os
import sys
import threading

import torch

import megatron.training  # noqa: F401
import pretrain_gpt
from megatron.inference.engine import GenerationEngine
from megatron.inference.jobs import Job
from megatron.inference.model_setup import setup_for_generation
from megatron.inference.sampling import SamplingParams
from megatron.inference.service import GenerationService
from megatron.training.initialize import shutdown

PROMPTS = [[464, 3290, 318], [40, 588, 284, 1842, 546, 262, 3303], [7496, 11], [1639, 389, 257, 845, 1402, 1110],
           [464] * 20, [818, 262, 3726]]
REQUESTS = [
    {"prompts": PROMPTS[:3], "params": {"top_k": 1, "tokens_to_generate": 10}},
    {"prompts": PROMPTS[3:4], "params": {"top_k": 20, "temperature": 0.9, "random_seed": 7, "tokens_to_generate": 9}},
    {"prompts": PROMPTS[4:6], "params": {"top_p": 0.9, "random_seed": 11, "tokens_to_generate": 12, "logprobs": True,
                                         "top_logprobs": 3}},
    {"prompts": PROMPTS[1:2], "params": {"random_seed": 3, "tokens_to_generate": 7, "logprobs": True}},
    {"prompts": PROMPTS[4:5], "params": {"tokens_to_generate": 0, "logprobs": True, "top_logprobs": 2}},  # scoring
    {"prompts": PROMPTS[0:1], "params": {"top_k": 1, "tokens_to_generate": 5, "stop_tokens": (0,)}},
] + [{"prompts": [prompt], "params": {"top_k": 1, "tokens_to_generate": 6 + index % 5}}
     for index, prompt in enumerate(PROMPTS * 3)]


def _result(job):
    if job.error is not None:
        return {"error": str(job.error)}
    generation = job.result
    return {"tokens": generation.tokens, "finish": generation.finish_reasons, "logprobs": generation.logprobs,
            "top_logprobs": generation.top_logprobs, "prompt_lengths": generation.prompt_lengths}


def _serve(service, jobs, rank):
    """Every rank runs the loop; rank 0 submits ``jobs`` at once (from another thread, as the REST server does)
    and stops the service once all are answered."""
    if rank == 0:
        def submit_all():
            for job in jobs:
                service.submit(job, refuse_if_busy=False)
            for job in jobs:
                job.done.wait()
            service.stop()
        threading.Thread(target=submit_all, daemon=True).start()
    service.serve_forever(rank)


def _jobs(requests):
    return [Job(payload={"kind": "generate", "prompts": request["prompts"],
                         "params": vars(SamplingParams(**request["params"]))}) for request in requests]


def main():
    args, model, tokenizer = setup_for_generation(sys.argv[1:], "batching_check.py", pretrain_gpt.model_provider)
    rank = torch.distributed.get_rank()
    engine = GenerationEngine(model, tokenizer.vocab_size, tokenizer.eod, args.max_position_embeddings, args.device,
                              slots=8)
    # A small prefill budget: the 20-token prompt is read in chunks beside decoding rows.
    batched = _jobs(REQUESTS)
    service = GenerationService(engine, args.device, prefill_tokens=8)
    steps = []
    if service.batcher is not None:
        step = service.batcher.step
        service.batcher.step = lambda message: (steps.append(1), step(message))
    _serve(service, batched, rank)
    alone = []
    for request in REQUESTS:  # each alone, one after the other, on the same service
        jobs = _jobs([request])
        _serve(GenerationService(engine, args.device, prefill_tokens=8), jobs, rank)
        alone.append(jobs[0])
    # The same requests on the engine's path for a generation that holds the model alone (MegaScope's).
    exclusive = [engine.generate(request["prompts"], SamplingParams(**request["params"])) for request in REQUESTS]
    if rank == 0:
        with open(os.environ["BATCHING_CHECK_OUT"], "w") as f:
            json.dump({"batched": [_result(job) for job in batched], "alone": [_result(job) for job in alone],
                       "exclusive": [generation.tokens for generation in exclusive], "steps": len(steps)}, f)
    shutdown()


if __name__ == "__main__":
    main()
