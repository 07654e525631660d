"""Gemma 4's tool calling and thinking through `vllm serve --tool-call-parser gemma4
--reasoning-parser gemma4`: the chat response carries the thought as `reasoning`, the text after it
as `content` and the call as an OpenAI `tool_calls` entry with JSON arguments, streamed or not.

A random model never writes Gemma 4's markup, so the tiny Gemma 4 text checkpoint with Gemma 4's
control tokens (`tests.fixtures.tiny_gemma4_tools`) is taught (`tests.fixtures.teach`) one answer
to one prompt, written as a Gemma 4 model writes it with thinking on: a thought on the channel, a
sentence, then the call in Gemma's own argument syntax, handing over to the tool with
`<|tool_response>` (a stop token). vLLM's parser reads that syntax from the decoded text and the
channel and call boundaries by token id; the checks below fail if the tokens reach it in another
form, if the parser mis-splits them, or if the engine's tokens differ from transformers'.

The first test needs no server: it parses the taught model's transformers output with the parser
class `vllm serve` builds from the same two flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

PARSER = "gemma4"  # the name of both the tool-call and the reasoning parser for Gemma 4
PARSER_ARGS = (
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    PARSER,
    "--reasoning-parser",
    PARSER,
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
THINKING = {"enable_thinking": True}
REASONING = "The user asks for the weather in Paris."
CONTENT = "Let me check."
ANSWER = (
    f"<|channel>thought\n{REASONING}<channel|>{CONTENT}"
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>'
)

# The `full` tier: teaching the checkpoint takes a minute of CI's two busy cores.
pytestmark = pytest.mark.full


@dataclass(frozen=True)
class Taught:
    model_dir: Path
    prompt: list[int]  # MESSAGES with TOOLS and thinking on, as the chat template renders them
    answer: list[int]  # ANSWER's tokens, the taught model's greedy continuation of `prompt`

    def reasoning_tokens(self) -> int:
        """Tokens between the channel markers (`thought\\n` and the thought)."""
        from tests.fixtures.tiny_gemma4_tools import CHANNEL_END, CHANNEL_START, gemma4_token_id

        start, end = gemma4_token_id(CHANNEL_START), gemma4_token_id(CHANNEL_END)
        return self.answer.index(end) - self.answer.index(start) - 1


@pytest.fixture(scope="session")
def taught_gemma4(tmp_path_factory) -> Taught:
    from transformers import AutoTokenizer

    from tests.fixtures.teach import teach
    from tests.fixtures.tiny_gemma4_tools import write_tiny_gemma4_tools

    root = tmp_path_factory.mktemp("gemma4-tools")
    model = write_tiny_gemma4_tools(root / "model")
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompt = tokenizer.apply_chat_template(
        MESSAGES, tools=TOOLS, add_generation_prompt=True, return_dict=True, **THINKING
    )["input_ids"]
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    taught = root / "taught"
    teach(model, taught, [prompt], answer)
    return Taught(taught, list(prompt), answer)


def _parser_and_request(model_dir: Path):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.parser.parser_manager import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model_dir))
    parser_cls = ParserManager.get_parser(
        tool_parser_name=PARSER,
        reasoning_parser_name=PARSER,
        enable_auto_tools=True,
        tokenizer=tokenizer,
    )
    request = ChatCompletionRequest(
        model="tiny-gemma4", messages=MESSAGES, tools=TOOLS, chat_template_kwargs=THINKING
    )

    def make():
        parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=THINKING)
        return parser, parser.adjust_request(request)

    return tokenizer, make


@pytest.mark.slow
def test_taught_gemma4_output_parses_with_vllms_gemma4_parsers(taught_gemma4):
    from tests.fixtures.oracles import hf_greedy

    taught = taught_gemma4
    generated = hf_greedy(taught.model_dir, [taught.prompt], len(taught.answer))[0]
    assert generated == taught.answer
    ids = taught.answer[:-1]  # the server's text ends before the stop token
    tokenizer, make = _parser_and_request(taught.model_dir)

    parser, request = make()
    assert request.skip_special_tokens is False  # the markers must reach the parser
    text = tokenizer.decode(ids, skip_special_tokens=False)
    reasoning, content, calls = parser.parse(
        text, request, enable_auto_tools=True, model_output_token_ids=ids
    )
    assert (reasoning, content) == (REASONING, CONTENT)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert parser.count_reasoning_tokens(ids) == taught.reasoning_tokens()

    # Token by token, as the server streams.
    parser, request = make()
    streamed = {"reasoning": "", "content": "", "name": "", "arguments": ""}
    for k, token in enumerate(ids):
        delta = parser.parse_delta(
            tokenizer.decode([token], skip_special_tokens=False),
            [token],
            request,
            prompt_token_ids=taught.prompt,
            finished=k == len(ids) - 1,
        )
        if delta is None:
            continue
        streamed["reasoning"] += delta.reasoning or ""
        streamed["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            streamed["name"] += call.function.name or ""
            streamed["arguments"] += call.function.arguments or ""
    assert streamed["reasoning"] == REASONING and streamed["content"] == CONTENT
    assert streamed["name"] == "get_weather"
    assert json.loads(streamed["arguments"]) == {"city": "Paris"}


@pytest.fixture
def gemma4_server(server_slot, taught_gemma4):
    model = taught_gemma4.model_dir
    return server_slot.get(
        ("gemma4_tools", str(model)),
        model,
        served_name="tiny-gemma4",
        api_key=None,
        extra_args=PARSER_ARGS,
    )


def _chat(server, **extra) -> dict:
    return {
        "model": server.model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "chat_template_kwargs": THINKING,
        "max_tokens": 64,
        "temperature": 0.0,
        **extra,
    }


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.own_server
def test_gemma4_chat_splits_reasoning_content_and_a_tool_call(gemma4_server, taught_gemma4):
    server, taught = gemma4_server, taught_gemma4
    r = server.post("/v1/chat/completions", _chat(server, return_token_ids=True))
    assert r.status_code == 200, r.text + server.context()
    out = r.json()
    # vLLM renders the same prompt, and the engine continues it as transformers does.
    assert out["prompt_token_ids"] == taught.prompt
    (choice,) = out["choices"]
    assert choice["token_ids"] in (taught.answer, taught.answer[:-1]), server.context()
    message = choice["message"]
    assert (message.get("reasoning") or message.get("reasoning_content")) == REASONING
    assert message["content"] == CONTENT
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"
    details = out["usage"]["completion_tokens_details"]
    assert details["reasoning_tokens"] == taught.reasoning_tokens()


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.own_server
def test_gemma4_streamed_chat_splits_reasoning_content_and_a_tool_call(gemma4_server):
    server = gemma4_server
    r = server.post("/v1/chat/completions", _chat(server, stream=True), stream=True)
    assert r.status_code == 200, r.text + server.context()
    reasoning, content, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                function = tc.get("function") or {}
                call["name"] += function.get("name") or ""
                call["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert (reasoning, content) == (REASONING, CONTENT), server.context()
    assert list(calls) == [0] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert finish == "tool_calls"
