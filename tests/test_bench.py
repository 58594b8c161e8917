"""The benchmark CLI's parsing, defaults, floors, CSV output and refusals (CPU)."""
import csv
import importlib.util
import itertools
import sys
import types

import pytest
import torch

from inputs import random_inputs
from kda_bench import bench, common, peers
from kda_bench.inputs import DECAYS, GATES, LAYOUTS, draw_call


def test_defaults_match_spec():
    a = bench.parse_args([])
    c = bench.case_from_args(a)
    assert (a.test, c.B, c.T, c.H, c.K, a.chunk_size) == ("all", 1, 8192, 96, 128, 64)
    assert (c.gate, c.lower_bound, c.dtype) == ("safe", -5.0, torch.bfloat16)
    assert not a.sweep


def test_the_call_a_server_makes_by_default():
    """The call a server makes: an initial state, A_log as the Kimi layer draws it (A = exp(A_log) in [1, 16]) and the
    fast-decay dt_bias ~ N(0, 1); --no-initial-state and --decay layer say otherwise, in the label too."""
    c = bench.case_from_args(bench.parse_args(["--seq-len", "64", "--num-heads", "32", "--no-safe-gate"]))
    args = c.inputs(device="cpu")
    assert args["initial_state"].shape == (1, 32, 128, 128) and args["initial_state"].dtype == torch.float32
    assert bool((args["A_log"] >= 0).all() and (args["A_log"] <= torch.log(torch.tensor(16.0))).all())
    assert args["A_log"].exp().max() > 8 and args["dt_bias"].std() > 0.5
    quiet = bench.case_from_args(bench.parse_args("--seq-len 64 --num-heads 32 --no-initial-state --decay layer".split()))
    args = quiet.inputs(device="cpu")
    assert "initial_state" not in args and quiet.label.endswith("no-initial-state decay=layer")
    assert bool((torch.nn.functional.softplus(args["dt_bias"]) <= 0.1 + 1e-6).all())
    assert quiet.inputs(device="cpu", initial_state=True)["initial_state"].shape == (1, 32, 128, 128)



# A layout of the benchmark's (kda_bench/inputs.LAYOUTS) → the tests' random_inputs options for that call.
TESTS_OPTIONS = {"default": {}, "l2norm": dict(l2norm=True), "kimi": dict(l2norm=True, beta_logits=True,
                                                                           state_v_first=True)}


@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_benchmark_draws_the_tests_numbers_on_its_calls(gate, layout):
    """The benchmark's own drawing (kda_bench/inputs.draw_call) makes, for each of its calls, the
    arguments the tests' random_inputs makes for that call, key for key in the same order and bit for
    bit: the inputs the profiles were measured on, from the one drawing both had before."""
    calls = [dict(B=2, T=40), dict(B=1, T=100, seqlens=[30, 0, 70], initial_state=True, seed=3)]
    for call, decay, dtype in itertools.product(calls, DECAYS, (torch.bfloat16, torch.float32)):
        kw = dict(H=2, K=32, gate=gate, dtype=dtype, decay=decay, device="cpu", **call)
        ours, theirs = draw_call(layout=layout, **kw), random_inputs(**kw, **TESTS_OPTIONS[layout])
        assert list(ours) == list(theirs), (call, decay)
        for name, x in theirs.items():
            y = ours[name]
            assert (torch.equal(y, x) and y.dtype == x.dtype) if torch.is_tensor(x) else y == x, (name, call, dtype)
    assert set(TESTS_OPTIONS) == set(LAYOUTS) and set(bench.CONFIGS.values()) <= set(LAYOUTS)

def test_benchmark_row_says_what_the_state_costs(monkeypatch):
    """With a state, kda_forward is also timed without it, and the row says so; without, n/a."""
    import triton.testing
    times = iter(range(1, 100))
    monkeypatch.setattr(triton.testing, "do_bench", lambda f, **kw: float(next(times)))
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench.peers, "flashkda", lambda args: (None, "not here"))
    monkeypatch.setattr(bench, "kernel_ms", lambda f, columns: {"stage1_ms": 0.25, "stages13_ms": 0.75})
    seen = []
    forward = lambda **a: seen.append("initial_state" in a and a["initial_state"] is not None)
    case = bench.Case(1, 64, 2, 64, "safe", -5.0, torch.float32, 0)
    monkeypatch.setattr(bench.Case, "inputs", lambda self: random_inputs(1, 64, 2, 64, device="cpu",
                                                                          initial_state=self.initial_state))
    row = bench.benchmark(case, lambda **a: None, 1, 1, (1e12, 1e12), forward)
    assert row["initial_state"] == 1 and row["decay"] == "fast" and True in seen and False in seen
    assert isinstance(row["kda_opt_no_state_ms"], float) and isinstance(row["state_cost_pct"], float)
    assert row["stage1_ms"] == 0.25 and row["stages13_ms"] == 0.75
    seen.clear()
    row = bench.benchmark(bench.Case(1, 64, 2, 64, "safe", -5.0, torch.float32, 0, initial_state=False),
                          lambda **a: None, 1, 1, (1e12, 1e12), forward)
    assert row["initial_state"] == 0 and row["state_cost_pct"] == bench.NOT_RUN and True not in seen


def test_kernel_columns_name_the_stages_kernels():
    """stage1_ms is the time of kernels named as stage 1's (kda_opt/gate); stages13_ms of every
    kernel before stage 4 (gate, intra, seqs), and of no other kernel of the package; n/a without CUDA."""
    from kda_opt import gate, intra, merge, recurrence, seqs, wuso
    kernel = lambda x: hasattr(x, "fn") or hasattr(x, "arg_names")       # a Triton JITFunction
    names = lambda module: {n for n, x in vars(module).items() if n.endswith("_kernel") and kernel(x)}
    before, after = names(gate) | names(intra) | names(seqs), names(merge) | names(recurrence)
    assert before and after and {"wuso_kernel"} <= set(vars(wuso))
    assert all(n.startswith(bench.KERNEL_COLUMNS["stage1_ms"]) for n in names(gate))
    assert all(n.startswith(bench.KERNEL_COLUMNS["stages13_ms"]) for n in before)
    assert not any(n.startswith(bench.KERNEL_COLUMNS["stages13_ms"]) for n in after | {"wuso_kernel"})
    if not torch.cuda.is_available():
        assert bench.kernel_ms(lambda: None, bench.KERNEL_COLUMNS) == dict.fromkeys(bench.KERNEL_COLUMNS, bench.NOT_RUN)


