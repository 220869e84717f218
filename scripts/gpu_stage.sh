#!/usr/bin/env bash
# Stage this checkout for a GPU run made from another checkout.
#
#   bash scripts/gpu_stage.sh /path/to/session-checkout [FOLDER]
#
# The device tool sends the checkout its session was started in, not a helper's worktree;
# what else a run needs travels only as an ignored folder of that checkout named in `carry`.
# This copies this checkout's tracked files (without sample_models/'s folders: the session
# checkout sends its own, and 34 MB would break the 64 MiB upload limit) and its .gl/ and .whl/
# (scripts/gpu_prepare.sh) into FOLDER (default .gpu-tree) of that checkout, and ignores
# FOLDER there (.git/info/exclude). Then, from the session:
#
#   run(carry=[".gpu-tree"],
#       command="cd .gpu-tree && bash scripts/gpu_run.sh bash scripts/gpu_measure.sh tests")
#
# It prints the upload size (the session checkout's tracked files plus FOLDER).
set -euo pipefail
SRC="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_REPO="$(cd "${1:?usage: $0 SESSION_CHECKOUT [FOLDER]}" && pwd)"
FOLDER="${2:-.gpu-tree}"
case "$FOLDER" in /* | *..*) echo "FOLDER must be a plain relative name" >&2; exit 2 ;; esac
DEST="$DEST_REPO/$FOLDER"

git_dir="$(git -C "$DEST_REPO" rev-parse --git-common-dir)"
case "$git_dir" in /*) ;; *) git_dir="$DEST_REPO/$git_dir" ;; esac
mkdir -p "$git_dir/info"
grep -qxF "/$FOLDER/" "$git_dir/info/exclude" 2>/dev/null || echo "/$FOLDER/" >>"$git_dir/info/exclude"

rm -rf "$DEST"
mkdir -p "$DEST"
# sample_models' own scripts travel (tests import sample_models/upcast.py); its models do not
(cd "$SRC" && git ls-files -z | grep -zvE '^sample_models/.*/' | xargs -0 cp --parents -t "$DEST")
for carried in .gl .whl; do
  if [ -d "$SRC/$carried" ]; then cp -r "$SRC/$carried" "$DEST/"; fi
done
tree=$(git -C "$DEST_REPO" ls-files -z | (cd "$DEST_REPO" && xargs -0 cat 2>/dev/null) | wc -c)
staged=$(find "$DEST" -type f -print0 | xargs -0 cat | wc -c)
echo "staged $SRC into $DEST; upload: $((tree / 1048576)) MiB tracked + $((staged / 1048576))" \
  "MiB staged = $(((tree + staged) / 1048576)) MiB of 64 MiB"
