"""One line from a `ninfer bench --json` report: the measured read bandwidth, decode ms a step per batch size with
its fraction of the bandwidth limit, prefill tok/s, graph memory. Used by `ab_bench.sh` and `env_bench.sh`.
Usage: python3 scripts/device/bench_line.py NAME REPORT.json"""

import json
import sys
from pathlib import Path

name, path = sys.argv[1], sys.argv[2]
try:
    report = json.loads(Path(path).read_text())
except (OSError, ValueError) as error:
    print(f"{name}: no report ({error})")
    raise SystemExit from None
cells = [f"bw {report['limits']['read_bytes_per_second'] / 1e12:.2f} TB/s"]
for row in report["decode"]:
    cells.append(f"b{row['batch']} {1000 * row['seconds_per_step']:.3f} ms {row['tokens_per_second']:.1f} tok/s "
                 f"({row['fraction_of_bandwidth_limit']:.3f})")
for row in report["prefill"]:
    cells.append(f"p{row['tokens']} {row['tokens_per_second']:.1f} tok/s ({row['fraction_of_matmul_limit']:.3f})")
if report.get("graph_memory_bytes"):  # trees before 037ba76 do not report it
    cells.append(f"graphs {report['graph_memory_bytes'] / 2**20:.1f} MiB")
print(f"{name}: " + ", ".join(cells))
