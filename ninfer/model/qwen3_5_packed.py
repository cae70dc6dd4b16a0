"""The Qwen3.5 text model (dense and MoE) over packed weights on the GPU: the same math as the reference
`Qwen35Model` (the oracle the GPU tests compare it with), read as a plain forward over its layers.

Two routes, both over the sequences' pools (`engine.kv_cache`: paged KV, slot-pooled GDN conv and recurrent state):
  * `step` (decode, verify, short prompt pieces; B sequences × T tokens, device tensors only, no host sync and
    no allocation that outlives it, so the engine's runner can capture it as a CUDA graph): every matrix through
    the Triton GEMV over int8 activations (groupwise) or FP8 rows, the fused residual-add + norm, q/k norm + rotary,
    the paged-KV write and split-K attention, the GDN conv-update and gated-delta-step kernels (with snapshot slots
    for verify steps), MoE routing in one kernel and the experts through the gathering GEMV;
  * `prefill` (T tokens of one sequence, in chunks of `prefill_chunk`): matrices dequantized to a scratch buffer and
    multiplied by cuBLAS, routed experts in one grouped launch per matrix, attention by fused SDPA over the
    sequence's pages, the delta rule by flash-linear-attention's chunked kernel when installed (else the torch
    reference); only the last position goes through the head.
Formats swap the linear layer (`packed_linear.PackedLinear`), never this model. Independent work of a step (the a/b
projection beside v|z, a MoE layer's shared expert, L2 prefetches of the next GEMV's rows) is declared through
`branches.Branches`, which makes it a second graph branch while a step is captured and leaves it in line otherwise.
docs/fast-path.md describes the whole path.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ninfer import flags
from ninfer.artifact.reader import Artifact
from ninfer.kernels.activation_quant import Int8Activations
from ninfer.kernels.attention import prefill_attention
from ninfer.kernels.conv1d import causal_conv1d
from ninfer.kernels.dense_linear import dense_linear_gemv
from ninfer.kernels.fused import add_rms_norm, moe_combine, route_top_k, sigmoid_mul, silu_mul
from ninfer.kernels.gated_delta_rule import gated_delta_rule_chunked, l2_normalize
from ninfer.kernels.gdn_decode import AB_IN_KERNEL_MAX_K, gated_delta_decode
from ninfer.kernels.l2_prefetch import L2Prefetch, prefetch_to_l2
from ninfer.kernels.norm import rms_norm_gated
from ninfer.kernels.paged_attention import paged_attention_decode, qk_norm_rope, write_kv
from ninfer.kernels.quant_linear import MAX_GEMV_TOKENS, group_pairs
from ninfer.kernels.rope import rope_inv_freq
from ninfer.model.branches import Branches
from ninfer.model.config import FULL_ATTENTION, TextConfig
from ninfer.model.packed_linear import PackedLinear, Scratch, is_packed, project, shared_input, shares_launch
from ninfer.model.protocol import PooledSequence

try:  # flash-linear-attention: the chunked delta rule for long prefills (optional GPU dependency)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
except ImportError:  # pragma: no cover - depends on the environment
    chunk_gated_delta_rule = None

FP32_OBJECTS = ("gdn/a_log", "gdn/dt_bias")
DRAFT_HEAD = "text/draft_head"  # `draft_head` and `draft_head_token_ids`: the drafter's restricted proposal head
GDN_PROJECTIONS = ("query_key", "value_z", "a_b_projection")  # the GDN layer's matrices that read its input
STEP_TOKENS = 16  # the most tokens a sequence appends in one `step` (short prompt piece or verify)
MOE_TILE = 16 if flags.triton_interpreted() else 64  # (token, expert) pairs per tile of the grouped MoE prefill


def device_bytes(artifact: Artifact) -> int:
    """Device bytes of the text model's weights on this path: packed formats as stored, other matrices as bf16,
    vectors as stored."""
    total = 0
    for obj in artifact.objects:
        if obj.kind == "tensor" and obj.component == "text" and not obj.id.startswith(DRAFT_HEAD):
            plain_matrix = not is_packed(obj.format) and len(obj.shape) == 2
            total += math.prod(obj.shape) * 2 if plain_matrix else obj.bytes
    return total


def delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial: torch.Tensor, k_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens of one sequence from `initial` `[H, Dk, Dv]` (fp32): q, k `[T, H, Dk]`
    before their L2 norm (already repeated to the value heads), v `[T, H, Dv]`, log-decay g and beta `[T, H]`.
    flash-linear-attention's chunked kernel for bf16/fp16 inputs when installed, else the torch reference
    (`gated_delta_rule_chunked`). Returns (o `[T, H, Dv]`, final state `[H, Dk, Dv]` fp32)."""
    if chunk_gated_delta_rule is not None and q.dtype in (torch.bfloat16, torch.float16) and q.is_cuda:
        o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], scale=k_dim**-0.5,
                                          initial_state=initial[None], output_final_state=True,
                                          use_qk_l2norm_in_kernel=True)
        return o[0], final[0]
    return gated_delta_rule_chunked(l2_normalize(q) * k_dim**-0.5, l2_normalize(k), v.float(), g, beta.float(),
                                    initial)


