#!/usr/bin/env bash
# Sample teacher text on every GPU, then train variants on it with pair.py: one unattended
# pipeline for a machine whose calls are limited to 10 minutes. Started detached (setsid), it
# outlives the call that starts it; later calls only wait for WORK/done and collect.
#
#   sample_and_train.sh WORK TEACHER DATA SAMPLE_MINUTES "GENERATE_ARGS" PAIR_ARGS...
#
# Runs from a copy of tools/train and python/ in WORK/code, so a call that refreshes the
# checkout cannot change code under a running job. GPU g writes WORK/synthetic/synthetic-g.u16
# (generate_text.py GENERATE_ARGS --seed SEED+g, SEED from the environment, default 0; the
# attention path from WORK/attention.txt when bench_generate.py wrote one). Then pair.py runs
# with PAIR_ARGS, which name those files in its --common "--synthetic ...". WORK/done gets
# pair.py's exit status; WORK/pipeline.log has every step's output.
set -u
WORK=$1 TEACHER=$2 DATA=$3 SAMPLE_MINUTES=$4 GENERATE_ARGS=$5
shift 5
SEED=${SEED:-0}
HERE=$(cd "$(dirname "$0")" && pwd)
CODE=$WORK/code
rm -f "$WORK/done"
mkdir -p "$CODE/tools" "$WORK/synthetic"
cp -r "$HERE" "$CODE/tools/" && cp -r "$HERE/../../python" "$CODE/" || { echo 90 >"$WORK/done"; exit 90; }
export PYTHONUNBUFFERED=1

ATTENTION=sdpa
[ -s "$WORK/attention.txt" ] && ATTENTION=$(cat "$WORK/attention.txt")
GPUS=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")  # 1: the CPU
echo "[pipeline] $(date -u +%T) sampling $SAMPLE_MINUTES min on $GPUS GPU(s), attention $ATTENTION"
for ((g = 0; g < GPUS; g++)); do
    # shellcheck disable=SC2086  # GENERATE_ARGS is a list of arguments
    CUDA_VISIBLE_DEVICES=$g python3 "$CODE/tools/train/generate_text.py" --teacher "$TEACHER" --data "$DATA" \
        --out "$WORK/synthetic/synthetic-$g.u16" --minutes "$SAMPLE_MINUTES" --seed $((SEED + g)) \
        --attention "$ATTENTION" $GENERATE_ARGS >"$WORK/generate-$g.log" 2>&1 &
done
wait
tail -n 2 "$WORK"/generate-*.log
echo "[pipeline] $(date -u +%T) training"
python3 "$CODE/tools/train/pair.py" --teacher "$TEACHER" "$@"
status=$?
echo "[pipeline] $(date -u +%T) pair.py exited $status"
echo $status >"$WORK/done"
