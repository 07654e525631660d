"""`vllm serve` of a tiny GPT-OSS with gpt-oss's own vocabulary (o200k_harmony) and the gpt-oss
parsers: completions, and chat through vLLM's harmony path (prompts rendered by `openai_harmony`,
output parsed by its `openai` tool and `openai_gptoss` reasoning parsers), token-identical to
transformers float32.

vLLM takes the harmony path for every `model_type: gpt_oss` checkpoint, whatever its tokenizer, so
the checkpoint needs the real vocabulary; `tests.fixtures.tiny_gpt_oss` rebuilds it from the
`openai_harmony` module vLLM installs (checked against the published sha256), offline.
"""

from __future__ import annotations

import json

import pytest

from tests.serving.conftest import greedy_completion

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.own_server]

PARSER_ARGS = (
    "--tool-call-parser",
    "openai",
    "--enable-auto-tool-choice",
    "--reasoning-parser",
    "openai_gptoss",
)
PINNED_DATE = {"VLLM_SYSTEM_START_DATE": "2026-01-01"}  # the harmony system message's date
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
# Harmony control tokens (o200k_harmony ids).
START, END, MESSAGE = 200006, 200007, 200008
SYSTEM, ASSISTANT = 17360, 173781  # "system", "assistant"


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory):
    from tests.fixtures.tiny_gpt_oss import write_tiny_gpt_oss

    try:
        return write_tiny_gpt_oss(
            tmp_path_factory.mktemp("gpt-oss-harmony") / "model", tokenizer="harmony"
        )
    except RuntimeError as e:  # the installed openai_harmony carries no vocabulary
        pytest.skip(str(e))


@pytest.fixture
def gpt_oss_server(server_slot, harmony_model):
    return server_slot.get(
        ("gpt_oss", str(harmony_model)),
        harmony_model,
        served_name="tiny-gpt-oss",
        api_key=None,
        extra_args=PARSER_ARGS,
        env=PINNED_DATE,  # the tool-call test below reuses this server
    )


def test_completions_and_harmony_chat_match_transformers(gpt_oss_server):
    from tests.fixtures.oracles import hf_greedy

    server = gpt_oss_server
    ctx = server.context
    greedy_completion(server)

    # Chat: vLLM renders the conversation (system preamble, tool namespace, user turn) with
    # openai_harmony; the engine continues it exactly as transformers does, past the window.
    chat = {
        "model": server.model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS,
        "max_tokens": 12,
        "temperature": 0.0,
        "return_token_ids": True,
    }
    r = server.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text + ctx()
    out = r.json()
    prompt = out["prompt_token_ids"]
    assert prompt[:3] == [START, SYSTEM, MESSAGE] and prompt[-2:] == [START, ASSISTANT], prompt
    assert END in prompt and len(prompt) > 64
    (choice,) = out["choices"]
    generated = choice["token_ids"]
    assert generated == hf_greedy(server.model_dir, [prompt], len(generated))[0]
    assert len(generated) == 12 or choice["finish_reason"] == "stop"
    # The reasoning parser ran (random tokens carry no analysis channel).
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


# What a trained gpt-oss answers to the weather question: reasoning on the analysis channel, then
# a call of the tool on the commentary channel, ended by <|call|> (a stop token of harmony).
TOOL_CALL_ANSWER = (
    "<|channel|>analysis<|message|>The user asks for the weather in Paris.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


@pytest.mark.full  # CI's budget (two servers, about two minutes): the parsing is vLLM's own, the
# tokens it parses are the engine's, which test_completions_and_harmony_chat_match_transformers
# checks in CI.
def test_harmony_chat_separates_reasoning_and_a_parsed_tool_call(
    server_slot, harmony_model, tmp_path
):
    """A random model never calls a tool: the tiny checkpoint is taught the answer above for the
    prompt vLLM renders (read back from the module's first server), then served."""
    from vllm.entrypoints.openai.parser.harmony_utils import get_encoding

    from tests.fixtures.oracles import hf_greedy
    from tests.fixtures.teach import teach

    chat = {
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS,
        "max_tokens": 64,
        "temperature": 0.0,
        "return_token_ids": True,
    }

    def serve_and_chat(model):
        server = server_slot.get(
            ("gpt_oss", str(model)),
            model,
            served_name="tiny-gpt-oss",
            api_key=None,
            extra_args=PARSER_ARGS,
            env=PINNED_DATE,
        )
        r = server.post("/v1/chat/completions", {"model": server.model, **chat})
        assert r.status_code == 200, r.text + server.context()
        return r.json()

    prompt = serve_and_chat(harmony_model)["prompt_token_ids"]
    server_slot.close()

    answer = get_encoding().encode(TOOL_CALL_ANSWER, allowed_special="all")
    taught = tmp_path / "taught"
    teach(harmony_model, taught, [prompt], answer)
    out = serve_and_chat(taught)
    assert out["prompt_token_ids"] == prompt
    (choice,) = out["choices"]
    # The engine's tokens are transformers' (the call token <|call|> stops generation).
    assert (
        choice["token_ids"]
        == hf_greedy(taught, [prompt], len(answer))[0][: len(choice["token_ids"])]
    )
    assert choice["token_ids"] == answer[:-1] or choice["token_ids"] == answer
    message = choice["message"]
    assert message["reasoning"] == "The user asks for the weather in Paris."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert not message.get("content")
    assert choice["finish_reason"] == "tool_calls"
