"""The `tinyloop` command line run in a child process, and the JSON report it prints last."""

import json
import os
import subprocess
import sys


def run(*args, check=True, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "tinyloop", *map(str, args)],
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=dict(os.environ, PYTHONIOENCODING="utf-8"))
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def last_json(proc) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr
    return json.loads(lines[-1])
