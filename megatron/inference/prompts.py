"""From a checked request (megatron/inference/requests.py) to token ids and sampling parameters, shared by the REST API
and the WebSocket: BOS, the chat template, and the checks that need the tokenizer and the model's length."""

import json
import os

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megatron.inference.errors import ProtocolError
from megatron.inference.limits import check_limits


def load_chat_template(args):
    """The chat template of a Hugging Face tokenizer folder (tokenizer_config.json's ``chat_template``),
    compiled in Jinja's sandbox as transformers does: a function of a conversation (a list of {"role", "content"}
    messages) to the text the model reads next; None when the tokenizer has none."""
    model = getattr(args, "tokenizer_model", None)
    if args.tokenizer_type != "HuggingFaceTokenizer" or not model:
        return None
    folder = model if os.path.isdir(model) else os.path.dirname(model)
    path = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        config = json.load(f)
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((item["template"] for item in template if item.get("name") == "default"), None)
    if not isinstance(template, str):
        return None

    def special(name):
        value = config.get(name)
        return value.get("content") if isinstance(value, dict) else value

    compiled = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    return lambda messages: compiled.render(messages=messages, add_generation_prompt=True,
                                            bos_token=special("bos_token") or "", eos_token=special("eos_token") or "")


class PromptEncoder:
    """Token ids of a request's prompts; ``vocab_size`` is the tokenizer's, ``max_length`` the model's."""

    def __init__(self, tokenizer, chat_template, max_length, limits):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.max_length = max_length
        self.limits = limits

    def encode(self, request):
        """Checked token ids of every prompt; ProtocolError naming the field otherwise."""
        vocab_size = self.tokenizer.vocab_size
        if request["top_k"] > vocab_size:
            raise ProtocolError("bad_field", f"top_k must be at most the vocabulary size {vocab_size}", "top_k")
        if any(token >= vocab_size for token in request["stop_tokens"]):
            raise ProtocolError("bad_field", f"stop_tokens must be token ids below {vocab_size}", "stop_tokens")
        if request["chat"] and self.chat_template is None:
            raise ProtocolError("bad_field", "this tokenizer has no chat template (tokenizer_config.json's "
                                "chat_template); send chat false", "chat")
        prompts = []
        for prompt in request["prompts"]:
            ids = self._token_ids(prompt, request["chat"])
            if request["add_BOS"]:
                ids = [self.tokenizer.eod] + ids  # Megatron-LM's BOS is the end-of-document token
            if not ids:
                raise ProtocolError("bad_field", "a prompt is empty after tokenization; send some text", "prompts")
            prompts.append(ids)
        longest = max(map(len, prompts))
        if longest >= self.max_length:
            raise ProtocolError("too_large", f"a prompt has {longest} tokens; this model reads at most "
                                f"{self.max_length - 1} before generating; shorten it", "prompts")
        if request["tokens_to_generate"] is None:  # as many as the limits and the model's length allow
            request["tokens_to_generate"] = min(self.limits.max_tokens_to_generate, self.max_length - longest)
        check_limits(request, self.limits, self.max_length - longest)
        return prompts

    def _token_ids(self, prompt, chat):
        """A prompt's ids: a text (a user's message when ``chat``), a conversation (a list of messages, ``chat``)
        or token ids already (a list of integers)."""
        if isinstance(prompt, list) and not chat:
            if any(token >= self.tokenizer.vocab_size for token in prompt):
                raise ProtocolError("bad_field", f"prompt token ids must be below {self.tokenizer.vocab_size}",
                                    "prompts")
            return list(prompt)
        if not chat:
            return self.tokenizer.tokenize(prompt)
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        try:
            return self.tokenizer.tokenize_plain(self.chat_template(messages))
        except TemplateError as error:
            raise ProtocolError("bad_field", f"the chat template failed on this prompt ({error})", "chat") from error

    def token_text(self, token_id):
        return self.tokenizer.detokenize([token_id])


def sampling_fields(request, seed, topk_report=5):
    """The SamplingParams fields of a checked request (a dict: it travels to every rank)."""
    return {"temperature": request["temperature"], "top_k": request["top_k"], "top_p": request["top_p"],
            "random_seed": seed, "stop_tokens": tuple(request["stop_tokens"]),
            "tokens_to_generate": request["tokens_to_generate"], "topk_report": topk_report,
            "logprobs": request.get("logprobs", False), "top_logprobs": request.get("top_logprobs", 0)}