@pytest.mark.parametrize("seqlens", [None, (30, 70)])
def test_flashkda_rows_time_checkpoints_every_512_tokens(monkeypatch, seqlens):
    """A row in FlashKDA's configuration with a state also times the call with fp32 V-first
    checkpoints every 512 tokens (a buffer with the rows kda_forward's docstring asks), and says what
    they cost; the default configuration's rows do not."""
    import triton.testing
    times = iter(range(1, 100))
    monkeypatch.setattr(triton.testing, "do_bench", lambda f, **kw: float(next(times)))
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench.peers, "flashkda", lambda args: (None, "not here"))
    buffers = []
    forward = lambda **a: buffers.append((a["checkpoints"].shape, a["checkpoints"].dtype, a["checkpoint_every"])
                                         if "checkpoints" in a else None)
    B = 1 if seqlens else 2
    for config in ("flashkda", "default"):
        case = bench.Case(B, 1100 if seqlens is None else 100, 2, 64, "safe", -5.0, torch.float32, 0,
                          seqlens=seqlens, config=config)
        monkeypatch.setattr(bench.Case, "inputs", lambda self: draw_call(
            self.B, self.T, 2, 64, device="cpu", seqlens=self.seqlens, initial_state=True,
            layout=bench.CONFIGS[self.config]))
        row = bench.benchmark(case, lambda **a: None, 1, 1, (1e12, 1e12), forward)
        timed = [b for b in buffers if b]
        if config == "flashkda":
            rows = 3 if seqlens is None else 1 + 2 - 1     # cdiv(1100, 512); packed cdiv(100, 512) + N − 1
            assert timed and set(timed) == {((B, rows, 2, 64, 64), torch.float32, 512)}, timed
            assert isinstance(row["kda_opt_ckpt_every_ms"], float) and isinstance(row["ckpt_every_cost_pct"], float)
        else:
            assert not timed and row["ckpt_every_cost_pct"] == bench.NOT_RUN
        buffers.clear()


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


@pytest.mark.parametrize("bad", [["--chunk-size", "32"], ["--test", "speed"], ["--dtype", "fp8"],
                                 ["--sweep", "--sweep-gates", "safe_no_A"]])
def test_bad_options_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2


def test_floors_at_default_shape():
    c = bench.case_from_args(bench.parse_args([]))
    # About 1.0 GB and 0.1–0.2 TFLOP at the default shape.
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


def test_quiet_option():
    """--quiet (no progress bar) is off unless given."""
    assert bench.parse_args([]).quiet is False and bench.parse_args(["--quiet"]).quiet is True


def test_progress_without_a_bar_is_the_items_themselves(monkeypatch):
    """quiet, or without tqdm (optional for the benchmark): the items as they are."""
    items = [("a", 1), ("b", 2), ("c", 3)]
    assert common.progress(items, quiet=True) is items
    monkeypatch.setitem(sys.modules, "tqdm", None)      # `from tqdm import tqdm` raises ImportError
    assert common.progress(items, str) is items and items == [("a", 1), ("b", 2), ("c", 3)]


def test_progress_bar_yields_every_item_in_order_and_names_it(capsys):
    """With tqdm: every item in order, the bar on stderr naming the one in hand; stdout left to the rows."""
    items = [("a", 1), ("b", 2), ("c", 3)]
    assert list(common.progress(items, lambda item: f"case {item[0]}")) == items
    out, err = capsys.readouterr()
    assert out == "" and "3/3" in err and "case c" in err


def test_rows_print_the_same_with_and_without_tqdm(monkeypatch, capsys):
    """show and echo write the same lines on stdout whether tqdm writes them (above a bar) or print does."""
    common.show(dict(B=1, kda_opt_ms=0.5))
    common.echo("wrote x.csv")
    monkeypatch.setitem(sys.modules, "tqdm", None)
    common.show(dict(B=1, kda_opt_ms=0.5))
    common.echo("wrote x.csv")
    assert capsys.readouterr().out == "  B 1  kda_opt_ms 0.5000\nwrote x.csv\n" * 2


