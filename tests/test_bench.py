"""The benchmark CLI's parsing, defaults, floors, CSV output and refusals (CPU)."""
import csv
import itertools

import pytest
import torch

from kda_opt import bench


def test_defaults_match_spec():
    a = bench.parse_args([])
    c = bench.case_from_args(a)
    assert (a.test, c.B, c.T, c.H, c.K, a.chunk_size) == ("all", 1, 8192, 96, 128, 64)
    assert (c.gate, c.lower_bound, c.dtype) == ("safe", -5.0, torch.bfloat16)
    assert not a.sweep


@pytest.mark.parametrize("flags,gate", [(["--no-safe-gate"], "softplus"), (["--no-gate-in-kernel"], "preactivated"),
                                        (["--no-gate-in-kernel", "--no-safe-gate"], "preactivated")])
def test_gate_flags(flags, gate):
    assert bench.case_from_args(bench.parse_args(flags)).gate == gate


def test_options_parse():
    a = bench.parse_args("--test fla --batch-size 2 --seq-len 100 --num-heads 4 --head-dim 64 "
                         "--lower-bound -3 --dtype fp16 --seed 7 --warmup 5 --rep 9".split())
    c = bench.case_from_args(a)
    assert (a.test, c.B, c.T, c.H, c.K, c.lower_bound, c.dtype, c.seed, a.warmup, a.rep) == (
        "fla", 2, 100, 4, 64, -3.0, torch.float16, 7, 5, 9)
    args = c.inputs(device="cpu")
    assert args["lower_bound"] == -3.0 and args["q"].dtype == torch.float16


@pytest.mark.parametrize("bad", [["--chunk-size", "32"], ["--test", "speed"], ["--dtype", "fp8"]])
def test_bad_options_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2


def test_floors_at_default_shape():
    c = bench.case_from_args(bench.parse_args([]))
    # SPEC §5: about 1.0 GB and 0.1–0.2 TFLOP at the default shape.
    assert 0.95e9 < bench.min_bytes(c) < 1.05e9
    assert 0.1e12 < bench.min_flops(c) < 0.2e12


def test_csv_roundtrip(tmp_path):
    row = dict(B=1, T=2048, H=16, K=128, V=128, mode="safe", fla_ms=1.8, kda_opt_ms=0.5, speedup=3.6,
               tbps=1.0, tflops=50.0, bytes_floor_pct=30.0, flops_floor_pct=10.0)
    path = tmp_path / "b.csv"
    bench.write_csv([row, dict(row, mode="softplus")], path)
    rows = list(csv.DictReader(open(path)))
    assert [r["mode"] for r in rows] == ["safe", "softplus"]
    assert list(rows[0]) == bench.CSV_FIELDS and float(rows[0]["speedup"]) == 3.6


def test_plot_is_small(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(B=1, T=t, H=32, K=128, V=128, mode=m, fla_ms=t / 1000, kda_opt_ms=t / 3000, speedup=3.0)
            for t in (1024, 2048, 4096) for m in ("safe", "softplus")]
    path = tmp_path / "b.png"
    bench.write_plot(rows, path, "test")
    assert 0 < path.stat().st_size < 200_000


def test_plot_before_any_h32_row(tmp_path, recwarn):
    """A sweep plots after its first shape, (1, 8192, 96): no H=32 line yet, and no legend warning."""
    pytest.importorskip("matplotlib")
    row = dict(B=1, T=8192, H=96, K=128, V=128, mode="safe", fla_ms=2.9, kda_opt_ms=2.0, speedup=1.45)
    bench.write_plot([row], tmp_path / "b.png", "test")
    assert (tmp_path / "b.png").stat().st_size > 0
    assert not [w for w in recwarn if "legend" in str(w.message)]


@pytest.mark.parametrize("test", ["naive", "fla", "benchmark", "all"])
def test_refuses_without_gpu(monkeypatch, capsys, test):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--test", test]) == 2
    err = capsys.readouterr().err
    assert "GPU" in err and len(err.strip().splitlines()) == 1


def test_refuses_without_fla(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None if name == "fla" else real(name))
    assert bench.main(["--test", "benchmark"]) == 2
    assert "fla-core" in capsys.readouterr().err


