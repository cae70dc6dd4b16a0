"""Launch choices of the Triton kernels, per GPU architecture: tiles, warps, pipeline depths, route thresholds.

`for_device(device)` gives a kernel's wrapper the `Tuning` to launch with: the entry of TABLE for the CUDA device's
compute capability, DEFAULT for a GPU not in the table (and for CPU tensors outside the interpreter: the offline
compile check), INTERPRETER under the Triton interpreter, where programs run one after another and few wide
programs are far faster. Each section belongs to one kernel module and says what its fields do.

Most choices move loads or regroup exact sums and never change a result's bits; the fields marked "part of the
bits" (a K tile, the warps that split a sum) do, so a GPU makes them the same way at every batch size, which keeps
a token's result independent of what else the step holds. The sm_90 entry holds the choices measured on the H200
(the method and the sweeps: docs/optimizations.md); GPUs not in the table run them too, the only measured set,
valid on every NVIDIA GPU the kernels support (the compile check builds them for sm_80 as well).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from ninfer import flags

ALL_BITS = (4, 5, 6, 8)  # the groupwise formats: q4, q5, q6 (g64) and q8 (g32)


def _power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"kernel tuning: {what}")


@dataclass(frozen=True)
class BatchTile:
    """A row of the batch GEMV's table (`quant_linear`'s batch route). It serves the products whose token tile (T
    rounded up to a power of two) lies in `tokens` (None: no upper bound), whose format has `bits`, whose matrix has
    at most `max_rows` rows (None: any) and whose padded K lies in [k_pad[0], k_pad[1]) (None: no bound). A program
    holds `block_n` rows and `block_t` tokens, loads `depth` weight tiles ahead, unrolls its K loop `unroll` times,
    chains `chain` `dp4a`, and with `lane_tree` sums its block positions by exchanging halves between lanes when
    it holds exactly 32 (token, row) sums. None of them changes a bit."""

    tokens: tuple[int, int | None]
    bits: tuple[int, ...]
    max_rows: int | None
    k_pad: tuple[int, int | None]
    block_n: int
    block_t: int
    depth: int
    unroll: int
    chain: int
    lane_tree: bool

    def __post_init__(self) -> None:
        _require(_power_of_two(self.block_n), f"batch block_n {self.block_n} is not a power of two")
        _require(self.block_t in (1, 2, 4, 8), f"batch block_t {self.block_t} is not 1, 2, 4 or 8")
        _require(self.depth in (1, 2) and self.unroll in (1, 2), f"batch depth {self.depth} / unroll {self.unroll}")
        _require(self.chain in (2, 4, 8), f"batch chain {self.chain} is not 2, 4 or 8")
        _require(set(self.bits) <= set(ALL_BITS), f"batch bits {self.bits}")

    def matches(self, tokens: int, bits: int, rows: int, k_pad: int) -> bool:
        """Whether a product of this token tile, format bits, rows and padded K takes this row."""
        least, most = self.tokens
        low, high = self.k_pad
        return (least <= tokens and (most is None or tokens <= most) and bits in self.bits
                and (self.max_rows is None or rows <= self.max_rows)
                and low <= k_pad and (high is None or k_pad < high))


@dataclass(frozen=True)
class QuantLinearTuning:
    """`quant_linear` (groupwise formats). `batch`: the batch route's rows, first match wins (the last rows of each
    token range match everything). The token route: `token_block_n` rows on `token_warps` warps a program for whole
    matrices, `gather_block_n` on `gather_warps` for gathered experts; its K tile is the widest power of two up to
    `token_max_block_k` lanes that divides the padded K (part of the bits). The grouped MoE product:
    `grouped_block_n` rows a program on `grouped_warps` warps. The dequantizer: `dequantize_block` (rows, lanes) a
    program."""

    batch: tuple[BatchTile, ...]
    token_block_n: int
    token_warps: int
    gather_block_n: int
    gather_warps: int
    token_max_block_k: int
    grouped_block_n: int
    grouped_warps: int
    dequantize_block: tuple[int, int]

    def __post_init__(self) -> None:
        for value in (self.token_block_n, self.token_warps, self.gather_block_n, self.gather_warps,
                      self.grouped_block_n, self.grouped_warps, *self.dequantize_block):
            _require(_power_of_two(value), f"quant_linear block or warps {value} is not a power of two")
        _require(_power_of_two(self.token_max_block_k) and self.token_max_block_k >= 64,
                 f"token_max_block_k {self.token_max_block_k}: a power of two ≥ 64 (K is padded to 128 lanes)")
        _require(self.dequantize_block[1] >= 64, "the dequantizer's K tile holds whole groups (≥ 64 lanes)")

    def batch_tile(self, tokens: int, bits: int, rows: int, k_pad: int) -> BatchTile:
        """The batch route's row for a product of `tokens` (its token tile), `bits`, `rows` and padded K."""
        for tile in self.batch:
            if tile.matches(tokens, bits, rows, k_pad):
                return tile
        raise ValueError(f"kernel tuning: no batch GEMV row for {tokens} tokens, q{bits}, {rows} rows, K {k_pad}")


