"""What a kernel boundary costs a decode step, against a handoff through a flag inside one launch.

A decode step is a chain of GEMVs with small kernels between them (norms, SwiGLU, the gated norm); with programmatic
dependent launch each boundary still costs the small kernel's wait for the GEMV before it and the next GEMV's wait
for the small kernel. This probe times three chains of STAGES stages as CUDA graphs, each stage a GEMV-like kernel B
(P programs, each streaming its own WEIGHT_BYTES / P of weights: the first half loaded before it waits) fed by a
small kernel S (16 programs reading B's last output, writing a vector that B reads):

  * `boundary`: S and B as two PDL launches (the fast path today);
  * `flag`: S's programs as the first 16 programs of B's launch; they wait for the previous launch
    (`griddepcontrol.wait`), write, and count themselves done with a release atomic; B's programs load their first
    half, then poll the count with acquire loads; `flag-ticket` takes each program's role from an atomic ticket
    (CUB's decoupled look-back method: a program waits only on programs that took a ticket before it, so no
    schedule can deadlock), `flag` from its program id; `flag-one` as `flag`, but only thread 0 of a program
    polls, with a 64 ns pause between its loads, while the others wait at a barrier (cooperative groups' grid sync
    does the same);
  * `alone`: B alone, reading the previous B's output itself (no small kernel: the floor).

Usage (GPU, from scripts/device): PYTHONPATH=$PWD/../.. python3 handoff_probe.py [STAGES]
Prints µs a stage for each chain, and checks that the flag chains compute what the boundary chain does."""

import sys

import torch
import triton
import triton.language as tl
from device_timing import captured, replay_us

STAGES = int(sys.argv[1]) if len(sys.argv) > 1 else 64
P = 1024  # B's programs
SMALL = 16  # S's programs
WIDTH = 16384  # S's output
WEIGHT_BYTES = 8 << 20  # a stage's weights: STAGES of them far exceed L2
WORDS = WEIGHT_BYTES // 4 // P  # int32 words a B program streams
HALF = WORDS // 2
REPLAYS = 20


