"""Random LoRA adapters in Hugging Face PEFT layout for the tiny checkpoints, written by PEFT.

PEFT initialises `lora_B` to zero, so an untrained adapter changes nothing; here both halves get
seeded random values large enough to change greedy tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

ATTENTION_AND_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_tiny_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    rank: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = ATTENTION_AND_MLP,
    seed: int = 0,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    std: float = 0.2,
) -> Path:
    """Write a PEFT LoRA adapter for the checkpoint in `model_dir` to `out_dir` and return it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out