def test_sweep_shows_a_progress_bar_and_quiet_hides_it(monkeypatch, capsys, tmp_path):
    """The sweep end to end with the GPU's parts stood in for: a bar on stderr through every case (its
    count and the case in hand), none with --quiet, the same CSV either way."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(peers, "fla_chunk_kda", lambda: object())
    monkeypatch.setattr(bench, "measure_ceilings", lambda: None)
    monkeypatch.setattr(bench, "write_plot", lambda *a, **kw: None)
    row = lambda c: {**c.columns, "fla_ms": 2.0, "kda_opt_ms": 1.0, "speedup": 2.0, "tbps": 1.0, "tflops": 1.0}
    monkeypatch.setattr(bench, "benchmark", lambda c, *a, **kw: row(c))
    argv = ["--sweep", "--sweep-rows", "dtypes", "--out-dir", str(tmp_path)]
    assert bench.main(argv) == 0
    err = capsys.readouterr().err
    cases = bench.sweep_cases(bench.parse_args(argv))
    assert f"{len(cases)}/{len(cases)}" in err and cases[-1].label in err
    (csv_path,) = tmp_path.glob("benchmark_*.csv")
    written = csv_path.read_text()
    assert bench.main(argv + ["--quiet"]) == 0
    assert capsys.readouterr().err == "" and csv_path.read_text() == written


def test_model_refuses_without_flas_models(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(peers, "fla_chunk_kda", lambda: object())
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "fla.models" else real(name))
    assert bench.main(["--test", "model"]) == 2
    assert "flash-linear-attention" in capsys.readouterr().err


def test_model_gates_option(monkeypatch, capsys):
    assert bench.parse_args([]).model_gates == "softplus,safe"
    assert bench.parse_args(["--model-gates", "safe"]).model_gates == "safe"
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--model-gates", "sigmoid"])
    assert e.value.code == 2


def test_sglang_calls_run_in_parts(tmp_path):
    """--sglang-calls: a run of some calls keeps the CSV's rows of the others, in ROWS' order; an
    unknown call is refused."""
    from kda_bench import sglang
    assert bench.parse_args([]).sglang_calls.split(",") == list(sglang.METHODS)
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--sglang-calls", "extend,prefill"])
    assert e.value.code == 2
    row = lambda r, ms: dict(zip(("call", "H", "requests", "tokens", "gate"), r), sglang_ms=ms, taken=True)
    first, last = sglang.ROWS[0], sglang.ROWS[-1]
    assert first[0] == "extend" and last[0] == "decode_step"
    path = tmp_path / "sglang.csv"
    common.write_table([row(first, 1.5), row(last, 0.25)], path, ["call", "H", "requests", "tokens", "gate",
                                                                  "sglang_ms", "taken"])
    kept = sglang.earlier_rows(path, ("decode_step",))
    assert [r["sglang_ms"] for r in kept] == [1.5]
    assert [r["call"] for r in sglang.in_rows_order([row(last, 0.2), *kept])] == ["extend", "decode_step"]
    assert sglang.earlier_rows(tmp_path / "absent.csv", ("extend",)) == []


def test_a_small_error_is_written_as_itself(tmp_path):
    """A float below 1e-3 keeps 3 significant digits in a CSV (4 decimals would write 2.4e-5 as 0.0000),
    and reads back as the number it was."""
    path = tmp_path / "errors.csv"
    common.write_table([dict(a=2.4e-5, b=0.0, c=1.23456, d="n/a", e=-3e-7, f=7)], path, list("abcdef"))
    assert path.read_text().splitlines()[1] == "2.40e-05,0.0000,1.2346,n/a,-3.00e-07,7"
    assert common.read_csv(path) == [dict(a=2.4e-5, b=0.0, c=1.2346, d="n/a", e=-3e-7, f=7)]


def test_systems_switch_flas_dispatch_and_restore_it(monkeypatch):
    monkeypatch.setenv("FLA_KDA_OPT", "7")
    for system, value in (("kda_opt", "1"), ("fla", "0")):
        with common.system(system):
            assert common.os.environ["FLA_KDA_OPT"] == value
        assert common.os.environ["FLA_KDA_OPT"] == "7"
    monkeypatch.delenv("FLA_KDA_OPT")
    with common.system("fla"):
        pass
    assert "FLA_KDA_OPT" not in common.os.environ


def test_model_rows_take_turns_and_time_what_they_name(monkeypatch):
    # A stand-in model records which system each call ran under (FLA_KDA_OPT) and its cache and mask.
    from kda_bench import model
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    real = model.prompts
    monkeypatch.setattr(model, "prompts", lambda *a, **kw: real(*a, **kw, device="cpu"))
    calls = []

    def fake(input_ids, attention_mask, past_key_values, use_cache, logits_to_keep):
        calls.append((model.os.environ["FLA_KDA_OPT"], past_key_values, attention_mask))
        logits = torch.zeros(input_ids.shape[0], 1, 8)
        logits[:, 0, int(input_ids[0, -1]) % 8] = 1
        return types.SimpleNamespace(logits=logits, past_key_values={"steps": len(calls)})
    rows = model.prefill_row(fake, 2, 10, False)
    assert [c[0] for c in calls] == ["0", "1"] * model.REPEATS and set(rows) == {"fla", "kda_opt"}
    assert all(len(t) == model.REPEATS and tokens.shape == (2, 1) and logits.shape == (2, 1, 8)
               for t, tokens, logits in rows.values())
    calls.clear()
    rows = model.cached_row(fake, 2, 10)
    prompt_caches = [c for _, c, _ in calls[:2]]
    timed_caches = [c for _, c, _ in calls[2:]]
    assert prompt_caches == [None, None] and len(timed_caches) == 2 * model.REPEATS
    assert len({id(c) for c in timed_caches}) == len(timed_caches)      # a fresh copy per repeat
    calls.clear()
    rows = model.decode_row(fake, 2, True)
    assert all(tokens.shape == (2, model.DECODE_STEPS + 1) and logits.shape == (2, model.DECODE_STEPS + 1, 8)
               and torch.equal(logits.argmax(-1), tokens) for _, tokens, logits in rows.values())
    masks = [m.shape[1] for _, _, m in calls[:model.DECODE_STEPS + 1]]
    assert masks == list(range(model.PROMPT, model.PROMPT + model.DECODE_STEPS + 1))   # one more column a step


def test_model_run_of_one_gate_keeps_the_other_gates_rows(tmp_path):
    from kda_bench import model
    row = lambda gate, ms: dict(gate=gate, phase="decode", B=2, T=1, padded=True, fla_ms=ms, kda_opt_ms=1.0,
                                speedup=ms, tokens_match=True)
    path = tmp_path / "model.csv"
    bench.write_table([row("softplus", 2.0), row("safe", 3.0)], path, model.FIELDS)
    rows = model.with_other_gates([row("safe", 4.0)], model.earlier_rows(path, ("safe",)))
    assert [(r["gate"], r["fla_ms"], r["padded"], r["tokens_match"]) for r in rows] == [
        ("softplus", 2.0, True, True), ("safe", 4.0, True, True)]
    assert model.with_other_gates([row("safe", 4.0)], model.earlier_rows(tmp_path / "none.csv", ("safe",))) == [
        row("safe", 4.0)]


def test_parting_gap_is_flas_margin_in_bf16_steps_where_tokens_part():
    from kda_bench import model
    tokens = torch.tensor([[1, 2, 3], [1, 2, 3]])
    logits = torch.zeros(2, 3, 8)
    logits[0, 1, 2], logits[0, 1, 5] = 3.1875, 3.1875        # request 0 parts at step 1: an exact tie
    logits[0, 2, 3] = 4.0                                    # (and differs at step 2, no longer a tie)
    logits[1, 2, 3], logits[1, 2, 4] = 2.75, 2.734375        # request 1 parts at step 2: one bf16 step
    ours = torch.tensor([[1, 5, 0], [1, 2, 4]])
    assert model.parting_gap(tokens, logits, ours) == 1.0
    assert model.parting_gap(tokens[:1], logits[:1], ours[:1]) == 0.0
    logits[1, 2, 4] = 2.5                                    # 16 steps below 2.75
    assert model.parting_gap(tokens, logits, ours) == 16.0
    assert model.parting_gap(tokens, logits, tokens) == model.NOT_RUN


def test_model_prompts_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from kda_bench import model
    ids, mask = model.prompts(3, 300, True, device="cpu")
    assert ids.shape == (3, 300) and mask.sum(1).tolist() == [300, 200, 100] and mask[:, -1].all()
    assert model.prompts(2, 8, False, device="cpu")[1] is None
    rows = [dict(gate=g, phase=p, B=B, T=T, padded=pad, fla_ms=2.0, kda_opt_ms=1.0, speedup=2.0, tokens_match=True,
                 parting_gap="n/a")
            for g in model.GATES for p, B, T, pad in model.ROWS]
    model.plot(rows, tmp_path / "m.png", "a GPU")
    assert 0 < (tmp_path / "m.png").stat().st_size < 200_000


def test_plot_is_small(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(B=1, T=t, H=32, K=128, V=128, mode=m, fla_ms=t / 1000, kda_opt_ms=t / 3000, speedup=3.0)
            for t in (1024, 2048, 4096) for m in ("safe", "softplus")]
    path = tmp_path / "b.png"
    bench.write_plot(rows, path, "test")
    assert 0 < path.stat().st_size < 200_000


def test_plot_of_flashkda_configuration_has_a_bar_per_system_and_case(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes
    row = dict(B=1, T=8192, H=96, K=128, V=128, mode="safe", config="flashkda", fla_ms=3.2, kda_opt_ms=1.6,
               speedup=2.0, flashkda_ms=1.5, speedup_vs_flashkda=0.94)
    rows = [row, dict(row, varlen=6, kda_opt_ms=1.7), dict(row, config="default", flashkda_ms="n/a")]
    bars, bar = [], matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, h, *a, **kw: bars.append((kw["label"], h)) or bar(self, x, h, *a, **kw))
    bench.write_plot(rows, tmp_path / "b.png", "test", "flashkda")
    assert bars == [("FLA", [3.2, 3.2]), ("kda_opt", [1.6, 1.7]), ("FlashKDA", [1.5, 1.5])]
    assert 0 < (tmp_path / "b.png").stat().st_size < 200_000


def test_plot_before_any_h32_row(tmp_path, recwarn):
    """A sweep plots after its first shape, (1, 8192, 96): no H=32 line yet, and no legend warning."""
    pytest.importorskip("matplotlib")
    row = dict(B=1, T=8192, H=96, K=128, V=128, mode="safe", fla_ms=2.9, kda_opt_ms=2.0, speedup=1.45)
    bench.write_plot([row], tmp_path / "b.png", "test")
    assert (tmp_path / "b.png").stat().st_size > 0
    assert not [w for w in recwarn if "legend" in str(w.message)]


@pytest.mark.parametrize("test", ["naive", "fla", "benchmark", "all", "host", "cp", "decode", "model", "sglang"])
def test_refuses_without_gpu(monkeypatch, capsys, test):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--test", test]) == 2
    err = capsys.readouterr().err
    assert "GPU" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("err,same,rc", [(9e-3, True, 0), (1.1e-2, True, 1), (1e-3, False, 1)])
def test_sglang_mode_fails_on_a_row_apart_or_touched(monkeypatch, capsys, err, same, rc):
    """--test sglang exits 1 where kda_opt and SGLang's kernel differ by more than twice the error
    floor, or a pool row not named was touched (rows, and SGLang itself, stood in for)."""
    from kda_bench import sglang
    on_a_gpu_where(monkeypatch, "sglang", "found")
    row = dict(call="extend", H=8, requests=1, tokens=2048, gate="safe", sglang_kernel="extend: Triton chunk_kda",
               timing="eager", sglang_ms=1.0, kda_opt_ms=0.5, speedup=2.0, taken=True, sglang_flashkda_ms="n/a",
               sglang_helion_ms=0.9, helion_max_rel_err=0.3, max_rel_err=err, untouched_ok=same)
    monkeypatch.setattr(sglang, "sglang_rows", lambda *a, **kw: [row])
    monkeypatch.setattr(sglang, "host_rows", lambda: {"kda_opt": 0.1, "sglang_triton": 0.5})
    assert bench.main(["--test", "sglang"]) == rc       # (the Helion kernel's own error is its, not a failure)
    out = capsys.readouterr().out
    assert "host ms per extend call" in out and "0.900 3.00e-01" in out


@pytest.mark.parametrize("test,package,says", [("sglang", "sglang", "needs SGLang"), ("benchmark", "fla", "fla-core")])
def test_refuses_without_its_package(monkeypatch, capsys, test, package, says):
    on_a_gpu_where(monkeypatch, package, None)
    assert bench.main(["--test", test]) == 2
    assert says in capsys.readouterr().err


def on_a_gpu_where(monkeypatch, package, spec):
    """A GPU stood in for, and importlib's find_spec answering `spec` for `package` (None: absent)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec if name == package else real(name))


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