@triton.jit
def _ld_acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _ld_acquire_first_thread(ptr, PAUSE: tl.constexpr):
    """Thread 0 of the program: the acquire load (after a 64 ns pause with PAUSE); every other thread: the largest
    int64 (it stops polling)."""
    pause: tl.constexpr = "@first nanosleep.u32 64; " if PAUSE else ""
    return tl.inline_asm_elementwise("{ .reg .pred first; .reg .u32 tid; mov.u32 tid, %tid.x; setp.eq.u32 first, "
                                     "tid, 0; mov.b64 $0, 0x7fffffffffffffff; " + pause + "@first "
                                     "ld.acquire.gpu.global.b64 $0, [$1]; }", "=l,l", [ptr], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _small_body(prev_ptr, y_ptr, program, P: tl.constexpr, WIDTH: tl.constexpr, SMALL: tl.constexpr):
    cols = program * (WIDTH // SMALL) + tl.arange(0, WIDTH // SMALL)
    tl.store(y_ptr + cols, tl.load(prev_ptr + cols % P) * 0.5 + 1.0)


@triton.jit
def _b_first(w_ptr, program, WORDS: tl.constexpr, HALF: tl.constexpr):
    return tl.load(w_ptr + program.to(tl.int64) * WORDS + tl.arange(0, HALF))


@triton.jit
def _b_rest(first, w_ptr, x_ptr, out_ptr, program, WORDS: tl.constexpr, HALF: tl.constexpr, WIDTH: tl.constexpr):
    second = tl.load(w_ptr + program.to(tl.int64) * WORDS + HALF + tl.arange(0, HALF))
    x = tl.load(x_ptr + (program * 16 + tl.arange(0, HALF) % 16) % WIDTH)
    total = tl.sum((first & 255).to(tl.float32) * x + (second & 255).to(tl.float32) * x)
    tl.store(out_ptr + program, total * 1e-6)


@triton.jit
def _small_kernel(prev_ptr, y_ptr, P: tl.constexpr, WIDTH: tl.constexpr, SMALL: tl.constexpr):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    _small_body(prev_ptr, y_ptr, tl.program_id(0), P, WIDTH, SMALL)


@triton.jit
def _b_kernel(w_ptr, x_ptr, out_ptr, WORDS: tl.constexpr, HALF: tl.constexpr, WIDTH: tl.constexpr):
    program = tl.program_id(0)
    first = _b_first(w_ptr, program, WORDS, HALF)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    _b_rest(first, w_ptr, x_ptr, out_ptr, program, WORDS, HALF, WIDTH)


@triton.jit
def _merged_kernel(prev_ptr, y_ptr, w_ptr, out_ptr, ticket_ptr, done_ptr, last_ticket_ptr, last_done_ptr,
                   P: tl.constexpr, WIDTH: tl.constexpr, SMALL: tl.constexpr, WORDS: tl.constexpr,
                   HALF: tl.constexpr, TICKET: tl.constexpr, ONE_POLLER: tl.constexpr):
    """S's programs first, then B's; the previous stage's counters are set back to zero by this stage's program 0
    once it has waited (that stage has finished then), so every launch finds its own at zero."""
    program = tl.minimum(tl.atomic_add(ticket_ptr, 1), P + SMALL - 1).to(tl.int32) if TICKET else tl.program_id(0)
    if program < SMALL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        if program == 0:
            tl.store(last_ticket_ptr, 0)
            tl.store(last_done_ptr, 0)
        _small_body(prev_ptr, y_ptr, program, P, WIDTH, SMALL)
        tl.debug_barrier()
        tl.atomic_add(done_ptr, 1, sem="release", scope="gpu")
    else:
        b = program - SMALL
        first = _b_first(w_ptr, b, WORDS, HALF)
        polls = 0
        if ONE_POLLER:  # thread 0 polls with a pause between loads, the others wait at the barrier
            seen = tl.max(_ld_acquire_first_thread(done_ptr + tl.zeros([1], tl.int32), False), 0)
            while (seen < SMALL) & (polls < 1 << 22):
                seen = tl.max(_ld_acquire_first_thread(done_ptr + tl.zeros([1], tl.int32), True), 0)
                polls += 1
            tl.debug_barrier()
        else:
            seen = tl.max(_ld_acquire(done_ptr + tl.zeros([1], tl.int32)), 0)
            while (seen < SMALL) & (polls < 1 << 22):  # bounded: a broken role assignment shows as a wrong result
                seen = tl.max(_ld_acquire(done_ptr + tl.zeros([1], tl.int32)), 0)
                polls += 1
        tl.extra.cuda.gdc_launch_dependents()
        _b_rest(first, w_ptr, y_ptr, out_ptr, b, WORDS, HALF, WIDTH)


def chain(kind: str, weights, outs, ys, counters):
    for s in range(STAGES):
        prev = outs[s]
        if kind == "boundary":
            _small_kernel[(SMALL,)](prev, ys[s], P=P, WIDTH=WIDTH, SMALL=SMALL, launch_pdl=True)
            _b_kernel[(P,)](weights[s], ys[s], outs[s + 1], WORDS=WORDS, HALF=HALF, WIDTH=WIDTH, launch_pdl=True)
        elif kind == "alone":
            _b_kernel[(P,)](weights[s], prev, outs[s + 1], WORDS=WORDS, HALF=HALF, WIDTH=P, launch_pdl=True)
        else:
            ticket, done = counters[s]
            last_ticket, last_done = counters[s - 1]  # stage 0: the last stage's, of the previous replay
            _merged_kernel[(P + SMALL,)](prev, ys[s], weights[s], outs[s + 1], ticket, done, last_ticket, last_done,
                                         P=P, WIDTH=WIDTH, SMALL=SMALL, WORDS=WORDS, HALF=HALF,
                                         TICKET=kind == "flag-ticket", ONE_POLLER=kind == "flag-one",
                                         launch_pdl=True)


def main() -> None:
    torch.manual_seed(0)
    weights = [torch.randint(0, 1 << 30, (P * WORDS,), dtype=torch.int32, device="cuda") for _ in range(STAGES)]
    results = {}
    source = torch.rand(P, device="cuda")
    for kind in ("boundary", "flag", "flag-ticket", "flag-one", "alone") * 2:
        outs = [source] + [torch.zeros(P, device="cuda") for _ in range(STAGES)]
        ys = [torch.zeros(WIDTH, device="cuda") for _ in range(STAGES)]
        counters = [(torch.zeros(1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64,
                                                                                    device="cuda"))
                    for _ in range(STAGES)]
        chain(kind, weights, outs, ys, counters)  # compile
        torch.cuda.synchronize()
        for ticket, done in counters:
            ticket.zero_()
            done.zero_()
        graph = captured(lambda k=kind, o=outs, y=ys, c=counters: chain(k, weights, o, y, c))
        graph.replay()
        torch.cuda.synchronize()
        results[kind] = outs[-1].clone()
        us = replay_us(graph, REPLAYS) / STAGES
        print(f"{kind:12s}: {us:6.2f} us a stage ({STAGES} stages, {WEIGHT_BYTES >> 20} MiB of weights each: "
              f"{WEIGHT_BYTES / us / 1e6:.2f} TB/s)", flush=True)
    for kind in ("flag", "flag-ticket", "flag-one"):
        same = torch.allclose(results[kind], results["boundary"], rtol=1e-5)
        print(f"{kind} computes what boundary does: {same}")


if __name__ == "__main__":
    main()
