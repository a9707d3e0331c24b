"""The router's chat rendering and tokenization equal transformers' apply_chat_template.

Each family is a model directory built here: a small BPE trained in the test with that family's
tokenizer pipeline (the normalizer, pre-tokenizer, decoder and post-processor its published
tokenizer.json uses) and its control tokens, a tokenizer_config.json as the family writes it,
and the family's published chat template (tests/core/data/chat_templates/, sources in its
README). The same directory is loaded by kvroute (ChatTokenizer.load) and by transformers
(AutoTokenizer.from_pretrained), and generated conversations must give the same ids.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvroute.core.chat_template import ChatTemplate, ChatTemplateError
from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.model_source import (
    ModelSourceError,
    parse_hf_source,
    parse_model_option,
    resolve_model_files,
)

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
EXAMPLES = 200  # generated conversations per family (derandomized: the same ones every run)

# The pre-tokenizer regexes of the published tokenizer.json files.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
              r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

PIECES = ["hello", " world", "  ", "\n", "\n\n", "\t", " ", "Grüße", "中文字符", "😀🚀", "naïve",
          "İstanbul", "ﬁx", "1234567", "don't", "it's", '{"a": [1, 2]}', "  leading",
          "trailing  ", "<b>&</b>", "é", "e\u0301", "\u00a0", "\r\n", "▁", "[/INST]", "</s>",
          "<|eot_id|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"]
CORPUS = [*PIECES, "The quick brown fox jumps over the lazy dog. " * 3,
          "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
          "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
          'Respond in the format {"name": function name, "parameters": dictionary}.',
          "get_weather location unit celsius fahrenheit city description parameters"]


def _text() -> st.SearchStrategy[str]:
    chars = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
    return st.lists(st.one_of(st.sampled_from(PIECES), chars), max_size=5).map("".join)


def _tool() -> st.SearchStrategy[dict[str, Any]]:
    props = st.dictionaries(st.sampled_from(["location", "unit", "query", "n"]),
                            st.fixed_dictionaries({"type": st.sampled_from(["string", "integer"]),
                                                   "description": _text()}), max_size=3)
    return st.builds(
        lambda name, desc, p: {"type": "function", "function": {
            "name": name, "description": desc,
            "parameters": {"type": "object", "properties": p, "required": sorted(p)[:1]}}},
        st.sampled_from(["get_weather", "search", "add"]), _text(), props)


def _arguments() -> st.SearchStrategy[Any]:
    args = st.dictionaries(st.sampled_from(["location", "query", "n"]),
                           st.one_of(_text(), st.integers(-5, 5000)), max_size=3)
    return st.one_of(args, args.map(json.dumps))


# -- the families ---------------------------------------------------------------------------------


@dataclass
class Family:
    name: str
    template: str
    tokenizer_class: str
    special: list[str]
    plain: list[str]  # added tokens that are not special (Qwen's <tool_call>, <think>, ...)
    named: dict[str, str | None]
    pipeline: Callable[[Tokenizer], None]
    post: Callable[[Tokenizer], Any]
    conversations: Callable[[], st.SearchStrategy[dict[str, Any]]]
    base: list[str] = field(default_factory=list)  # trained-in tokens at the first ids
    config: dict[str, Any] = field(default_factory=dict)
    template_in_file: bool = False  # chat_template.jinja rather than tokenizer_config.json


def _byte_level(tok: Tokenizer, split: str, nfc: bool, trim_offsets: bool) -> None:
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False,
                                 trim_offsets=trim_offsets)])
    tok.decoder = decoders.ByteLevel()


def _sentencepiece_bpe(tok: Tokenizer) -> None:
    # Mistral v0.3's tokenizer.json: "▁" prepended and spaces replaced, no pre-tokenizer.
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])


def _bos_template(bos: str) -> Callable[[Tokenizer], Any]:
    return lambda tok: processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])


@st.composite
def llama31_chat(draw: st.DrawFn) -> dict[str, Any]:
    tools = draw(st.none() | st.lists(_tool(), min_size=1, max_size=2))
    kwargs: dict[str, Any] = {}
    if draw(st.booleans()):
        kwargs["date_string"] = draw(st.sampled_from(["01 Jan 2030", "26 Jul 2024"]))
    if tools is not None and draw(st.booleans()):
        kwargs["tools_in_user_message"] = False
    builtin = draw(st.booleans()) and tools is None
    if builtin:
        kwargs["builtin_tools"] = ["brave_search", "wolfram_alpha"]
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_text())})
    msgs.append({"role": "user", "content": draw(_text())})
    for kind in draw(st.lists(st.sampled_from(["user", "assistant", "call"]), max_size=5)):
        if kind == "call":
            name = draw(st.sampled_from(["brave_search", "get_weather"] if builtin
                                        else ["get_weather", "search"]))
            args = (draw(st.dictionaries(st.sampled_from(["query"]), _text(), min_size=1))
                    if name == "brave_search" else draw(_arguments()))
            msgs.append({"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": name, "arguments": args}}]})
            msgs.append({"role": draw(st.sampled_from(["tool", "ipython"])),
                         "content": draw(st.one_of(_text(), st.just({"temp": 21})))})
        else:
            msgs.append({"role": kind, "content": draw(_text())})
    return {"messages": msgs, "tools": tools, "kwargs": kwargs}


def _qwen_chat(thinking: bool) -> Callable[[], st.SearchStrategy[dict[str, Any]]]:
    @st.composite
    def chat(draw: st.DrawFn) -> dict[str, Any]:
        tools = draw(st.none() | st.lists(_tool(), min_size=1, max_size=2))
        kwargs: dict[str, Any] = {}
        if thinking and draw(st.booleans()):
            kwargs["enable_thinking"] = draw(st.booleans())
        msgs: list[dict[str, Any]] = []
        if draw(st.booleans()):
            msgs.append({"role": "system", "content": draw(_text())})
        kinds = draw(st.lists(st.sampled_from(["user", "assistant", "call", "tool"]),
                              min_size=1, max_size=6))
        for kind in kinds:
            if kind == "call":
                calls = [{"type": "function", "function": {
                    "name": draw(st.sampled_from(["get_weather", "search"])),
                    "arguments": draw(_arguments())}}
                    for _ in range(draw(st.integers(1, 2)))]
                content = draw(_text()) if thinking else draw(st.none() | _text())
                msgs.append({"role": "assistant", "content": content, "tool_calls": calls})
            elif kind == "assistant" and thinking and draw(st.booleans()):
                field_name = draw(st.sampled_from(["reasoning_content", "reasoning", "inline"]))
                reasoning, answer = draw(_text()), draw(_text())
                if field_name == "inline":
                    msgs.append({"role": "assistant",
                                 "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"})
                else:
                    msgs.append({"role": "assistant", "content": answer, field_name: reasoning})
            elif kind == "tool":
                msgs.append({"role": "tool", "content": draw(_text())})
            else:
                msgs.append({"role": kind, "content": draw(_text())})
        return {"messages": msgs, "tools": tools, "kwargs": kwargs}

    return chat


@st.composite
def mistral_chat(draw: st.DrawFn) -> dict[str, Any]:
    """Mistral's template raises unless user and assistant alternate (tool turns aside) and tool
    call ids are 9 characters: the conversations keep to that."""
    ident = st.text(string.ascii_letters + string.digits, min_size=9, max_size=9)
    tools = draw(st.none() | st.lists(_tool(), min_size=1, max_size=2))
    msgs: list[dict[str, Any]] = []
    if draw(st.booleans()):
        msgs.append({"role": "system", "content": draw(_text())})
    for r in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(_text())})
        if draw(st.booleans()):
            calls = [{"id": draw(ident), "type": "function", "function": {
                "name": draw(st.sampled_from(["get_weather", "search"])),
                "arguments": draw(_arguments())}} for _ in range(draw(st.integers(1, 2)))]
            msgs.append({"role": "assistant", "tool_calls": calls})
            for call in calls:
                msgs.append({"role": "tool", "tool_call_id": call["id"],
                             "content": draw(_text())})
            msgs.append({"role": "assistant", "content": draw(_text())})
        elif r < 2 and draw(st.booleans()):
            msgs.append({"role": "assistant", "content": draw(_text())})
        else:
            break
    return {"messages": msgs, "tools": tools, "kwargs": {}}


LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                 "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
                 "<|python_tag|>"]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                "<|vision_start|>"]
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
              "</think>"]
QWEN_NAMED: dict[str, str | None] = {"bos_token": None, "eos_token": "<|im_end|>",
                                     "pad_token": "<|endoftext|>", "unk_token": None}

FAMILIES = {
    "llama3.1": Family(
        "llama3.1", "llama3.1-instruct.jinja", "PreTrainedTokenizerFast", LLAMA_SPECIAL, [],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
        lambda t: _byte_level(t, LLAMA3_SPLIT, nfc=False, trim_offsets=True),
        _bos_template("<|begin_of_text|>"), llama31_chat),
    "qwen2.5": Family(
        "qwen2.5", "qwen2.5-instruct.jinja", "Qwen2Tokenizer", QWEN_SPECIAL, QWEN_PLAIN,
        QWEN_NAMED, lambda t: _byte_level(t, QWEN_SPLIT, nfc=True, trim_offsets=False),
        lambda t: processors.ByteLevel(trim_offsets=False), _qwen_chat(thinking=False),
        config={"add_bos_token": False, "split_special_tokens": False, "errors": "replace"}),
    "qwen3": Family(
        "qwen3", "qwen3.jinja", "Qwen2Tokenizer", QWEN_SPECIAL, QWEN_PLAIN, QWEN_NAMED,
        lambda t: _byte_level(t, QWEN_SPLIT, nfc=True, trim_offsets=False),
        lambda t: processors.ByteLevel(trim_offsets=False), _qwen_chat(thinking=True),
        config={"add_bos_token": False}, template_in_file=True),
    "mistral-v0.3": Family(
        "mistral-v0.3", "mistral-7b-instruct-v0.3.jinja", "LlamaTokenizer",
        ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
         "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [],
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
        _sentencepiece_bpe, _bos_template("<s>"), lambda: mistral_chat(),
        base=["<unk>", "<s>", "</s>"],
        config={"add_bos_token": True, "add_eos_token": False, "legacy": False}),
}


def _added_entry(tok: AddedToken) -> dict[str, Any]:
    return {"content": tok.content, "lstrip": tok.lstrip, "rstrip": tok.rstrip,
            "normalized": tok.normalized, "single_word": tok.single_word, "special": tok.special}


def build_model_dir(root: Path, fam: Family) -> Path:
    """A model directory for ``fam``: trained tokenizer.json, tokenizer_config.json, template."""
    sentencepiece = fam.tokenizer_class == "LlamaTokenizer"
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True)
                    if sentencepiece else models.BPE(ignore_merges=fam.name == "llama3.1"))
    fam.pipeline(tok)
    template_text = (TEMPLATES / fam.template).read_text(encoding="utf-8")
    alphabet = ([] if sentencepiece else pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, special_tokens=fam.base,
                                  initial_alphabet=alphabet)
    tok.train_from_iterator([*CORPUS, template_text] * 2, trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam.special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.plain])
    tok.post_processor = fam.post(tok)
    d = root / fam.name
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    config: dict[str, Any] = {
        "tokenizer_class": fam.tokenizer_class, **fam.named, **fam.config,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
        "added_tokens_decoder": {str(i): _added_entry(t)
                                 for i, t in sorted(tok.get_added_tokens_decoder().items())}}
    if fam.template_in_file:
        (d / "chat_template.jinja").write_text(template_text, encoding="utf-8")
    else:
        config["chat_template"] = template_text
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {name: build_model_dir(root, fam) for name, fam in FAMILIES.items()}


@pytest.fixture(scope="module")
def loaded(model_dirs: dict[str, Path]) -> dict[str, tuple[ChatTokenizer, Any]]:
    return {name: (ChatTokenizer.load(str(d), name=name),
                   transformers.AutoTokenizer.from_pretrained(str(d)))
            for name, d in model_dirs.items()}


def _as_vllm_hands_them(messages: list[Any]) -> list[Any]:
    """The messages as vLLM passes them to the template: an assistant's tool calls with
    their JSON-string arguments parsed (empty: ``{}``). The router renders as vLLM does, so
    transformers' render of these is the reference."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            m = {**m, "tool_calls": [
                {**c, "function": {**c["function"], "arguments": (
                    json.loads(a) if isinstance(a := c["function"].get("arguments"), str) and a
                    else (a or {}))}}
                for c in m["tool_calls"]]}
        out.append(m)
    return out