def test_resumed_sweep_measures_only_the_cases_missing_from_its_csv(tmp_path, monkeypatch, capsys):
    """--resume skips every case with a row in the CSV and measures the rest (run again: none); without
    it, every case runs again."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(peers, "fla_chunk_kda", lambda: (lambda **a: None))
    monkeypatch.setattr(bench, "measure_ceilings", lambda: (1e12, 1e12))
    monkeypatch.setattr(bench, "write_plot", lambda *a, **kw: None)
    measured, times = [], dict(fla_ms=2.0, kda_opt_ms=1.0, speedup=2.0, tbps=1.0, tflops=1.0)
    monkeypatch.setattr(bench, "benchmark", lambda c, *a: measured.append(c) or dict(c.columns, **times))
    argv = ["--sweep", "--sweep-rows", "load", "--config", "flashkda", "--out-dir", str(tmp_path)]
    cases = bench.sweep_cases(bench.parse_args(argv))
    bench.write_csv([dict(cases[1].columns, **{**times, "kda_opt_ms": 2.0})], tmp_path / "benchmark_h200.csv")
    assert bench.main(argv + ["--resume"]) == 0
    assert measured == cases[:1] + cases[2:] and f"1 of {len(cases)} cases already" in capsys.readouterr().out
    rows = bench.read_csv(tmp_path / "benchmark_h200.csv")
    assert sorted(r["kda_opt_ms"] for r in rows) == [1.0] * (len(cases) - 1) + [2.0]
    measured.clear()
    assert bench.main(argv + ["--resume"]) == 0 and measured == []
    assert bench.main(argv) == 0 and measured == cases


def test_varlen_options():
    c = bench.case_from_args(bench.parse_args(["--varlen", "--num-seqs", "5", "--seq-len", "300", "--num-heads", "4"]))
    assert c.B == 1 and len(c.seqlens) == 5 and all(64 <= n <= 300 for n in c.seqlens) and c.T == sum(c.seqlens)
    assert c == bench.case_from_args(bench.parse_args(["--varlen", "--num-seqs", "5", "--seq-len", "300",
                                                        "--num-heads", "4"]))  # seeded: the same lengths
    args = c.inputs(device="cpu", initial_state=True)
    assert args["cu_seqlens_cpu"].tolist() == [0, *itertools.accumulate(c.seqlens)]
    assert args["initial_state"].shape[0] == 5
    explicit = bench.case_from_args(bench.parse_args(["--seq-lens", "1300,547,2048", "--l2norm"]))
    assert explicit.seqlens == (1300, 547, 2048) and explicit.T == 3895 and explicit.config == "l2norm"
    assert explicit.tag == "b1_t3895_h96_k128_safe_varlen3_l2norm"
    assert explicit.inputs(device="cpu")["use_qk_l2norm_in_kernel"]


@pytest.mark.parametrize("bad", [["--varlen", "--batch-size", "2"], ["--seq-lens", "5,0"], ["--varlen", "--seq-len", "10"]])
def test_bad_varlen_options_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2


def test_trimmed_case_keeps_whole_sequences_first():
    c = bench.case_from_args(bench.parse_args(["--seq-lens", "1300,547,2048"]))
    assert c.trimmed(1500).seqlens == (1300, 200) and c.trimmed(1847).seqlens == (1300, 547)
    assert c.trimmed(100).seqlens == (100,) and c.trimmed(5000) == c


def test_sweep_rows():
    """The sweep's and the peers' shapes, the packed mixes (the many-short-sequence ones too), the
    l2norm row; per gate mode."""
    cases = bench.sweep_cases(bench.parse_args([]))
    per_gate = len(bench.SWEEP_SHAPES) + len(bench.SWEEP_PACKED) + 1
    assert len(cases) == 2 * per_gate and {c.gate for c in cases[per_gate:]} == {"softplus"}
    shapes = [(c.B, c.T, c.H) for c in cases[:per_gate] if not c.seqlens and c.config == "default"]
    assert {(1, 8192, 96), (1, 8192, 64), (1, 65536, 16), (1, 2048, 16), (1, 65536, 32)} <= set(shapes)
    drawn, mix6, mix8, short32, short96, lognormal96, long64, step128, many512, l2norm = cases[per_gate - 10:per_gate]
    assert (drawn.H, len(drawn.seqlens), max(drawn.seqlens) <= 8192) == (32, 64, True)
    assert (mix6.H, mix6.T, mix6.seqlens) == (96, 8192, (1300, 547, 2048, 963, 271, 3063))
    assert (mix8.H, mix8.T, mix8.seqlens) == (96, 8192, (1024,) * 8)
    for mix, H, count, long in ((short32, 32, 384, 4096), (short96, 96, 256, 2048)):
        short = [n for n in mix.seqlens if n <= bench.MIN_SEQ_LEN]
        assert (mix.H, len(short), min(short), mix.T) == (H, count, 1, sum(mix.seqlens))
        assert sorted(mix.seqlens)[count:] == [long] * (len(mix.seqlens) - count) and max(short) == bench.MIN_SEQ_LEN
        assert mix.seqlens != tuple(sorted(mix.seqlens)) and mix.seqlens[-1] != long   # shuffled
    lens = sorted(lognormal96.seqlens)
    assert (lognormal96.H, len(lens), lens[0], lens[-1], lognormal96.T) == (96, 400, 1, bench.MIN_SEQ_LEN, sum(lens))
    assert 10 <= lens[200] <= 14                                                        # median ≈ 12
    lens = sorted(long64.seqlens)                                     # prefill under load: 64 long requests
    assert (long64.H, len(lens), lens[-1], long64.T) == (32, 64, 32768, sum(lens)) and 2000 <= lens[32] <= 2800
    assert 3500 <= long64.T / 64 <= 4100                                                # mean ≈ 3.8 k
    lens = sorted(step128.seqlens)                                    # the full GPU: a 128-request step
    assert (step128.H, len(lens), lens[-1], step128.T) == (32, 128, 8192, sum(lens)) and 800 <= lens[64] <= 1300
    assert {(16, 2048, 32), (32, 1024, 32), (16, 4096, 12), (8, 8192, 12)} <= set(shapes)
    assert (many512.H, many512.seqlens) == (32, (512,) * 512)
    assert (l2norm.T, l2norm.H, l2norm.seqlens, l2norm.config) == (8192, 96, None, "l2norm")
    serving = bench.sweep_cases(bench.parse_args(["--sweep-rows", "serving"]))
    shapes = bench.sweep_cases(bench.parse_args(["--sweep-rows", "shapes"]))
    assert serving == cases[per_gate - 10:per_gate] + cases[-10:]
    assert shapes == cases[:per_gate - 10] + cases[per_gate:-10]
    peers = bench.sweep_cases(bench.parse_args(["--sweep-rows", "peers", "--sweep-gates", "safe"]))
    assert [(c.B, c.T, c.H) for c in peers[:7]] == [(1, 8192, 96), (1, 8192, 64), (8, 4096, 32), (2, 16384, 64),
                                                   (1, 32768, 32), (1, 65536, 16), (1, 2048, 16)]
    assert peers[7:] == [mix6, mix8, short32, short96, lognormal96] and set(peers[:7]) <= set(cases[:per_gate])
    short = bench.sweep_cases(bench.parse_args(["--sweep-rows", "short", "--sweep-gates", "safe"]))
    assert short == [short32, short96, lognormal96]
    dtypes = bench.sweep_cases(bench.parse_args(["--sweep-rows", "dtypes", "--sweep-gates", "safe"]))
    assert [(c.B, c.T, c.H, c.dtype) for c in dtypes] == [(1, 8192, 96, torch.bfloat16), (1, 8192, 96, torch.float32)]
    assert dtypes[0] == cases[0] and dtypes[1].tag.endswith("_fp32")
    load = bench.sweep_cases(bench.parse_args(["--sweep-rows", "load", "--config", "flashkda"]))
    assert [(c.B, c.T, c.H) for c in load[:7]] == [(1, 8192, 96), (8, 4096, 32), (2, 16384, 64), (16, 2048, 32),
                                                   (32, 1024, 32), (16, 4096, 12), (8, 8192, 12)]
    assert [c.seqlens for c in load[7:]] == [long64.seqlens, step128.seqlens, many512.seqlens]
    assert {(c.config, c.gate) for c in load} == {("flashkda", "safe")}
    tp = bench.sweep_cases(bench.parse_args(["--sweep-rows", "tp", "--sweep-gates", "safe"]))
    assert {(c.B, c.T, c.H) for c in tp[:18]} == {(B, T, H) for B in (1, 4) for T in (8192, 32768, 131072)
                                                   for H in (8, 12, 24)}
    one_long8k, one_long32k, lognormal16, lognormal64 = tp[18:]
    for mix, long in ((one_long8k, 8192), (one_long32k, 32768)):
        assert (mix.H, sorted(mix.seqlens)[-1], sorted(mix.seqlens)[-2] <= bench.MIN_SEQ_LEN) == (12, long, True)
    assert (lognormal16.H, len(lognormal16.seqlens), max(lognormal16.seqlens) <= 32768) == (12, 16, True)
    assert 15000 <= lognormal16.T <= 80000 and (lognormal64.H, len(lognormal64.seqlens)) == (12, 64)


def test_sweep_in_flashkda_configuration():
    """--config flashkda: every row in FlashKDA's configuration, the safe gate only, no l2norm row."""
    cases = bench.sweep_cases(bench.parse_args(["--config", "flashkda"]))
    assert len(cases) == len(bench.SWEEP_SHAPES) + len(bench.SWEEP_PACKED)
    assert {(c.config, c.gate) for c in cases} == {("flashkda", "safe")}
    args = cases[0].inputs(device="cpu", initial_state=True)
    assert args["use_qk_l2norm_in_kernel"] and args["use_beta_sigmoid_in_kernel"] and args["state_v_first"]
    assert (args["beta"] < 0).any()   # logits
    assert args["initial_state"].shape == (1, 96, 128, 128)


