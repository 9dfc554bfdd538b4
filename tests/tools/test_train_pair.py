"""tools/train/pair.py: models come back from the GPU machine in pieces below its 16 MiB
per-file limit that join to the same bytes; variant arguments are parsed strictly."""

from pathlib import Path

import pytest

from tool_module import load_tool


@pytest.fixture(scope="module")
def pair():
    return load_tool("train/pair.py", "pair")


@pytest.mark.parametrize("size", [0, 1, 15 << 20, (15 << 20) + 1, (31 << 20) + 12345])
def test_pieces_join_to_the_file(pair, tmp_path, size):
    src = tmp_path / "m.tinyloop"
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    src.write_bytes(data)
    dest = tmp_path / "out"
    dest.mkdir()
    pieces = pair.split_file(src, dest)
    assert len(pieces) == -(-size // pair.PIECE_BYTES)
    assert all(p.stat().st_size <= 16 << 20 for p in pieces)
    assert [p.name for p in pieces] == [f"m.tinyloop.part-{i}" for i in range(len(pieces))]
    assert b"".join(p.read_bytes() for p in pieces) == data


def test_named_arguments(pair):
    assert pair.named(['a=--lr 1e-4 --seed 2', 'b='], "--variant") == {"a": "--lr 1e-4 --seed 2", "b": ""}
    for bad in ("no-equals", "1x=--lr 1", "=--lr 1"):
        with pytest.raises(SystemExit, match="NAME=ARGS"):
            pair.named([bad], "--variant")


@pytest.mark.parametrize("gpus", ["1", "0,x", "-1,2"])
def test_every_variant_needs_a_gpu_index(pair, tmp_path, gpus):
    with pytest.raises(SystemExit, match="one GPU index per variant"):
        pair.main(["--teacher", "T.gguf", "--root", str(tmp_path / "r"), "--copy-to", str(tmp_path / "o"),
                   "--run-minutes", "1", "--variant", "a=", "--variant", "b=", f"--gpus={gpus}"])


def test_each_variant_trains_on_its_gpu(pair, tmp_path, monkeypatch):
    launched = []

    class FakeRun:  # a train.py that exits at once without results: nothing to export
        def __init__(self, cmd, env, stdout, stderr):
            launched.append((cmd[cmd.index("--out") + 1], env["CUDA_VISIBLE_DEVICES"]))
            (Path(cmd[cmd.index("--out") + 1]) / "train.log").write_text("")

        def wait(self):
            return 1

    monkeypatch.setattr(pair.subprocess, "Popen", FakeRun)
    status = pair.main(["--teacher", "T.gguf", "--root", str(tmp_path / "r"), "--copy-to", str(tmp_path / "o"),
                        "--run-minutes", "1", "--variant", "a=", "--variant", "b=", "--gpus", "1,3"])
    assert status == 1  # neither run left results
    assert launched == [(str(tmp_path / "r" / "a"), "1"), (str(tmp_path / "r" / "b"), "3")]