def _hf_apply(hf: Any, chat: dict[str, Any], gen: bool, tokenize: bool, cont: bool) -> Any:
    return hf.apply_chat_template(_as_vllm_hands_them(chat["messages"]), tools=chat["tools"],
                                  tokenize=tokenize,
                                  add_generation_prompt=gen, continue_final_message=cont,
                                  return_dict=False, **chat["kwargs"])


# -- the property -------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_equal_transformers_apply_chat_template(
        family: str, loaded: dict[str, tuple[ChatTokenizer, Any]]) -> None:
    mine, hf = loaded[family]
    seen = {"tools": 0, "gen": 0, "kwargs": 0, "specials_in_text": 0, "continued": 0,
            "refused": 0, "compared": 0}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(chat=FAMILIES[family].conversations(), gen=st.booleans(), cont=st.booleans())
    def check(chat: dict[str, Any], gen: bool, cont: bool) -> None:
        cont = cont and not gen and isinstance(chat["messages"][-1].get("content"), str)
        args = {"tools": chat["tools"], "add_generation_prompt": gen,
                "continue_final_message": cont, "chat_template_kwargs": chat["kwargs"]}
        try:
            want_text = _hf_apply(hf, chat, gen, tokenize=False, cont=cont)
        except ValueError as exc:  # transformers refuses to continue this message: so do we
            assert cont, exc
            with pytest.raises(ChatTemplateError, match="continue_final_message"):
                mine.render(chat["messages"], **args)
            seen["refused"] += 1
            return
        text = mine.render(chat["messages"], **args)
        assert text == want_text
        ids = mine.apply(chat["messages"], **args)
        assert ids == _hf_apply(hf, chat, gen, tokenize=True, cont=cont)
        assert ids and ids == mine.encode(text, add_special_tokens=False)
        seen["compared"] += 1
        seen["tools"] += chat["tools"] is not None
        seen["gen"] += gen
        seen["continued"] += cont
        seen["kwargs"] += bool(chat["kwargs"])
        seen["specials_in_text"] += any(
            p in json.dumps(chat["messages"], ensure_ascii=False)
            for p in ("<|eot_id|>", "<|im_end|>", "[/INST]", "</s>"))

    check()
    # The generated conversations covered what the property is about.
    assert seen["tools"] > 20 and seen["gen"] > 20 and seen["specials_in_text"] > 10
    assert seen["continued"] > 5 and seen["compared"] > 0.9 * EXAMPLES, seen
    if family in ("llama3.1", "qwen3"):  # the templates with kwargs of their own
        assert seen["kwargs"] > 20


