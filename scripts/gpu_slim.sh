#!/usr/bin/env bash
# Keep the committed sample models out of a GPU run's upload, and put them back.
#
#   bash scripts/gpu_slim.sh on     # before device runs: sample_models/exported leaves the index
#   bash scripts/gpu_slim.sh off    # after them: the index as HEAD has it again
#
# The device tool uploads the tracked (and untracked, not ignored) files of this checkout, at
# most 64 MiB with the carried .gl/.whl; the committed exports alone are about 65 MB. "on"
# removes them from the index only (the files stay on disk, nothing is committed) and ignores
# them in .git/info/exclude; "off" restores both. The kernel tests and the benchmark need none
# of them; scripts/webgpu_router_check.py carries its own models in .gpu_models/.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
line="/sample_models/exported/"
case "${1:-}" in
  on)
    git rm -r -q --cached sample_models/exported
    grep -qxF "$line" .git/info/exclude || echo "$line" >> .git/info/exclude
    ;;
  off)
    sed -i "\|^${line}\$|d" .git/info/exclude
    git reset -q sample_models/exported
    ;;
  *) echo "usage: $0 on|off" >&2; exit 2 ;;
esac
git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | awk '{printf "tracked files: %.1f MiB\n", $1 / 1048576}'
