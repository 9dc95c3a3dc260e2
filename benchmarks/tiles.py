"""The quantize launchers' tile tables, set from a benchmark's command line.

`--band N` sets the quantize grids' band (kernels/_common.py BAND: N row tiles, then the next
column tile), so the old plain grid can be timed against the banded one in one process.

`--tiles 'nvfp4.both_dq=64,64,4,128;grouped.nvfp4:both_dq=32,64,4'` sets entries of
kernels.nvfp4.TILES, kernels.mxfp8.TILES, kernels.amax.TILES or kernels.grouped.TILES (the
grouped kernels' overrides of the dense tables, keyed "nvfp4:KIND" / "mxfp8:KIND") before
anything launches. A quantize entry is (BM, BK, num_warps[, maxnreg]) (`_common.launch_tiles`);
an amax entry keeps its own length. bench_quantize.py, bench_grouped_mm.py, bench_model.py and
sass_cpu.py take it, so a tile (or a register cap) can be timed, or counted on the CPU, without
editing the defaults.
"""

from __future__ import annotations

import importlib

_common = importlib.import_module("blockscale.kernels._common")
TABLES = {
    name: importlib.import_module(f"blockscale.kernels.{name}").TILES
    for name in ("amax", "nvfp4", "mxfp8", "grouped")
}


def parse(spec: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """'TABLE.KEY=A,B,C[,D];...' -> [(table, key, cfg)], checked against the tables."""
    entries = []
    for item in (s.strip() for s in spec.split(";")):
        if not item:
            continue
        target, _, values = item.partition("=")
        table, _, key = target.partition(".")
        if table not in TABLES or not key or not values:
            raise SystemExit(f"--tiles {item!r}: expected TABLE.KEY=BM,BK,WARPS[,MAXNREG] with "
                             f"TABLE one of {', '.join(TABLES)}")  # fmt: skip
        if table == "grouped":
            fmt, _, kind = key.partition(":")
            known = TABLES.get(fmt) if fmt in ("nvfp4", "mxfp8") else None
            if known is None or kind not in known:
                raise SystemExit(f"--tiles {item!r}: grouped keys are nvfp4:KIND or mxfp8:KIND, "
                                 f"KIND one of {', '.join(TABLES['nvfp4'])}")  # fmt: skip
        elif key not in TABLES[table]:
            raise SystemExit(f"--tiles {item!r}: {table} has {', '.join(TABLES[table])}")
        lengths = {len(TABLES["amax"][key])} if table == "amax" else {3, 4}
        entries.append((table, key, _config(values, lengths, f"--tiles {item!r}")))
    return entries


def configs(spec: str, option: str = "--kernel-tiles") -> list[tuple[int, ...]]:
    """'BM,BK,WARPS[,MAXNREG];...' -> quantize tile entries (no table named)."""
    return [_config(c, {3, 4}, f"{option} {c!r}") for c in spec.split(";") if c.strip()]


def spec(entries: dict[str, tuple[int, ...]]) -> str:
    """{"nvfp4:both_dq": (64, 64, 4), ...} (bench_quantize's families) -> a --tiles value."""
    return ";".join(f"{k.replace(':', '.')}={','.join(map(str, c))}" for k, c in entries.items())


def _config(values: str, lengths: set[int], what: str) -> tuple[int, ...]:
    try:
        cfg = tuple(int(v) for v in values.split(","))
    except ValueError:
        raise SystemExit(f"{what}: the values must be integers") from None
    if len(cfg) not in lengths:
        raise SystemExit(f"{what}: {sorted(lengths)} values expected")
    return cfg


def add_arg(parser) -> None:
    parser.add_argument(
        "--tiles", default="", metavar="TABLE.KEY=BM,BK,WARPS[,MAXNREG][;...]",
        help="override launch tiles (benchmarks/tiles.py), e.g. nvfp4.both_dq=64,64,4,128",
    )  # fmt: skip
    parser.add_argument(
        "--band", type=int, default=0, metavar="TILES",
        help="row tiles a band of the quantize grids (kernels/_common.py BAND); 1073741824 "
             "gives the plain grid used before 2026-11-26",
    )  # fmt: skip


def band() -> int:
    """The quantize grids' band now in force (for a benchmark's JSON)."""
    return _common.BAND


def apply(args) -> list[tuple[str, str, tuple[int, ...]]]:
    if args.band:
        if args.band < 1:
            raise SystemExit("--band: a band holds at least one row tile")
        _common.BAND = args.band
    entries = parse(args.tiles)
    for table, key, cfg in entries:
        TABLES[table][key] = cfg
    return entries
