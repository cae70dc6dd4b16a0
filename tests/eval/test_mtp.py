"""mtp_top1_accuracy counts every target once across windows and compares the draft with x_{t+2}."""

from __future__ import annotations

import torch

from ninfer.eval.mtp import mtp_top1_accuracy

VOCAB = 11


class _SuccessorModel:
    """A fake model whose MTP head drafts x_{t+1} + `step` (mod VOCAB) for x_{t+2}."""

    device = torch.device("cpu")

    def __init__(self, step: int):
        self.step = step

    def new_state(self, capacity: int) -> None:
        return None

    def new_mtp_state(self, capacity: int) -> None:
        return None

    def hidden_states(self, ids: torch.Tensor, state: None) -> torch.Tensor:
        return ids.float()[:, None]

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor, state: None) -> torch.Tensor:
        assert hidden.shape[0] == next_ids.numel()
        return torch.nn.functional.one_hot((next_ids + self.step) % VOCAB, VOCAB).float()


def test_counts_every_target_once_and_scores_the_draft():
    ids = [t % VOCAB for t in range(1000)]  # x_{t+2} = x_{t+1} + 1 (mod VOCAB)
    for context, stride in ((64, 32), (512, 256), (2000, 1000), (100, 98)):
        assert mtp_top1_accuracy(_SuccessorModel(1), ids, context, stride) == (998, 998)
        assert mtp_top1_accuracy(_SuccessorModel(2), ids, context, stride) == (0, 998)


def test_a_window_overlapping_by_one_token_cannot_draft_its_first_target():
    ids = [t % VOCAB for t in range(1000)]
    # windows of 100 advancing by 99 (11 of them): each later window's first scored position has no h_{t-1}
    assert mtp_top1_accuracy(_SuccessorModel(1), ids, 100, 99) == (988, 988)