def test_special_tokens_and_ids_match_transformers(
        loaded: dict[str, tuple[ChatTokenizer, Any]]) -> None:
    for name, (mine, hf) in loaded.items():
        assert mine.vocab_size == len(hf), name
        assert mine.eos_token_id == hf.eos_token_id, name
        assert mine.bos_token_id == hf.bos_token_id, name
        assert mine.special_tokens == hf.special_tokens_map, name
        for text in [*PIECES, "<s>[INST] hi[/INST]", " two  spaces ", "<|im_start|>user\nx"]:
            for add in (False, True):
                assert mine.encode(text, add) == hf.encode(text, add_special_tokens=add), (
                    name, text, add)
            ids = mine.encode(text, False)
            assert mine.decode(ids) == hf.decode(ids), (name, text)


# -- templates: content parts, kwargs, errors, sandbox --------------------------------------------


PARTS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{% if m.content is string %}"
    "{{ m.content }}{% else %}{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}"
    "{% else %}[{{ p.type }}]{% endif %}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_content_parts_reach_the_template_as_transformers_passes_them(
        loaded: dict[str, tuple[ChatTokenizer, Any]]) -> None:
    mine, hf = loaded["llama3.1"]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "look "},
                                         {"type": "image_url", "image_url": {"url": "x"}},
                                         {"type": "text", "text": "here"}]},
            {"role": "assistant", "content": "ok"}]
    text = mine.render(msgs, chat_template=PARTS_TEMPLATE)
    assert text == "<|begin_of_text|><user>look [image_url]here<assistant>ok<assistant>"
    assert mine.apply(msgs, chat_template=PARTS_TEMPLATE) == hf.apply_chat_template(
        msgs, chat_template=PARTS_TEMPLATE, add_generation_prompt=True, return_dict=False)
    # The published Llama-3.1 template trims content as a string: both render the list the same.
    assert mine.apply(msgs) == hf.apply_chat_template(msgs, add_generation_prompt=True,
                                                      return_dict=False)
    # Qwen2.5's template concatenates content as a string: a list of parts is an error there.
    qwen, _ = loaded["qwen2.5"]
    with pytest.raises(ChatTemplateError, match=r"qwen2\.5: chat template failed"):
        qwen.render(msgs)


