"""The GPU tests of a selection that have no outcome in a tests.log of benchmarks/gpu_session.sh (its
`tests` part stops at TESTS_TIMEOUT), as pytest ids, one a line: every `-m gpu` test of the selection minus
those with an outcome (PASSED, FAILED, SKIPPED, ERROR, XFAIL, XPASS) in the log. `tests=@FILE` runs them:

    python3 -m benchmarks.unfinished_tests TESTS_LOG [PYTEST_SELECTION ...] > unfinished.args
"""

from __future__ import annotations

import re
import subprocess
import sys

OUTCOME = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS) (tests/\S+)")


def finished(log_text: str) -> set[str]:
    return {match.group(2) for match in OUTCOME.finditer(log_text)}


def gpu_test_ids(selection: list[str]) -> list[str]:
    listing = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                              "-p", "no:cacheprovider", *selection], capture_output=True, text=True, check=True)
    return [line for line in listing.stdout.splitlines() if "::" in line]


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    with open(argv[0]) as log:
        done = finished(log.read())
    for test_id in gpu_test_ids(argv[1:] or ["tests"]):
        if test_id not in done:
            print(test_id)


if __name__ == "__main__":
    main(sys.argv[1:])