@pytest.mark.parametrize("bad", [["--config", "flashkda", "--no-safe-gate"], ["--config", "flashkda", "--head-dim", "64"],
                                 ["--config", "flashkda", "--dtype", "fp16"], ["--config", "flashkda", "--sweep-gates", "safe,softplus"],
                                 ["--config", "l2", "--sweep"]])
def test_bad_config_options_exit_2(bad):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2


def test_rows_of_an_older_csv_merge_with_new_rows(tmp_path):
    """A CSV written before the varlen, config, FlashKDA and FLA_FLASH_KDA columns: its rows are
    fixed-length, default configuration, FlashKDA not timed, FLA on its Triton path."""
    path = tmp_path / "old.csv"
    path.write_text("B,T,H,K,V,mode,fla_ms,kda_opt_ms,speedup,tbps,tflops,bytes_floor_pct,flops_floor_pct\n"
                    "1,8192,96,128,128,safe,2.9,1.43,2.03,0.71,99,24,14\n")
    new = dict(B=1, T=8192, H=96, K=128, V=128, mode="safe", varlen=0, config="flashkda", fla_ms=3.2, kda_opt_ms=1.5,
               speedup=2.1, flashkda_ms=1.47, speedup_vs_flashkda=0.98, tbps=0.7, tflops=90.0,
               bytes_floor_pct=23.0, flops_floor_pct=13.0, fla_flash_kda="0")
    merged = bench.merge_rows(bench.read_csv(path), [new])
    assert [(r["config"], r["kda_opt_ms"], r["flashkda_ms"]) for r in merged] == [
        ("default", 1.43, bench.NOT_RUN), ("flashkda", 1.5, 1.47)]
    bench.write_csv(merged, path)
    rows = list(csv.DictReader(open(path)))
    assert [(r["config"], r["flashkda_ms"], r["fla_flash_kda"], r["dtype"]) for r in rows] == [
        ("default", "n/a", "0", "bf16"), ("flashkda", "1.4700", "0", "bf16")]
    bench.print_table(merged)