@dataclass(frozen=True)
class StripeTuning:
    """`stripe_linear`: `warps` a program (warp w sums groups w, w + warps, …: part of the bits), groups loaded ahead
    by the one-token kernel (`one_token_depth`) and by the 8-token tiles (`tile_depth`), 1–4; the chunk dequantizer's
    `dequantize_groups` groups a program on `dequantize_warps` warps."""

    warps: int
    one_token_depth: int
    tile_depth: int
    dequantize_groups: int
    dequantize_warps: int

    def __post_init__(self) -> None:
        _require(_power_of_two(self.warps), f"stripe warps {self.warps} is not a power of two")
        _require(self.one_token_depth in (1, 2, 3, 4) and self.tile_depth in (1, 2, 3, 4), "stripe depths are 1-4")
        _require(_power_of_two(self.dequantize_groups) and _power_of_two(self.dequantize_warps),
                 "the stripe dequantizer's groups and warps are powers of two")


@dataclass(frozen=True)
class DenseTuning:
    """`dense_linear` (few-token GEMV of dense matrices): `block_n` rows a program; `block_k` lanes of K a step (part
    of the bits), None for one step over the whole K rounded up to a power of two (up to its MAX_BLOCK_K)."""

    block_n: int
    block_k: int | None

    def __post_init__(self) -> None:
        _require(_power_of_two(self.block_n), f"dense block_n {self.block_n} is not a power of two")
        _require(self.block_k is None or _power_of_two(self.block_k), f"dense block_k {self.block_k}")


@dataclass(frozen=True)
class Fp8Tuning:
    """`fp8_linear`: `block_n` rows a program, `block_k` lanes of K a step (part of the bits), `warps`."""

    block_n: int
    block_k: int
    warps: int

    def __post_init__(self) -> None:
        _require(all(_power_of_two(v) for v in (self.block_n, self.block_k, self.warps)),
                 "fp8 block_n, block_k and warps are powers of two")


@dataclass(frozen=True)
class AttentionTuning:
    """`paged_attention`: `block_positions` cache positions a tile (part of the bits; ≥ 16, a `tl.dot` operand);
    splits of the positions aimed at `waves` programs per SM for one sequence, at most `max_splits` (part of the
    bits, fixed per GPU); warps of the decode, merge, cache-write and q/k norm + RoPE kernels."""

    block_positions: int
    waves: int
    max_splits: int
    decode_warps: int
    merge_warps: int
    write_warps: int
    rope_warps: int

    def __post_init__(self) -> None:
        _require(_power_of_two(self.block_positions) and self.block_positions >= 16,
                 f"attention block_positions {self.block_positions}: a power of two ≥ 16")
        _require(self.waves >= 1 and self.max_splits >= 1, "attention waves and max_splits are ≥ 1")
        _require(all(_power_of_two(w) for w in (self.decode_warps, self.merge_warps, self.write_warps,
                                                self.rope_warps)), "attention warps are powers of two")


