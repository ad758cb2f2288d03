"""Text and chats as token ids: the one place a prompt's text or a conversation goes through the
tokenizer and its chat template (`python -m infer`, the server, training data).

    ids = encode_chat(tokenizer, messages, enable_thinking=False)   # with the generation prompt
    ids = encode_text(tokenizer, "def f(")
"""

from __future__ import annotations


def has_chat_template(tokenizer) -> bool:
    """Whether a tokenizer (None: none) can render conversations."""
    return tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None


def encode_text(tokenizer, text: str) -> list[int]:
    """A raw prompt's token ids, with the tokenizer's special tokens (a BOS where it adds one)."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def encode_chat(tokenizer, messages: list[dict], *, generation_prompt: bool = True, **template_kwargs) -> list[int]:
    """A conversation's token ids through the tokenizer's chat template. generation_prompt: end
    with the assistant's turn opening (what a model answers after). template_kwargs go to the
    template (enable_thinking=..., a request's chat_template_kwargs). The template's own errors
    propagate."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                        **template_kwargs)
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in newer transformers
        ids = ids["input_ids"]
    return list(ids)
