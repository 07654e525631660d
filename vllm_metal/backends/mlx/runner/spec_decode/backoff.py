"""Who drafts in the next step: speculation goes on only where it is measured to pay.

Verifying k drafts adds k query rows to a step. When the step is bound by reading the weights
(batch 1, above all on Apple Silicon) the extra rows are nearly free and any reasonable
acceptance wins; in a large, compute-bound batch every rejected draft costs about as much as a
real token. Instead of modelling the device, the policy measures:

- **per batch size** (decoding requests, in powers of two), the token rate of decode steps that
  verified drafts and of decode steps that did not: tokens produced per second, the drafter's
  own time included, over about each mode's last sixteen steps (`_Rate`). The faster mode is used,
  and only a clear lead changes which one that is; the slower one is tried again now and then,
  so a change (a stream turning repetitive, a longer context) is noticed, and more rarely each
  time it stays slower. A try measures the slower mode afresh: its old figures may date from the
  engine's first steps, when MLX was still building kernels for the mode's shapes. The first
  step after a change of mode is not timed: it pays for the change (a head's pass over the
  positions it left while nobody drafted, a step that could not be built while the one before
  ran), which the next ones do not, so a try runs several steps;
- **per request**, the share of its drafts that were accepted (with a weak prior). A request
  whose share falls below `MIN_ACCEPTANCE` stops drafting for a pause that doubles (up to a cap)
  each time it is still poor, so one bad stream does not weigh down a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# A request drafts while at least this share of its drafts is accepted.
MIN_ACCEPTANCE = 0.25
# Prior of a request's acceptance counts: as if one draft had been accepted and one rejected.
_PRIOR_ACCEPTED, _PRIOR_REJECTED = 1.0, 1.0
_ACCEPTANCE_DECAY = 0.8  # per verification
# Weight kept by a mode's sums of tokens and seconds at each new step: they span about its last
# 1 / (1 - _RATE_DECAY) steps, so the pairs of one long and one short step that pipelined steps
# give (two outputs read in one drain) weigh in whole, whichever came last.
_RATE_DECAY = 15 / 16
# Samples of a mode before its rate is trusted; the first one of each (new shapes, JIT) is not
# counted.
_MIN_SAMPLES = 3
# How much faster the other mode must run before it becomes the one used (each change of mode
# costs a step that cannot be built one ahead and, for a head, a pass over what it left).
_LEAD = 0.05
# Decode steps in a batch size between tries of the slower mode: at first, and again whenever
# the faster mode changes; each try that leaves it the slower one doubles the wait, up to the cap
# (a try of a useless drafter costs a catch-up pass and a verification, many steps' worth).
_EXPLORE_EVERY, _MAX_EXPLORE_EVERY = 32, 512
# Decode steps of one try: the first, after the change of mode, is not timed.
_EXPLORE_STEPS = 5
_FIRST_PAUSE, _MAX_PAUSE = 4, 64  # steps a poor request waits before drafting again


@dataclass
class _Request:
    accepted: float = _PRIOR_ACCEPTED
    rejected: float = _PRIOR_REJECTED
    pause: int = _FIRST_PAUSE
    paused_until: int = -1
    verified: bool = False  # verifications since the counts were last reset

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class _Rate:
    """A mode's token rate: sums of the tokens and the seconds of its recent steps, each older
    step weighing `_RATE_DECAY` less. Sums, not an average of per-step rates, so a step timed
    short because its output came right after the previous one (two steps read in one drain)
    and the long one before it count as what the two cost together."""

    samples: int = 0
    tokens: float = 0.0
    seconds: float = 0.0
    fresh: bool = False  # the next sample starts the sums afresh (`restart`)

    def add(self, tokens: int, seconds: float) -> None:
        self.samples += 1
        if self.samples == 1:
            return
        if self.fresh:
            self.tokens, self.seconds, self.fresh = 0.0, 0.0, False
        self.tokens = _RATE_DECAY * self.tokens + tokens
        self.seconds = _RATE_DECAY * self.seconds + seconds

    def restart(self) -> None:
        """Measure afresh from the next sample: the sums are of steps taken long ago (at
        shorter contexts, or while kernels were still being built for the mode's first shapes,
        which can make a mode look several times slower than it runs)."""
        self.fresh = True

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    spec: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    steps: int = 0
    faster_is_spec: bool | None = None  # the faster mode when last decided
    explore_every: int = _EXPLORE_EVERY
    explored_at: int = -1  # `steps` when the slower mode was last tried
    exploring: int = 0  # steps of the slower mode's current try still to run
    last_verified: bool | None = None  # the mode of the last decode step recorded


def batch_bucket(num_decoding: int) -> int:
    """1, 2, 3-4, 5-8, ... decoding requests -> 0, 1, 2, 3, ..."""
    return max(0, num_decoding - 1).bit_length()


@dataclass
class Backoff:
    enabled: bool = True  # False: every request drafts up to its cap (vLLM's own behaviour)
    step: int = 0
    requests: dict[str, _Request] = field(default_factory=dict)
    buckets: dict[int, _Bucket] = field(default_factory=dict)

    # ------------------------------------------------------------ measurements

    def record_verification(self, req_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification of `num_drafts` real drafts, `num_accepted` of them accepted."""
        if num_drafts <= 0:
            return
        r = self.requests.setdefault(req_id, _Request())
        r.accepted = _ACCEPTANCE_DECAY * r.accepted + num_accepted
        r.rejected = _ACCEPTANCE_DECAY * r.rejected + (num_drafts - num_accepted)
        r.verified = True

    def record_decode_step(
        self, num_decoding: int, num_tokens_out: int, seconds: float, verified_drafts: bool
    ) -> None:
        """A step of decoding rows only: tokens it produced and its cost (sampling included,
        and the drafter's time before it: its drafts and its catch-up forward). Not timed where
        the step before it in the batch size ran the other mode (it paid for the change)."""
        bucket = self.buckets.setdefault(batch_bucket(num_decoding), _Bucket())
        bucket.steps += 1
        changed = bucket.last_verified not in (None, verified_drafts)
        bucket.last_verified = verified_drafts
        if not changed:
            (bucket.spec if verified_drafts else bucket.plain).add(num_tokens_out, seconds)

    def forget(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    # ------------------------------------------------------------ decision

    def choose(self, req_ids: Sequence[str], caps: Sequence[int], num_decoding: int) -> list[int]:
        """Caps for the next step: each row's `caps[i]`, or 0 where drafting does not pay."""
        if not self.batch_drafts(num_decoding):
            return [0] * len(caps)
        return self.per_request(req_ids, caps)

    def batch_drafts(self, num_decoding: int) -> bool:
        """The next step counted: whether any of its rows may draft (false: no row's cap needs
        working out)."""
        self.step += 1
        return not self.enabled or self._speculate(num_decoding)

    def per_request(self, req_ids: Sequence[str], caps: Sequence[int]) -> list[int]:
        """In a step whose rows may draft (`batch_drafts`): each row's cap, or 0 where the
        request's drafts are not accepted often enough."""
        caps = list(caps)
        if not self.enabled:
            return caps
        for i, (req_id, cap) in enumerate(zip(req_ids, caps)):
            r = self.requests.get(req_id)
            if cap <= 0 or r is None:
                continue
            if self.step < r.paused_until:
                caps[i] = 0
            elif r.acceptance < MIN_ACCEPTANCE:
                caps[i] = 0
                r.paused_until = self.step + r.pause
                r.pause = min(2 * r.pause, _MAX_PAUSE)
                # Afresh after the pause: the stream may have changed.
                r.accepted, r.rejected, r.verified = _PRIOR_ACCEPTED, _PRIOR_REJECTED, False
            elif r.verified:  # good drafts since the last pause
                r.pause = _FIRST_PAUSE
        return caps

    def _speculate(self, num_decoding: int) -> bool:
        bucket = self.buckets.get(batch_bucket(num_decoding))
        if bucket is None:
            return True
        spec, plain = bucket.spec, bucket.plain
        if spec.samples < _MIN_SAMPLES:
            return True
        if plain.samples < _MIN_SAMPLES:
            return False
        better = _faster_is_spec(spec.tokens_per_s, plain.tokens_per_s, bucket.faster_is_spec)
        if better != bucket.faster_is_spec:  # a new faster mode: try the other one soon
            bucket.faster_is_spec, bucket.explore_every = better, _EXPLORE_EVERY
            bucket.explored_at, bucket.exploring = bucket.steps, 0
        if not bucket.exploring and bucket.steps - bucket.explored_at >= bucket.explore_every:
            bucket.explored_at, bucket.exploring = bucket.steps, _EXPLORE_STEPS
            bucket.explore_every = min(2 * bucket.explore_every, _MAX_EXPLORE_EVERY)
            # A try measures the slower mode as it runs now, not blended with what it cost
            # when last used.
            (plain if better else spec).restart()
        if bucket.exploring:
            bucket.exploring -= 1
            return not better
        return better


def _faster_is_spec(spec: float, plain: float, was_spec: bool | None) -> bool:
    """Whether drafting is the faster mode at these rates, the mode found faster last time
    (`was_spec`) keeping its place unless the other leads it by `_LEAD`."""
    if was_spec is None:
        return spec >= plain
    if was_spec:
        return spec * (1 + _LEAD) >= plain
    return spec > plain * (1 + _LEAD)
