"""The Qwen3.5 text model (dense and MoE) on the torch reference operations: the oracle path.

Per layer: h += mixer(rms_norm(h)) with mixer = gated attention ("full_attention") or Gated DeltaNet
("linear_attention"), then h += mlp(rms_norm(h)) with a SwiGLU MLP or the sparse MoE; a final norm and the
head. The forward below reads like the model card; the semantics (zero-centred norms, per-head query/gate,
partial interleaved rotary, fp32 decay and delta rule, softmax-top-k-renormalise routing with a
sigmoid-gated shared expert) are those of transformers' qwen3_5 / qwen3_5_moe, against which it is tested.

Weights come from the artifact's `text` objects (docs/artifact-format.md §4), decoded at load into the
compute dtype (fp32 or bf16); A_log and dt_bias stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ninfer.artifact.reader import Artifact
from ninfer.kernels.attention import causal_attention
from ninfer.kernels.conv1d import causal_conv1d
from ninfer.kernels.gated_delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent, l2_normalize
from ninfer.kernels.moe import moe_mlp, swiglu_mlp
from ninfer.kernels.norm import rms_norm, rms_norm_gated
from ninfer.kernels.rope import apply_rope, rope_cos_sin
from ninfer.model.config import FULL_ATTENTION, TextConfig

FP32_OBJECTS = ("gdn/a_log", "gdn/dt_bias")


@dataclass
class SequenceState:
    """Everything a sequence carries between forward calls: its length, the KV cache of each attention layer
    (preallocated to `capacity` positions) and the conv and recurrent state of each GDN layer; with a drafter,
    the MTP head's own sequence (`mtp`: its KV, one position behind the trunk) and the trunk's last final-normed
    hidden state (`pending`, `[1, H]`), which the head pairs with the next token once that token is known."""

    capacity: int
    length: int = 0
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    conv: dict[int, torch.Tensor | None] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor | None] = field(default_factory=dict)
    mtp: SequenceState | None = None
    pending: torch.Tensor | None = None
    unaccepted: int = 0  # tokens of a verify step not yet accepted or rejected
    verified: list[dict] = field(default_factory=list)  # the recurrent part of the state after each of them


class Qwen35Model:
    """Qwen3.5 text model on the reference operations, implementing the `Model` protocol directly (one sequence
    after another; every sequence keeps its own tensors). `prefill(ids, state)` appends `ids` to the sequence."""

    max_batch = None  # any number of sequences per decode step
    page = 1  # a sequence's KV rows are allocated to its capacity exactly

    def __init__(self, config: TextConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, drafter: bool = False, draft_head: bool = False):
        """`drafter`: every sequence also carries the MTP head's state, so that `draft` can propose tokens;
        `draft_head`: drafts take the argmax over the restricted proposal head (`draft_head`, rows of the output
        head for the ids `draft_head_token_ids`) instead of the whole head."""
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.head = weights["output_head"] if "output_head" in weights else weights["token_embedding"]
        self.kv_capacity: int | None = None  # set by the loader: KV positions the engine may reserve in all
        if drafter and not self.has_mtp:
            raise ValueError("this artifact has no MTP head to draft with")
        if draft_head:
            _check_draft_head(weights, config)
        self.drafter = drafter
        self.proposal = (weights["draft_head"], weights["draft_head_token_ids"].long()) if draft_head else None

    @classmethod
    def from_artifact(cls, artifact: Artifact, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32, drafter: bool = False,
                      draft_head: bool = False) -> Qwen35Model:
        config = TextConfig.from_dict(artifact.components["text"]["config"])
        device = torch.device(device)
        weights = {}
        for obj in artifact.objects:
            if obj.kind != "tensor" or obj.component not in ("text", "mtp"):
                continue
            name = obj.id.removeprefix("text/")  # the MTP head's weights keep their "mtp/" prefix
            tensor = artifact.tensor(obj.id, device)
            if tensor.is_floating_point():  # ids (the draft head's token ids) stay integers
                tensor = tensor.to(torch.float32 if name.endswith(FP32_OBJECTS) else dtype)
            weights[name] = tensor
        return cls(config, weights, device, dtype, drafter, draft_head)

    def new_state(self, capacity: int) -> SequenceState:
        c = self.config
        state = SequenceState(capacity)
        for i, kind in enumerate(c.layer_types):
            if kind == FULL_ATTENTION:
                shape = (capacity, c.kv_heads, c.head_dim)
                state.keys[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                state.values[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            else:
                state.conv[i] = None
                state.recurrent[i] = None
        if self.drafter:
            state.mtp = self.new_mtp_state(capacity)
        return state

    def free_state(self, state: SequenceState) -> None:
        """Drop the sequence's tensors (they are plain tensors: memory returns when the last reference goes)."""
        state.keys.clear()
        state.values.clear()
        state.conv.clear()
        state.recurrent.clear()
        state.mtp = state.pending = None

    def snapshot(self, state: SequenceState) -> dict[tuple[str, int], torch.Tensor]:
        """Copies of a sequence's state (KV rows up to its length, conv and recurrent state): prefix reuse."""
        tensors: dict[tuple[str, int], torch.Tensor] = {}
        for layer, keys in state.keys.items():
            tensors[("keys", layer)] = keys[: state.length].clone()
            tensors[("values", layer)] = state.values[layer][: state.length].clone()
        for kind, states in (("conv", state.conv), ("recurrent", state.recurrent)):
            for layer, tensor in states.items():
                if tensor is not None:
                    tensors[(kind, layer)] = tensor.clone()
        if state.mtp is not None:
            tensors[("mtp_keys", 0)] = state.mtp.keys[0][: state.mtp.length].clone()
            tensors[("mtp_values", 0)] = state.mtp.values[0][: state.mtp.length].clone()
            if state.pending is not None:
                tensors[("pending", 0)] = state.pending.clone()
        return tensors

    def restore(self, state: SequenceState, length: int, tensors: dict[tuple[str, int], torch.Tensor]) -> None:
        """Put a `snapshot` of a `length`-token prefix into a fresh state."""
        for (kind, layer), tensor in tensors.items():
            if kind in ("keys", "values"):
                getattr(state, kind)[layer][:length] = tensor.to(self.device)
            elif kind in ("mtp_keys", "mtp_values") and state.mtp is not None:
                getattr(state.mtp, kind.removeprefix("mtp_"))[0][: tensor.shape[0]] = tensor.to(self.device)
                state.mtp.length = tensor.shape[0]
            elif kind == "pending":
                state.pending = tensor.to(self.device).clone() if state.mtp is not None else None
            elif kind in ("conv", "recurrent"):
                getattr(state, kind)[layer] = tensor.to(self.device).clone()
        state.length = length

    def release_snapshot(self, snapshot: dict[tuple[str, int], torch.Tensor]) -> None:
        """Snapshots are plain tensors here: nothing to give back."""

    def set_reclaim(self, reclaim) -> None:
        """No shared pools here: nothing to reclaim."""

    def prepare(self, batch_sizes) -> None:
        """Nothing is captured on the reference path."""

    def warm_up(self, max_batch: int | None = None) -> float:
        """Nothing to compile on the reference path."""
        return 0.0

    def describe_memory(self) -> str | None:
        return None

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    def matrices(self) -> dict[str, tuple[int, int, int]]:
        """Name → (rows, columns, bytes as held) of every trunk weight matrix (speed accounting)."""
        return {name: (t.shape[0], t.shape[1], t.numel() * t.element_size()) for name, t in self.weights.items()
                if t.dim() == 2 and not name.startswith(("mtp/", "draft_head"))}

    # -- the forward pass ------------------------------------------------------------------------------------

    def decode(self, states: list[SequenceState], ids: torch.Tensor) -> torch.Tensor:
        """One token for each sequence: logits `[B, V]` (the reference runs them one after another)."""
        return torch.stack([self.prefill(ids[i : i + 1], state) for i, state in enumerate(states)])

    def verify(self, states: list[SequenceState], ids: torch.Tensor) -> torch.Tensor:
        """T draft tokens `ids` `[B, T]` appended to each of B sequences, one token at a time, keeping a copy of
        each sequence's state after every token for `accept`: logits `[B, T, V]`."""
        rows = []
        for state, drafts in zip(states, ids, strict=True):
            if state.unaccepted:
                raise ValueError("accept the previous verify step before the next one")
            logits, state.verified = [], []
            for token in drafts:
                logits.append(self.prefill(token.view(1), state))
                state.verified.append(_recurrent_part(state))
            state.unaccepted = len(drafts)
            rows.append(torch.stack(logits))
        return torch.stack(rows)

    def accept(self, states: list[SequenceState], accepted: list[int]) -> None:
        """Keep the first `accepted[b]` (≥ 1) draft tokens of each sequence's last verify step."""
        for state, count in zip(states, accepted, strict=True):
            if not 1 <= count <= state.unaccepted:
                raise ValueError(f"accept 1..{state.unaccepted} tokens of the verify step, not {count}")
            if count < state.unaccepted:  # KV rows past the new length are dead: later tokens overwrite them
                state.length -= state.unaccepted - count
                conv, recurrent, pending, mtp_length = state.verified[count - 1]
                state.conv, state.recurrent, state.pending = dict(conv), dict(recurrent), pending
                if state.mtp is not None:
                    state.mtp.length = mtp_length
            state.unaccepted, state.verified = 0, []

    def draft(self, states: list[SequenceState], ids: torch.Tensor, k: int) -> torch.Tensor:
        """K draft tokens `[B, K]` for each sequence from the MTP head, greedy: the first from the trunk's last
        hidden state and the sequence's next token `ids[b]` (sampled, not yet in the state), each later one from
        the head's own final-normed output and the previous draft (Qwen3.5's chained MTP). The states are left
        as they were (the head's KV rows written past its length are dead)."""
        if not self.drafter:
            raise ValueError("the model was loaded without a drafter")
        rows = []
        for state, token in zip(states, ids.view(-1, 1), strict=True):
            mtp, hidden, drafts = state.mtp, state.pending, []
            length = mtp.length
            for _ in range(k):
                hidden = self.mtp_hidden(hidden, token, mtp)
                if self.proposal is None:
                    token = (hidden @ self.head.T).argmax(-1)
                else:  # the restricted head's argmax, mapped back to its token id
                    proposal, proposal_ids = self.proposal
                    token = proposal_ids[(hidden @ proposal.T).argmax(-1)]
                drafts.append(token)
            mtp.length = length
            rows.append(torch.cat(drafts))
        return torch.stack(rows)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weights["token_embedding"][ids]

    def prefill(self, ids: torch.Tensor, state: SequenceState, all_logits: bool = False) -> torch.Tensor:
        """Logits (fp32) of the last new position `[V]`, or of every new position `[T, V]` with `all_logits`.
        With a drafter the MTP head follows: it takes every (hidden state, next token) pair the new ids complete."""
        ids = ids.to(self.device)
        hidden = self.hidden_states(ids, state)
        if state.mtp is not None:
            before = hidden[:-1] if state.pending is None else torch.cat([state.pending, hidden[:-1]])
            after = ids[1:] if state.pending is None else ids
            if after.numel():
                self.mtp_hidden(before, after, state.mtp)
            state.pending = hidden[-1:]
        last = hidden if all_logits else hidden[-1]
        return (last @ self.head.T).float()

    def hidden_states(self, ids: torch.Tensor, state: SequenceState,
                      collect: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The final-normed hidden states `[T, H]` of the new tokens; with `collect`, each layer's input and
        the final output are appended to it (to locate the first layer that diverges from a reference)."""
        c = self.config
        t = ids.numel()
        start = state.length
        if start + t > state.capacity:
            raise ValueError(f"sequence of {start + t} tokens exceeds the state's capacity of {state.capacity}")
        positions = torch.arange(start, start + t, device=self.device)
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta, list(c.mrope_section)
                                if c.mrope_section else None, dtype=self.dtype)
        x = self.embed(ids.to(self.device))
        for i, kind in enumerate(c.layer_types):
            if collect is not None:
                collect.append(x)
            w = _LayerWeights(self.weights, f"layers/{i}/")
            h = rms_norm(x, w["input_norm"], c.rms_eps)
            if kind == FULL_ATTENTION:
                h = self.attention(h, w, state, i, start, cos, sin)
            else:
                h = self.gated_deltanet(h, w, state, i)
            x = x + h
            h = rms_norm(x, w["post_attention_norm"], c.rms_eps)
            x = x + self.mlp(h, w)
        state.length = start + t
        x = rms_norm(x, self.weights["final_norm"], c.rms_eps)
        if collect is not None:
            collect.append(x)
        return x

    @property
    def has_mtp(self) -> bool:
        return "mtp/input_projection" in self.weights

    def new_mtp_state(self, capacity: int) -> SequenceState:
        """State of the MTP head's own attention layer (its KV cache), one per sequence."""
        c = self.config
        state = SequenceState(capacity)
        state.keys[0] = torch.zeros((capacity, c.kv_heads, c.head_dim), dtype=self.dtype, device=self.device)
        state.values[0] = torch.zeros_like(state.keys[0])
        return state

    def mtp_logits(self, hidden: torch.Tensor, next_ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """The MTP head's logits `[T, V]` for x_{t+2}: `head(mtp_hidden(...))`."""
        return (self.mtp_hidden(hidden, next_ids, state) @ self.head.T).float()

    def mtp_hidden(self, hidden: torch.Tensor, next_ids: torch.Tensor, state: SequenceState) -> torch.Tensor:
        """The MTP head's final-normed output `[T, H]` from the trunk's final-normed hidden states h_t `[T, H]` and
        the next tokens x_{t+1} `[T]`, appended to the head's own sequence `state` (position t for h_t):
            u = input_projection([embedding_norm(embed(x_{t+1})) ; hidden_norm(h_t)])
            u = full-attention decoder layer (mtp/layers/0) over u;  out = final_norm(u)
        The head's logits for x_{t+2} are head(out); a chained draft feeds `out` back as the next h.
        """
        if not self.has_mtp:
            raise ValueError("this artifact has no MTP head")
        c = self.config
        t = hidden.shape[0]
        start = state.length
        if start + t > state.capacity:
            raise ValueError(f"MTP sequence of {start + t} tokens exceeds its capacity of {state.capacity}")
        w = _LayerWeights(self.weights, "mtp/")
        embedded = rms_norm(self.embed(next_ids.to(self.device)), w["embedding_norm"], c.rms_eps)
        u = torch.cat([embedded, rms_norm(hidden, w["hidden_norm"], c.rms_eps)], dim=-1) @ w["input_projection"].T
        positions = torch.arange(start, start + t, device=self.device)
        cos, sin = rope_cos_sin(positions, c.rotary_dim, c.rope_theta, list(c.mrope_section)
                                if c.mrope_section else None, dtype=self.dtype)
        layer = _LayerWeights(self.weights, "mtp/layers/0/")
        u = u + self.attention(rms_norm(u, layer["input_norm"], c.rms_eps), layer, state, 0, start, cos, sin)
        u = u + self.mlp(rms_norm(u, layer["post_attention_norm"], c.rms_eps), layer)
        state.length = start + t
        return rms_norm(u, w["final_norm"], c.rms_eps)

    def attention(self, x: torch.Tensor, w: _LayerWeights, state: SequenceState, layer: int, start: int,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        t, q_rows = x.shape[0], c.heads * c.head_dim
        query_key = x @ w["attention/query_key"].T
        gate_value = x @ w["attention/gate_value"].T
        q = query_key[:, :q_rows].reshape(t, c.heads, c.head_dim)
        k = query_key[:, q_rows:].reshape(t, c.kv_heads, c.head_dim)
        gate = gate_value[:, :q_rows]
        v = gate_value[:, q_rows:].reshape(t, c.kv_heads, c.head_dim)
        q = apply_rope(rms_norm(q, w["attention/query_norm"], c.rms_eps), cos, sin)
        k = apply_rope(rms_norm(k, w["attention/key_norm"], c.rms_eps), cos, sin)
        keys, values = state.keys[layer], state.values[layer]
        keys[start : start + t] = k
        values[start : start + t] = v
        o = causal_attention(q, keys[: start + t], values[: start + t], start, c.head_dim**-0.5)
        o = o.reshape(t, q_rows) * torch.sigmoid(gate)
        return o @ w["attention/output"].T

    def gated_deltanet(self, x: torch.Tensor, w: _LayerWeights, state: SequenceState, layer: int) -> torch.Tensor:
        c = self.config
        t = x.shape[0]
        key_rows, value_rows = c.k_heads * c.k_dim, c.v_heads * c.v_dim
        query_key = x @ w["gdn/query_key"].T
        value_z = x @ w["gdn/value_z"].T
        a_b = x @ w["gdn/a_b_projection"].T
        mixed = torch.cat([query_key, value_z[:, :value_rows]], dim=-1)  # the in_proj_qkv order: q, k, v
        mixed, state.conv[layer] = causal_conv1d(mixed, w["gdn/convolution"], state.conv[layer])
        q = mixed[:, :key_rows].reshape(t, c.k_heads, c.k_dim)
        k = mixed[:, key_rows : 2 * key_rows].reshape(t, c.k_heads, c.k_dim)
        v = mixed[:, 2 * key_rows :].reshape(t, c.v_heads, c.v_dim)
        z = value_z[:, value_rows:].reshape(t, c.v_heads, c.v_dim)
        a, b = a_b[:, : c.v_heads], a_b[:, c.v_heads :]
        beta = torch.sigmoid(b).float()  # in the activation dtype, as transformers rounds it
        g = -torch.exp(w["gdn/a_log"]) * F.softplus(a.float() + w["gdn/dt_bias"])
        q = l2_normalize(q) * c.k_dim**-0.5
        k = l2_normalize(k)
        repeat = c.v_heads // c.k_heads  # value head j reads key head j // repeat
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        rule = gated_delta_rule_chunked if t > 1 else gated_delta_rule_recurrent
        o, state.recurrent[layer] = rule(q, k, v.float(), g, beta, state.recurrent[layer])
        o = rms_norm_gated(o.to(x.dtype), z, w["gdn/norm"], c.rms_eps)
        return o.reshape(t, value_rows) @ w["gdn/output"].T

    def mlp(self, x: torch.Tensor, w: _LayerWeights) -> torch.Tensor:
        if not self.config.moe:
            return swiglu_mlp(x, w["mlp/gate_up"], w["mlp/down"])
        return moe_mlp(x, w["moe/router_shared_gate"], w["moe/routed_gate_up"], w["moe/routed_down"],
                       w["moe/shared_gate_up"], w["moe/shared_down"], self.config.top_k)


def _check_draft_head(weights: dict[str, torch.Tensor], config: TextConfig) -> None:
    """The restricted proposal head's contract (docs/artifact-format.md): both objects, rows of the hidden width,
    one unique id in [0, vocab) per row."""
    if "draft_head" not in weights or "draft_head_token_ids" not in weights:
        raise ValueError("this artifact has no whole draft head (text/draft_head and text/draft_head_token_ids): "
                         "add one with `ninfer draft-head`")
    rows, ids = weights["draft_head"], weights["draft_head_token_ids"]
    if rows.dim() != 2 or rows.shape[1] != config.hidden or ids.shape != (rows.shape[0],):
        raise ValueError(f"draft head of shape {list(rows.shape)} with {list(ids.shape)} ids does not fit hidden "
                         f"size {config.hidden}")
    if ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= config.vocab:
        raise ValueError(f"draft head token ids must be unique and in [0, {config.vocab})")


def _recurrent_part(state: SequenceState) -> tuple:
    """What `accept` needs to put a sequence back after one of its verify tokens: the GDN conv and recurrent state
    (the operations return new tensors, so references suffice), the trunk's last hidden state and the MTP head's
    length."""
    return dict(state.conv), dict(state.recurrent), state.pending, state.mtp.length if state.mtp else 0


class _LayerWeights:
    """`w["attention/query_key"]` reads weights[prefix + "attention/query_key"], prefix e.g. "layers/3/"."""

    def __init__(self, weights: dict[str, torch.Tensor], prefix: str):
        self._weights = weights
        self._prefix = prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._weights[self._prefix + name]
