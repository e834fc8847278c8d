"""The reference score of a multiple-choice task: a Hugging Face model (transformers, not our engine) sums the
log-likelihood of each choice after its question, as lm-evaluation-harness defines it (the choice follows the
question after one space; its tokens are those of question + choice past the question's), and picks the best.

    python tests/helpers/multiple_choice_reference.py HF_DIR TASK.jsonl     prints the accuracy
"""

import json
import sys

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM


def choice_loglikelihoods(model, tokenizer, question, choices):
    """The summed log-probability of each choice's tokens given the question's."""
    context = tokenizer.encode(question).ids
    scores = []
    for choice in choices:
        whole = tokenizer.encode(question + " " + choice).ids
        with torch.no_grad():
            logprobs = model(torch.tensor([whole])).logits[0].float().log_softmax(dim=-1)
        scores.append(sum(logprobs[position - 1, whole[position]].item()
                          for position in range(len(context), len(whole))))
    return scores


def score(hf_dir, task_file):
    """(accuracy, per document the choices' log-likelihoods) of the task's documents
    ({"question", "choices", "answer"} per line)."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tokenizer = Tokenizer.from_file(f"{hf_dir}/tokenizer.json")
    with open(task_file) as f:
        documents = [json.loads(line) for line in f if line.strip()]
    per_document = [choice_loglikelihoods(model, tokenizer, doc["question"], doc["choices"]) for doc in documents]
    correct = [max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
               for scores, doc in zip(per_document, documents)]
    return sum(correct) / len(correct), per_document


if __name__ == "__main__":
    print(score(sys.argv[1], sys.argv[2])[0])