def test_rows_of_another_dtype_are_rows_of_their_own():
    """The dtype column keys a row: an fp32 row beside the bf16 one of the same case."""
    row = dict(B=1, T=8192, H=96, K=128, V=128, mode="safe", varlen=0, config="default", initial_state=1,
               decay="fast", fla_ms=2.9, kda_opt_ms=1.4, speedup=2.07, tbps=0.7, tflops=99.0, bytes_floor_pct=24.0,
               flops_floor_pct=14.0, fla_flash_kda="0")
    merged = bench.merge_rows([row], [dict(row, dtype="fp32", kda_opt_ms=2.5)])
    assert [(r["dtype"], r["kda_opt_ms"]) for r in merged] == [("bf16", 1.4), ("fp32", 2.5)]


def test_flashkda_call_and_refusals(monkeypatch):
    """The FlashKDA column's call: refused outside FlashKDA's configuration, with the reason; inside
    it, flash_kda.fwd gets kda_forward's arguments in its own form (dt_bias [H, K], cu_seqlens int64,
    the final state buffer [N, H, V, K])."""
    calls = []
    fake = types.SimpleNamespace(fwd=lambda *a, **kw: calls.append((a, kw)))
    monkeypatch.setitem(sys.modules, "flash_kda", fake)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_kda" else real(name))
    c = bench.case_from_args(bench.parse_args(["--seq-lens", "100,28", "--num-heads", "2", "--config", "flashkda"]))
    args = c.inputs(device="cpu", initial_state=True)
    call, why_not = peers.flashkda(args)
    assert why_not is None
    out, final = call()
    (q, k, v, g, beta, scale, o, A_log, dt_bias, lower_bound), kw = calls[0]
    assert o is out and dt_bias.shape == (2, 128) and lower_bound == -5.0 and scale == 128 ** -0.5
    assert kw["cu_seqlens"].dtype == torch.int64 and kw["cu_seqlens"].tolist() == [0, 100, 128]
    assert final.shape == (2, 2, 128, 128) and kw["final_state"] is final and kw["initial_state"] is args["initial_state"]
    for over in (dict(use_beta_sigmoid_in_kernel=False), dict(allow_neg_eigval=True), dict(state_v_first=False),
                 dict(use_qk_l2norm_in_kernel=False), dict(A_log=None), dict(v=args["v"][..., :64])):
        call, why_not = peers.flashkda({**args, **over})
        assert call is None and "FlashKDA computes only" in why_not, over
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "flash_kda" else real(name))
    assert peers.flashkda(args) == (None, "flash_kda is not installed")


def cudnn_stand_in(monkeypatch, declines=()):
    """cudnn.linear_attention with a kimi_delta_attention that keeps its calls and returns o [T, HV, V]
    and a final state [N, HV, V, K] of zeros (an engine in `declines` raises, as the frontend does)."""
    calls = []

    def kimi_delta_attention(q, k, v, g, beta, cu_seqlens, **options):
        if options["plan_name"] in declines:
            raise RuntimeError(f"no {options['plan_name']} plan for this graph")
        calls.append(((q, k, v, g, beta, cu_seqlens), options))
        N, (HV, V), K = cu_seqlens.numel() - 1, v.shape[1:], q.shape[-1]
        return v.new_zeros(v.shape), torch.zeros(N, HV, V, K)
    module = types.ModuleType("cudnn.linear_attention")
    module.kimi_delta_attention = kimi_delta_attention
    monkeypatch.setitem(sys.modules, "cudnn", types.ModuleType("cudnn"))
    monkeypatch.setitem(sys.modules, "cudnn.linear_attention", module)
    return calls


