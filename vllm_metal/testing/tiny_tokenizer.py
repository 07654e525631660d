"""The tiny checkpoints' tokenizer: a byte-level BPE trained on a small fixed corpus, with
control and markup tokens and a ChatML chat template, written in Hugging Face layout."""

from __future__ import annotations

import functools
import json
from typing import Any

# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

# Control tokens: never produced by ordinary text, dropped by skip_special_tokens.
SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Markup tokens: atomic in the vocabulary but kept in decoded text, because the reasoning and tool
# parsers look for them in the detokenized output.
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
PAD_TOKEN, BOS_TOKEN, EOT_TOKEN, IM_START, IM_END = SPECIAL_TOKENS
TOKENIZER_VOCAB_SIZE = 768

# Training text for the tokenizer: varied enough that merges cover prose, numbers, code and JSON.
_CORPUS = r"""
The old lighthouse stood at the edge of the cliff, and every night its lamp turned slowly over the
dark water. Sailors who passed the point counted the flashes: three short, one long. When the fog
came in from the north, the keeper rang a bell instead, and the sound carried for miles.
In the morning the village woke early. Bakers pulled bread from their ovens, children ran to school
along the harbour wall, and fishermen argued about the weather over cups of strong black coffee.
"Will it rain today?" asked Maria. "Probably not," said her brother, "but take a coat anyway."
Mathematics is the study of patterns. A prime number has exactly two divisors: 2, 3, 5, 7, 11, 13,
17, 19, 23 and 29 are the first ten primes. The sum 1 + 2 + 3 + ... + 100 equals 5050, and the
square root of 144 is 12. In 1969 two astronauts walked on the Moon; in 2024 a probe reached the
far side of it again. Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees.
A good recipe for pancakes: mix 200 grams of flour, 2 eggs, 300 millilitres of milk and a pinch of
salt. Let the batter rest for ten minutes, then fry thin layers in a hot pan with a little butter.
Serve them with lemon and sugar, or with honey, berries and yoghurt.
def fibonacci(n: int) -> list[int]:
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]

for index, value in enumerate(fibonacci(10)):
    print(f"{index}: {value}")

class Queue:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop(0) if self.items else None
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
{"name": "search", "arguments": {"query": "train times to Lyon", "limit": 5}}
{"type": "function", "function": {"name": "add", "description": "Add two numbers",
 "parameters": {"type": "object", "properties": {"a": {"type": "number"},
 "b": {"type": "number"}}, "required": ["a", "b"]}}}
The weather in Paris is sunny with a high of 24 degrees. Tomorrow brings clouds and light wind.
User: Can you tell me a short story about a fox?
Assistant: Once upon a time, a clever fox lived at the edge of a quiet forest. Every evening she
watched the farmer lock his hens away, and every evening she found the gate a little looser.
One night the gate swung open, but instead of the hens she found a small dog, just as hungry and
just as lonely as she was. They shared the farmer's leftover supper and became friends for life.
User: What is the capital of Japan?
Assistant: The capital of Japan is Tokyo. It is one of the largest cities in the world.
Let me think step by step. First, we need the total cost: three books at 12 dollars each is 36
dollars. Then we add the tax of 10 percent, which is 3.60 dollars, so the answer is 39.60 dollars.
Rivers carry sand and stone from the mountains to the sea. Over thousands of years they carve
valleys, build deltas and change the shape of entire continents. Forests slow the water down;
cities, with their roads and roofs, speed it up, and that is why floods have become more common.
Music travels through the air as waves of pressure. A violin string vibrating 440 times a second
plays the note A; double the frequency and you hear the same note an octave higher.
SELECT name, price FROM products WHERE price < 20 ORDER BY price DESC LIMIT 10;
https://example.com/docs/index.html?page=2&sort=asc
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday.
January, February, March, April, May, June, July, August, September, October, November, December.
red, orange, yellow, green, blue, indigo, violet; black, white, grey, brown, pink, purple.
She said quietly: "I don't know where we are going, but I'm glad we're going together."
The committee will meet again next week to review the budget, discuss the new library building
and vote on the proposal to extend the opening hours of the public swimming pool.
Error: file not found (code 404). Please check the path and try again; if the problem persists,
contact support@example.org with the request id 7f3a-19c2.
"""


