"""scripts/bench_stages.py: its comma-separated list options (warps, V blocks) parse (CPU)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_stages as bs  # noqa: E402


def test_int_lists():
    assert bs.ints("32,64,128") == [32, 64, 128]
    assert bs.ints("") == [None]
