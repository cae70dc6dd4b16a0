"""Run a command; print its wall time and the peak resident memory of the processes it started."""

import resource
import subprocess
import sys
import time

label, command = sys.argv[1], sys.argv[2:]
start = time.perf_counter()
code = subprocess.call(command)
peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
print(f"{label}: exit {code}, {time.perf_counter() - start:.1f} s wall, {peak_gib:.2f} GiB peak RSS", flush=True)
sys.exit(code)
