"""Speculative decoding with the model's MTP head: the round, its statistics, and the choice of draft length.

A speculating sequence holds its next token x (sampled, not yet in the model's state). One round:
1. `model.draft(states, x, K)`: K greedy drafts d_1..d_K from the MTP head, chained;
2. `model.verify(states, [x, d_1..d_K])`: one target forward over the K+1 positions, logits after each;
3. `kernels.sampling.speculative_accept` per sequence: the accepted prefix d_1..d_A and the token after it (the
   correction at the first rejection, or the bonus after K accepted), with plain decoding's distribution;
4. `model.accept(states, A + 1)`: x and the accepted drafts stay in the state; the new token becomes the next x.
All sequences of a round with the same K go through the model together, and one read-back gives every sequence's
A, token and drafts. The emitted tokens then go through the output pipeline one by one, so that EOS, a stop string
or `max_tokens` inside a round ends the sequence exactly where plain decoding would.

The draft length is fixed (`draft_tokens`) or chosen per round (`DraftLength`) from the sequence's acceptance per
draft position and the measured cost of rounds of each length against a plain decode step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ninfer.config import MAX_DRAFT_TOKENS
from ninfer.kernels.sampling import speculative_accept


@dataclass
class SpeculationStats:
    """Per request: rounds, drafted and accepted tokens; per draft position (index i: draft i+1) the rounds that
    proposed it, the rounds that reached it (every draft before it accepted) and the rounds that accepted it; plain
    decode steps taken instead of a round (no room for one near the end of the budget, or K chosen as 0)."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    reached_per_position: list[int] = field(default_factory=list)
    fallback_steps: int = 0

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            for counts in (self.drafted_per_position, self.reached_per_position, self.accepted_per_position):
                counts += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.reached_per_position[i] += i <= accepted
            self.accepted_per_position[i] += i < accepted

    @property
    def tokens_per_round(self) -> float:
        """Tokens a round emitted on average (accepted drafts plus the token after them)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def as_dict(self) -> dict:
        return {"rounds": self.rounds, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "accepted_per_position": list(self.accepted_per_position), "fallback_steps": self.fallback_steps}


class DraftLength:
    """Chooses K for a sequence's next round: the K in 1..`most` that maximises expected tokens per second,
        E(K) = 1 + Σ_{i≤K} Π_{j≤i} a_j   (a_j: the sequence's acceptance at draft position j given the ones before,
                                           a Beta(1, 1)-smoothed estimate, so unseen positions start at 1/2)
        cost(K) = measured seconds of a K-draft round (an exponential average over the engine's rounds; before
                  any is measured, plain step × (1 + K / 4))
    and 0 (a plain decode step) when no K beats a plain step's one token per step, or to measure a plain step (the
    first FIRST_PLAIN_STEPS choices, then one in REMEASURE_EVERY)."""

    SMOOTHING = 0.2  # weight of a new measurement in the running averages
    REMEASURE_EVERY = 64  # choices between two plain steps taken to measure one
    FIRST_PLAIN_STEPS = 3  # plain steps measured before the first round (the first one of a process runs cold)

    def __init__(self, most: int = MAX_DRAFT_TOKENS):
        self.most = most
        self.choices = 0
        self.plain_steps = 0
        self.plain_seconds: float | None = None
        self.round_seconds: dict[int, float] = {}

    def measured(self, k: int, seconds: float) -> None:
        """One round of K drafts (k = 0: a plain decode step) took `seconds`."""
        old = self.plain_seconds if k == 0 else self.round_seconds.get(k)
        new = seconds if old is None else old + self.SMOOTHING * (seconds - old)
        if k == 0:
            self.plain_steps += 1
            self.plain_seconds = new if self.plain_steps > 1 else None  # the first, cold, is not kept
        else:
            self.round_seconds[k] = new

    def cost(self, k: int) -> float:
        """Seconds of a round of K drafts (K = 0: a plain step): measured, else the prior's shape plain × (1 + K/4)
        scaled to the lengths that were measured (all in the same unit, whatever was measured first)."""
        measured = dict(self.round_seconds)
        if self.plain_seconds is not None:
            measured[0] = self.plain_seconds
        if k in measured:
            return measured[k]
        scale = sum(seconds / (1 + j / 4) for j, seconds in measured.items()) / len(measured) if measured else 1.0
        return scale * (1 + k / 4)

    def choose(self, stats: SpeculationStats) -> int:
        self.choices += 1
        if self.plain_steps < self.FIRST_PLAIN_STEPS or self.choices % self.REMEASURE_EVERY == 0:
            return 0  # plain steps first and now and then: the unit rounds are weighed against, measured warm
        best, best_rate = 0, 1.0 / self.cost(0)
        expected, chain = 1.0, 1.0
        for k in range(1, self.most + 1):
            seen = k <= len(stats.reached_per_position)
            reached = stats.reached_per_position[k - 1] if seen else 0
            accepted = stats.accepted_per_position[k - 1] if seen else 0
            chain *= (accepted + 1) / (reached + 2)
            expected += chain
            rate = expected / self.cost(k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


def run_round(model, states: list, next_ids: torch.Tensor, k: int, vocab: int, rows: list[tuple]) -> list[tuple]:
    """One round for sequences whose next tokens are `next_ids` `[B]` with K drafts each. `rows[b]`: (params,
    generator, prompt ids or None, generated ids or None) as `sample_batch` takes them. Returns, per sequence,
    (accepted count A, the accepted drafts + the token after them, broken, empty), read back in one transfer; the
    model's states keep x and the A accepted drafts."""
    drafts = model.draft(states, next_ids, k)  # [B, K]
    logits = model.verify(states, torch.cat([next_ids.view(-1, 1), drafts], dim=1))  # [B, K+1, V]
    logits[..., vocab:] = float("-inf")  # padding rows of the embedding: no text
    decided = torch.stack([speculative_accept(logits[b], drafts[b], *row) for b, row in enumerate(rows)])
    host = torch.cat([decided, drafts], dim=1).tolist()  # the one synchronisation
    results = []
    for values in host:
        accepted, token, broken, empty = values[:4]
        results.append((accepted, [*values[4 : 4 + accepted], token], bool(broken), bool(empty)))
    model.accept(states, [a + 1 for a, *_ in results])
    return results
