"""benchmarks/research/sass_cpu.py: every quantization kernel a step runs, compiled for an H100 (sm_90)
on the CPU as the launcher specializes it, with no register spills, and the stochastic
rounding's hash computed once a word by the threads that need it. A kernel change that spills (local
memory traffic in a kernel judged by bytes) fails here, before any GPU sees it.

The script runs in a child process without TRITON_INTERPRET: it compiles the jit kernels,
which this test process has replaced with the interpreter's. It compiles into this module's
own Triton cache: a user-wide one keys a kernel by its source, not its file, so a kernel that
another checkout compiled first would name that checkout's files in its line markers.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCHMARKS / "research" / "sass_cpu.py"


def sass_rows(out: Path, cache: Path, *args: str) -> list[dict]:
    """sass_cpu.py's rows for a 256x256 input, with `args` (run without TRITON_INTERPRET,
    compiling into the Triton cache `cache`)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--shape", "256,256", *args, "--json", str(out)],
        env=env, capture_output=True, text=True, timeout=1800,  # 143 s on one loaded core
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())["rows"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("triton_cache")


@pytest.fixture(scope="module")
def rows(tmp_path_factory, cache):
    return sass_rows(tmp_path_factory.mktemp("sass") / "sass.json", cache)


def test_every_kernel_compiles_for_sm90_without_spills(rows):
    """No spills, except a few bytes where a launch caps its registers on purpose (the NVFP4
    nearest both-direction `_dq` launch: 48 bytes for a fourth program an SM, measured
    faster on the H100, kernels/nvfp4.py TILES)."""
    kernels = {r["kernel"] for r in rows}
    assert {"_nvfp4_quantize_kernel", "_mxfp8_quantize_kernel", "_amax_kernel"} <= kernels
    for r in rows:
        assert r["instructions"] > 100 and r["registers"] > 0, r
        allowed = 64 if r["maxnreg"] else 0
        assert r["spill_bytes"] <= allowed, f"{r['case']}: {r['spill_bytes']} bytes of spills"
        assert not r["maxnreg"] or r["registers"] <= r["maxnreg"], r


def test_no_kernel_flushes_subnormals_or_approximates(rows):
    """Every quantization kernel's PTX is free of `.ftz` and `.approx` float instructions. A
    flushing instruction changes what a subnormal rounds to: Triton's `tl.ceil` is
    `cvt.rpi.ftz.f32`, which made stochastic rounding code a scaled value below 2^-126 as 0
    where the reference rounds it up to 0.5 with u = 0 (on the H100,
    test_stochastic_rounds_subnormal_scaled_values_up; the interpreter does not flush, so
    only this check sees it on the CPU)."""
    assert {r["case"] for r in rows if "SR" in r["case"]}  # the stochastic launches are here
    for r in rows:
        assert r["ptx_inexact"] == {}, (r["case"], r["ptx_inexact"])


def test_stochastic_rounding_hashes_each_word_once_a_thread(rows):
    """mix32 is two multiplies by its constants: one hash of the seed, then one a 32-bit word
    (4 values). Each thread hashes exactly the words of its own values, rowwise and in the
    columnwise (MMA) layout with that copy's byte order (the Philox draw it replaced was
    computed by every thread holding part of a block). Nearest rounding hashes nothing."""
    by_case = {r["case"]: r for r in rows}
    assert by_case["nvfp4 1x16 rowwise + dq"]["hash_multiplies"] == 0
    assert by_case["nvfp4 both (row + col RHT) + dq"]["hash_multiplies"] == 0
    row = by_case["nvfp4 1x16 rowwise SR + dq"]
    assert row["hash_multiplies"] == 2 + 2 * row["values_per_thread"] / 4, row
    col = by_case["nvfp4 columnwise RHT SR"]
    assert col["hash_multiplies"] == 2 + 2 * col["values_per_thread"] / 4, col
    both = by_case["nvfp4 both SR (grad_output) + dq"]  # a key hash and the words, each copy
    assert both["hash_multiplies"] == 2 * (2 + 2 * both["values_per_thread"] / 4), both


def test_the_block_scale_switches_for_ab_timing_take_effect(rows, cache, tmp_path):
    """`--replaced e4m3-integer,enc-division` must compile the integer E4M3 codec and a
    division a block back into the NVFP4 launches, or an A/B timing of the 2026-12-02
    changes would compare the new code with itself (at 256 x 256, instructions to EXIT of the
    two dq-only launches the models run: 1035 -> 1161 and 1496 -> 1795)."""
    old = sass_rows(
        tmp_path / "old.json",
        cache,
        *("--only", "dq only: both", "--replaced", "e4m3-integer,enc-division"),
    )
    old, new = {r["case"]: r for r in old}, {r["case"]: r for r in rows}
    for case in (
        "nvfp4 dq only: both stochastic + dq (grad_output)",
        "nvfp4 dq only: both, row dq (forward input)",
    ):
        assert old[case]["instructions_to_exit"] > new[case]["instructions_to_exit"] + 100, case
        # the divisions' reciprocal approximations (MUFU.RCP), one a block and thread again
        assert old[case]["opcodes"].get("MUFU", 0) > new[case]["opcodes"].get("MUFU", 0), case


def test_the_philox_switch_for_ab_timing_takes_effect(rows, cache, tmp_path):
    """`--replaced sr-philox` (benchmarks/replaced.py) must compile the old Philox draw into
    the kernels, or an A/B timing would compare the hash with itself."""
    (row,) = sass_rows(
        tmp_path / "philox.json", cache, "--only", "rowwise SR", "--replaced", "sr-philox"
    )
    assert row["hash_multiplies"] == 0
    # Philox4x32-7: seven rounds of two 32x32 -> 64-bit multiplies a draw
    hashed = {r["case"]: r for r in rows}["nvfp4 1x16 rowwise SR + dq"]
    assert row["wide_multiplies"] >= hashed["wide_multiplies"] + 14


def test_a_register_cap_given_on_the_command_line_reaches_the_compiler(cache, tmp_path):
    """`--tiles TABLE.KEY=BM,BK,WARPS,MAXNREG` (benchmarks/tiles.py) sets a launch's register
    cap, which ptxas honours (spilling if it must): the both-direction SR kernel, 168 registers
    at a 64x64/4 tile, compiles within 128 with the cap, so 4 programs fit an SM."""
    (plain,) = sass_rows(
        tmp_path / "plain.json", cache, "--only", "both SR", "--tiles", "nvfp4.both_sr_dq=64,64,4"
    )
    (capped,) = sass_rows(
        tmp_path / "capped.json",
        cache,
        *("--only", "both SR", "--tiles", "nvfp4.both_sr_dq=64,64,4,128"),
    )
    assert plain["registers"] > 128 and plain["programs_per_sm"] < 4, plain
    assert capped["registers"] <= 128 and capped["programs_per_sm"] == 4, capped


@pytest.mark.parametrize(
    "spec",
    [
        "nvfp4.both_dq=64,64",  # too few values
        "nvfp4.both_dq=64,64,4,128,1",  # too many
        "nvfp4.bath_dq=64,64,4",  # no such kind
        "fp8.both_dq=64,64,4",  # no such table
        "grouped.both_dq=64,64,4",  # grouped keys name the format
        "amax.plain=32,256,8",  # amax entries keep their four values
        "nvfp4.both_dq=64,64,x",
    ],
)
def test_tile_overrides_refuse_what_no_launcher_reads(spec):
    sys.path.insert(0, str(BENCHMARKS))
    import tiles  # noqa: PLC0415 (benchmarks/tiles.py)

    with pytest.raises(SystemExit, match="--tiles"):
        tiles.parse(spec)
    assert tiles.parse("grouped.nvfp4:both_dq=32,64,4,168;mxfp8.col=64,64,4") == [
        ("grouped", "nvfp4:both_dq", (32, 64, 4, 168)),
        ("mxfp8", "col", (64, 64, 4)),
    ]


def test_a_sweeps_winners_print_as_a_tiles_option_that_parses_back():
    sys.path.insert(0, str(BENCHMARKS))
    import tiles  # noqa: PLC0415 (benchmarks/tiles.py)

    best = {"nvfp4:both_dq": (64, 64, 4, 128), "amax:hadamard": (32, 128, 4, 16)}
    assert tiles.parse(tiles.spec(best)) == [
        ("nvfp4", "both_dq", (64, 64, 4, 128)),
        ("amax", "hadamard", (32, 128, 4, 16)),
    ]
    assert tiles.configs("64,64,4;32,64,4,168") == [(64, 64, 4), (32, 64, 4, 168)]
    with pytest.raises(SystemExit, match="--kernel-tiles"):
        tiles.configs("64,64")


def test_both_direction_kernels_stay_within_their_alu_budget(rows):
    """The quantize kernels are bound by the H100's ALU pipe (docs/archive/KERNELS-2026-11.md,
    "2026-11-26 (later)"), so the ALU warp instructions a value (sass_cpu.PIPES) is their cost model. The
    rewrite that moved their work to the FMA pipe took these from 2.01 (NVFP4 both SR + dq),
    1.70 (NVFP4 both + dq, then at 32x64/4) and 2.56 (MXFP8 both + dq) to 1.48, 1.18 and 1.55
    on Triton 3.6; the block scales' hardware E4M3 codec, encode table and one-multiply
    `_dq` (2026-12-02) took the NVFP4 ones to 1.29 and 0.97, and the dq-only launches the
    models run to 0.92 (grad_output) and 0.73 (forward input). The ceilings leave room for
    compiler drift but not for the integer codecs, divisions, shifts and selects coming
    back."""
    by_case = {r["case"]: r for r in rows}
    ceilings = {
        "nvfp4 both SR (grad_output) + dq": 1.4,
        "nvfp4 both (row + col RHT) + dq": 1.1,
        "nvfp4 dq only: both stochastic + dq (grad_output)": 1.05,
        "nvfp4 dq only: both, row dq (forward input)": 0.85,
        "mxfp8 both + dq": 1.7,
    }
    for case, ceiling in ceilings.items():
        r = by_case[case]
        assert r["pipes"]["alu"] < r["instructions"], r
        assert r["alu_warp_instr_per_value"] <= ceiling, (case, r["alu_warp_instr_per_value"])


def test_instructions_are_charged_to_the_source_lines_a_program_runs(rows):
    """`by_line` (`--lines`): each instruction up to the first EXIT charged to its source line
    (nvdisasm -g), so the counts add up to what a loop-free program runs; the out-of-line code
    after it (the IEEE divisions' slow paths) is left out. The per-value work of a quantize
    kernel sits in the package's kernel files: some line there costs at least one instruction
    a value a thread (the stochastic grad_output kernel: its rounding's add, one a value and
    copy)."""
    for r in rows:
        assert 0 < r["instructions_to_exit"] <= r["instructions"], r["case"]
        assert sum(r["by_line"].values()) == r["instructions_to_exit"], r["case"]
        assert all(k == "?" or k.startswith(("blockscale/", "triton/")) for k in r["by_line"]), r
    both = next(r for r in rows if r["case"] == "nvfp4 dq only: both stochastic + dq (grad_output)")
    top = max(n for k, n in both["by_line"].items() if k.startswith("blockscale/kernels/nvfp4.py"))
    assert top >= 2 * both["values_per_thread"], both["by_line"]


def test_line_markers_name_files_relative_to_their_package_whatever_the_clone_is_called(tmp_path):
    """A clone is often a folder named blockscale, holding the package blockscale: the key is
    the path below the package's parent (not `blockscale/blockscale/...`), reached through a
    folder named blockscale or through a link. A file of neither package (another checkout's,
    from a shared Triton cache) keeps its whole path, so the test above would catch it."""
    root = BENCHMARKS.parent
    (tmp_path / "clones").mkdir()
    (tmp_path / "clones" / "blockscale").symlink_to(root, target_is_directory=True)
    through_link = tmp_path / "clones" / "blockscale" / "blockscale" / "kernels" / "nvfp4.py"
    sass = "\n".join(
        [
            f'//## File "{root / "blockscale" / "kernels" / "nvfp4.py"}", line 10',
            "/*0010*/ IMAD R1, R2, R3, R4 ;",
            f'//## File "{through_link}", line 11',
            "/*0020*/ FADD R1, R2, R3 ;",
            '//## File "/elsewhere/blockscale/blockscale/kernels/nvfp4.py", line 12',
            "/*0030*/ EXIT ;",
        ]
    )
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPT.parent)!r}); import sass_cpu; "
        f"print('|'.join(sass_cpu._source_lines(sys.stdin.read())))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", code], input=sass, env=env, capture_output=True, text=True,
        cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().split("|") == [
        "blockscale/kernels/nvfp4.py:10",
        "blockscale/kernels/nvfp4.py:11",
        "/elsewhere/blockscale/blockscale/kernels/nvfp4.py:12",
    ]
