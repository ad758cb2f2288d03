"""Tool calls in a model's answer: one module per format, each a `Format` (`FORMATS`, by name)
that reads a whole answer (`parse(text, tools) -> (content, [ToolCall])`), streams one
(`stream(tools)`: `feed(text) -> deltas`, `finish() -> deltas`, OpenAI's chat-chunk deltas:
content, and each call's id, type and name, then its arguments) and writes the pattern one call
follows (`call_pattern(name, parameters) -> CallPattern`, for constraining an answer to a call).
`format_for` picks a target's format from its chat template's text and its config's model_type.

Its modules:

- `base`: the shared types (`ToolCall`, `CallPattern`), `Format` and the streaming parser of block
  formats (`BlockStream`), `assemble` (deltas back into content and calls), `typed` (a value written as
  text, typed by its schema).
- `hermes`: `<tool_call>` JSON `</tool_call>` (Qwen2.5, Qwen3; the fallback).
- `qwen3_coder`: `<tool_call><function=NAME><parameter=P>` markup (Qwen3-Coder, Qwen3.5).
- `llama3`: Llama 3.x's JSON calls (`{"name", "parameters"}`, `<|python_tag|>`, `;`-separated).
- `harmony`: gpt-oss's messages (a call is a commentary message `to=functions.NAME`).
- `kimi_k2`: Kimi K2's tool-call section.
- `glm`: GLM-4.5's `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>`.
- `minimax_m2`: MiniMax-M2's `<minimax:tool_call><invoke name=...><parameter name=...>`.
- `deepseek_v3`: DeepSeek V3's (and V3.1's) tool-call tokens.
- `request`: the server's side: a request's `tools`, `tool_choice` and tool messages checked
  (`plan_tools` -> `ToolPlan`), and an answer's text read as content and calls (`ToolReader`).
"""

from __future__ import annotations

from infer.serve.toolcalls import deepseek_v3, glm, harmony, hermes, kimi_k2, llama3, minimax_m2, qwen3_coder
from infer.serve.toolcalls.base import CallPattern, Format, ToolCall, assemble

FORMATS: dict[str, Format] = {m.FORMAT.name: m.FORMAT for m in (hermes, qwen3_coder, llama3, harmony, kimi_k2, glm,
                                                                 minimax_m2, deepseek_v3)}
FALLBACK = "hermes"

# What a chat template writes, most telling first: (a string only that format's template holds, the format).
TEMPLATE_SIGNS = (
    ("<|tool_calls_section_begin|>", "kimi_k2"),
    ("tool▁calls▁begin", "deepseek_v3"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("<|channel|>", "harmony"),
    ("<arg_key>", "glm"),
    ("<function=", "qwen3_coder"),
    ("<|python_tag|>", "llama3"),
    ("<tool_call>", "hermes"),
)
# A config's model_type, where the template says nothing: (its start, the format).
MODEL_TYPES = (
    ("kimi_k2", "kimi_k2"), ("kimi", "kimi_k2"), ("deepseek_v3", "deepseek_v3"), ("deepseek_v32", "deepseek_v3"),
    ("minimax_m2", "minimax_m2"), ("gpt_oss", "harmony"), ("glm4_moe", "glm"), ("glm5", "glm"),
    ("qwen3_5", "qwen3_coder"), ("qwen3_coder", "qwen3_coder"), ("qwen", "hermes"), ("llama", "llama3"),
)


def format_for(model_type: str | None, chat_template: str | None) -> tuple[Format, bool]:
    """The target's tool-call format, and whether it was recognized (False: the hermes fallback).
    The chat template decides where it writes tool calls in a way one format does; then the
    config's model_type."""
    template = chat_template or ""
    for sign, name in TEMPLATE_SIGNS:
        if sign in template:
            return FORMATS[name], True
    kind = (model_type or "").lower()
    for start, name in MODEL_TYPES:
        if kind.startswith(start):
            return FORMATS[name], True
    return FORMATS[FALLBACK], False


__all__ = ["FORMATS", "FALLBACK", "CallPattern", "Format", "ToolCall", "assemble", "format_for"]