@dataclass(frozen=True)
class GatedDeltaTuning:
    """`gdn_decode`: `conv_block_c` channels a program of the conv launch; `delta_block_v` state columns a
    delta-rule program, on `delta_warps` warps when its tile has 128 × 32 lanes or more (else `small_delta_warps`);
    `norm_heads` value heads a gated-norm program on `norm_warps` warps; steps of up to `early_state_sequences`
    sequences read their state tiles before the PDL wait. None of them changes a bit."""

    conv_block_c: int
    delta_block_v: int
    delta_warps: int
    small_delta_warps: int
    norm_heads: int
    norm_warps: int
    early_state_sequences: int

    def __post_init__(self) -> None:
        _require(all(_power_of_two(v) for v in (self.conv_block_c, self.delta_block_v, self.delta_warps,
                                                self.small_delta_warps, self.norm_heads, self.norm_warps)),
                 "gated delta tiles and warps are powers of two")
        _require(self.early_state_sequences >= 0, "early_state_sequences is ≥ 0")


@dataclass(frozen=True)
class ElementwiseTuning:
    """`fused`: `block` lanes a program of the elementwise kernels (a multiple of 128: whole int8 records) on
    `warps` warps; a decode step's norm row spread over programs of `block` lanes runs them on `norm_split_warps`."""

    block: int
    warps: int
    norm_split_warps: int

    def __post_init__(self) -> None:
        _require(_power_of_two(self.block) and self.block >= 128, f"elementwise block {self.block}: 2^n ≥ 128")
        _require(_power_of_two(self.warps) and _power_of_two(self.norm_split_warps), "elementwise warps are 2^n")


@dataclass(frozen=True)
class Tuning:
    """Every kernel module's launch choices for one GPU architecture (or the interpreter)."""

    quant_linear: QuantLinearTuning
    stripes: StripeTuning
    dense: DenseTuning
    fp8: Fp8Tuning
    attention: AttentionTuning
    gated_delta: GatedDeltaTuning
    elementwise: ElementwiseTuning


# The batch GEMV on sm_90 (H200 sweeps over T = 1, 2, 4, 8, 16 at the 27B and 35B-A3B shapes). Few programs (up to
# 8,192 rows, 12,288 at 4 tokens) keep too few weight bytes in flight per SM: a second tile ahead helps them, at one
# token only with the loop unrolled and K ≥ 6,144. q5 at 8 tokens: K ≥ 8,192 runs two 4-token programs a row tile
# (the second reads the weights from L2), 6,144 ≤ K < 8,192 one 8-token program with chains of 8.
_ANY_ROWS, _ANY_K = None, (0, None)
_SM90_BATCH = (
    #          tile tokens  bits       rows ≤  K range        BN  BT  depth unroll chain lane tree
    BatchTile((1, 1),      ALL_BITS,  8192,   (6144, None),  2,  1,  2,    2,     2,    False),
    BatchTile((1, 1),      ALL_BITS,  None,   _ANY_K,        2,  1,  1,    1,     2,    False),
    BatchTile((2, 2),      (5,),      None,   _ANY_K,        2,  2,  1,    1,     2,    False),
    BatchTile((2, 2),      ALL_BITS,  None,   _ANY_K,        4,  2,  1,    1,     2,    False),
    BatchTile((4, 4),      (5,),      12288,  _ANY_K,        2,  4,  2,    1,     2,    False),
    BatchTile((4, 4),      (5,),      None,   _ANY_K,        2,  4,  1,    1,     2,    False),
    BatchTile((4, 4),      (4, 6),    12288,  _ANY_K,        4,  4,  2,    1,     2,    False),
    BatchTile((4, 4),      ALL_BITS,  None,   _ANY_K,        4,  4,  1,    1,     2,    False),
    BatchTile((8, None),   (4,),      8192,   _ANY_K,        4,  8,  2,    1,     2,    True),
    BatchTile((8, None),   (4,),      None,   _ANY_K,        4,  8,  1,    1,     2,    True),
    BatchTile((8, None),   (5,),      8192,   (8192, None),  4,  4,  2,    1,     4,    True),
    BatchTile((8, None),   (5,),      None,   (8192, None),  4,  4,  1,    1,     4,    True),
    BatchTile((8, None),   (5,),      None,   (6144, 8192),  4,  8,  1,    1,     8,    True),
    BatchTile((8, None),   (5,),      None,   _ANY_K,        4,  8,  1,    1,     4,    True),
    BatchTile((8, None),   (6,),      8192,   _ANY_K,        4,  8,  2,    1,     8,    False),
    BatchTile((8, None),   (6,),      None,   _ANY_K,        4,  8,  1,    1,     8,    False),
    BatchTile((8, None),   ALL_BITS,  None,   _ANY_K,        4,  8,  1,    1,     2,    False),
)