@functools.lru_cache(maxsize=1)
def build_tokenizer_json() -> str:
    """Train the byte-level BPE tokenizer on the built-in corpus and return its JSON.

    BPE training is deterministic for a fixed corpus and settings, so every call (in any process)
    returns the same text; it is cached per process because training takes ~0.1 s.
    """
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(MARKUP_TOKENS),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [line for line in _CORPUS.splitlines(keepends=True) if line.strip()]
    tokenizer.train_from_iterator(lines, trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    return tokenizer.to_str()


# A ChatML conversation format. Tool definitions go into the system turn as JSON lines; the model
# answers calls as <tool_call>{"name": ..., "arguments": ...}</tool_call> (what vLLM's `hermes`
# parser reads). `enable_thinking=false` pre-fills an empty reasoning block, as Qwen3 does.
CHAT_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set ns.system = messages[0]['content'] -%}
    {%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
    {{- '<|im_start|>system\\n' -}}
    {%- if ns.system -%}{{- ns.system + '\\n\\n' -}}{%- endif -%}
    {{- '# Tools\\n\\nThese functions are available. Their signatures are listed one per line:\\n' -}}
    {{- '<tools>' -}}
    {%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\\n</tools>\\n\\nTo call a function, reply with one JSON object per call, ' -}}
    {{- 'each wrapped in tags:\\n<tool_call>\\n' -}}
    {{- '{"name": "<function name>", "arguments": {<arguments as JSON>}}\\n</tool_call>' -}}
    {{- '<|im_end|>\\n' -}}
{%- elif ns.system -%}
    {{- '<|im_start|>system\\n' + ns.system + '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'assistant' -%}
        {{- '<|im_start|>assistant\\n' -}}
        {%- set reasoning = message.get('reasoning_content') or message.get('reasoning') -%}
        {%- if reasoning -%}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}{%- endif -%}
        {%- if message.get('content') -%}{{- message['content'] -}}{%- endif -%}
        {%- for call in message.get('tool_calls') or [] -%}
            {%- set fn = call['function'] if call.get('function') else call -%}
            {%- if not loop.first or message.get('content') -%}{{- '\\n' -}}{%- endif -%}
            {{- '<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' -}}
            {%- if fn['arguments'] is string -%}{{- fn['arguments'] -}}
            {%- else -%}{{- fn['arguments'] | tojson -}}{%- endif -%}
            {{- '}\\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\\n' -}}
    {%- elif message['role'] == 'tool' -%}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] -}}
        {{- '\\n</tool_response><|im_end|>\\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\\n' -}}
    {%- if enable_thinking is defined and not enable_thinking -%}
        {{- '<think>\\n\\n</think>\\n\\n' -}}
    {%- endif -%}
{%- endif -%}
"""


def tokenizer_files(tokenizer_json: str) -> dict[str, Any]:
    """The tokenizer-side files of a checkpoint, keyed by file name."""
    vocab = json.loads(tokenizer_json)["added_tokens"]
    added_tokens_decoder = {
        str(t["id"]): {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t["special"],
        }
        for t in vocab
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "added_tokens_decoder": added_tokens_decoder,
        "additional_special_tokens": [EOT_TOKEN, IM_START],
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [EOT_TOKEN, IM_START],
    }
    return {
        "tokenizer.json": tokenizer_json,
        "tokenizer_config.json": tokenizer_config,
        "special_tokens_map.json": special_tokens_map,
    }


def token_id(token: str) -> int:
    """Id of a special or markup token in the built-in tokenizer."""
    for t in json.loads(build_tokenizer_json())["added_tokens"]:
        if t["content"] == token:
            return int(t["id"])
    raise KeyError(token)


def media_chat_template(image: str, video: str | None = None) -> str:
    """A ChatML template for vision-language checkpoints: a list content is written part by part,
    an image part (OpenAI-style "image_url" parts too) as `image`, a video part as `video` (with
    `video` given), a text part as its text; a string content as it is (vLLM then writes the
    media markup into the text itself)."""
    parts = [
        "            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}",
        "                {{- '" + image + "' -}}",
    ]
    if video is not None:
        parts += [
            "            {%- elif part['type'] == 'video' or 'video' in part -%}",
            "                {{- '" + video + "' -}}",
        ]
    lines = [
        "{%- for message in messages -%}",
        "    {{- '<|im_start|>' + message['role'] + '\\n' -}}",
        "    {%- if message['content'] is string -%}",
        "        {{- message['content'] -}}",
        "    {%- else -%}",
        "        {%- for part in message['content'] -%}",
        *parts,
        "            {%- elif 'text' in part -%}",
        "                {{- part['text'] -}}",
        "            {%- endif -%}",
        "        {%- endfor -%}",
        "    {%- endif -%}",
        "    {{- '<|im_end|>\\n' -}}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}",
        "    {{- '<|im_start|>assistant\\n' -}}",
        "{%- endif -%}",
    ]
    return "\n".join(lines) + "\n"