def test_cudnn_call_takes_kda_forwards_arguments_in_its_form(monkeypatch):
    """The cuDNN columns' call: cuDNN's kimi_delta_attention gets the tokens flat [B·T, heads, ...],
    int32 cu_seqlens (B sequences of T without them), the state V-first, the safe gate as its own
    (A_log, dt_bias [HV, K], the lower bound), the norm and β options and the engine by name; o comes
    back [B, T, HV, V] and the final state in the call's layout. The softplus gate is refused, and an
    engine that declines is reported with its reason."""
    calls = cudnn_stand_in(monkeypatch, declines=("kda_hopper",))
    c = bench.case_from_args(bench.parse_args(["--seq-lens", "100,28", "--num-heads", "2", "--config", "flashkda"]))
    args = c.inputs(device="cpu", initial_state=True)
    call, why_not = peers.cudnn(args, "kda_hopper_cuda")
    assert why_not is None and len(calls) == 1          # tried once, untimed
    o, final = call()
    (q, k, v, g, beta, cu), options = calls[-1]
    assert q.shape == (128, 2, 128) and beta.shape == (128, 2)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 100, 128]
    assert options["safe_gate"] and options["gate_lower_bound"] == -5.0 and options["a_log"] is args["A_log"]
    assert options["dt_bias"].shape == (2, 128) and options["initial_state"] is args["initial_state"]
    assert options["use_qk_l2norm_in_kernel"] and options["use_beta_sigmoid_in_kernel"]
    assert options["plan_name"] == "kda_hopper_cuda" and options["output_final_state"]
    assert o.shape == (1, 128, 2, 128) and final.shape == (2, 2, 128, 128)
    call, why_not = peers.cudnn(args, "kda_hopper")
    assert call is None and "kda_hopper" in why_not and "no kda_hopper plan" in why_not
    # K-first states, a fixed-length batch, the log-decay gate: transposed there and back, B sequences.
    args = random_inputs(2, 40, 2, 64, gate="preactivated", device="cpu", initial_state=True)
    call, why_not = peers.cudnn(args, "kda_cutile")
    (_, _, _, _, _, cu), options = calls[-1]
    assert why_not is None and cu.tolist() == [0, 40, 80] and "safe_gate" not in options
    assert torch.equal(options["initial_state"], args["initial_state"].transpose(-1, -2))
    assert call()[1].shape == args["initial_state"].shape
    softplus = random_inputs(1, 40, 2, 64, gate="softplus", device="cpu")
    call, why_not = peers.cudnn(softplus, "kda_hopper_cuda")
    assert call is None and "not softplus" in why_not
    monkeypatch.setitem(sys.modules, "cudnn.linear_attention", None)
    assert "not installed" in peers.cudnn(args, "kda_hopper_cuda")[1]


def test_cudnn_columns_time_each_engine_beside_its_error(monkeypatch):
    """cudnn_peers: every engine the frontend has that makes the call, timed on the row's arguments,
    and o's error against the float64 recurrence of each engine and of kda_opt on the case's first
    tokens; nothing without the frontend."""
    monkeypatch.setitem(sys.modules, "cudnn.linear_attention", None)
    case = bench.Case(1, 70, 2, 64, "safe", -5.0, torch.float32, 0)
    monkeypatch.setattr(bench.Case, "inputs", lambda self: random_inputs(self.B, self.T, 2, 64, device="cpu"))
    assert bench.cudnn_peers(case, case.inputs(), lambda **a: None) == ({}, {})
    cudnn_stand_in(monkeypatch, declines=("kda_hopper",))
    from kda_opt.reference import reference_forward
    runs, errors = bench.cudnn_peers(case, case.inputs(), lambda **a: (1.5 * reference_forward(**a)[0], None))
    assert set(runs) == {"cudnn_kda_hopper_cuda", "cudnn_kda_cutile"}
    assert errors["kda_opt"] == pytest.approx(0.5) and errors["cudnn_kda_cutile"] == 1.0   # the stand-in's o: zeros
    assert set(bench.CSV_FIELDS) >= {"kda_opt_err", "cudnn_kda_hopper_cuda_ms", "cudnn_kda_hopper_cuda_err"}


def test_serving_step_row(monkeypatch):
    """A serving-step case (config serving) times kda_forward with the pool in place, the dense call,
    the pool call with checkpoints and FLA around a gather and a scatter, and says what the pool and
    the checkpoints cost."""
    import triton.testing
    times = iter(range(1, 100))
    monkeypatch.setattr(triton.testing, "do_bench", lambda f, **kw: float(next(times)))
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(bench.peers, "flashkda", lambda args: (None, "not here"))
    case = bench.Case(1, 100, 2, 64, "safe", -5.0, torch.float32, 0, seqlens=(30, 70), config="serving")
    monkeypatch.setattr(bench.Case, "inputs", lambda self: draw_call(
        1, 100, 2, 64, device="cpu", seqlens=[30, 70], initial_state=True, layout=bench.CONFIGS["serving"]))
    calls = []
    forward = lambda **a: calls.append(sorted(n for n in ("initial_state_indices", "checkpoints") if n in a))
    fla = lambda **a: (None, a["initial_state"] + 1)      # a final state to scatter
    row = bench.benchmark(case, fla, 1, 1, (1e12, 1e12), forward)
    assert [] in calls and ["initial_state_indices"] in calls and ["checkpoints", "initial_state_indices"] in calls
    assert all(isinstance(row[n], float) for n in ("kda_opt_dense_ms", "pool_cost_pct", "kda_opt_ckpt_ms",
                                                   "ckpt_cost_pct"))
    assert row["config"] == "serving" and row["flashkda_ms"] == bench.NOT_RUN


def test_host_rows_make_the_calls_they_name(monkeypatch):
    """--test host (kda_bench/host): each row's kda_forward call carries what its name says (the host
    copies, the pool, checkpoints), and the peers are timed only on calls they can make as they are."""
    from kda_bench import host
    real_inputs = bench.Case.inputs
    monkeypatch.setattr(bench.Case, "inputs", lambda self, **kw: real_inputs(self, device="cpu", **kw))
    monkeypatch.setattr(host.peers, "flashkda", lambda args: ((lambda: None), None) if args.get("state_v_first")
                        else (None, "not its call"))
    names = [name for name, _, _ in host.HOST_CALLS]
    assert len(set(names)) == len(names)
    for name, fields, extra in host.HOST_CALLS:
        made = []
        case = bench.Case(**{"B": 1, "H": host.H, "K": host.K, "gate": "safe", "lower_bound": -5.0,
                             "dtype": torch.bfloat16, "seed": 0, **fields})
        runs = host.calls(case, extra, fla=lambda **a: None, kda_forward=lambda **a: made.append(a))
        runs["kda_opt"]()
        a = made[0]
        packed = case.seqlens is not None
        assert ("cu_seqlens_cpu" in a) == (packed and "no cu_seqlens_cpu" not in name), name
        assert ("initial_state_indices" in a) == ("pool" in extra), name
        assert ("initial_state_indices_cpu" in a) == ("indices_cpu" in name), name
        assert ("checkpoints" in a) == ("checkpoints" in name), name
        assert set(runs) == ({"kda_opt"} if "pool" in extra else
                             {"kda_opt", "fla", "via_fla"} | ({"flashkda"} if case.config == "flashkda"
                                                              else set())), name