def test_sweep_rows_merge(tmp_path):
    row = dict(B=1, T=2048, H=16, K=128, V=128, mode="safe", fla_ms=1.8, kda_opt_ms=0.5, speedup=3.6,
               tbps=1.0, tflops=50.0, bytes_floor_pct=30.0, flops_floor_pct=10.0)
    path = tmp_path / "b.csv"
    bench.write_csv([row, dict(row, T=4096)], path)
    old = bench.read_csv(path)
    assert old[0]["T"] == 2048 and old[0]["fla_ms"] == 1.8 and old[0]["mode"] == "safe"
    merged = bench.merge_rows(old, [dict(row, kda_opt_ms=0.25), dict(row, mode="softplus")])
    assert [(r["T"], r["mode"], r["kda_opt_ms"]) for r in merged] == [
        (2048, "safe", 0.25), (4096, "safe", 0.5), (2048, "softplus", 0.5)]


def test_varlen_options():
    c = bench.case_from_args(bench.parse_args(["--varlen", "--num-seqs", "5", "--seq-len", "300", "--num-heads", "4"]))
    assert c.B == 1 and len(c.seqlens) == 5 and all(64 <= n <= 300 for n in c.seqlens) and c.T == sum(c.seqlens)
    assert c == bench.case_from_args(bench.parse_args(["--varlen", "--num-seqs", "5", "--seq-len", "300",
                                                        "--num-heads", "4"]))  # seeded: the same lengths
    args = c.inputs(device="cpu", initial_state=True)
    assert args["cu_seqlens_cpu"].tolist() == [0, *itertools.accumulate(c.seqlens)]
    assert args["initial_state"].shape[0] == 5
    explicit = bench.case_from_args(bench.parse_args(["--seq-lens", "1300,547,2048", "--l2norm"]))
    assert explicit.seqlens == (1300, 547, 2048) and explicit.T == 3895 and explicit.l2norm
    assert explicit.tag == "b1_t3895_h96_k128_safe_varlen3_l2norm"


@pytest.mark.parametrize("bad", [["--varlen", "--batch-size", "2"], ["--seq-lens", "5,0"], ["--varlen", "--seq-len", "10"]])
def test_bad_varlen_options_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2


def test_trimmed_case_keeps_whole_sequences_first():
    c = bench.case_from_args(bench.parse_args(["--seq-lens", "1300,547,2048"]))
    assert c.trimmed(1500).seqlens == (1300, 200) and c.trimmed(1847).seqlens == (1300, 547)
    assert c.trimmed(100).seqlens == (100,) and c.trimmed(5000) == c


def test_sweep_has_the_serving_rows():
    cases = bench.sweep_cases(bench.parse_args(["--sweep-gates", "safe"]))
    assert len(cases) == len(bench.SWEEP_SHAPES) + 2
    varlen, l2norm = cases[-2:]
    assert (varlen.H, len(varlen.seqlens), max(varlen.seqlens) <= 8192, varlen.l2norm) == (32, 64, True, False)
    assert (l2norm.B, l2norm.T, l2norm.H, l2norm.seqlens, l2norm.l2norm) == (1, 8192, 96, None, True)
    assert not any(c.seqlens or c.l2norm for c in cases[:-2])


def test_rows_of_an_older_csv_merge_with_serving_rows(tmp_path):
    """A CSV written before the varlen/l2norm columns: its rows are fixed-length, no l2norm."""
    path = tmp_path / "old.csv"
    path.write_text("B,T,H,K,V,mode,fla_ms,kda_opt_ms,speedup,tbps,tflops,bytes_floor_pct,flops_floor_pct\n"
                    "1,8192,96,128,128,safe,2.9,1.43,2.03,0.71,99,24,14\n")
    new = dict(B=1, T=8192, H=96, K=128, V=128, mode="safe", varlen=0, l2norm=1, fla_ms=3.0, kda_opt_ms=1.5,
               speedup=2.0, tbps=0.7, tflops=90.0, bytes_floor_pct=23.0, flops_floor_pct=13.0)
    merged = bench.merge_rows(bench.read_csv(path), [new])
    assert [(r["l2norm"], r["kda_opt_ms"]) for r in merged] == [(0, 1.43), (1, 1.5)]
    bench.write_csv(merged, path)
    assert [r["l2norm"] for r in csv.DictReader(open(path))] == ["0", "1"]