def test_chat_template_kwargs_are_rendered(loaded: dict[str, tuple[ChatTokenizer, Any]]) -> None:
    qwen3, hf = loaded["qwen3"]
    msgs = [{"role": "user", "content": "2+2?"}]
    off = qwen3.render(msgs, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert qwen3.render(msgs).endswith("<|im_start|>assistant\n")
    assert qwen3.apply(msgs, enable_thinking=False) == hf.apply_chat_template(
        msgs, add_generation_prompt=True, enable_thinking=False, return_dict=False)
    # Reasoning under another name reaches the template as reasoning_content.
    for field_name in ("reasoning", "thinking", "reasoning_content"):
        turn = [*msgs, {"role": "assistant", "content": "4", field_name: "add them"}]
        text = qwen3.render(turn, add_generation_prompt=False)
        assert text.endswith("<|im_start|>assistant\n<think>\nadd them\n</think>\n\n4<|im_end|>\n")
        assert qwen3.apply(turn, add_generation_prompt=False) == hf.apply_chat_template(
            turn, return_dict=False)
    llama, _ = loaded["llama3.1"]
    assert "Today Date: 01 Jan 2030\n" in llama.render(msgs, date_string="01 Jan 2030")
    # A kwarg overrides a special token of the same name, as in transformers.
    assert llama.render(msgs, bos_token="<BOS>").startswith("<BOS>")
    assert qwen3.render(msgs, chat_template_kwargs={"enable_thinking": False}) == off
    with pytest.raises(ChatTemplateError, match="cannot set add_generation_prompt, messages"):
        llama.render(msgs, chat_template_kwargs={"messages": [], "add_generation_prompt": 1})


def test_tools_are_rendered_not_dropped(loaded: dict[str, tuple[ChatTokenizer, Any]]) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Wetter ☀",
                                             "parameters": {"type": "object"}}}
    msgs = [{"role": "user", "content": "weather?"}]
    for name in FAMILIES:
        mine, _ = loaded[name]
        assert "get_weather" in mine.render(msgs, tools=[tool]), name
        assert "get_weather" not in mine.render(msgs), name
    # tojson as transformers defines it: no ASCII or HTML escaping.
    assert '"description": "Wetter ☀"' in loaded["qwen2.5"][0].render(msgs, tools=[tool])
    with pytest.raises(ChatTemplateError, match=r"tools\[0\] must be an object"):
        loaded["qwen2.5"][0].render(msgs, tools=["get_weather"])