def test_host_decode_rows_make_the_layers_call(monkeypatch):
    """--test host's decode rows: kda_decode on the call FLA's KDA layer makes (its bf16 gate
    parameters, an fp32 V-first state, the final state out), B requests or packed with cu_seqlens;
    FLA's fused_recurrent_kda on the same arguments, with its dispatch set to keep the call (fla) or
    send it to kda_opt (via_fla), and FLA's KDA layer's (via_layer) with kda_opt on."""
    from kda_bench import host
    real_inputs = host.draw_call
    monkeypatch.setattr(host, "draw_call", lambda *a, **kw: real_inputs(*a, **kw, device="cpu"))
    seen = []
    fla_ops = types.ModuleType("fla.ops.kda")
    def fused_recurrent_kda(**a):
        seen.append((common.os.environ["FLA_KDA_OPT"], a))
    fla_ops.fused_recurrent_kda = fused_recurrent_kda
    monkeypatch.setitem(sys.modules, "fla.ops.kda", fla_ops)
    layer = types.ModuleType("fla.layers.kda")          # FLA's KDA layer, as use_in_fla leaves it
    layer.fused_recurrent_kda = fused_recurrent_kda
    monkeypatch.setitem(sys.modules, "fla.layers.kda", layer)
    for name, B, packed in host.DECODE_CALLS:
        made = []
        runs = host.decode_calls(B, packed, kda_decode=lambda **a: made.append(a))
        assert set(runs) == {"kda_opt", "fla", "via_fla", "via_layer"}
        seen.clear()
        for system in runs.values():
            system()
        (a,) = made
        assert [env for env, _ in seen] == ["0", "1", "1"], name
        assert all(b is a[n] for (_, f) in seen for n, b in f.items()), name
        assert a["A_log"].dtype == a["dt_bias"].dtype == torch.bfloat16 and a["output_final_state"], name
        assert a["initial_state"].dtype == torch.float32 and a["state_v_first"], name
        assert a["q"].shape[:2] == ((1, B) if packed else (B, 1)) and ("cu_seqlens" in a) == packed, name
        if packed:
            assert a["cu_seqlens"].tolist() == list(range(B + 1)), name


def test_cp_rows_make_the_calls_they_name(monkeypatch):
    """--test cp (kda_bench/cp): kda_forward as users call it and the sequential path on one set of
    inputs (the plan made without parallel segments), FLA on the same; FlashKDA where it runs."""
    from kda_bench import cp
    import kda_opt.plan as plan_module
    monkeypatch.setattr(plan_module, "make_plan", lambda arguments, tuning: tuning)
    monkeypatch.setattr(cp.peers, "flashkda", lambda args: ((lambda: "fkda"), None) if args.get("state_v_first")
                        else (None, "no"))
    import kda_opt.forward as forward
    made = []
    monkeypatch.setattr(forward, "run", lambda plan, **t: made.append(("sequential", plan, t)))
    for config in ("default", "flashkda"):
        case = bench.Case(B=1, T=128, H=2, K=64, gate="safe", lower_bound=-5.0, dtype=torch.float32, seed=0,
                          config=config)
        args = case.inputs(device="cpu")
        calls = cp.runs(args, fla=lambda **a: made.append(("fla", None, a)),
                        kda_forward=lambda **a: made.append(("ours", None, a)))
        assert set(calls) == ({"kda_opt", "sequential", "fla", "flashkda"} if config == "flashkda"
                              else {"kda_opt", "sequential", "fla"})
        for name in ("kda_opt", "sequential", "fla"):
            calls[name]()
        assert all(t["q"] is args["q"] for _, _, t in made[-3:])
    assert [k for k, _, _ in made] == ["ours", "sequential", "fla"] * 2
    assert all(p.parallel is False for k, p, _ in made if k == "sequential")


def test_decode_rows_and_floor_bytes():
    """--test decode's rows (kda_bench/decode): every decode size at each H and pool dtype, the verify
    and mixed steps; the floor's bytes: a state read and written per request (per token in verify)."""
    from kda_bench import decode
    steps = decode.steps()
    assert sum(m == "decode" for m, *_ in steps) == 5 * 3 * 2
    assert {(n, t) for m, n, _, t, _, _ in steps if m == "verify"} == {(64, 4), (64, 8), (256, 4), (256, 8)}
    assert [(n, sum(p)) for m, n, _, _, p, _ in steps if m == "mixed"] == [(256, 3584), (128, 4096)]
    assert decode.state_bytes(64, 32, 1, "fp32", False) == 64 * 32 * 128 * 128 * 4 * 2
    assert decode.state_bytes(64, 32, 4, "fp32", True) == 64 * 32 * 128 * 128 * 4 * 5
    assert decode.state_bytes(8, 8, 1, "bf16", False) == 8 * 8 * 128 * 128 * 2 * 2
    assert bench.parse_args(["--test", "decode"]).test == "decode"


def test_sglang_compare_leaves_out_a_decodes_padding_outputs():
    """--test sglang's error of a decode step: the live requests' o and pool rows; the padding
    requests' o (which the caller drops, and SGLang's kernels write differently) left out."""
    from kda_bench import sglang
    call = sglang.step("decode", 2, [1] * 5, "safe", device="cpu")
    live = call["cache_indices"] >= 0

    class Kernel:                        # o: v, its padding requests' rows `pad`, its live ones moved by `shift`
        def __init__(self, pad, shift):
            self.pad, self.shift = pad, shift

        def decode(self, q, k, v, a, b, **kw):
            o = v.float().clone()
            o[:, ~live] = self.pad
            o[:, live] += self.shift
            return o
    compare = lambda ours, theirs: sglang.compare(sglang.run(ours, call), sglang.run(theirs, call), call)
    assert compare(Kernel(0.0, 0.0), Kernel(5.0, 0.0)) == (0.0, True)
    assert compare(Kernel(0.0, 1.0), Kernel(0.0, 0.0))[0] > 0.1
