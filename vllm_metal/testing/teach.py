"""Teach a tiny random checkpoint one answer, so a test can see what only a trained model does.

A random-weight model never emits, say, a harmony tool call, so a test of the tool-call parser
on the served output would have nothing to parse. `teach` fine-tunes the checkpoint with
transformers in float32 (every parameter, AdamW) until its greedy continuation of each given
prompt is the answer, every answer token ahead of the runner-up by a clear logit margin, and
saves it as a new checkpoint. The test then serves that checkpoint and checks the answer comes
back through the server; transformers float32 stays the oracle for the tokens.

    python -m vllm_metal.testing.teach MODEL_DIR OUT_DIR --prompt-ids 1,2,3 --answer-ids 4,5,6
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

# The answer's tokens lead the runner-up by at least this (float32 logits), so MLX's float32
# arithmetic, summed in another order, picks the same token.
MIN_MARGIN = 4.0
MAX_STEPS = 600
LEARNING_RATE = 3e-3
# Files copied beside the new weights: the tokenizer and chat template of the original.
_KEEP = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def teach(
    model_dir: Path,
    out_dir: Path,
    prompts: Sequence[Sequence[int]],
    answer: Sequence[int],
    *,
    seed: int = 0,
) -> int:
    """Fine-tune `model_dir` until each prompt continues greedily with `answer`; write the
    result to `out_dir`. Returns the number of optimizer steps taken."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train()
    rows = [list(p) + list(answer) for p in prompts]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        ids[i, : len(row)] = torch.tensor(row)
        labels[i, len(prompt) : len(row)] = torch.tensor(answer)
        mask[i, : len(row)] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    for step in range(1, MAX_STEPS + 1):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if step % 10 == 0 and _margin(model, ids, mask, labels) >= MIN_MARGIN:
            break
    else:
        raise RuntimeError(f"the model did not learn the answer in {MAX_STEPS} steps")
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in _KEEP:
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out_dir / name)
    return step


def _margin(model, ids, mask, labels) -> float:
    """The smallest lead of an answer token over the best other token, teacher-forced."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    rows, cols = torch.nonzero(target != -100, as_tuple=True)
    picked = logits[rows, cols]
    wanted = picked.gather(1, target[rows, cols, None]).squeeze(1)
    picked[torch.arange(len(rows)), target[rows, cols]] = float("-inf")
    return float((wanted - picked.max(dim=1).values).min())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    parser.add_argument("--answer-ids", required=True, help="comma-separated token ids")
    args = parser.parse_args(argv)
    prompt = [int(t) for t in args.prompt_ids.split(",")]
    answer = [int(t) for t in args.answer_ids.split(",")]
    steps = teach(args.model_dir, args.out_dir, [prompt], answer)
    print(f"taught in {steps} steps: {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
