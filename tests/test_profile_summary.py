"""scripts/profile_summary.py: kernels assigned to systems by NVTX range and to stages by name (CPU)."""
import profile_summary as ps

TRACE = """Start (ns),Duration (ns),CorrId,Name
100,2000,1,gate_cumsum_kernel
300,6000,2,intra_chunk_kernel
500,4000,3,wuso_kernel_Kt2_A4bf16
1100,3000,4,chunk_kda_fwd_kernel_intra_sub_chunk
1200,5000,5,chunk_kda_fwd_kernel_inter_solve_fused
1300,7000,6,chunk_gated_delta_rule_fwd_kernel_h_blockdim64
1400,1000,7,[CUDA memset]
5000,9999,8,kernel_outside_any_range
"""
RANGES = """Start (ns),End (ns),Duration (ns),Name
50,1000,950,kda_opt:kda_opt/profile/kda_opt
1050,2000,950,kda_opt:kda_opt/profile/fla
"""


def test_kernels_by_system_and_stage(tmp_path):
    (tmp_path / "t.csv").write_text(TRACE)
    (tmp_path / "r.csv").write_text(RANGES)
    kernels = ps.read_kernels(tmp_path / "t.csv", tmp_path / "r.csv")
    assert {(s, n) for s, n, _ in kernels} == {
        ("kda_opt", "gate_cumsum_kernel"), ("kda_opt", "intra_chunk_kernel"), ("kda_opt", "wuso_kernel_Kt2_A4bf16"),
        ("fla", "chunk_kda_fwd_kernel_intra_sub_chunk"), ("fla", "chunk_kda_fwd_kernel_inter_solve_fused"),
        ("fla", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64")}
    stages, names = ps.per_stage(kernels, iters=2)
    assert stages["kda_opt"] == {"gate": 0.001, "intra + solve": 0.003, "wuso": 0.002}
    # "gated" in FLA's state kernel must not read as the gate stage.
    assert stages["fla"] == {"intra": 0.0015, "inter + solve": 0.0025, "state pass": 0.0035}
    assert names["fla"]["chunk_kda_fwd_kernel_intra_sub_chunk"] == [1, 0.0015]
    table = ps.stage_table(stages, names, 2)
    assert "kda_opt: 0.006 ms per forward" in table and "fla: 0.007 ms per forward" in table


def test_torch_trace_columns(tmp_path):
    (tmp_path / "t.csv").write_text("Start (ns),Duration (ns),Name,System\n0,1000,intra_chunk_kernel,kda_opt\n")
    kernels = ps.read_kernels(tmp_path / "t.csv", None)
    assert kernels == [("kda_opt", "intra_chunk_kernel", 1000)]
    assert ps.kernel_summary(kernels, 1).splitlines()[1].split() == ["1000", "1", "1000", "intra_chunk_kernel"]


def test_flashkda_listed_per_kernel(tmp_path):
    """FlashKDA's kernels (no stage map) are their own stages, templates cut off."""
    (tmp_path / "t.csv").write_text("Start (ns),Duration (ns),Name,System\n"
                                    "0,3000,kda_fwd_kernel1<cutlass::bfloat16_t>,flashkda\n"
                                    "10,5000,kda_fwd_kernel2<128>,flashkda\n")
    stages, _ = ps.per_stage(ps.read_kernels(tmp_path / "t.csv", None), iters=1)
    assert stages["flashkda"] == {"kda_fwd_kernel1": 0.003, "kda_fwd_kernel2": 0.005}


def test_readme_sections():
    """Each shape's table replaces only its own section; the notes under a table and the other
    sections stay."""
    text = ps.readme_text(None, "A, a", "day 1", "table A1\n", "nsys 1")
    text = ps.readme_text(text.replace("table A1\n```\n", "table A1\n```\n\nnotes on A\n"), "B, b", "day 1",
                          "table B1\n", "nsys 1")
    text = ps.readme_text(text, "A, a", "day 2", "table A2\n", "nsys 2")
    assert text == ("# Profiles\n\nPer-stage GPU time of one forward, from `bash scripts/profile.sh` (nsys 2); "
                    "kernel and NVTX summaries beside this file as `<gpu>_<shape>_{kern,nvtx,stages}.txt`.\n\n"
                    "## A, a\n\nday 2\n\n```\ntable A2\n```\n\nnotes on A\n"
                    "\n## B, b\n\nday 1\n\n```\ntable B1\n```\n")
