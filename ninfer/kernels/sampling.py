"""Next-token sampling: penalties → temperature → top-k → top-p → min-p → one draw (vLLM's order).

For one row of logits `[V]` and a `SamplingParams`:

1. `apply_penalties` (fp32), in this order:
   - repetition (HF / vLLM): for every id in prompt ∪ generated, `l > 0 → l / r`, else `l · r`;
   - presence (OpenAI): `l −= presence_penalty` once for every id that was generated;
   - frequency (OpenAI): `l −= frequency_penalty · count`, count = occurrences among generated ids;
   - logit bias: `l[id] += bias`.
   The prompt feeds the repetition penalty only; presence and frequency see generated ids only.
2. Greedy (temperature 0): the argmax of the penalised logits, lowest id on ties. No filter can remove the
   argmax, so the filters are skipped, and the generator is not touched.
3. Temperature: `l = (l − max l) / T`. The shift changes no probability and keeps a tiny T from overflowing.
4. `filter_logits`: top-k, then top-p on the top-k distribution, then min-p; tokens outside become −inf.
5. Softmax in fp32 and `torch.multinomial` with the request's generator: the same seed on the same device
   gives the same tokens (CPU and CUDA streams differ).

There is no hidden cap on top-k (upstream NInfer caps it at 20; we do not).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ninfer.sampling import SamplingError, SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator on `device` seeded with `seed`; None (torch's global generator) when `seed` is None."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


def apply_penalties(
    logits: Tensor, params: SamplingParams, prompt_ids: Tensor | None = None, generated_ids: Tensor | None = None,
    *, checked: bool = True,
) -> Tensor:
    """Repetition, presence and frequency penalties, then the logit bias (module docstring, step 1).

    Shapes: logits `[V]` (any float dtype); prompt_ids, generated_ids `[N]` integer ids in `[0, V)` or None
    (empty). Returns a new fp32 `[V]` tensor; the input is not modified. Raises SamplingError for an id, or a
    logit_bias id, outside the vocabulary, and for NaN / +inf logits. `checked=False` skips the checks that read
    device values back (the ids' range, NaN / +inf): for callers whose ids are the tokenizer's and the sampler's
    own and that check the logits themselves (`sample_batch`).
    """
    vocab = _check_logits(logits, read_back=checked)
    out = logits.to(torch.float32, copy=True)
    prompt = _token_ids(prompt_ids, vocab, "prompt_ids", out.device, checked)
    generated = _token_ids(generated_ids, vocab, "generated_ids", out.device, checked)

    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool, device=out.device)
        seen[prompt] = True
        seen[generated] = True
        # a tensor divisor: CUDA turns division by a Python scalar into a multiplication by its reciprocal
        divided = out / torch.full_like(out, params.repetition_penalty)
        penalised = torch.where(out > 0, divided, out * params.repetition_penalty)
        out = torch.where(seen, penalised, out)

    if params.presence_penalty != 0.0 or params.frequency_penalty != 0.0:
        counts = torch.bincount(generated, minlength=vocab).to(torch.float32)
        out -= params.presence_penalty * (counts > 0).to(torch.float32) + params.frequency_penalty * counts

    if params.logit_bias:
        ids = [token_id for token_id, _ in params.logit_bias]
        if ids[-1] >= vocab:  # sorted by id
            raise SamplingError(f"logit_bias token id {ids[-1]} is outside the vocabulary of {vocab} tokens")
        bias = torch.tensor([value for _, value in params.logit_bias], dtype=torch.float32, device=out.device)
        out[torch.tensor(ids, device=out.device)] += bias  # ids are unique
    return out


def filter_logits(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> Tensor:
    """Set to −inf every token outside the top-k, then top-p, then min-p set; the argmax is always kept.

    logits are temperature-scaled, `[..., V]` float with a finite maximum per row; each row is filtered alone.
    Candidates are ranked by logit, descending; ties rank the lower id first.
    - top_k (0 = off; k ≥ V keeps all): exactly the k first ranked (a tie at the k-th value keeps lower ids).
    - top_p (1 = off): with p the softmax over the top-k survivors, keep the shortest ranked prefix whose
      mass reaches top_p: a token is kept iff the mass ranked strictly before it is < top_p (mass in float64).
    - min_p (0 = off): keep p_i ≥ min_p · p_max, evaluated as `l_i ≥ l_max + log(min_p)` (the same in exact
      arithmetic, free of softmax rounding, and unchanged by the renormalisation after top-k / top-p).
    Returns a new tensor of the same shape and dtype.
    """
    vocab = logits.shape[-1]
    if (top_k == 0 or top_k >= vocab) and top_p >= 1.0 and min_p <= 0.0:
        return logits.clone()
    ranked, order = torch.sort(logits, dim=-1, descending=True, stable=True)
    keep = torch.ones_like(ranked, dtype=torch.bool)
    if 0 < top_k < vocab:
        keep[..., top_k:] = False
    if top_p < 1.0:
        # float64 mass: the kept set does not depend on fp32 summation order (CPU vs CUDA scans)
        probs = torch.softmax(ranked.double().masked_fill(~keep, -math.inf), dim=-1)
        mass = torch.cumsum(probs, dim=-1)
        mass_before = torch.cat([torch.zeros_like(mass[..., :1]), mass[..., :-1]], dim=-1)
        keep &= mass_before < top_p
    if min_p > 0.0:
        keep &= ranked >= ranked[..., :1] + math.log(min_p)
    keep_by_id = torch.empty_like(keep).scatter_(-1, order, keep)
    return logits.masked_fill(~keep_by_id, -math.inf)


def next_token_probs(
    logits: Tensor, params: SamplingParams, prompt_ids: Tensor | None = None, generated_ids: Tensor | None = None
) -> Tensor:
    """The distribution the next token is drawn from (module docstring, steps 1–4), fp32 `[V]`.

    Greedy params give the one-hot vector of the penalised argmax (lowest id on ties). Speculative acceptance
    uses this distribution; `sample_next` draws from it.
    """
    penalised = apply_penalties(logits, params, prompt_ids, generated_ids)
    best = penalised.max()
    if best == -math.inf:
        raise SamplingError(NOTHING_SAMPLABLE.format(penalised.numel()))
    if params.greedy:
        return torch.zeros_like(penalised).index_fill_(0, torch.argmax(penalised), 1.0)
    return _tempered_probs(penalised, best, params)


def _tempered_probs(penalised: Tensor, best: Tensor, params: SamplingParams) -> Tensor:
    """Steps 3–4 and the softmax of step 5 for a non-greedy row whose largest penalised logit is `best`."""
    scaled = (penalised - best) / torch.full_like(penalised, params.temperature)  # tensor divisor: see above
    return torch.softmax(filter_logits(scaled, params.top_k, params.top_p, params.min_p), dim=-1)


def sample_next(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    prompt_ids: Tensor | None = None,
    generated_ids: Tensor | None = None,
) -> int:
    """One next-token id from logits `[V]` (module docstring). Greedy params never touch the generator.

    generator: from `make_generator(params.seed, logits.device)`, created once per request and reused for every
    step, so that a seeded request is reproducible; None uses torch's global generator.
    """
    probs = next_token_probs(logits, params, prompt_ids, generated_ids)
    if params.greedy:
        return int(torch.argmax(probs).item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def sample_batch(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                 prompt_ids: Sequence[Tensor | None],
                 generated_ids: Sequence[Tensor | None]) -> list[int | SamplingError]:
    """One next token for each row of `logits` `[B, V]`, row b under params[b] / generators[b] (its request's),
    each the token `sample_next` would give that row alone (sampled rows: the same device ops and draws; greedy
    rows without penalties: one argmax pass over the batch), with ONE read back to the host for the whole batch:
    the validity of each row (no NaN / +inf, something samplable) is computed on the device and read with the
    tokens. A row that cannot be sampled gets its SamplingError in place of a token (its draw is then made from a
    harmless one-hot, so the device never sees invalid probabilities). The ids in prompt_ids / generated_ids are
    trusted (not range-checked on the device)."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise SamplingError(f"sample_batch needs float logits [B, V], got {logits.dtype} {list(logits.shape)}")
    # greedy rows without penalties need no per-row work: their argmax and checks are one pass over the whole batch
    # (a handful of launches a step rather than a handful a row; the other rows' results of it go unused), with
    # the values of the per-row path below
    plain = [b for b, row_params in enumerate(params) if row_params.greedy and not _penalised(row_params)]
    picks: list[Tensor | SamplingError | None] = [None] * len(params)
    if plain:
        every = logits.to(torch.float32)
        every_empty = every.amax(-1) == -math.inf
        every_pick = torch.stack([every.argmax(-1), _broken(every).long(), every_empty.long()], dim=1)
        for b in plain:
            picks[b] = every_pick[b]
    for b, row_params in enumerate(params):
        if picks[b] is not None:
            continue
        row = logits[b]
        try:
            penalised = apply_penalties(row, row_params, prompt_ids[b], generated_ids[b], checked=False)
        except SamplingError as error:  # found on the host (a logit_bias id outside the vocabulary)
            picks[b] = error
            continue
        broken = _broken(row)
        best = penalised.max()
        empty = best == -math.inf
        if row_params.greedy:
            token = torch.argmax(penalised)
        else:
            probs = _tempered_probs(penalised, best, row_params)
            harmless = torch.zeros_like(probs)
            harmless[0] = 1.0
            probs = torch.where(broken | empty, harmless, probs)
            token = torch.multinomial(probs, 1, generator=generators[b])[0]
        picks[b] = torch.stack([token, broken.long(), empty.long()])
    rows = [p for p in picks if isinstance(p, Tensor)]
    values = iter(torch.stack(rows).tolist() if rows else [])  # the one synchronisation
    out: list[int | SamplingError] = []
    for pick in picks:
        if isinstance(pick, SamplingError):
            out.append(pick)
            continue
        token, broken, empty = next(values)
        out.append(SamplingError(BROKEN_LOGITS) if broken else SamplingError(NOTHING_SAMPLABLE.format(
            logits.shape[1])) if empty else token)
    return out


def speculative_accept(logits: Tensor, drafts: Tensor, params: SamplingParams, generator: torch.Generator | None,
                       prompt_ids: Tensor | None, generated_ids: Tensor | None) -> Tensor:
    """Accept a prefix of K greedy drafts against the target's logits and draw the token after it (speculative
    sampling with one-hot proposals, as upstream NInfer's MTP does), on the device, without reading back.

    logits `[K+1, V]` fp32: the target after each verified token (column j predicts the token after draft j; column
    0 the token after the sequence's last one); drafts `[K]` ids; generated_ids: the generated ids before the round
    (penalties of column j also count drafts 1..j). Column j's distribution p_j is `next_token_probs`'s.
    - Greedy params: accept draft j+1 while it is p_j's argmax; the next token is the argmax at the first miss
      (the correction), or of column K (the bonus). Exactly plain greedy decoding; the generator is not touched.
    - Sampled: accept draft j+1 with probability p_j(d_{j+1}) (u ~ U[0,1) from the generator, K draws); at the first
      rejection draw from the residual p_j with d_{j+1} removed, renormalised; with all accepted draw from p_K.
      Each emitted token then has exactly plain sampling's distribution given the ones before it (the proposal
      is a point mass, so min(1, p/q) = p(d) and the residual is max(0, p - q) ∝ p without d).
    Returns int64 `[4]`: (accepted count A in 0..K, the token after the accepted drafts, broken, empty) where broken
    / empty flag NaN or +inf logits / a column with nothing samplable (its token is then meaningless).
    """
    k = drafts.numel()
    columns = []
    for j in range(k + 1):
        seen = drafts[:j] if generated_ids is None else torch.cat([generated_ids.to(drafts.device), drafts[:j]])
        columns.append(apply_penalties(logits[j], params, prompt_ids, seen, checked=False)
                       if _penalised(params) else logits[j].to(torch.float32))
    penalised = torch.stack(columns)
    best = penalised.amax(-1, keepdim=True)
    broken, empty = _broken(logits).any(), (best == -math.inf).any()
    rows = torch.arange(k, device=logits.device)
    if params.greedy:
        targets = penalised.argmax(-1)
        accepted = torch.cumprod((targets[:k] == drafts).long(), 0).sum()
        token = targets[accepted]
    else:
        probs = torch.stack([_tempered_probs(penalised[j], best[j], params) for j in range(k + 1)])
        probs = torch.where(broken | empty, torch.zeros_like(probs).index_fill_(-1, rows.new_zeros(1), 1.0), probs)
        draws = torch.rand(k, generator=generator, device=logits.device)
        accepted = torch.cumprod((draws < probs[rows, drafts]).long(), 0).sum()
        residual = probs.clone()
        residual[rows, drafts] = 0.0
        residual[k] = probs[k]
        row = residual.index_select(0, accepted.view(1))[0]
        row = torch.where(row.sum() > 0, row, probs.index_select(0, accepted.view(1))[0])  # p_j(d) = 1: no residual
        token = torch.multinomial(row, 1, generator=generator)[0]
    return torch.stack([accepted, token, broken.long(), empty.long()])


def _penalised(params: SamplingParams) -> bool:
    """Whether `apply_penalties` changes any logit under these params."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or bool(params.logit_bias))


BROKEN_LOGITS = "logits contain NaN or +inf: the model output is broken, nothing can be sampled"
NOTHING_SAMPLABLE = "every one of the {} logits is -inf: no token can be sampled"


def _check_logits(logits: Tensor, read_back: bool = True) -> int:
    if logits.dim() != 1 or not logits.is_floating_point():
        raise SamplingError(f"the sampler needs one row of float logits [V], got {logits.dtype} {list(logits.shape)}")
    if read_back and bool(_broken(logits)):
        raise SamplingError(BROKEN_LOGITS)
    return logits.shape[0]


def _broken(logits: Tensor) -> Tensor:
    """Whether each row (the last dimension) holds NaN or +inf (device bools: the model output is broken)."""
    return torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)


def _token_ids(ids: Tensor | None, vocab: int, name: str, device: torch.device, checked: bool = True) -> Tensor:
    if ids is None or ids.numel() == 0:  # an empty tensor holds no ids, whatever its dtype
        return torch.zeros(0, dtype=torch.int64, device=device)
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise SamplingError(f"{name} must be a 1-D integer tensor of token ids, got {ids.dtype} {list(ids.shape)}")
    ids = ids.to(device=device, dtype=torch.int64)
    if checked and (ids.min() < 0 or ids.max() >= vocab):
        raise SamplingError(
            f"{name} holds an id outside the vocabulary [0, {vocab}): {ids.min().item()}..{ids.max().item()}"
        )
    return ids
