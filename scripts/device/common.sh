# Sourced by the device scripts (run from the repository root): the wheels in .whl (fla-core etc.) installed to
# /tmp/site when present, SITE naming that folder (empty without wheels), OUT the folder for logs (the device call's
# $OUT; /tmp/ninfer-device elsewhere), and `artifact PRESET RECIPE`, which prints the path of
# /tmp/PRESET-RECIPE.ninfer after synthesizing it with this tree's `ninfer synth` the first time.
OUT=${OUT:-/tmp/ninfer-device}
mkdir -p "$OUT"
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && SITE=/tmp/site
fi

artifact() {
  local path="/tmp/$1-$2.ninfer"
  [ -f "$path" ] || PYTHONPATH=".:$SITE" python3 -m ninfer synth --preset "$1" --recipe "$2" --device cuda \
    --out "$path" --quiet >&2
  echo "$path"
}
