#!/usr/bin/env bash
# Release gate: compress, validate, and fail the release unless the gate says PASS.
#   examples/release_gate/gate.sh target=jetson-orin recipe=default out=release-run [key=value ...]
# Exit codes pass through from compress: 0 PASS, 1 FAIL, 2 usage error, 3 NOT_MEASURED, 4 stage error.
set -uo pipefail
COMPRESS=${COMPRESS:-compress}
"$COMPRESS" run --no-progress "$@"
code=$?
case $code in
  0) echo "release gate: PASS" ;;
  1) echo "release gate: FAIL (a check is over its limit; see report.md)" ;;
  3) echo "release gate: NOT_MEASURED (a check could not be measured; the release is blocked)" ;;
  *) echo "release gate: the run did not complete (exit $code)" ;;
esac
exit $code
