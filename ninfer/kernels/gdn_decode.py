"""The Gated DeltaNet decode step for a batch: T = 1..16 new tokens per sequence (T > 1: speculative verify), each
sequence's conv window and recurrent state in a pool slot.

`gated_delta_decode`, the fused few-token form of the torch reference path of `Qwen35Model.gated_deltanet` from the
input projections on, in two Triton launches (three above FUSED_CONV_SEQUENCES sequences, the conv apart):
  * the delta rule: `causal_conv1d` of each program's channels from its pooled window, q/k L2 norm, the gates and T
    steps of the gated delta rule on the sequence's recurrent state (kept in registers between tokens, written back
    at the end; programs own column tiles of a head's state);
  * the gated RMSNorm of each output (optionally writing the int8 records of the output projection's input), and
    the windows shifted past the new inputs.
With `snapshot_slots` `[B, T]`, they also write the window and the state after every token t into pool slot
snapshot_slots[b, t]: a verify step that accepts j of T draft tokens resumes from snapshot j - 1 (the recurrent
state cannot be cut back).
Rows address the pools through `slots` (a device tensor, never read on the host) and nothing but the outputs is
allocated, so a step can be captured in a CUDA graph (after a first, compiling call). Slots must be distinct
within a call: two rows on one slot race. Under TRITON_INTERPRET=1 they run on the CPU (fp32 tested there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ninfer.kernels import tuning
from ninfer.kernels.activation_quant import Int8Activations, empty_records, quantize_activations
from ninfer.kernels.dependent_launch import launch_options, wait_for_inputs

try:  # Triton is optional: the CPU path never needs it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

if triton is not None:
    from ninfer.kernels.activation_quant import store_tile_records
    from ninfer.kernels.fixed_order import pairwise_row_sum

L2_EPS = 1e-6  # transformers' l2norm: eps on the sum of squares (ninfer.kernels.gated_delta_rule.l2_normalize)
# a dense a/b projection up to this K is computed in the delta-rule launch (the head's two rows and the input row
# in registers beside the state tile)
AB_IN_KERNEL_MAX_K = 8192
# steps of up to this many sequences make the conv in the delta-rule launch (one launch fewer); larger ones in a
# launch of its own: at the 27B shapes on the H200 that is faster at one sequence and slower at 8, where the 1,536
# delta-rule programs each making its conv cost more than the launch. Either way a token gets the same bits.
FUSED_CONV_SEQUENCES = 1


if triton is not None:

    @triton.jit
    def _conv_window(window, weights, stride_s_k, stride_w_k, ok, K: tl.constexpr):
        """The conv window of some channels (`window`, `weights`: pointer tensors to their first column): its K − 1
        past inputs as stored, oldest first, and the K taps in fp32 (tuples grow by concatenation: Triton 3.6's
        frontend has no starred expressions)."""
        taps = ()
        for j in tl.static_range(K):
            taps = taps + (tl.load(weights + j * stride_w_k, mask=ok, other=0.0).to(tl.float32),)  # noqa: RUF005
        return _load_window(window, stride_s_k, ok, K), taps

    @triton.jit
    def _load_window(window, stride_s_k, ok, K: tl.constexpr):
        """The K − 1 inputs of the window at `window` (pointers to its first column), oldest first, as stored."""
        past = ()
        for j in tl.static_range(K - 1):
            past = past + (tl.load(window + j * stride_s_k, mask=ok, other=0.0),)  # noqa: RUF005
        return past

    @triton.jit
    def _store_window(window, past, stride_s_k, ok, K: tl.constexpr):
        """The K − 1 inputs `past` (oldest first) as the window at `window` (pointers to its first column)."""
        for j in tl.static_range(K - 1):
            tl.store(window + j * stride_s_k, past[j], mask=ok)

    @triton.jit
    def _conv_token(x, past, taps, K: tl.constexpr):
        """One token of the depthwise causal conv: silu(w[K-1] · x + Σ_j w[j] · past[j]) in fp32, in that order,
        and the window shifted by x (the newest input last). Every product is rounded where the code says so (FMAs
        written out, the silu product as `fma(a, b, 0)`), so no variant of the kernel that inlines this fuses it
        into what follows: the one-token and T-token launches give the same bits (`kernels.fixed_order`)."""
        acc = taps[K - 1] * x.to(tl.float32)
        for j in tl.static_range(K - 1):
            acc = tl.fma(taps[j], past[j].to(tl.float32), acc)
        return tl.fma(acc, tl.sigmoid(acc), 0.0), past[1:] + (x,)  # noqa: RUF005

    @triton.jit
    def _conv_kernel(x_ptr, weight_ptr, state_ptr, slot_ptr, snapshot_ptr, out_ptr, C, stride_x, stride_w_c,
                     stride_w_k, stride_s_slot, stride_s_c, stride_s_k, stride_out, K: tl.constexpr,
                     BLOCK_C: tl.constexpr, T: tl.constexpr, SNAPSHOTS: tl.constexpr, PDL: tl.constexpr):
        """The conv of steps above FUSED_CONV_SEQUENCES: BLOCK_C channels of one sequence's T tokens, the window
        read once and moved through registers, written back (and to the snapshots) as the norm launch does it."""
        wait_for_inputs(PDL)
        sequence = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = cols < C
        window = state_ptr + tl.load(slot_ptr + sequence).to(tl.int64) * stride_s_slot + cols * stride_s_c
        past, taps = _conv_window(window, weight_ptr + cols * stride_w_c, stride_s_k, stride_w_k, ok, K)
        for t in tl.static_range(T):
            row = sequence * T + t
            out, past = _conv_token(tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0), past, taps, K)
            tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)
            if SNAPSHOTS:
                snapshot = state_ptr + tl.load(snapshot_ptr + row).to(tl.int64) * stride_s_slot + cols * stride_s_c
                _store_window(snapshot, past, stride_s_k, ok, K)
        _store_window(window, past, stride_s_k, ok, K)

    @triton.jit
    def _gated_delta_decode_kernel(x_ptr, conv_w_ptr, conv_ptr, a_b_ptr, ab_x_ptr, ab_w_ptr, a_log_ptr, dt_bias_ptr,
                                   state_ptr, slot_ptr, snapshot_ptr, o_ptr, stride_x, stride_w_c, stride_w_k,
                                   stride_c_slot, stride_c_c, stride_c_k, stride_a_b, stride_ab_x, stride_ab_w,
                                   stride_o, stride_s_slot, stride_s_head, stride_s_k, stride_s_v, q_scale, AB_K,
                                   K_HEADS: tl.constexpr, K_DIM: tl.constexpr, V_HEADS: tl.constexpr,
                                   V_DIM: tl.constexpr, CONV_K: tl.constexpr, BLOCK_K: tl.constexpr,
                                   BLOCK_V: tl.constexpr, L2_EPS: tl.constexpr, SNAPSHOTS: tl.constexpr,
                                   T: tl.constexpr, CONV: tl.constexpr, AB_DOT: tl.constexpr,
                                   AB_BLOCK: tl.constexpr, EARLY_STATE: tl.constexpr, PDL: tl.constexpr):
        if not EARLY_STATE:
            wait_for_inputs(PDL)
        # one program: BLOCK_V state columns of one value head of one sequence (the columns evolve independently)
        sequence = tl.program_id(0)
        head = tl.program_id(1)  # value head; it reads key head head // (V_HEADS // K_HEADS)
        key_head = head // (V_HEADS // K_HEADS)
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < K_DIM
        vs = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = vs < V_DIM

        a_log = tl.load(a_log_ptr + head).to(tl.float32)
        dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
        slot = tl.load(slot_ptr + sequence).to(tl.int64)
        head_tile = head * stride_s_head + ks[:, None] * stride_s_k + vs[None, :] * stride_s_v
        tile = state_ptr + slot * stride_s_slot + head_tile
        tile_ok = k_ok[:, None] & v_ok[None, :]
        S = tl.load(tile, mask=tile_ok, other=0.0).to(tl.float32)  # fp32 in registers whatever the pool holds
        # with CONV the conv of the program's channels — its key head's q and k, its value columns — from their
        # windows (the q / k conv is made by every program that reads the key head; the norm launch moves the windows
        # on); else x is the conv's output
        q_channels = key_head * K_DIM + ks
        k_channels = (K_HEADS + key_head) * K_DIM + ks
        v_channels = 2 * K_HEADS * K_DIM + head * V_DIM + vs
        if CONV:
            window = conv_ptr + slot * stride_c_slot
            q_past, q_taps = _conv_window(window + q_channels * stride_c_c, conv_w_ptr + q_channels * stride_w_c,
                                          stride_c_k, stride_w_k, k_ok, CONV_K)
            k_past, k_taps = _conv_window(window + k_channels * stride_c_c, conv_w_ptr + k_channels * stride_w_c,
                                          stride_c_k, stride_w_k, k_ok, CONV_K)
            v_past, v_taps = _conv_window(window + v_channels * stride_c_c, conv_w_ptr + v_channels * stride_w_c,
                                          stride_c_k, stride_w_k, v_ok, CONV_K)
        if EARLY_STATE:  # the tile and windows streamed in while the kernel before finished (`gated_delta_decode`)
            wait_for_inputs(PDL)
        dtype = o_ptr.dtype.element_ty
        state_dtype = state_ptr.dtype.element_ty
        for t in tl.static_range(T):  # unrolled: a runtime loop carrying S spills more registers
            row = sequence * T + t
            inputs = x_ptr + row * stride_x
            q = tl.load(inputs + q_channels, mask=k_ok, other=0.0)
            k = tl.load(inputs + k_channels, mask=k_ok, other=0.0)
            v = tl.load(inputs + v_channels, mask=v_ok, other=0.0)
            if CONV:  # the conv outputs rounded to the activation dtype, as the conv launch stores them
                q, q_past = _conv_token(q, q_past, q_taps, CONV_K)
                k, k_past = _conv_token(k, k_past, k_taps, CONV_K)
                v, v_past = _conv_token(v, v_past, v_taps, CONV_K)
            q = q.to(dtype).to(tl.float32)
            k = k.to(dtype).to(tl.float32)
            v = v.to(dtype).to(tl.float32)
            q = q * tl.rsqrt(tl.sum(q * q, 0) + L2_EPS) * q_scale
            k = k * tl.rsqrt(tl.sum(k * k, 0) + L2_EPS)

            if AB_DOT:  # the head's a and b rows of the projection, read with the row's input in one wave
                lanes = tl.arange(0, AB_BLOCK)
                ab_rows = tl.where(tl.arange(0, 2) == 0, head, V_HEADS + head)
                w = tl.load(ab_w_ptr + ab_rows[:, None] * stride_ab_w + lanes[None, :], mask=(lanes < AB_K)[None, :],
                            other=0.0)
                x_row = tl.load(ab_x_ptr + row * stride_ab_x + lanes, mask=lanes < AB_K, other=0.0)
                # the dense GEMV's bits (`dense_linear_gemv(pairwise=True)`), rounded as its output
                products = tl.fma(w.to(tl.float32), x_row.to(tl.float32)[None, :], tl.zeros([2, AB_BLOCK], tl.float32))
                a_b = pairwise_row_sum(products, AB_BLOCK).to(dtype)
                a = tl.sum(tl.where(tl.arange(0, 2) == 0, a_b, 0.0), 0).to(tl.float32)
                b = tl.sum(tl.where(tl.arange(0, 2) == 1, a_b, 0.0), 0).to(dtype)
            else:
                a = tl.load(a_b_ptr + row * stride_a_b + head).to(tl.float32)
                b = tl.load(a_b_ptr + row * stride_a_b + V_HEADS + head)
            beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)  # rounded like the reference's sigmoid
            x = a + dt_bias
            softplus = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x))))  # torch's cut
            g = -tl.exp(a_log) * softplus

            S = S * tl.exp(g)
            error = v - tl.sum(k[:, None] * S, 0)
            S += k[:, None] * (error * beta)[None, :]
            if SNAPSHOTS:
                snapshot = tl.load(snapshot_ptr + row).to(tl.int64)
                tl.store(state_ptr + snapshot * stride_s_slot + head_tile, S.to(state_dtype), mask=tile_ok)
            o = tl.sum(q[:, None] * S, 0)
            # a bf16 pool's state is rounded as stored after every token, so that the next token of a several-token
            # call starts where a one-token call would (no-op for fp32)
            S = S.to(state_dtype).to(tl.float32)
            tl.store(o_ptr + row * stride_o + head * V_DIM + vs, o.to(dtype), mask=v_ok)
        tl.store(tile, S.to(state_dtype), mask=tile_ok)

    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, norm_weight_ptr, out_ptr, records_ptr, x_ptr, conv_ptr, slot_ptr,
                           snapshot_ptr, stride_o, stride_z, stride_out, stride_x, stride_c_slot, stride_c_c,
                           stride_c_k, eps, record_count, C, V_HEADS: tl.constexpr, V_DIM: tl.constexpr,
                           HEADS: tl.constexpr, BLOCK_V: tl.constexpr, ROUND_NORM_PRODUCT: tl.constexpr,
                           QUANTIZE: tl.constexpr, WINDOWS: tl.constexpr, CONV_K: tl.constexpr,
                           BLOCK_C: tl.constexpr, T: tl.constexpr, SNAPSHOTS: tl.constexpr, PDL: tl.constexpr):
        vs = tl.arange(0, BLOCK_V)
        norm_weight = tl.load(norm_weight_ptr + vs, mask=vs < V_DIM, other=0.0)  # no kernel writes it: read early
        row = tl.program_id(0).to(tl.int64)
        if WINDOWS:  # the conv windows move on here, once every delta-rule program has read them: the program of a
            # sequence's last row shifts channels [program_id(1) · BLOCK_C, …) of its window past its T new inputs
            sequence = row // T
            cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
            window_ok = cols < tl.where(row % T == T - 1, C, 0)  # the other rows' programs skip this part
            window = conv_ptr + tl.load(slot_ptr + sequence).to(tl.int64) * stride_c_slot + cols * stride_c_c
            past = _load_window(window, stride_c_k, window_ok, CONV_K)  # before the wait (`gated_delta_decode`: why)
            if T == 1:  # one new input: it too streams in while the delta rule runs
                new_input = tl.load(x_ptr + row * stride_x + cols, mask=window_ok, other=0.0)
        wait_for_inputs(PDL)
        if WINDOWS:
            for t in tl.static_range(T):
                if T > 1:
                    new_input = tl.load(x_ptr + (sequence * T + t) * stride_x + cols, mask=window_ok, other=0.0)
                past = past[1:] + (new_input,)  # noqa: RUF005 (shift left: the new input is the newest column)
                if SNAPSHOTS:
                    snapshot = tl.load(snapshot_ptr + sequence * T + t).to(tl.int64)
                    _store_window(conv_ptr + snapshot * stride_c_slot + cols * stride_c_c, past, stride_c_k,
                                  window_ok, CONV_K)
            _store_window(window, past, stride_c_k, window_ok, CONV_K)
        # HEADS value heads of one row: rms_norm_gated per head, and with QUANTIZE (V_DIM a multiple of 32, so a
        # head is whole int8 blocks) the output's records
        heads = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
        ok = (heads < V_HEADS)[:, None] & (vs < V_DIM)[None, :]
        lanes = heads[:, None] * V_DIM + vs[None, :]
        o = tl.load(o_ptr + row * stride_o + lanes, mask=ok, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        # rms_norm_gated with its casts: x̂ rounded to the activation dtype, times the weight (rounded when torch
        # would multiply in the activation dtype), times silu(z) in fp32, rounded once more
        x_hat = (o * tl.rsqrt(tl.sum(o * o, 1) / V_DIM + eps)[:, None]).to(dtype).to(tl.float32)
        y = norm_weight.to(tl.float32)[None, :] * x_hat
        if ROUND_NORM_PRODUCT:
            y = y.to(dtype).to(tl.float32)
        z = tl.load(z_ptr + row * stride_z + lanes, mask=ok, other=0.0).to(tl.float32)
        y = (y * (z * tl.sigmoid(z))).to(dtype)
        tl.store(out_ptr + row * stride_out + lanes, y, mask=ok)
        if QUANTIZE:
            store_tile_records(y, records_ptr, row, record_count, HEADS * BLOCK_V)


def _require_triton(name: str) -> None:
    if triton is None:
        raise RuntimeError(f"{name} needs the triton package (pip install triton), or use the torch reference path")


def _check_rows(name: str, what: str, t: Tensor, rows: int, cols: int) -> None:
    if t.dim() != 2 or t.shape != (rows, cols) or t.stride(1) != 1:
        raise ValueError(f"{name}: {what} must be [{rows}, {cols}] with unit column stride, got {list(t.shape)} "
                         f"strides {list(t.stride())}")


def _check_slots(name: str, slots: Tensor, rows: int, device: torch.device) -> None:
    if slots.shape != (rows,) or slots.dtype not in (torch.int32, torch.int64) or slots.device != device:
        raise ValueError(f"{name}: slots must be int32/int64 [{rows}] on {device}, got {slots.dtype} "
                         f"{list(slots.shape)} on {slots.device}")


def _check_snapshots(name: str, snapshots: Tensor | None, sequences: int, tokens: int, device: torch.device) -> None:
    if snapshots is None:
        return
    if snapshots.shape != (sequences, tokens) or snapshots.dtype not in (torch.int32, torch.int64) or \
            snapshots.device != device or not snapshots.is_contiguous():
        raise ValueError(f"{name}: snapshot_slots must be contiguous int32/int64 [{sequences}, {tokens}] on {device}, "
                         f"got {snapshots.dtype} {list(snapshots.shape)} on {snapshots.device}")


def gated_delta_decode(x: Tensor, z: Tensor, a_b: Tensor | tuple[Tensor, Tensor], conv_weight: Tensor,
                       conv_state: Tensor, a_log: Tensor, dt_bias: Tensor, norm_weight: Tensor, state: Tensor,
                       slots: Tensor, k_heads: int, k_dim: int, v_heads: int, v_dim: int, eps: float, tokens: int = 1,
                       snapshot_slots: Tensor | None = None, quantize: bool = False,
                       before_delta_rule: Callable[[], None] | None = None) -> Tensor | Int8Activations:
    """`tokens` Gated DeltaNet tokens per sequence from the input projections: the causal conv on the pooled windows,
    gates, delta-rule steps on the pooled state, gated norm. Rows b·T … b·T + T − 1 are sequence b's tokens in
    order; each row is one step below.

    Math, per row b (window u = conv_state[slots[b]] `[C, K-1]`, oldest input first, extended by each token in turn)
    and value head j (key head i = j // (v_heads // k_heads)), as the reference path of `Qwen35Model.gated_deltanet`
    for T = 1, everything fp32 unless said:
        mixed[c] = silu(Σ_{m<K-1} w[c, m] · u[c, m] + w[c, K-1] · x[b, c]) rounded to x's dtype   (`causal_conv1d`)
        q = l2_normalize(q_i) · k_dim^-0.5,  k = l2_normalize(k_i)        (q | k | v = mixed; eps 1e-6 on Σ squares)
        beta = sigmoid(b_j) rounded to a_b's dtype;  g = −exp(a_log_j) · softplus(a_j + dt_bias_j)
        S = S · exp(g);  S += k ⊗ ((v_j − kᵀS) · beta);  o = qᵀS             (S = state[slots[b], j])
        out_j = rms_norm_gated(o rounded to x's dtype, z_j, norm_weight, eps)   (its casts included)
    Effect: `conv_state[slots[b]]` holds the window after the sequence's last token (exact copies of inputs) and
    `state[slots[b], j]` S after it; with `snapshot_slots` `[B, T]`, the window and S after token t are also
    written to conv_state[snapshot_slots[b, t]] and state[snapshot_slots[b, t], j]; nothing else in the pools is
    touched.

    Shapes: x `[B·T, 2·k_heads·k_dim + v_heads·v_dim]` (q | k | v before the conv, C channels) fp32/bf16/fp16; z
    `[B·T, v_heads·v_dim]`; a_b either the projection's output `[B·T, 2·v_heads]` (a | b) or, to compute it in
    the delta-rule launch, the pair (x `[B·T, H]`, W `[2·v_heads, H]`, one dtype, H ≤ AB_IN_KERNEL_MAX_K): a_b =
    x · Wᵀ in fp32 with the fixed-order sums of `dense_linear_gemv(x, W, pairwise=True)` (the same bits), rounded
    to x's dtype — each with unit column stride, row views fine; conv_weight `[C, K]`, K ≥ 2, any float dtype;
    conv_state `[S, C, K-1]` in x's dtype (any strides); a_log, dt_bias `[v_heads]`; norm_weight `[v_dim]`; state
    `[S, v_heads, k_dim, v_dim]` fp32 or bf16 (any strides: a bf16 pool is read into fp32, and S is rounded to
    bf16 after every token, as stored, before the next token reads it; o is read from S before that rounding);
    slots `[B]` int32/int64; slots and snapshot slots all distinct, in [0, S) of both pools (not checked: no host
    sync); v_heads a multiple of k_heads. All on one device. Returns out `[B·T, v_heads·v_dim]` in x's dtype; with
    `quantize`, as `Int8Activations` (the output projection's input: its records made by the norm kernel when v_dim
    is a multiple of 32, else by the quantizer).

    Up to FUSED_CONV_SEQUENCES sequences, two launches. The delta rule over (sequence, value head, `delta_block_v` state
    columns: `tuning.GatedDeltaTuning`) — a column of S evolves on its own, so a head's [k_dim, v_dim] state splits into
    independent column tiles — makes the conv of the channels it reads from their windows (a key head's q / k conv in
    each program that reads it) and writes o; it does not write the windows, since other programs still read them. The
    gated norm over whole heads (it needs all of a head's o) writes the int8 records and moves the windows on, once
    every delta-rule program is done. More sequences take three: the conv in a launch of its own (which moves the
    windows on), then the delta rule on its output, then the norm. The products are the same in both (written out as
    FMAs), so a token's bits do not depend on the route. `before_delta_rule`, when given, is called right before the
    delta rule's launch, after the conv's where it has one: the runner joins its graph branch there, since the a/b
    projection computed beside the input projections is first read by the delta rule, and the conv launch needs only x.

    Under PDL the launches read before they wait for the kernel before them (`kernels.dependent_launch`'s rule):
    the delta rule `slots` and, for up to `early_state_sequences` sequences (`tuning`), its state tiles, windows and
    conv weights; the norm the windows and, at T = 1, the new inputs x. The pools are written only by this function's
    launches (the state by the delta rule, which the norm always follows; the windows by the norm or the conv
    launch, never right before a launch that reads them: a GEMV follows the norm in the runner, the delta rule the
    conv) and by kernels without PDL (prefill, state copies); x comes from the kernel before this function, two
    launches before the norm; `slots` comes from the host or from earlier kernels. So a caller must not write x,
    the pools or `slots` with a PDL kernel launched right before this function (the runner's is the input
    projections' GEMV, which writes x).
    """
    _require_triton("gated_delta_decode")
    name = "gated_delta_decode"
    if x.dim() != 2:
        raise ValueError(f"{name}: x must be [B, channels], got {list(x.shape)}")
    rows = x.shape[0]
    if tokens < 1 or rows % tokens:
        raise ValueError(f"{name}: {rows} rows are not whole sequences of {tokens} tokens")
    B = rows // tokens
    if k_heads < 1 or v_heads % k_heads != 0:
        raise ValueError(f"{name}: v_heads ({v_heads}) must be a multiple of k_heads ({k_heads})")
    C = 2 * k_heads * k_dim + v_heads * v_dim
    _check_rows(name, "x", x, rows, C)
    _check_rows(name, "z", z, rows, v_heads * v_dim)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != C or conv_weight.shape[1] < 2:
        raise ValueError(f"{name}: conv_weight must be [{C}, K ≥ 2], got {list(conv_weight.shape)}")
    K = conv_weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (C, K - 1) or conv_state.dtype != x.dtype:
        raise ValueError(f"{name}: conv_state must be [S, {C}, {K - 1}] {x.dtype}, got {list(conv_state.shape)} "
                         f"{conv_state.dtype}")
    ab_dot = isinstance(a_b, tuple)
    if ab_dot:
        ab_x, ab_w = a_b
        hidden = ab_w.shape[-1]
        _check_rows(name, "the a/b weight", ab_w, 2 * v_heads, hidden)
        _check_rows(name, "the a/b input", ab_x, rows, hidden)
        if hidden > AB_IN_KERNEL_MAX_K or ab_x.dtype != ab_w.dtype:
            raise ValueError(f"{name}: the a/b product in the kernel takes one dtype and K ≤ {AB_IN_KERNEL_MAX_K}, "
                             f"got {ab_x.dtype} x, {ab_w.dtype} W, K = {hidden}")
        a_b = x  # its own pointer is unused
    else:
        _check_rows(name, "a_b", a_b, rows, 2 * v_heads)
        hidden, ab_x, ab_w = 0, a_b, a_b  # the product's pointers are unused
    for what, t, size in (("a_log", a_log, v_heads), ("dt_bias", dt_bias, v_heads), ("norm_weight", norm_weight,
                                                                                     v_dim)):
        if t.shape != (size,):
            raise ValueError(f"{name}: {what} must be [{size}], got {list(t.shape)}")
    if state.dim() != 4 or state.shape[1:] != (v_heads, k_dim, v_dim) or \
            state.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{name}: state must be [S, {v_heads}, {k_dim}, {v_dim}] float32 or bfloat16, got "
                         f"{list(state.shape)} {state.dtype}")
    tensors = (z, conv_weight, conv_state, ab_x, ab_w, a_log, dt_bias, norm_weight, state)
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"{name}: all tensors must be on {x.device}, got {[str(t.device) for t in tensors]}")
    _check_slots(name, slots, B, x.device)
    _check_snapshots(name, snapshot_slots, B, tokens, x.device)
    width = v_heads * v_dim
    out = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    if B == 0:
        return out
    snapshots = snapshot_slots if snapshot_slots is not None else slots
    fused = B <= FUSED_CONV_SEQUENCES
    choice = tuning.for_device(x.device).gated_delta
    if not fused:  # the conv in a launch of its own, which moves the windows on; the delta rule reads its output
        mixed = torch.empty((rows, C), dtype=x.dtype, device=x.device)
        _conv_kernel[(B, triton.cdiv(C, choice.conv_block_c))](
            x, conv_weight, conv_state, slots, snapshots, mixed, C, x.stride(0), conv_weight.stride(0),
            conv_weight.stride(1), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), mixed.stride(0),
            K=K, BLOCK_C=choice.conv_block_c, T=tokens, SNAPSHOTS=snapshot_slots is not None,
            **launch_options(x.device))
    if before_delta_rule is not None:
        before_delta_rule()
    block_k, block_v = triton.next_power_of_2(k_dim), triton.next_power_of_2(v_dim)
    delta_block_v = min(block_v, choice.delta_block_v)
    o = torch.empty((rows, width), dtype=x.dtype, device=x.device)
    source = x if fused else mixed
    _gated_delta_decode_kernel[(B, v_heads, triton.cdiv(v_dim, delta_block_v))](
        source, conv_weight, conv_state, a_b, ab_x, ab_w, a_log, dt_bias, state, slots, snapshots, o,
        source.stride(0), conv_weight.stride(0), conv_weight.stride(1), conv_state.stride(0), conv_state.stride(1),
        conv_state.stride(2), a_b.stride(0), ab_x.stride(0), ab_w.stride(0), o.stride(0), state.stride(0),
        state.stride(1), state.stride(2), state.stride(3), k_dim**-0.5, hidden, K_HEADS=k_heads, K_DIM=k_dim,
        V_HEADS=v_heads, V_DIM=v_dim, CONV_K=K, BLOCK_K=block_k, BLOCK_V=delta_block_v, L2_EPS=L2_EPS,
        SNAPSHOTS=snapshot_slots is not None, T=tokens, CONV=fused, AB_DOT=ab_dot,
        AB_BLOCK=triton.next_power_of_2(hidden) if ab_dot else 1, EARLY_STATE=choice.early_state_sequences >= B,
        num_warps=choice.delta_warps if block_k * delta_block_v >= 128 * 32 else choice.small_delta_warps,
        **launch_options(x.device))
    # torch multiplies the norm weight by x̂ in their promoted dtype: rounded when that is the activation dtype
    round_norm_product = torch.promote_types(norm_weight.dtype, x.dtype) == x.dtype
    records_here = quantize and v_dim % 32 == 0 and block_v == v_dim
    records = empty_records(rows, width, x.device) if records_here else out
    record_count = records.shape[1] if records_here else 0
    heads = min(choice.norm_heads, triton.next_power_of_2(v_heads))
    lanes = record_count * 32 if records_here else width  # padding blocks past the heads get zero records
    programs = triton.cdiv(lanes, heads * v_dim)
    _gated_norm_kernel[(rows, programs)](
        o, z, norm_weight, out, records, x, conv_state, slots, snapshots, o.stride(0), z.stride(0), out.stride(0),
        x.stride(0), conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), eps, record_count, C,
        V_HEADS=v_heads, V_DIM=v_dim, HEADS=heads, BLOCK_V=block_v, ROUND_NORM_PRODUCT=round_norm_product,
        QUANTIZE=records_here, WINDOWS=fused, CONV_K=K, BLOCK_C=triton.next_power_of_2(triton.cdiv(C, programs)),
        T=tokens, SNAPSHOTS=snapshot_slots is not None, num_warps=choice.norm_warps, **launch_options(x.device))
    if not quantize:
        return out
    return Int8Activations(out, records) if records_here else quantize_activations(out)
