"""scripts/bench_stages.py: its variant options parse into the launchers' keyword arguments (CPU)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import bench_stages as bs  # noqa: E402


def test_intra_variants():
    assert bs.intra_variants("32:4:2,16:8:,::,64") == [
        {"block_k": 32, "num_warps": 4, "num_stages": 2}, {"block_k": 16, "num_warps": 8}, {}, {"block_k": 64}]
    assert bs.variant_label({"block_k": 16, "num_warps": 8}) == "16:8" and bs.variant_label({}) == "default"


def test_int_lists():
    assert bs.ints("32,64,128") == [32, 64, 128]
    assert bs.ints("") == [None]
