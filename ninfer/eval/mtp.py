"""How often the MTP head's top-1 draft is right: the acceptance rate a one-token MTP draft would see."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.eval.perplexity import windows


@torch.no_grad()
def mtp_top1_accuracy(model, ids: Sequence[int], context: int = 512, stride: int = 256) -> tuple[int, int]:
    """(correct, total) over the windows of `ninfer ppl`: in each window the trunk runs from an empty state, the
    MTP head reads h_t and x_{t+1} and its argmax is compared with x_{t+2}; every target position counts once
    (a target needs two tokens of its window before it, so a window overlapping the last by one cannot draft
    its first scored position)."""
    ids_tensor = torch.as_tensor(list(ids), dtype=torch.long)
    correct = total = 0
    for begin, end, score_from in windows(len(ids_tensor), context, stride):
        x = ids_tensor[begin:end].to(model.device)
        length = x.numel()
        if length < 3:
            continue
        hidden = model.hidden_states(x, model.new_state(length))
        logits = model.mtp_logits(hidden[:-2], x[1:-1], model.new_mtp_state(length))  # row t predicts x[t + 2]
        first = max(0, score_from - begin - 2)  # targets already scored by an earlier window are skipped
        predicted = logits[first:].argmax(-1)
        correct += int((predicted == x[first + 2 :]).sum())
        total += predicted.numel()
    return correct, total