def test_raise_exception_surfaces_the_templates_message(
        loaded: dict[str, tuple[ChatTokenizer, Any]]) -> None:
    mistral, hf = loaded["mistral-v0.3"]
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    msg = "conversation roles must alternate user/assistant/user/assistant"
    with pytest.raises(ChatTemplateError, match=f"mistral-v0.3: chat template: After the "
                                                f"optional system message, {msg}"):
        mistral.apply(bad)
    with pytest.raises(Exception, match=msg):
        hf.apply_chat_template(bad)
    call = [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [
        {"id": "short", "function": {"name": "f", "arguments": {}}}]}]
    with pytest.raises(ChatTemplateError, match="Tool call IDs should be alphanumeric"):
        mistral.render(call)


@pytest.mark.parametrize(("messages", "match"), [
    ([], "messages is empty"),
    ("hello", "must be a list of message objects"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\] must be an object"),
])
def test_bad_messages_are_named(loaded: dict[str, tuple[ChatTokenizer, Any]], messages: Any,
                                match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        loaded["qwen2.5"][0].apply(messages)


def test_environment_globals_and_sandbox() -> None:
    t = ChatTemplate("{{ strftime_now('%Y') }}|{{ {'k': '<é>'} | tojson }}|"
                     "{{ {'a': 1} | tojson(indent=2) }}|{% for m in messages %}"
                     "{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
                     "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}|"
                     "{% generation %}{{ eos_token }}{% endgeneration %}",
                     {"eos_token": "</s>"})
    year = str(datetime.now().year)
    out = t.render([{"role": "a", "content": ""}, {"role": "b", "content": ""}])
    assert out == f'{year}|{{"k": "<é>"}}|{{\n  "a": 1\n}}|a|1|</s>'
    escape = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="chat template"):
        escape.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        ChatTemplate("{% set ns = namespace(_x=1) %}").render([{"role": "u"}])
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}")
    # None-valued keys are dropped, so `is defined` sees an OpenAI null as absent.
    t = ChatTemplate("{% for m in messages %}{{ m.tool_calls is defined }}{% endfor %}")
    assert t.render([{"role": "assistant", "content": "x", "tool_calls": None}]) == "False"


