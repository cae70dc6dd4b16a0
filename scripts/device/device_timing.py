"""What the device scripts share to time a kernel against the memory limit: the read bandwidth measured now (a
reduction over 1 GiB, median of triton's `do_bench`), and copies of a matrix to rotate through so that the 50 MiB
L2 never holds the one a call reads."""

import torch
import triton


def read_bandwidth() -> float:
    """Bytes per second of a 1 GiB fp32 reduction on the current CUDA device, printed in TB/s as well."""
    buffer = torch.ones(1 << 28, device="cuda")
    bandwidth = buffer.numel() * 4 / (triton.testing.do_bench(buffer.sum, return_mode="median") / 1e3)
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s")
    return bandwidth


def rotating_copies(data: torch.Tensor, at_most: int = 63) -> list[torch.Tensor]:
    """`data` and up to `at_most` clones of it, about 256 MiB in all (far past L2)."""
    return [data, *(data.clone() for _ in range(min(at_most, (256 << 20) // data.numel())))]