SM90 = Tuning(
    # the token route: 2 rows on 1 warp for whole matrices, 4 on 2 for gathered experts, K tiles up to 512 lanes
    quant_linear=QuantLinearTuning(batch=_SM90_BATCH, token_block_n=2, token_warps=1, gather_block_n=4,
                                   gather_warps=2, token_max_block_k=512, grouped_block_n=64,
                                   grouped_warps=8,  # 4 warps spill registers at 64 × 64 tiles
                                   dequantize_block=(16, 128)),
    # 8 warps: 16 were no faster at one token and slower at 8; the one-token kernel keeps 4 groups in flight
    stripes=StripeTuning(warps=8, one_token_depth=4, tile_depth=3, dequantize_groups=8, dequantize_warps=4),
    # one row a program and K in one step: the decode step's short matrices (GDN a/b, routers) spread wide
    dense=DenseTuning(block_n=1, block_k=None),
    fp8=Fp8Tuning(block_n=8, block_k=512, warps=4),
    attention=AttentionTuning(block_positions=32, waves=2, max_splits=64, decode_warps=4, merge_warps=4,
                              write_warps=2, rope_warps=2),
    # [128, 32] state tiles: a 27B step (48 value heads) runs 192 programs rather than 48 holding a whole head;
    # 4 warps (2 were faster alone, slower inside a batch-8 step); early state reads pay at one sequence only
    gated_delta=GatedDeltaTuning(conv_block_c=256, delta_block_v=32, delta_warps=4, small_delta_warps=2,
                                 norm_heads=8, norm_warps=4, early_state_sequences=1),
    elementwise=ElementwiseTuning(block=1024, warps=4, norm_split_warps=8),
)

TABLE: dict[tuple[int, int], Tuning] = {(9, 0): SM90}
DEFAULT = SM90

# The interpreter: wide programs (it runs programs one by one and vectorises within one); the rest as DEFAULT.
INTERPRETER = dataclasses.replace(
    DEFAULT,
    quant_linear=dataclasses.replace(
        DEFAULT.quant_linear, batch=tuple(dataclasses.replace(row, block_n=256) for row in DEFAULT.quant_linear.batch),
        token_block_n=256, token_warps=2, gather_block_n=256, gather_warps=2, grouped_block_n=256,
        dequantize_block=(256, 128)),
    dense=DenseTuning(block_n=64, block_k=256),
    fp8=dataclasses.replace(DEFAULT.fp8, block_n=256),
)


def for_arch(arch: tuple[int, int]) -> Tuning:
    """The table's entry for compute capability `arch` (major, minor), DEFAULT when it has none."""
    return TABLE.get(tuple(arch), DEFAULT)


def for_device(device: torch.device) -> Tuning:
    """The launch choices for kernels on `device`: INTERPRETER under the Triton interpreter, the table's entry for a
    CUDA device's compute capability, DEFAULT otherwise."""
    if flags.triton_interpreted():
        return INTERPRETER
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT
    return _for_cuda(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache
def _for_cuda(index: int) -> Tuning:
    return for_arch(torch.cuda.get_device_capability(index))
