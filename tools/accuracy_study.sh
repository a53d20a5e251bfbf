#!/usr/bin/env bash
# The seed's accuracy table on dumps, at ε = 0.005: hot share, min / mean cosine, pairs
# below 0.999 and 0.99, the error certificate's coverage and tightness (scan), the 20 worst pairs
# with their diagnosis (worst), per-operand attribution over every pair (attribute) and the FP16
# stages' headroom (headroom). Tables go to the terminal and to OUT_DIR/*.txt, plots to
# OUT_DIR/*.png; docs/accuracy.md quotes them.
#
#   bash tools/accuracy_study.sh OUT_DIR DUMP_OR_FOLDER... [-- apa options, e.g. --backend gpu]
#
# On a GPU machine the studies run on the kernel (--backend auto); head dim 256 (Gemma 3) runs on the
# CPU emulator, where --workers N spreads the warps. STUDIES="scan worst" runs a subset (headroom is
# computed on the CPU, about 20 ms a pair).
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash tools/accuracy_study.sh OUT_DIR DUMP_OR_FOLDER... [-- apa options]" >&2
  exit 2
fi
out=$1
shift
dumps=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do dumps+=("$1"); shift; done
[ $# -gt 0 ] && shift
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then
  echo "accuracy_study.sh: $out is not empty; choose a new folder (nothing is overwritten)" >&2
  exit 2
fi
mkdir -p "$out"
APA="${APA:-apa}"  # e.g. APA="python3 -m apa_emu.study.cli" where the package is not installed
run() { local name=$1; shift; echo "\$ apa $*" | tee "$out/$name.txt"; $APA "$@" | tee -a "$out/$name.txt"; }
for study in ${STUDIES:-scan worst attribute headroom}; do
  case $study in
    scan) run scan scan "${dumps[@]}" --eps 0.005 "$@" ;;
    worst) run worst worst "${dumps[@]}" -n 20 --eps 0.005 "$@" ;;
    attribute) run attribute attribute "${dumps[@]}" --eps 0.005 --plot "$out/attribute.png" "$@" ;;
    headroom) run headroom headroom "${dumps[@]}" --eps 0.005 "$@" ;;
    *) echo "accuracy_study.sh: unknown study $study (scan, worst, attribute, headroom)" >&2; exit 2 ;;
  esac
done
