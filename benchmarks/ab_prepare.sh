#!/usr/bin/env bash
# The baseline tree of an A/B run: commit REV extracted into .ab/baseline (ignored), REV's sha in
# .ab/baseline/COMMIT, for gpu_session.sh's build:baseline and bench:NAME@baseline parts. Name .ab in
# the device call's carry list.
#
#   benchmarks/ab_prepare.sh REV
#
# Also prints the TK_OPS_COMMIT / TK_OPS_DIRTY that name this tree in the device command.
set -euo pipefail
rev=${1:?usage: benchmarks/ab_prepare.sh REV}
cd "$(git rev-parse --show-toplevel)"
sha=$(git rev-parse --verify "$rev^{commit}")
rm -rf .ab/baseline
mkdir -p .ab/baseline
git archive "$sha" | tar -x -C .ab/baseline
echo "$sha" > .ab/baseline/COMMIT
echo "baseline: $(git log -1 --format='%h %s' "$sha")"
echo "          in .ab/baseline, $(du -sh .ab | cut -f1) to carry (.ab)"
python3 - <<'PY'
from benchmarks.common import source_commit

tree = source_commit()
print(f"this tree: TK_OPS_COMMIT={tree['commit']} TK_OPS_DIRTY={int(tree['dirty'])}")
PY
