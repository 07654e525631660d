"""When drafting pays: a per-request acceptance record and a batch-size limit.

Verifying k drafts costs k extra query rows in the step. At batch 1 on Apple Silicon the step is
bound by reading the weights, so extra rows are nearly free and any reasonable acceptance wins;
in a large batch the step is bound by compute and every rejected draft costs about as much as a
real token. So a request drafts only while its recent acceptance rate stays above a floor
(after a run of poor verifications it pauses, for longer each time, then tries again), and no
request drafts while more than `max_batch` requests are decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of the newest verification in a request's acceptance rate.
_EMA_WEIGHT = 0.3
# Verifications before a request's rate is trusted.
_WARMUP_VERIFICATIONS = 2
# Steps a request stops drafting after its rate falls below the floor (doubling, capped).
_FIRST_PAUSE, _MAX_PAUSE = 4, 64


@dataclass
class _Record:
    rate: float = 1.0
    verifications: int = 0
    pause: int = _FIRST_PAUSE
    paused_until: int = -1


@dataclass
class Backoff:
    min_acceptance: float  # accepted / drafted below which a request stops drafting
    max_batch: int  # more decoding requests than this: nobody drafts
    step: int = 0
    records: dict[str, _Record] = field(default_factory=dict)

    def allowed(self, req_id: str, num_decoding: int) -> bool:
        if num_decoding > self.max_batch:
            return False
        record = self.records.get(req_id)
        return record is None or self.step >= record.paused_until

    def record(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` real drafts, `num_accepted` of them accepted."""
        if num_drafts <= 0:
            return
        rec = self.records.setdefault(req_id, _Record())
        rate = num_accepted / num_drafts
        rec.rate = (
            rate if rec.verifications == 0 else (_EMA_WEIGHT * rate + (1 - _EMA_WEIGHT) * rec.rate)
        )
        rec.verifications += 1
        if rec.verifications >= _WARMUP_VERIFICATIONS and rec.rate < self.min_acceptance:
            rec.paused_until = self.step + rec.pause
            rec.pause = min(2 * rec.pause, _MAX_PAUSE)
            # Start afresh after the pause: the text may have become repetitive.
            rec.rate, rec.verifications = 1.0, 0
        elif rec.rate >= self.min_acceptance:
            rec.pause = _FIRST_PAUSE

    def end_step(self) -> None:
        self.step += 1

    def forget(self, req_id: str) -> None:
        self.records.pop(req_id, None)
