"""A model directory for the tiny engine's byte vocabulary, and how to call it over HTTP.

:func:`write_byte_model` writes ``tokenizer.json`` (built with ``tokenizers``) and
``tokenizer_config.json`` with a chat template, whose ids are ``--tokenizer byte``'s: byte b is
id b, 256 ``<|endoftext|>`` (EOS), 257 ``<|startoftext|>``. A router started with
``--model NAME=DIR`` then renders chats, tokenizes and decodes exactly as the tiny agents
generate, so ``kvroute demo --serve`` (and the tests) can serve OpenAI-style text from them.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% if tools %}<|startoftext|>tools\n{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|startoftext|>{{ m['role'] }}\n{{ m['content'] }}\n"
    "{% for c in m['tool_calls'] or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>\n{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|startoftext|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")
"""A ChatML-like template: each turn a start token, the role, the content, a newline, an
assistant's tool calls as Hermes writes them (``<tool_call>{"name", "arguments"}</tool_call>``);
the tools first; ``chat_template_kwargs={"enable_thinking": false}`` closes the reply's
thinking, as Qwen3's template does."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the ByteLevel pre-tokenizer's alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def write_byte_model(directory: Path, chat_template: str = CHAT_TEMPLATE) -> Path:
    """Write the byte-vocabulary model files into ``directory`` (created) and return it.
    Needs ``tokenizers`` (kvroute[models])."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no merges: every byte is its own token, whatever the text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False),
                            AddedToken("<|startoftext|>", special=True, normalized=False)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": "<|startoftext|>",
        "chat_template": chat_template, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return directory


def openai_lines(http_address: str, model: str) -> str:
    """A curl line and an ``openai`` SDK snippet against the HTTP front at ``http_address``."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": 32,
                       "messages": [{"role": "user", "content": "hi"}]})
    return (f"  curl -N http://{http_address}/v1/chat/completions "
            f"-H 'content-type: application/json' \\\n      -d '{body}'\n"
            "  python - <<'EOF'\n"
            "import openai\n"
            f"c = openai.OpenAI(base_url='http://{http_address}/v1', api_key='unused')\n"
            f"r = c.chat.completions.create(model={model!r}, max_tokens=32,\n"
            "    messages=[{'role': 'user', 'content': 'hi'}])\n"
            "print(r.choices[0].message.content, r.usage)\n"
            "EOF")