# -- loading model sources ---------------------------------------------------------------------


def test_load_from_a_tokenizer_json_path_and_file_precedence(
        model_dirs: dict[str, Path], tmp_path: Path) -> None:
    src = model_dirs["qwen2.5"]
    by_file = ChatTokenizer.load(str(src / "tokenizer.json"))
    by_dir = ChatTokenizer.load(str(src))
    msgs = [{"role": "user", "content": "hi"}]
    assert by_file.apply(msgs) == by_dir.apply(msgs)
    assert by_file.name == str(src / "tokenizer.json")

    d = tmp_path / "m"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes((src / f).read_bytes())
    (d / "chat_template.jinja").write_text("{{ 'file:' + messages[0].content }}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools:' ~ tools|length }}")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    tok = ChatTokenizer.load(str(d), name="m")
    assert tok.template_names == ["default", "tool_use"]
    assert tok.render(msgs) == "file:hi"  # chat_template.jinja wins over tokenizer_config.json
    assert tok.render(msgs, tools=[{"type": "function"}]) == "tools:1"
    assert tok.render(msgs, chat_template="default") == "file:hi"
    assert tok.stop_token_ids == (tok.eos_token_id, 7, 8)

    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    plain = ChatTokenizer.load(str(bare))
    assert plain.encode("hello world", False) == by_dir.encode("hello world", False)
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        plain.render(msgs)


