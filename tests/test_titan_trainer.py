"""torchtitan's own Trainer on local text, end to end on the CPU (issue 61; docs/TORCHTITAN.md,
"Training on local text"): blockscale/integrations/titan/{local_text,train,train_v0_3,
train_v0_2}.py and benchmarks/bench_titan.py.

Without torchtitan: the tokenizer written for torchtitan's assets folder, the local-text
dataset in both versions' layouts (and its resume), and the launcher's `datasets` stand-in.
With torchtitan (one version at a time, as tests/test_torchtitan.py; the other's tests skip
saying why): the real Trainer, one gloo rank in a process of its own through the launcher, on
torchtitan's debug model with a tokenizer trained on a slice of this Python's standard
library: BF16 and blockscale's NVFP4 through bench_titan's smoke run (finite losses, the
converter's log line, the JSON), and, without `datasets` (the launcher's stand-in), a run
stopped at a checkpoint and resumed, whose losses equal those of a run that did not stop, bit
for bit (the data loader's position comes back). And a checkpoint moving between BF16 and NVFP4,
both ways, on one rank and on two under FSDP2 (DCP's shards of each rank).
"""

import gzip
import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from test_torchtitan import needs_v0_2, needs_v0_3  # which torchtitan is installed

from blockscale.integrations.titan.local_text import (
    BOS,
    EOS,
    LocalTextDataset,
    documents,
    text_files,
    write_tokenizer,
)

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # s a trainer process may take on a loaded two-core CI machine


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """About 300 KB of text: standard-library modules, documents split at blank lines."""
    folder = tmp_path_factory.mktemp("text")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n\n".join((stdlib / f"{name}.py").read_text() for name in
                       ("argparse", "textwrap", "dataclasses", "functools", "inspect"))  # fmt: skip
    (folder / "part1.txt").write_text(text[: len(text) // 2])
    with gzip.open(folder / "part2.txt.gz", "wt") as f:
        f.write(text[len(text) // 2 :])
    return folder


@pytest.fixture(scope="module")
def assets(corpus, tmp_path_factory):
    return write_tokenizer(text_files(str(corpus)), tmp_path_factory.mktemp("bpe-2k"), 2048)


class CountingTokenizer:
    """Each document's characters as ids, BOS 1 and EOS 2 around them."""

    def encode(self, text, *, add_bos, add_eos):
        return [1] * add_bos + [3 + ord(c) % 50 for c in text] + [2] * add_eos


def test_documents_are_split_at_blank_lines(tmp_path):
    (tmp_path / "a.txt").write_text("one\nline two\n\n\n  \nthree\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("four\n\nfive")
    files = text_files(f"{tmp_path / 'a.txt'},{tmp_path / 'b.txt.gz'}")
    assert list(documents(files)) == ["one\nline two", "three", "four", "five"]
    assert text_files(str(tmp_path)) == [tmp_path / "a.txt", tmp_path / "b.txt.gz"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        text_files(str(tmp_path / "missing.txt"))


def test_tokenizer_is_the_assets_folder_torchtitan_reads(assets):
    from tokenizers import Tokenizer

    config = json.loads((assets / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"]) == (BOS, EOS)
    tokenizer = Tokenizer.from_file(str(assets / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 2048
    assert (tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)) == (0, 1)
    text = "def f(x):\n    return x ** 2  # naïve, 中文, ✓\n"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids) == text  # byte-level: any text, no unknown token
    assert len(ids) < len(text.encode())  # merges learned from the text


def test_documents_layout_shifts_within_documents_and_resets_positions(tmp_path):
    (tmp_path / "t.txt").write_text("abc\n\nde\n\nfghij\n\nk")
    data = LocalTextDataset(text_files(str(tmp_path)), CountingTokenizer(), seq_len=4,
                            infinite=False)  # fmt: skip
    rows = list(data)
    inputs = torch.cat([row["input"] for row, _ in rows]).tolist()
    labels = torch.cat([label for _, label in rows]).tolist()
    docs = [[1, *(3 + ord(c) % 50 for c in d), 2] for d in ("abc", "de", "fghij", "k")]
    expected_inputs = [t for d in docs for t in d[:-1]]
    expected_labels = [t for d in docs for t in d[1:]]
    n = len(inputs)  # whole rows only: the rest waits in the buffer
    assert n == 4 * len(rows) and (inputs, labels) == (expected_inputs[:n], expected_labels[:n])
    assert rows[0][0]["positions"].tolist() == [0, 1, 2, 3]  # "abc": BOS a b c
    assert rows[1][0]["positions"].tolist() == [0, 1, 2, 0]  # "de", then "fghij" begins
    assert rows[2][0]["positions"].tolist() == [0, 1, 2, 3]  # "fghij" goes on, counted from 0


def test_stream_layout_keeps_eos_in_the_inputs(tmp_path):
    (tmp_path / "t.txt").write_text("abc\n\nde\n\nfghij")
    data = LocalTextDataset(text_files(str(tmp_path)), CountingTokenizer(), seq_len=5,
                            infinite=False, layout="stream")  # fmt: skip
    (row, label), *_ = list(data)
    assert list(row) == ["input"]
    assert row["input"][1:].tolist() == label[:-1].tolist()
    assert 2 in row["input"].tolist()  # the first document's EOS, where 0.2.2 masks


@pytest.mark.parametrize("layout", ["documents", "stream"])
def test_ranks_share_the_documents_and_a_restored_state_reads_on(corpus, assets, layout):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(assets / "tokenizer.json"))

    class Encoder:
        def encode(self, text, *, add_bos, add_eos):
            return [0] * add_bos + hf.encode(text).ids + [1] * add_eos

    files = text_files(str(corpus))

    def dataset(rank=0, world=1):
        return LocalTextDataset(files, Encoder(), 32, dp_rank=rank, dp_world_size=world,
                                layout=layout)  # fmt: skip

    seen = []
    for rank in (0, 1):
        shard = dataset(rank, 2)
        iterator = iter(shard)
        next(iterator)
        seen.append(shard._next_doc)
    assert seen[0] != seen[1]  # each rank reads its own documents
    whole, part = iter(dataset()), dataset()
    rows = [next(whole) for _ in range(6)]
    iterator = iter(part)
    for _ in range(3):
        next(iterator)
    resumed = dataset()
    resumed.load_state_dict(part.state_dict())
    for (row, label), (expected, expected_label) in zip(iter(resumed), rows[3:]):
        assert torch.equal(row["input"], expected["input"])
        assert torch.equal(label, expected_label)


def test_data_loader_workers_read_their_own_documents(tmp_path):
    """With `num_workers`, each worker process is a reader of its own (every n-th document),
    as a rank is: the loader's rows are rank 0 and rank 1 of a two-rank split, in turn."""
    (tmp_path / "t.txt").write_text("\n\n".join(f"document {i} " * 3 for i in range(40)))
    files = text_files(str(tmp_path))

    def dataset(rank=0, world=1):
        return LocalTextDataset(files, CountingTokenizer(), 8, dp_rank=rank,
                                dp_world_size=world, infinite=False)  # fmt: skip

    loader = torch.utils.data.DataLoader(dataset(), batch_size=None, num_workers=2)
    rows = [row["input"] for row, _ in loader]
    halves = [[row["input"] for row, _ in dataset(rank, 2)] for rank in (0, 1)]
    assert torch.equal(rows[0], halves[0][0]) and torch.equal(rows[1], halves[1][0])
    assert len(rows) == len(halves[0]) + len(halves[1])


def test_launcher_stands_in_for_a_missing_datasets():
    code = (
        "import sys; sys.modules['datasets'] = None\n"  # what an uninstalled package raises
        "from blockscale.integrations.titan.train import install_datasets_stand_in\n"
        "assert install_datasets_stand_in()\n"
        "from datasets import Dataset, load_dataset\n"
        "from datasets.distributed import split_dataset_by_node\n"
        "try:\n    load_dataset('allenai/c4')\nexcept ImportError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, cwd=ROOT)  # fmt: skip
    assert "local text does not" in done.stdout


@pytest.fixture(scope="module")
def no_datasets(tmp_path_factory):
    """A folder whose `datasets` package fails to import, as where it is not installed (the
    GPU machines): first on the path, the trainer runs on the launcher's stand-in."""
    folder = tmp_path_factory.mktemp("no_datasets")
    (folder / "datasets").mkdir()
    (folder / "datasets" / "__init__.py").write_text("raise ImportError('not installed')\n")
    return folder


def run_trainer(titan_args, log, path_first=None, nproc=1):
    """torchtitan's trainer through blockscale's launcher, `nproc` gloo ranks (processes of
    their own)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(nproc), "-m", "blockscale.integrations.titan.train",
               *titan_args]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    path = (str(ROOT), path_first and str(path_first), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                              timeout=TIMEOUT)  # fmt: skip
    assert done.returncode == 0, Path(log).read_text()[-3000:]


def losses(dump):
    records = [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss_metrics/global_avg_loss"] for r in records}


def bench_smoke(corpus, assets, tmp_path):
    """bench_titan's CPU smoke run (the debug model, BF16 and NVFP4): its JSON rows and each
    recipe's trainer log."""
    out = tmp_path / "bench.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_titan.py"), "--smoke",
               "--assets", str(assets), "--data", str(corpus), "--dump", str(tmp_path / "runs"),
               "--out", str(out), "--timeout", str(TIMEOUT)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=2 * TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["recipe"], r["status"]) for r in rows] == [("bf16", "ok"), ("nvfp4", "ok")], rows
    for row in rows:
        assert row["steps_done"] == 3 and all(math.isfinite(loss) for _, loss in row["losses"])
        assert row["tokens_per_s"] > 0
    assert rows[1]["tok_vs_bf16"] > 0 and "tok_vs_bf16" in done.stdout  # the table, last
    return rows, [Path(r["dump"]) / "log.txt" for r in rows]


def resumes_bit_for_bit(titan_args, tmp_path, no_datasets):
    """4 steps in one run, and 2 then 2 more resumed from the step-2 checkpoint: the same
    losses (a 2-step warm-up, then no decay before step 4: the schedules of 2 and 4 steps
    agree where both run). Without `datasets`, as on the GPU machines."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    run_trainer(titan_args(4, whole), tmp_path / "whole.log", no_datasets)
    run_trainer(titan_args(2, parts), tmp_path / "part1.log", no_datasets)
    run_trainer(titan_args(4, parts), tmp_path / "part2.log", no_datasets)
    assert "Loading the checkpoint" in (tmp_path / "part2.log").read_text()
    assert "a stand-in takes its place" in (tmp_path / "whole.log").read_text()
    expected = losses(whole)
    assert sorted(expected) == [1, 2, 3, 4] and all(map(math.isfinite, expected.values()))
    assert losses(parts) == expected


def v0_3_args(assets, corpus, steps, dump, extra=()):
    """torchtitan 0.3.0's Trainer on the DeepSeek-V3 debug model and local text, checkpoints
    every 2 steps; `extra` (a converter's arguments) before the activation checkpointing."""
    return ["--module", "blockscale.integrations.titan.train_v0_3",
            "--config", "deepseek_v3_debugmodel", "--hf_assets_path", str(assets),
            "--dataloader.dataset_path", str(corpus), "--dump_folder", str(dump),
            "--training.steps", str(steps),
            "--training.local_batch_size", "2", "--training.seq_len", "64",
            "--checkpoint.enable", "--checkpoint.interval", "2", "--debug.seed", "0",
            *extra, "activation-checkpoint:none"]  # fmt: skip


def v0_2_args(assets, corpus, steps, dump, extra=()):
    """torchtitan 0.2.2's Trainer on the Llama 4 debug model and local text, checkpoints every
    2 steps (a 2-step warm-up, no decay); `extra`: a converter's arguments."""
    return ["--experimental.custom_import", "blockscale.integrations.titan.train_v0_2",
            "--model.name", "llama4_local_text", "--model.flavor", "debugmodel",
            "--job.dump_folder", str(dump),
            "--model.hf_assets_path", str(assets), "--training.dataset_path", str(corpus),
            "--training.steps", str(steps), "--training.local_batch_size", "2",
            "--training.seq_len", "64", "--metrics.log_freq", "1", "--debug.seed", "0",
            "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0",
            "--checkpoint.enable", "--checkpoint.interval", "2",
            "--checkpoint.no_last_save_model_only",
            "--activation_checkpoint.mode", "none", *extra]  # fmt: skip


@needs_v0_3
def test_v0_3_trainer_trains_bf16_and_nvfp4_through_the_bench(corpus, assets, tmp_path):
    rows, (bf16_log, nvfp4_log) = bench_smoke(corpus, assets, tmp_path)
    line = "blockscale: 35 of 48 linears and 4 of 5 experts modules to recipe nvfp4"
    assert line in nvfp4_log.read_text() and "blockscale:" not in bf16_log.read_text()


@needs_v0_3
def test_v0_3_bench_converges_bf16_seeds_in_parallel_and_reads_finished_runs(
    corpus, assets, tmp_path
):
    """bench_titan's convergence mode with two BF16 seeds and two runs at a time: the rows in
    the order asked (the second seed's folder and row carry it, its loss_vs_bf16 is the seed
    gap), and the same command again reads the finished runs instead of training them."""
    out, dump = tmp_path / "converge.json", tmp_path / "runs"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_titan.py"), "--smoke",
               "--converge", "--parallel", "2", "--bf16-seeds", "0,1", "--assets", str(assets),
               "--data", str(corpus), "--dump", str(dump), "--out", str(out),
               "--timeout", str(TIMEOUT)]  # fmt: skip
    for attempt in (1, 2):
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              timeout=3 * TIMEOUT)  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = json.loads(out.read_text())["rows"]
        got = [(r["recipe"], r["seed"], r["status"]) for r in rows]
        assert got == [("bf16", 0, "ok"), ("bf16", 1, "ok"), ("nvfp4", 0, "ok")], got
        assert ("wall_s" in rows[0]) == (attempt == 1)  # trained once, then read
    assert Path(rows[1]["dump"]).name.endswith("-seed1")
    assert rows[0]["losses"] != rows[1]["losses"]  # another seed, another run
    assert rows[1]["loss_vs_bf16"] == rows[1]["loss_end"] / rows[0]["loss_end"]
    assert all(r["steps_done"] == 3 for r in rows)


def test_bench_shares_gpus_between_convergence_runs_only():
    """`--per-gpu K`: each GPU is a place for K runs, the first runs on different GPUs; a speed
    run refuses it (runs sharing a GPU time each other)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_titan  # noqa: PLC0415

    assert bench_titan.gpu_slots(2, 1) == [0, 1]
    assert bench_titan.gpu_slots(2, 2) == [0, 1, 0, 1]
    assert bench_titan.gpu_slots(1, 4) == [0, 0, 0, 0]
    common = ["--model", "deepseek_v3", "--flavor", "small", "--parallel", "4", "--per-gpu", "4"]
    with pytest.raises(SystemExit):
        bench_titan.parse_args(common)
    args = bench_titan.parse_args([*common, "--converge", "--dump", "runs"])
    assert (args.parallel, args.per_gpu) == (4, 4)


def test_bench_compares_cut_runs_at_the_step_all_reached():
    """A convergence run cut early (its timeout) sets end_step for all: each loss_end is the mean
    of the same steps' losses, the last `tail` up to there."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_titan  # noqa: PLC0415

    rows = [{"losses": [[s, 10.0 - s] for s in range(1, 9)]},
            {"losses": [[s, 20.0 - s] for s in range(1, 6)]},
            {"status": "exit 1: no losses"}]  # fmt: skip
    bench_titan.align_ends(rows, tail=2)
    assert [r.get("end_step") for r in rows] == [5, 5, None]
    assert [r.get("loss_end") for r in rows] == [5.5, 15.5, None]


def test_bench_merges_convergence_runs_of_several_calls(tmp_path, capsys):
    """`--merge`: a model's runs from two calls' JSONs in one table, BF16 seed 0 the baseline
    wherever it came from and however far it got, loss_end over the steps all reached, no
    speed ratios, the loss ratios printed to four decimals (three significant digits would
    print a 0.28% gap as 1);
    a run in two files is taken from the one that reached the most steps; a run complete in
    two files, or files of other settings, are refused."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_titan  # noqa: PLC0415

    def run(recipe, seed, steps, offset, status="ok"):
        return {"model": "deepseek_v3", "flavor": "small", "mode": "compile", "recipe": recipe,
                "seed": seed, "status": status, "tokens_per_s": 1.0, "tok_vs_bf16": 1.0,
                "steps_done": steps,
                "losses": [[s, offset + 10.0 / s] for s in range(1, steps + 1)]}  # fmt: skip

    def call(name, rows, steps=10):
        path = tmp_path / name
        path.write_text(json.dumps({"benchmark": "titan_converge", "batch": 8, "seq_len": 2048,
                                    "steps": steps, "rows": rows}))  # fmt: skip
        return str(path)

    first = call("a.json", [run("nvfp4", 0, 10, 0.2), run("bf16", 1, 10, 0.1)])
    # BF16 seed 0 cut by its call at step 8: still the baseline of the loss ratios
    second = call("b.json", [run("bf16", 0, 8, 0.0, "timeout after 519 s"),
                             run("mxfp8", 0, 10, 0.05)])  # fmt: skip
    merged, rows = bench_titan.merge([first, second], tail=2)
    assert [(r["recipe"], r["seed"]) for r in rows] == [
        ("bf16", 0), ("bf16", 1), ("nvfp4", 0), ("mxfp8", 0)]  # fmt: skip
    assert all(r["end_step"] == 8 for r in rows)  # BF16 seed 0 stopped at step 8
    base, nvfp4 = ((offset + 10 / 7 + offset + 10 / 8) / 2 for offset in (0.0, 0.2))
    assert (rows[0]["loss_end"], rows[2]["loss_end"]) == (base, nvfp4)
    assert rows[2]["loss_vs_bf16"] == nvfp4 / base
    assert not any("tok_vs_bf16" in r for r in rows)
    assert [m["path"] for m in merged["merged_from"]] == [first, second]
    bench_titan.harness.print_table(rows, bench_titan.CONVERGE_COLUMNS, bench_titan.FORMATS)
    table = capsys.readouterr().out
    assert f" {nvfp4 / base:.4f} |" in table and f" {nvfp4:.4f} |" in table
    with pytest.raises(SystemExit, match="complete .10 steps. in more than one file"):
        bench_titan.merge([first, first], tail=2)
    # a run cut by its call (nvfp4 seed 0, 6 steps) and the same run complete in a later call:
    # the complete one is kept, the cut one dropped and listed
    cut = call("cut.json", [run("bf16", 0, 10, 0.0), run("nvfp4", 0, 6, 0.3)])
    merged, rows = bench_titan.merge([cut, first], tail=2)
    assert [(r["recipe"], r["seed"], r["steps_done"]) for r in rows] == [
        ("bf16", 0, 10), ("bf16", 1, 10), ("nvfp4", 0, 10)]  # fmt: skip
    assert all(r["end_step"] == 10 for r in rows)
    assert merged["dropped"] == [
        {"path": cut, "mode": "compile", "recipe": "nvfp4", "seed": 0, "steps_done": 6}]  # fmt: skip
    # the same run cut in two calls (neither could resume the other): the longer copy is kept,
    # whichever file comes first
    cut2 = call("cut2.json", [run("nvfp4", 0, 7, 0.4)])
    for files in ([cut, cut2], [cut2, cut]):
        merged, rows = bench_titan.merge(files, tail=2)
        assert [(r["recipe"], r["seed"], r["steps_done"]) for r in rows] == [
            ("bf16", 0, 10), ("nvfp4", 0, 7)]  # fmt: skip
        assert rows[1]["losses"][-1] == [7, 0.4 + 10 / 7]
        assert all(r["end_step"] == 7 for r in rows)
        assert merged["dropped"] == [
            {"path": cut, "mode": "compile", "recipe": "nvfp4", "seed": 0, "steps_done": 6}]  # fmt: skip
    with pytest.raises(SystemExit, match="different settings"):
        bench_titan.merge([first, call("c.json", [run("bf16", 2, 5, 0.0)], steps=5)], tail=2)


def test_bench_plots_each_runs_gap_to_bf16_over_tokens(tmp_path):
    """`--plot`: the trailing means are each loss_end a run stopped at that step would have
    (the first whole window on), and the gap curve of a run is its trailing mean over BF16 seed
    0's at the same steps, in %, against millions of tokens; BF16 seed 0 has no gap curve."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_titan  # noqa: PLC0415

    losses = [[s, 10.0 / s] for s in range(1, 11)]
    means = bench_titan.trailing_means(losses, tail=3)
    assert [s for s, _ in means] == list(range(3, 11))
    for step, mean in means:
        rows = [{"losses": [x for x in losses if x[0] <= step]}]
        bench_titan.align_ends(rows, tail=3)
        assert mean == pytest.approx(rows[0]["loss_end"], rel=1e-12)

    def run(recipe, seed, scale):
        return {"mode": "compile", "recipe": recipe, "seed": seed,
                "losses": [[s, scale * 10.0 / s] for s in range(1, 11)]}  # fmt: skip

    png = tmp_path / "gaps.png"
    # mxfp8: cut before its first whole window, so it has no curve (and does not stop the plot)
    rows = [run("bf16", 0, 1.0), run("bf16", 1, 1.01), run("nvfp4", 0, 1.02), {"status": "x"},
            {**run("mxfp8", 0, 1.0), "losses": [[1, 9.0], [2, 8.0]]}]  # fmt: skip
    gaps = bench_titan.plot_gaps(rows, tail=3, tokens_per_step=500_000, path=str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(gaps) == {("compile", "bf16", 1), ("compile", "nvfp4", 0)}
    assert [t for t, _ in gaps[("compile", "nvfp4", 0)]] == [s * 0.5 for s in range(3, 11)]
    assert all(g == pytest.approx(2.0) for _, g in gaps[("compile", "nvfp4", 0)])
    assert all(g == pytest.approx(1.0) for _, g in gaps[("compile", "bf16", 1)])
    with pytest.raises(SystemExit):  # a speed run has no curves to draw
        bench_titan.parse_args(["--model", "llama4", "--flavor", "small", "--plot", "x.png"])


@needs_v0_3
def test_v0_3_trainer_resumes_from_its_checkpoint(corpus, assets, tmp_path, no_datasets):
    def titan_args(steps, dump):
        return v0_3_args(assets, corpus, steps, dump)

    resumes_bit_for_bit(titan_args, tmp_path, no_datasets)


@needs_v0_2
def test_v0_2_trainer_trains_bf16_and_nvfp4_through_the_bench(corpus, assets, tmp_path):
    rows, (bf16_log, nvfp4_log) = bench_smoke(corpus, assets, tmp_path)
    line = "converted 35 of 46 linears and 6 of 9 expert weights to recipe nvfp4"
    assert line in nvfp4_log.read_text() and "converted" not in bf16_log.read_text()


@needs_v0_2
def test_v0_2_trainer_resumes_from_its_checkpoint(corpus, assets, tmp_path, no_datasets):
    def titan_args(steps, dump):
        return v0_2_args(assets, corpus, steps, dump)

    resumes_bit_for_bit(titan_args, tmp_path, no_datasets)


@needs_v0_3
def test_v0_3_local_text_override_replaces_the_trainers_data_loader_only():
    """`--override.imports '...train_v0_3.local_text={"path": ...}'` on torchtitan's own
    DeepSeek-V3 config: its data loader becomes local text; the validator's stays."""
    from torchtitan.config.override import OverrideConfig, apply_overrides
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from blockscale.integrations.titan.train_v0_3 import LocalTextDataLoader

    config = deepseek_v3_debugmodel()
    validator_loader = config.validator.dataloader
    target = "blockscale.integrations.titan.train_v0_3.local_text"
    apply_overrides(OverrideConfig(imports=[(target, {"path": "a.txt,b.txt.gz"})]), config)
    assert isinstance(config.dataloader, LocalTextDataLoader.Config)
    assert config.dataloader.dataset_path == "a.txt,b.txt.gz"
    assert config.validator.dataloader is validator_loader


@needs_v0_2
def test_v0_2_trainer_with_selective_activation_checkpointing(corpus, assets, tmp_path):
    """torchtitan's selective activation checkpointing per op (it saves some GEMMs' outputs and
    refuses one modified in place) with the converter: the emulated GEMM scaled its product in
    place and the first step failed there."""
    dump = tmp_path / "run"
    run_trainer(["--experimental.custom_import", "blockscale.integrations.titan.train_v0_2",
                 "--model.name", "llama4_local_text", "--model.flavor", "debugmodel",
                 "--model.converters", "blockscale", "--job.dump_folder", str(dump),
                 "--model.hf_assets_path", str(assets), "--training.dataset_path", str(corpus),
                 "--training.steps", "3", "--training.local_batch_size", "2",
                 "--training.seq_len", "64", "--metrics.log_freq", "1",
                 "--activation_checkpoint.mode", "selective",
                 "--activation_checkpoint.selective_ac_option", "op"],
                tmp_path / "log.txt")  # fmt: skip
    log = (tmp_path / "log.txt").read_text()
    assert "to recipe nvfp4" in log and "activation checkpointing" in log.lower(), log[-2000:]
    got = losses(dump)
    assert sorted(got) == [1, 2, 3] and all(map(math.isfinite, got.values())), got


def switches_recipe_at_a_checkpoint(titan_args, converter_args, tmp_path, no_datasets, nproc=1):
    """Two steps and a checkpoint with one recipe, then two more from it with the other, both
    ways: a converted model's checkpoint is a BF16 model's (the same names, shapes and dtypes),
    and back. The loss at step 3 continues from step 2's weights either way: within 0.5% of
    the run that did not switch (the recipes differ in their rounding only). Every rank writes
    its shard of the checkpoint. Returns each run's (recipe, log text, dump folder)."""
    whole = tmp_path / "whole"
    run_trainer(titan_args(4, whole, converter_args), tmp_path / "whole.log", no_datasets, nproc)
    reference = losses(whole)
    runs = [("nvfp4", (tmp_path / "whole.log").read_text(), whole)]
    for first, then in (("nvfp4", "bf16"), ("bf16", "nvfp4")):
        dump = tmp_path / f"{first}-then-{then}"
        args = {"nvfp4": converter_args, "bf16": []}
        run_trainer(titan_args(2, dump, args[first]), tmp_path / f"{first}.log", no_datasets,
                    nproc)  # fmt: skip
        log = tmp_path / f"{first}-{then}.log"
        run_trainer(titan_args(4, dump, args[then]), log, no_datasets, nproc)
        assert "Loading the checkpoint" in log.read_text(), log.read_text()[-2000:]
        shards = sorted(p.name for p in (dump / "checkpoint" / "step-2").glob("*.distcp"))
        assert shards == [f"__{rank}_0.distcp" for rank in range(nproc)], shards
        runs += [(first, (tmp_path / f"{first}.log").read_text(), dump),
                 (then, log.read_text(), dump)]  # fmt: skip
        for recipe, text, _ in runs[-2:]:
            assert ("to recipe nvfp4" in text) == (recipe == "nvfp4"), (recipe, text[-2000:])
        got = losses(dump)
        assert sorted(got) == [1, 2, 3, 4] and all(map(math.isfinite, got.values())), got
        assert abs(got[3] - reference[3]) < 0.005 * reference[3], (first, got, reference)
    return runs


def assert_saved_in_row_shards(dump, name, nproc):
    """`name` stored by DCP in FP32 as `nproc` shards of whole rows, one per rank (FSDP2's
    dim-0 shards)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(dump / "checkpoint" / "step-2")).read_metadata()
    saved = meta.state_dict_metadata[name]
    rows, cols = saved.size
    boxes = sorted((tuple(c.offsets), tuple(c.sizes)) for c in saved.chunks)
    share = rows // nproc
    assert boxes == [((r * share, 0), (share, cols)) for r in range(nproc)], (name, boxes)
    assert saved.properties.dtype == torch.float32, saved.properties.dtype


@needs_v0_2
def test_v0_2_checkpoint_moves_between_bf16_and_nvfp4(corpus, assets, tmp_path, no_datasets):
    def titan_args(steps, dump, recipe_args):
        return v0_2_args(assets, corpus, steps, dump, recipe_args)

    converter = ["--model.converters", "blockscale"]
    switches_recipe_at_a_checkpoint(titan_args, converter, tmp_path, no_datasets)


@needs_v0_3
def test_v0_3_checkpoint_moves_between_bf16_and_nvfp4(corpus, assets, tmp_path, no_datasets):
    def titan_args(steps, dump, recipe_args):
        return v0_3_args(assets, corpus, steps, dump, recipe_args)

    target = "blockscale.integrations.titan.v0_3.blockscale"
    converter = ["--override.imports", f'{target}={{"recipe": "nvfp4"}}']
    switches_recipe_at_a_checkpoint(titan_args, converter, tmp_path, no_datasets)


FSDP_RANKS = 2
CONVERTED_LINEAR = "layers.0.attention.wq.weight"  # converted in both versions' debug models


@needs_v0_2
def test_v0_2_checkpoint_moves_between_bf16_and_nvfp4_on_two_fsdp_ranks(
    corpus, assets, tmp_path, no_datasets
):
    """The same on 2 gloo ranks under FSDP2 (dp_shard 2). There the converter turns on the
    quantized all-gather (its log line, once a rank): the converted linears' weights are
    `ShardedWeight`s, which DCP saves as each rank's FP32 rows and loads back in place, into a
    BF16 run's plain shards too; a load that replaced them would make the nvfp4 run's first
    forward raise (`_QuantizedGatherCheck`) rather than gather unquantized. Before the
    launcher's SUM reductions, the first backward failed (gloo has no PREMUL_SUM)."""

    def titan_args(steps, dump, recipe_args):
        fsdp = ["--parallelism.data_parallel_shard_degree", str(FSDP_RANKS)]
        return v0_2_args(assets, corpus, steps, dump, [*fsdp, *recipe_args])

    converter = ["--model.converters", "blockscale"]
    runs = switches_recipe_at_a_checkpoint(
        titan_args, converter, tmp_path, no_datasets, nproc=FSDP_RANKS
    )
    line = "blockscale: FSDP2 all-gathers 35 linear weights quantized"
    for recipe, text, dump in runs:
        assert text.count(line) == FSDP_RANKS * (recipe == "nvfp4"), (recipe, text[-2000:])
        assert_saved_in_row_shards(dump, CONVERTED_LINEAR, FSDP_RANKS)


@needs_v0_3
def test_v0_3_checkpoint_moves_between_bf16_and_nvfp4_on_two_fsdp_ranks(
    corpus, assets, tmp_path, no_datasets
):
    """The same with 0.3.0, on its `partial_dtensor` backend (under its default, `spmd_types`,
    torch 2.13's `fully_shard` refuses the plain parameters that backend makes:
    docs/TORCHTITAN.md). The config's model spec turns on the quantized all-gather
    (`v0_3.with_quantized_all_gather`, its log line once a rank); torchtitan's checkpointer
    then reads each `ShardedWeight` as the FP32 tensor it wraps (it crashed on the wrapper's
    missing storage before the state-dict hook)."""

    def titan_args(steps, dump, recipe_args):
        fsdp = ["--parallelism.data_parallel_shard_degree", str(FSDP_RANKS),
                "--parallelism.spmd_backend", "partial_dtensor"]  # fmt: skip
        return v0_3_args(assets, corpus, steps, dump, [*fsdp, *recipe_args])

    target = "blockscale.integrations.titan.v0_3.blockscale"
    converter = ["--override.imports", f'{target}={{"recipe": "nvfp4"}}']
    runs = switches_recipe_at_a_checkpoint(
        titan_args, converter, tmp_path, no_datasets, nproc=FSDP_RANKS
    )
    line = "blockscale: FSDP2 all-gathers 35 linear weights quantized"
    for recipe, text, dump in runs:
        assert text.count(line) == FSDP_RANKS * (recipe == "nvfp4"), (recipe, text[-2000:])
        assert_saved_in_row_shards(dump, CONVERTED_LINEAR, FSDP_RANKS)
