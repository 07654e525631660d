"""Speculative decoding on the MLX runner: proposers (n-gram, draft model) that fill
`take_draft_token_ids`, and verification of `scheduled_spec_decode_tokens` as ordinary varlen
query rows (q_len = 1 + drafts) with vLLM's rejection-sampling semantics. Not built yet:
`--speculative-config` is refused at startup by the capability table."""
