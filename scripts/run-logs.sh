#!/usr/bin/env bash
# Carries eval/frontier run logs between machines through the repository (docs/runs/).
# A long suite (RULER at 32K: hours on two cores) outlives one machine; its run log
# ($MOSAICKV_HOME/runs/eval-KEY.jsonl, one JSON line per (prompt, method) result) is what
# lets the next machine resume it instead of starting over.
#
#   scripts/run-logs.sh save [eval-KEY.jsonl ...]     # merge $MOSAICKV_HOME/runs/ into docs/runs/
#   scripts/run-logs.sh restore [eval-KEY.jsonl ...]  # merge docs/runs/ into $MOSAICKV_HOME/runs/
#
# Without names, every log of the source. A merge keeps every line of the destination in its
# order and appends the source's complete lines that the destination lacks, so neither side
# loses a result (a later line with the same key supersedes an earlier one when the log is
# read, as after `--fresh`). The destination is replaced by rename, never half written.
set -euo pipefail
cd "$(dirname "$0")/.."
home="${MOSAICKV_HOME:-$HOME/.cache/mosaickv}"
case "${1:-}" in
  save) src="$home/runs"; dst="docs/runs" ;;
  restore) src="docs/runs"; dst="$home/runs" ;;
  *) echo "usage: $0 save|restore [eval-KEY.jsonl ...]" >&2; exit 2 ;;
esac
shift
mkdir -p "$dst"
if [ "$#" -eq 0 ]; then
  shopt -s nullglob
  set -- "$src"/eval-*.jsonl
  set -- "${@##*/}"
fi
for name in "$@"; do
  [ -f "$src/$name" ] || { echo "$src/$name: no such run log" >&2; exit 1; }
  python3 - "$src/$name" "$dst/$name" <<'PY'
import json, os, sys, tempfile
src, dst = sys.argv[1], sys.argv[2]
def complete(path):
    # lines a reader accepts: whole JSON objects (a run may be appending to the source now)
    out = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.rstrip("\n")
                try:
                    if isinstance(json.loads(line), dict):
                        out.append(line)
                except ValueError:
                    pass
    return out
have = complete(dst)
seen = set(have)
new = [l for l in complete(src) if not (l in seen or seen.add(l))]
fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dst) or ".", prefix=".runlog.")
with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.writelines(l + "\n" for l in have + new)
    f.flush()
    os.fsync(f.fileno())
os.chmod(tmp, 0o644)
os.replace(tmp, dst)
print(f"{os.path.basename(dst)}: {len(have)} lines kept, {len(new)} added, in {os.path.dirname(dst)}")
PY
done