def test_load_errors_name_the_problem(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="no such file or directory"):
        ChatTokenizer.load(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelSourceError, match=r"no tokenizer\.json in"):
        ChatTokenizer.load(str(empty))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelSourceError, match="cannot read"):
        ChatTokenizer.load(str(broken))
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    src = model_dirs["llama3.1"]
    (wrong / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    eot = next(k for k, v in config["added_tokens_decoder"].items() if v["content"] == "<|eot_id|>")
    config["added_tokens_decoder"][str(int(eot) + 100)] = config["added_tokens_decoder"].pop(eot)
    (wrong / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match=r"'<\|eot_id\|>' is id \d+ in .* but id \d+ in"):
        ChatTokenizer.load(str(wrong))
    # A token declared in tokenizer_config.json only is added at its id, as transformers does.
    config = json.loads((src / "tokenizer_config.json").read_text())
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    new_id = tok.get_vocab_size(with_added_tokens=True)
    config["added_tokens_decoder"][str(new_id)] = {"content": "<|new|>", "special": True}
    (wrong / "tokenizer_config.json").write_text(json.dumps(config))
    added = ChatTokenizer.load(str(wrong))
    assert added.encode("a<|new|>", False)[-1] == new_id
    assert added.vocab_size == new_id + 1


def test_model_option_and_hub_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      model_dirs: dict[str, Path]) -> None:
    assert parse_model_option("llama=hf:meta-llama/Llama-3.1-8B-Instruct") == (
        "llama", "hf:meta-llama/Llama-3.1-8B-Instruct")
    assert parse_model_option("q = /models/qwen") == ("q", "/models/qwen")
    for bad in ("llama", "=x", "llama=", "-x=/m"):
        with pytest.raises(ModelSourceError, match="--model"):
            parse_model_option(bad)
    assert parse_hf_source("hf:Qwen/Qwen2.5-7B-Instruct@v1.0") == (
        "Qwen/Qwen2.5-7B-Instruct", "v1.0")
    assert parse_hf_source("hf:org/repo") == ("org/repo", None)
    with pytest.raises(ModelSourceError, match="expected hf:ORG/REPO"):
        parse_hf_source("hf:just-a-name")

    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # these machines cannot reach the hub
    cache = tmp_path / "hub"
    with pytest.raises(ModelSourceError, match="could not fetch org/absent@main from the Hugging"):
        resolve_model_files("hf:org/absent@main", cache_dir=str(cache))
    # A snapshot already in the hub cache is found by the same download call, offline.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--served"
    snap = repo / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (snap / f).write_bytes((model_dirs["qwen2.5"] / f).read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    files = resolve_model_files("hf:org/served", cache_dir=str(cache))
    assert files.tokenizer_json == snap / "tokenizer.json"
    tok = ChatTokenizer.load("hf:org/served", name="served", cache_dir=str(cache))
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply(msgs) == ChatTokenizer.load(str(model_dirs["qwen2.5"])).apply(msgs)


def test_continue_final_message_leaves_the_last_turn_open(
        loaded: dict[str, tuple[ChatTokenizer, Any]]) -> None:
    qwen, hf = loaded["qwen2.5"]
    msgs = [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "Bl"}]
    text = qwen.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nBl")
    assert qwen.apply(msgs, add_generation_prompt=False, continue_final_message=True) == (
        hf.apply_chat_template(msgs, continue_final_message=True, return_dict=False))
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        qwen.render(msgs, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="has no content"):
        qwen.render([{"role": "user", "content": None}], add_generation_prompt=False,
                    continue_final_message=True)
