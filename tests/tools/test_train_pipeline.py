"""tools/train/sample_and_train.sh: sampling on every GPU, then pair.py, with WORK/done
holding the exit status whatever happens. A stand-in python3 on PATH records each call, so
the pipeline's logic is tested without PyTorch or a GPU."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "train" / "sample_and_train.sh"
FAKE_PYTHON = """#!/bin/sh
echo "GPU=$CUDA_VISIBLE_DEVICES $*" >> "$CALLS"
case "$*" in
  -c*) echo "${FAKE_GPUS:-2}" ;;
  *generate_text.py*)
    [ "$CUDA_VISIBLE_DEVICES" = "${FAIL_GPU:-none}" ] && exit 1
    [ "$CUDA_VISIBLE_DEVICES" = "${SLOW_GPU:-none}" ] && exec sleep 60  # a sampler that runs on
    exit 0 ;;
  *pair.py*) exit "${PAIR_STATUS:-0}" ;;
esac
"""

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def run(tmp_path, env_extra=None, work=None, pair_args=()):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    work = work or tmp_path / "work"
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SEED": "40",
           **(env_extra or {})}
    (tmp_path / "sotu=3,brown=x").write_text("")  # what the glob in the arguments would match
    proc = subprocess.run(["bash", str(SCRIPT), str(work), "T.gguf", "DATA", "0.5",
                           "--batch 8 --free-share 0.2 --source-weights sotu=3,brown=*",
                           "--root", "R", "--variant", "a=--lr 1e-4", *pair_args],
                          env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, (work / "done").read_text().strip() if (work / "done").exists() else None, lines


def test_samples_on_every_gpu_then_trains(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "attention.txt").write_text("matmul\n")
    proc, done, calls = run(tmp_path, work=work)
    assert proc.returncode == 0 and done == "0", proc.stdout + proc.stderr
    generate = [c for c in calls if "generate_text.py" in c]
    assert len(generate) == 2
    for g, call in enumerate(sorted(generate)):
        assert call.startswith(f"GPU={g} ")
        assert f"--out {work}/synthetic/synthetic-{g}.u16 --minutes 0.5 --seed {40 + g} --attention matmul" in call
        assert call.endswith("--batch 8 --free-share 0.2 --source-weights sotu=3,brown=*")  # no glob expansion
        assert str(work / "code" / "tools" / "train") in call  # runs from the copy
    assert calls[-1].endswith("pair.py --teacher T.gguf --root R --variant a=--lr 1e-4 --gpus 0,1")
    assert not list((work / "code" / "python").rglob("*.tinyloop"))


def test_failed_sampling_stops_before_training(tmp_path):
    proc, done, calls = run(tmp_path, {"FAIL_GPU": "1"})
    assert done == "92" and proc.returncode == 92
    assert "sampling on GPU 1 failed" in proc.stdout
    assert not any("pair.py" in c for c in calls)


def test_training_status_reaches_done(tmp_path):
    proc, done, _ = run(tmp_path, {"PAIR_STATUS": "5"})
    assert done == "5" and proc.returncode == 5


def test_unreadable_gpu_count_stops(tmp_path):
    proc, done, calls = run(tmp_path, {"FAKE_GPUS": "Traceback"})
    assert done == "91" and not any("generate_text.py" in c for c in calls)


def test_existing_records_are_not_appended_to(tmp_path):
    work = tmp_path / "work"
    (work / "synthetic").mkdir(parents=True)
    (work / "synthetic" / "synthetic-0.u16").write_bytes(b"\0\0")
    proc, done, calls = run(tmp_path, work=work)
    assert done == "93" and calls == []
    assert "already holds records" in proc.stdout


def test_gpu_0_keeps_sampling_while_the_others_train(tmp_path):
    proc, done, calls = run(tmp_path, {"KEEP_SAMPLING_MINUTES": "2.5", "SLOW_GPU": "0"})
    assert proc.returncode == 0 and done == "0", proc.stdout + proc.stderr
    generate = sorted(c for c in calls if "generate_text.py" in c)
    assert "--minutes 3 " in generate[0] and "--minutes 0.5 " in generate[1]
    assert calls[-1].endswith("--variant a=--lr 1e-4 --gpus 1")
    assert "stopped the sampler on GPU 0, which was still running" in proc.stdout  # not left behind
    assert "the sampler on GPU 0 exited 143" in proc.stdout  # the stand-in's sleep does not catch SIGTERM


def test_no_minutes_kept_means_every_gpu_trains(tmp_path):
    proc, done, calls = run(tmp_path, {"KEEP_SAMPLING_MINUTES": "0.0"})
    assert done == "0" and calls[-1].endswith("--gpus 0,1")


def test_more_variants_than_gpus_share_them_in_turn(tmp_path):
    variants = ["--variant", "b=", "--variant", "c="]
    proc, done, calls = run(tmp_path, {"FAKE_GPUS": "1"}, pair_args=variants)
    assert done == "0" and calls[-1].endswith("--variant c= --gpus 0,0,0"), proc.stdout + proc.stderr
    (tmp_path / "two").mkdir()
    proc, done, calls = run(tmp_path / "two", {"FAKE_GPUS": "2"}, pair_args=variants)
    assert done == "0" and calls[-1].endswith("--variant c= --gpus 0,1,0"), proc.stdout + proc.stderr


def test_keeping_a_sampler_needs_a_gpu_per_variant(tmp_path):
    proc, done, calls = run(tmp_path, {"KEEP_SAMPLING_MINUTES": "2"}, pair_args=["--variant", "b="])
    assert done == "94" and "1 GPU(s) left for 2 variant(s)" in proc.stdout
    assert not any("generate_text.py" in c for c in calls)  # refused before any sampling


def test_keeping_a_sampler_needs_a_gpu_to_train_on(tmp_path):
    proc, done, calls = run(tmp_path, {"KEEP_SAMPLING_MINUTES": "2", "FAKE_GPUS": "1"})
    assert done == "94" and not any("generate_text.py" in c for c in calls)
    proc, done, calls = run(tmp_path, {"KEEP_SAMPLING_MINUTES": "soon"}, work=tmp_path / "w2")
    assert done == "94" and "needs a number of minutes" in proc.stdout


def test_failed_sampling_stops_the_kept_sampler_too(tmp_path):
    proc, done, calls = run(tmp_path, {"KEEP_SAMPLING_MINUTES": "2", "SLOW_GPU": "0", "FAIL_GPU": "1"})
    assert done == "92" and "stopped the sampler on GPU 0" in proc.stdout
    assert not any("pair.py" in c for c in calls)


def test_usage(tmp_path):
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "usage:" in proc.stderr