class PackedQwen35:
    """Qwen3.5 text model over packed weights (see the module docstring). Build with `load`. `cache` holds the
    pools (`engine.kv_cache.KVCache`: `key_pages`, `value_pages`, `key_scales`, `value_scales`, `conv`,
    `recurrent`, `block_tables`, `gdn_index`, `scratch_slot`, `dense_kv`); the model reads and writes them, the
    engine allocates them."""

    def __init__(self, config: TextConfig, linears: dict[str, PackedLinear], vectors: dict[str, torch.Tensor],
                 cache, *, dtype: torch.dtype, prefill_chunk: int, int8_activations: bool = True):
        self.config = config
        self.linears = linears
        self.vectors = vectors
        self.cache = cache
        self.device = cache.device
        self.dtype = dtype
        self.prefill_chunk = prefill_chunk
        self.int8_activations = int8_activations
        self.head = linears["output_head"] if "output_head" in linears else linears["token_embedding"]
        self.inv_freq = rope_inv_freq(config.rotary_dim, config.rope_theta).to(self.device)
        self.offsets = torch.arange(STEP_TOKENS, dtype=torch.int32, device=self.device)  # a step's token offsets
        self.prefetches: dict[tuple[str, ...], L2Prefetch | None] = {}
        self.prefetch_bytes = int(flags.L2_PREFETCH_MIB.get() * 2**20)
        self.branches = Branches(self.device)

    @classmethod
    def load(cls, artifact: Artifact, cache, *, dtype: torch.dtype = torch.bfloat16, prefill_chunk: int = 4096,
             int8_activations: bool = True, progress: bool = False) -> PackedQwen35:
        """Load the text weights onto the cache's device, packed formats as stored. `dtype` is the activation dtype
        (bf16; fp32 serves the CPU tests under the Triton interpreter). `int8_activations=False` gives steps the
        prefill's exact numerics (every product through the decoded weights: slow, and the head's decoded matrix
        needs its size in scratch) — for checking this model against the reference."""
        config = TextConfig.from_dict(artifact.components["text"]["config"])
        device = cache.device
        scratch = Scratch(device, dtype)
        linears, vectors = {}, {}
        objects = [o for o in artifact.objects if o.kind == "tensor" and o.component == "text"
                   and not o.id.startswith(DRAFT_HEAD)]  # the proposal head serves the drafter alone
        for obj in tqdm(objects, desc="loading weights", unit="object", disable=not progress):
            name = obj.id.removeprefix("text/")
            if len(obj.shape) == 2 and not name.endswith("gdn/convolution"):
                linears[name] = PackedLinear(artifact.raw(obj.id).to(device), obj.shape, obj.format, scratch,
                                             whole=name != "token_embedding" and "/moe/routed_" not in name)
            else:
                tensor = artifact.tensor(obj.id, device)
                vectors[name] = tensor.to(torch.float32 if name.endswith(FP32_OBJECTS) else dtype)
        return cls(config, linears, vectors, cache, dtype=dtype, prefill_chunk=prefill_chunk,
                   int8_activations=int8_activations)

    @property
    def weight_bytes(self) -> int:
        return sum(m.nbytes for m in self.linears.values()) + sum(
            t.numel() * t.element_size() for t in self.vectors.values())

    def matrices(self) -> dict[str, tuple[int, int, int]]:
        """Name → (rows, columns, bytes as held) of every weight matrix (speed accounting)."""
        return {name: (*m.shape, m.nbytes) for name, m in self.linears.items()}

    # -- the two routes --------------------------------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, state: PooledSequence, all_logits: bool = False) -> torch.Tensor:
        """Append `ids` `[T]` to one sequence in chunks of `prefill_chunk`: logits (fp32) of the last position
        `[V]` (all new positions `[T, V]` with `all_logits`)."""
        ids = ids.to(self.device)
        outputs = [self._prefill_chunk(chunk, state, all_logits) for chunk in ids.split(self.prefill_chunk)]
        return torch.cat(outputs) if all_logits else outputs[-1]

    def step(self, ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, snapshots: torch.Tensor | None,
             logits: torch.Tensor, *, last_only: bool = False, advance: bool = False) -> torch.Tensor:
        """T tokens appended to each of B sequences in one pass of the decode kernels: `ids` `[B·T]`
        (sequence-major), the sequences' state `slots` `[B]` and lengths before the step `starts` `[B]` (int32,
        on the device; padding rows: the scratch slot from position 0). `snapshots` `[B, T]`: a verify step's GDN
        pool slots that keep the state after every token (None otherwise). The head writes into `logits`: a row
        per token `[B·T, V]`, or with `last_only` (a short prompt piece, B = 1) the last token's `[1, V]`; returns
        that view. `advance`: the live rows' `starts` grow by one (a decode step leaves the next step's lengths in
        place)."""
        batch = slots.numel()
        tokens = ids.numel() // batch
        rows = 1 if last_only else ids.numel()
        # the embedding rows before the fork: a graph with two streams starts its first few kernels and then
        # pauses about 10 µs; forked after the rows, the pause falls less on the main chain
        x = self.linears["token_embedding"].rows(ids)
        with self.branches.beside():  # first needed by the first attention layer (which joins)
            positions = (starts[:, None] + self.offsets[:tokens]).view(-1)
            lengths = positions + 1
            tables = self.cache.block_tables.index_select(0, slots).repeat_interleave(tokens, dim=0)
            if advance:
                starts += slots != self.cache.scratch_slot
        h = self._layers(x, lambda h, i: self._attention_decode(h, i, positions, lengths, tables),
                         lambda h, i: self._gdn_decode(h, i, slots, tokens, snapshots), self.int8_activations)
        if last_only:
            h = h.rows(slice(-1, None)) if isinstance(h, Int8Activations) else h[-1:]
        logits = project(self._input(h, [self.head], self.int8_activations), [self.head], outs=[logits[:rows]])[0]
        self.branches.join()  # the head's prefetch, or positions and tables unused by a model without attention
        return logits

    # -- the layers ------------------------------------------------------------------------------------------

    def _linears(self, readers: list[PackedLinear], x: torch.Tensor, integer: bool,
                 out_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """x through the matrices `readers`: with `integer` (decode and verify steps) the integer GEMV over x's int8
        image, made once for all of them; else the exact route (packed weights decoded for cuBLAS: the prefill's
        numerics)."""
        return project(self._input(x, readers, integer), readers, out_dtype=out_dtype)

    @staticmethod
    def _input(x: torch.Tensor, readers: list[PackedLinear], integer: bool) -> torch.Tensor | Int8Activations:
        """x as the matrices `readers` take it: its int8 image, made once, in decode and verify steps (`integer`)."""
        return shared_input(x, readers) if integer else x

    def _linear(self, reader: PackedLinear, x: torch.Tensor, integer: bool,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._linears([reader], x, integer, out_dtype)[0]

    @staticmethod
    def _quantizes(x: torch.Tensor, integer: bool) -> bool:
        """Whether a kernel making x's rows should also make their int8 records: a decode or verify step's input of
        the integer GEMV (at most MAX_GEMV_TOKENS rows)."""
        return integer and x.shape[0] <= MAX_GEMV_TOKENS

    def _quantizes_for(self, reader: PackedLinear, x: torch.Tensor, integer: bool) -> bool:
        """Whether a kernel making x, the input of `reader` alone, should also make x's int8 records: when `reader`
        takes the integer GEMV."""
        return reader.groupwise and self._quantizes(x, integer)

    def _layers(self, x: torch.Tensor, attention, gdn, integer: bool) -> torch.Tensor:
        """The decoder layers and the final norm over embedded tokens x `[T, H]`; the residual adds are fused into
        the next norm. `attention(h, layer)` / `gdn(h, layer)` are the mixers; `integer`: decode-step numerics
        (int8 activations in the GEMVs, MoE experts gathered per token) rather than the prefill's — then h comes
        as `Int8Activations`, quantized by the norm that made it."""
        c = self.config
        quantize = self._quantizes(x, integer)  # the norms emit the GEMVs' int8 records themselves
        x, h = add_rms_norm(x, None, self.vectors["layers/0/input_norm"], c.rms_eps, quantize)
        for i, kind in enumerate(c.layer_types):
            prefix = f"layers/{i}/"
            mixed = attention(h, i) if kind == FULL_ATTENTION else gdn(h, i)
            self._prefetch([prefix + "mlp/gate_up"])
            x, h = add_rms_norm(x, mixed, self.vectors[prefix + "post_attention_norm"], c.rms_eps, quantize)
            following = f"layers/{i + 1}/input_norm" if i + 1 < c.layers else "final_norm"
            mlp = self._mlp(h, prefix, integer)
            self._prefetch(self._inputs_of(i + 1))
            x, h = add_rms_norm(x, mlp, self.vectors[following], c.rms_eps, quantize)
        return h

    def _inputs_of(self, layer: int) -> list[str]:
        """The matrices that read layer `layer`'s normed input (the head's after the last layer)."""
        c = self.config
        if layer == c.layers:
            return ["output_head" if "output_head" in self.linears else "token_embedding"]
        if c.layer_types[layer] == FULL_ATTENTION:
            return [f"layers/{layer}/attention/{n}" for n in ("query_key", "gate_value")]
        return [f"layers/{layer}/gdn/{n}" for n in GDN_PROJECTIONS[:2]]

    def _prefetch(self, names: list[str]) -> None:
        """In a captured step, stream the first `prefetch_bytes` of the packed matrices `names` (those present)
        into L2 in the step's second branch, from when the kernels launched so far have finished: the small kernels
        launched next run meanwhile, and the GEMV after them reads those rows from L2 (`kernels.l2_prefetch`)."""
        if not (self.prefetch_bytes and self.branches.side is not None):
            return
        key = tuple(names)
        if key not in self.prefetches:  # made by the eager step before a capture (its ranges are a host copy)
            packed = [self.linears[n] for n in names if n in self.linears and self.linears[n].packed]
            self.prefetches[key] = L2Prefetch([(m.data, m.shape, m.format) for m in packed],
                                              self.prefetch_bytes) if packed else None
        if self.prefetches[key] is not None and self.branches.active:
            with self.branches.beside():
                prefetch_to_l2(self.prefetches[key])

    def _attention_inputs(self, h: torch.Tensor, layer: int, positions: torch.Tensor, tables: torch.Tensor,
                          integer: bool) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """An attention layer up to its scores, for T rows at `positions`: the query/key and gate/value
        projections, q/k norm + rotary, and the new keys and values written into the pages of `tables` `[T, ·]`.
        Returns q `[T, heads, hd]`, the output gate `[T, heads·hd]` and the layer's (key, value, scale) pools."""
        c, cache = self.config, self.cache
        prefix = f"layers/{layer}/attention/"
        q_rows = c.heads * c.head_dim
        readers = [self.linears[prefix + n] for n in ("query_key", "gate_value")]
        source = self._input(h, readers, integer)
        if shares_launch(source, *readers):
            query_key, gate_value = project(source, readers)
        else:  # two launches: q|k beside gate|v
            with self.branches.beside(self._independent(source, readers)):
                query_key = project(source, readers[:1])[0]
            gate_value = project(source, readers[1:])[0]
        self.branches.join()  # q|k, and the step's positions and block tables
        self._prefetch([prefix + "output"])
        q, k = qk_norm_rope(query_key, self.vectors[prefix + "query_norm"], self.vectors[prefix + "key_norm"],
                            positions, c.heads, c.kv_heads, c.head_dim, c.rotary_dim, self.inv_freq, c.rms_eps)
        v = gate_value[:, q_rows:].view(h.shape[0], c.kv_heads, c.head_dim)
        pools = (cache.key_pages[layer], cache.value_pages[layer], cache.key_scales.get(layer),
                 cache.value_scales.get(layer))
        write_kv(k, v, *pools, tables, positions)
        return q, gate_value[:, :q_rows], pools

    def _attention_decode(self, h: torch.Tensor, layer: int, positions: torch.Tensor, lengths: torch.Tensor,
                          tables: torch.Tensor) -> torch.Tensor:
        c, cache = self.config, self.cache
        q, gate, pools = self._attention_inputs(h, layer, positions, tables, self.int8_activations)
        output = self.linears[f"layers/{layer}/attention/output"]
        # the output gate (and the output projection's int8 records) applied by the kernel that writes the output
        gated = paged_attention_decode(q, *pools, tables, lengths, c.head_dim**-0.5,
                                       max_length=cache.max_pages * cache.page, gate=gate,
                                       quantize=self._quantizes_for(output, gate, self.int8_activations))
        return self._linear(output, gated, self.int8_activations)

    def _gdn_decode(self, h: torch.Tensor, layer: int, slots: torch.Tensor, tokens: int = 1,
                    snapshots: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        prefix = f"layers/{layer}/gdn/"
        value_rows = c.v_heads * c.v_dim
        query_key, value_z, a_b = (self.linears[prefix + n] for n in GDN_PROJECTIONS)
        output = self.linears[prefix + "output"]
        key_columns = query_key.shape[0]
        # q | k and v | z side by side in one buffer: the conv reads q | k | v as one row view
        projected = torch.empty((h.shape[0], key_columns + value_z.shape[0]), dtype=self.dtype, device=self.device)
        source = self._input(h, [query_key, value_z, a_b], self.int8_activations)
        outs = [projected[:, :key_columns], projected[:, key_columns:]]
        one_launch = shares_launch(source, query_key, value_z)
        # the a/b projection, and q|k when it has a launch of its own, beside v|z
        with self.branches.beside(self._independent(source, [query_key, value_z, a_b])):
            if not one_launch:
                project(source, [query_key], outs[:1])
            a_b = self._gdn_a_b(source, a_b)
        project(source, [query_key, value_z] if one_launch else [value_z], outs if one_launch else outs[1:])

        def joined() -> None:
            self.branches.join()
            self._prefetch([prefix + "output"])

        # the branch's a/b is first read by the delta rule: with q|k in v|z's launch, the conv (a launch of its own
        # above one sequence) reads nothing from the branch and runs before the join, under PDL; else q|k, made in
        # the branch, is the conv's input too
        if not one_launch:
            joined()

        index = self.cache.gdn_index[layer]
        o = gated_delta_decode(projected[:, : key_columns + value_rows], projected[:, key_columns + value_rows :], a_b,
                               self.vectors[prefix + "convolution"], self.cache.conv[index],
                               self.vectors[prefix + "a_log"], self.vectors[prefix + "dt_bias"],
                               self.vectors[prefix + "norm"], self.cache.recurrent[index], slots, c.k_heads, c.k_dim,
                               c.v_heads, c.v_dim, c.rms_eps, tokens=tokens, snapshot_slots=snapshots,
                               quantize=self._quantizes_for(output, projected, self.int8_activations),
                               before_delta_rule=joined if one_launch else None)
        return self._linear(output, o, self.int8_activations)

    @staticmethod
    def _independent(x: torch.Tensor | Int8Activations, readers: list[PackedLinear]) -> bool:
        """Whether products of x (or of inputs of its rows) by `readers` may run in two graph branches: none of them
        decodes its matrix into the one scratch buffer (decode steps of more than MAX_GEMV_TOKENS rows do, as do
        steps with exact activations)."""
        return not any(reader.route(x) == "scratch" for reader in readers)

    def _gdn_a_b(self, source: torch.Tensor | Int8Activations,
                 reader: PackedLinear) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The GDN a/b projection of a step's rows, or the pair (x, W) for the delta-rule kernel to compute it. A
        dense a/b (the 27B's 0.5 M bf16 elements) takes the dense GEMV's fixed-order sums on either route, so a
        token's bits never depend on the batch. One row computes it in the delta-rule launch (one launch fewer),
        unless the step runs it in a graph branch of its own (`Branches`), beside the input projections; more rows
        always take the GEMV, since the kernel's programs would each read the rows again (one per column tile)."""
        if reader.weight is None or reader.shape[1] > AB_IN_KERNEL_MAX_K or source.shape[0] > MAX_GEMV_TOKENS:
            return reader(source)
        x = (source.source if isinstance(source, Int8Activations) else source).to(reader.weight.dtype)
        if x.shape[0] == 1 and self.branches.side is None:
            return x, reader.weight
        return dense_linear_gemv(x, reader.weight, self.dtype, pairwise=True)

    def _mlp(self, h: torch.Tensor, prefix: str, integer: bool) -> torch.Tensor:
        """SwiGLU MLP or sparse MoE. With `integer` (decode, verify) every (token, expert) pair goes through the
        gathering GEMV (no host sync: graph-capturable), else tokens are grouped by expert (`_moe_prefill`)."""
        c = self.config
        if not c.moe:
            gate_up = self._linear(self.linears[prefix + "mlp/gate_up"], h, integer)
            self._prefetch([prefix + "mlp/down"])
            down = self.linears[prefix + "mlp/down"]
            return self._linear(down, silu_mul(gate_up, self._quantizes_for(down, gate_up, integer), down.stripes),
                                integer)
        routed_gate_up = self.linears[prefix + "moe/routed_gate_up"]
        routed_down = self.linears[prefix + "moe/routed_down"]
        readers = [self.linears[prefix + "moe/router_shared_gate"], self.linears[prefix + "moe/shared_gate_up"]]
        source = self._input(h, [*readers, routed_gate_up], integer)
        shared_down = self.linears[prefix + "moe/shared_down"]
        # the shared expert beside the routing and the routed experts
        with self.branches.beside(self._independent(source, [*readers, routed_gate_up, shared_down, routed_down])):
            shared_gate_up = readers[1](source)
            shared = self._linear(shared_down, silu_mul(shared_gate_up, self._quantizes_for(
                shared_down, shared_gate_up, integer)), integer)
        logits = readers[0](source)
        weights, ids = route_top_k(logits, c.experts, c.top_k)
        if integer:
            flat = ids.reshape(-1)
            activation = silu_mul(routed_gate_up.gather(source, flat, 2 * c.expert_width, c.top_k),
                                  quantize=routed_down.groupwise)
            routed = routed_down.gather(activation, flat, c.hidden, 1)
        else:
            routed = self._moe_prefill(h, ids, routed_gate_up, routed_down)
        self.branches.join()
        return moe_combine(routed, weights, shared, logits[:, c.experts :])

    def _moe_prefill(self, h: torch.Tensor, ids: torch.Tensor, routed_gate_up: PackedLinear,
                     routed_down: PackedLinear) -> torch.Tensor:
        """Routed experts for many tokens: `[T·k, H]`, row t·k + j = token t through its j-th expert, unweighted.
        Groupwise experts: pairs tiled by expert on the device (`group_pairs`), one grouped launch per matrix.
        Other formats (bf16, fp8 rows): one cuBLAS product per expert hit (the expert counts come to the host once per
        layer; prefill is never graph-captured)."""
        c = self.config
        width = c.expert_width
        pairs = ids.numel()
        if routed_gate_up.groupwise and routed_down.groupwise:
            plan = group_pairs(ids, c.experts, MOE_TILE)
            activation = silu_mul(routed_gate_up.grouped(h, plan, pairs, 2 * width, c.top_k))
            return routed_down.grouped(activation, plan, pairs, c.hidden, 1)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=c.experts).tolist()
        out = torch.empty((pairs, c.hidden), dtype=h.dtype, device=h.device)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            chosen = order[start : start + count]
            start += count
            activation = silu_mul(routed_gate_up.block(h[chosen // c.top_k], expert * 2 * width, 2 * width))
            out[chosen] = routed_down.block(activation, expert * c.hidden, c.hidden)
        return out

    # -- prefill ---------------------------------------------------------------------------------------------

    def _prefill_chunk(self, ids: torch.Tensor, state: PooledSequence, all_logits: bool) -> torch.Tensor:
        start, tokens = state.length, ids.numel()
        positions = torch.arange(start, start + tokens, device=self.device, dtype=torch.int32)
        x = self.linears["token_embedding"].rows(ids.to(torch.int32))
        h = self._layers(x, lambda h, i: self._attention_prefill(h, i, state, positions),
                         lambda h, i: self._gdn_prefill(h, i, state), integer=False)
        state.length = start + tokens
        # the head reads one row (or few): the integer GEMV, as in decode steps, not a dequantized vocabulary matrix
        logits = self._linear(self.head, h if all_logits else h[-1:], self.int8_activations, torch.float32)
        return logits if all_logits else logits[0]

    def _attention_prefill(self, h: torch.Tensor, layer: int, state: PooledSequence,
                           positions: torch.Tensor) -> torch.Tensor:
        c, cache = self.config, self.cache
        tokens = h.shape[0]
        tables = cache.block_tables[state.slot : state.slot + 1].expand(tokens, -1)
        q, gate, _ = self._attention_inputs(h, layer, positions, tables, integer=False)
        start = state.length
        keys, values = cache.dense_kv(layer, state, start + tokens, q.dtype)
        o = prefill_attention(q, keys, values, start, c.head_dim**-0.5).reshape(tokens, -1)
        return self.linears[f"layers/{layer}/attention/output"](sigmoid_mul(o, gate))

    def _gdn_prefill(self, h: torch.Tensor, layer: int, state: PooledSequence) -> torch.Tensor:
        c, cache = self.config, self.cache
        prefix = f"layers/{layer}/gdn/"
        tokens = h.shape[0]
        key_rows, value_rows = c.k_heads * c.k_dim, c.v_heads * c.v_dim
        query_key, value_z, a_b = self._linears([self.linears[prefix + n] for n in GDN_PROJECTIONS], h, integer=False)
        index = cache.gdn_index[layer]
        mixed, window = causal_conv1d(torch.cat([query_key, value_z[:, :value_rows]], dim=1),
                                      self.vectors[prefix + "convolution"], cache.conv[index, state.slot])
        cache.conv[index, state.slot] = window
        q = mixed[:, :key_rows].reshape(tokens, c.k_heads, c.k_dim)
        k = mixed[:, key_rows : 2 * key_rows].reshape(tokens, c.k_heads, c.k_dim)
        v = mixed[:, 2 * key_rows :].reshape(tokens, c.v_heads, c.v_dim)
        a, b = a_b[:, : c.v_heads], a_b[:, c.v_heads :]
        beta = torch.sigmoid(b)
        g = -torch.exp(self.vectors[prefix + "a_log"]) * F.softplus(a.float() + self.vectors[prefix + "dt_bias"])
        repeat = c.v_heads // c.k_heads
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
        o, final = delta_rule_prefill(q, k, v, g, beta, cache.recurrent[index, state.slot].float(), c.k_dim)
        cache.recurrent[index, state.slot] = final  # rounded to a bf16 pool's dtype
        o = rms_norm_gated(o.to(h.dtype), value_z[:, value_rows:].reshape(tokens, c.v_heads, c.v_dim),
                           self.vectors[prefix + "norm"], c.rms_eps)
        return self.linears[prefix + "output"](o.reshape(tokens, value_rows))
