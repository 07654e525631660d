"""Proves structured outputs, tool calling and the reasoning parser work through our server.

A random-weight model obeys only what the grammar forces, so every output is validated, not read.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

pytestmark = [pytest.mark.server, pytest.mark.slow]

NO_THINKING = {"enable_thinking": False}  # pre-fills an empty reasoning block: output is content
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ADD_SCHEMA = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
# `strict: true` asks for the arguments to follow the schema (without it vLLM constrains only
# the call envelope, as OpenAI does).
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER_SCHEMA,
            "strict": True,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": ADD_SCHEMA,
            "strict": True,
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# Without `strict`, tool_choice="auto" leaves the output free (a request's own structured output
# applies); with it, vLLM's structural tag for the hermes format would take over.
LOOSE_TOOLS = [
    {"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
    for t in TOOLS
]


def chat(server: Any, check: Any, content: str = "What is the weather in Paris?", **body: Any):
    request = {
        "model": server.model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0.0,
        "max_tokens": 64,
        **body,
    }
    return check(server.post("/v1/chat/completions", request))


def test_json_object_parses(vllm_server, check):
    out = chat(
        vllm_server,
        check,
        "Answer in JSON.",
        max_tokens=200,
        chat_template_kwargs=NO_THINKING,
        response_format={"type": "json_object"},
        # Closing a string or an object pays: a random model may otherwise write one endless string.
        logit_bias={str(i): 5.0 for i in (6, 97, 658)},  # '"', '}', '"}' of the tiny tokenizer
    )
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_json_schema_output_validates(vllm_server, check, seed):
    out = chat(
        vllm_server,
        check,
        temperature=1.0,
        seed=seed,
        chat_template_kwargs=NO_THINKING,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA, "strict": True},
        },
    )
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), WEATHER_SCHEMA)


def test_json_schema_through_the_openai_client(vllm_server, client):
    r = client.chat.completions.create(
        model=vllm_server.model,
        messages=[{"role": "user", "content": "Weather?"}],
        max_tokens=64,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER_SCHEMA},
        },
        extra_body={"chat_template_kwargs": NO_THINKING},
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER_SCHEMA)


def test_regex_constraint(vllm_server, check):
    pattern = r"[a-c]{3}-[0-9]{2,4}"
    for endpoint_body in (
        {"chat_template_kwargs": NO_THINKING},
        None,
    ):
        if endpoint_body is None:
            out = check(
                vllm_server.post(
                    "/v1/completions",
                    {
                        "model": vllm_server.model,
                        # With a reasoning parser, vLLM applies a grammar only once the
                        # reasoning has ended; an empty reasoning block ends it in the prompt.
                        "prompt": "Code: <think>\n\n</think>\n\n",
                        "max_tokens": 20,
                        "temperature": 1.0,
                        "seed": 3,
                        "structured_outputs": {"regex": pattern},
                    },
                )
            )
            text = out["choices"][0]["text"]
        else:
            out = chat(
                vllm_server,
                check,
                temperature=1.0,
                seed=3,
                structured_outputs={"regex": pattern},
                **endpoint_body,
            )
            text = out["choices"][0]["message"]["content"]
        assert re.fullmatch(pattern, text), text


def test_choice_constraint(vllm_server, check):
    choices = ["alpha", "beta gamma", "delta"]
    seen = set()
    for seed in range(4):
        out = chat(
            vllm_server,
            check,
            temperature=1.0,
            seed=seed,
            chat_template_kwargs=NO_THINKING,
            structured_outputs={"choice": choices},
        )
        text = out["choices"][0]["message"]["content"]
        assert text in choices
        seen.add(text)
    assert seen  # at least one answer; random seeds usually give several


def test_grammar_constraint(vllm_server, check):
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    out = chat(
        vllm_server,
        check,
        chat_template_kwargs=NO_THINKING,
        structured_outputs={"grammar": grammar},
    )
    assert re.fullmatch(r"yes|no|maybe [0-9]", out["choices"][0]["message"]["content"])


def _tool_calls(out: dict[str, Any]) -> list[dict[str, Any]]:
    message = out["choices"][0]["message"]
    calls = message.get("tool_calls") or []
    assert calls, f"no tool calls in {message}"
    return calls


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "add"}}],
    ids=["required", "named"],
)
def test_forced_tool_calls_validate_against_the_tool_schema(
    vllm_server, check, whitespace_ids, tool_choice
):
    out = chat(
        vllm_server,
        check,
        max_tokens=200,
        chat_template_kwargs=NO_THINKING,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        logit_bias={str(i): -100 for i in whitespace_ids},
    )
    calls = _tool_calls(out)
    for call in calls:
        assert call["type"] == "function" and call["id"]
        name = call["function"]["name"]
        if isinstance(tool_choice, dict):
            assert name == tool_choice["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


def test_auto_tool_choice_parses_a_hermes_call(vllm_server, check):
    # Force the model's text to be a Hermes-style call; the server's hermes parser must turn it
    # into a structured tool call and leave no content behind.
    call_text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "days": 3}}\n'
        "</tool_call>"
    )
    out = chat(
        vllm_server,
        check,
        max_tokens=80,
        chat_template_kwargs=NO_THINKING,
        tools=LOOSE_TOOLS,
        tool_choice="auto",
        structured_outputs={"regex": re.escape(call_text)},
    )
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    (call,) = _tool_calls(out)
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Lyon", "days": 3}
    assert not out["choices"][0]["message"].get("content")


def test_auto_tool_choice_streaming_parses_a_hermes_call(vllm_server, client):
    call_text = '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call>'
    stream = client.chat.completions.create(
        model=vllm_server.model,
        messages=[{"role": "user", "content": "4 + 5?"}],
        max_tokens=80,
        temperature=0,
        tools=LOOSE_TOOLS,
        tool_choice="auto",
        stream=True,
        extra_body={
            "chat_template_kwargs": NO_THINKING,
            "structured_outputs": {"regex": re.escape(call_text)},
        },
    )
    names, arguments, finish = [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            if tc.function and tc.function.name:
                names.append(tc.function.name)
            if tc.function and tc.function.arguments:
                arguments += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert names == ["add"] and json.loads(arguments) == {"a": 4, "b": 5}
    assert finish == "tool_calls"


def _think_prefill(server: Any, budget: int, stream: bool = False) -> dict[str, Any]:
    # The assistant turn is pre-filled with "<think>\n": the model is reasoning, and
    # thinking_token_budget makes the server end the reasoning after `budget` tokens.
    return {
        "model": server.model,
        "messages": [
            {"role": "user", "content": "Why is the sky blue?"},
            {"role": "assistant", "content": "<think>\n"},
        ],
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 16,
        "temperature": 0.0,
        "ignore_eos": True,
        "thinking_token_budget": budget,
        "return_token_ids": True,
        "stream": stream,
    }


def test_reasoning_parser_separates_reasoning_from_content(vllm_server, check, tokenizer):
    from vllm_metal.testing.tiny_models import token_id

    start_think, end_think = token_id("<think>"), token_id("</think>")
    out = check(vllm_server.post("/v1/chat/completions", _think_prefill(vllm_server, 4)))
    choice = out["choices"][0]
    ids = choice["token_ids"]
    assert end_think in ids, f"the thinking budget did not end the reasoning: {ids}"
    k = ids.index(end_think)
    assert k <= 4 + 1
    message = choice["message"]
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    assert reasoning and message["content"]
    # The parser drops stray <think> markers from the reasoning text.
    thought = [t for t in ids[:k] if t != start_think]
    assert reasoning.strip() == tokenizer.decode(thought, skip_special_tokens=False).strip()
    answer = tokenizer.decode(ids[k + 1 :], skip_special_tokens=False)
    # The server holds back the bytes of a character the last token leaves incomplete; a one-shot
    # decode shows them as U+FFFD.
    assert message["content"].strip() == answer.rstrip("\ufffd").strip()
    # Reasoning tokens are counted without the markers.
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(thought)


def test_reasoning_parser_streaming_matches_non_streaming(vllm_server, check):
    full = check(vllm_server.post("/v1/chat/completions", _think_prefill(vllm_server, 4)))
    message = full["choices"][0]["message"]
    response = vllm_server.post(
        "/v1/chat/completions", _think_prefill(vllm_server, 4, stream=True), stream=True
    )
    check(response)
    reasoning, content = "", ""
    for line in response.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            delta = choice["delta"]
            reasoning += delta.get("reasoning") or delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert reasoning == (message.get("reasoning") or message.get("reasoning_content"))
    assert content == message["content"]


def test_chat_template_kwargs_reach_the_template(vllm_server, check, tokenizer):
    messages = [{"role": "user", "content": "hello"}]

    def tokens(**extra: Any) -> list[int]:
        body = {"model": vllm_server.model, "messages": messages, **extra}
        return check(vllm_server.post("/tokenize", body))["tokens"]

    thinking = tokens()
    no_thinking = tokens(chat_template_kwargs=NO_THINKING)
    # enable_thinking=false appends an empty reasoning block after the generation prompt.
    block = tokenizer.encode("<think>\n\n</think>\n\n", add_special_tokens=False).ids
    assert no_thinking == thinking + block
    # The same template result is what a chat completion is computed from.
    out = chat(vllm_server, check, "hello", max_tokens=1, chat_template_kwargs=NO_THINKING)
    assert out["usage"]["prompt_tokens"] == len(no_thinking)
    out = chat(vllm_server, check, "hello", max_tokens=1)
    assert out["usage"]["prompt_tokens"] == len(thinking)
