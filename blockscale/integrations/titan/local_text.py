"""Local text for torchtitan's trainer, with nothing downloaded: a tokenizer trained on the text,
and the text's documents streamed as torchtitan's datasets stream theirs.

torchtitan reads two things from the Hugging Face hub, and both are made here from `.txt` and
`.txt.gz` files (documents separated by blank lines):

- the tokenizer: `write_tokenizer` trains a byte-level BPE (the `tokenizers` package, which
  torchtitan itself loads tokenizers with) and writes the assets folder that torchtitan's
  `HuggingFaceTokenizer` reads from `hf_assets_path`: `tokenizer.json` and a
  `tokenizer_config.json` that names the BOS and EOS tokens, which torchtitan adds around each
  document. From the command line:

      python -m blockscale.integrations.titan.local_text --data .data/train.txt.gz \\
          --out .titan-assets/bpe-32k --vocab-size 32768

  Byte-level: every byte is a token of its own before merges, so any text encodes (no unknown
  token). A model's vocabulary must hold the tokenizer's (`vocab_size` at least as large).
- the documents: `LocalTextDataset` streams them from the files, each rank of data parallelism
  (and each worker process of its data loader, with `num_workers`) taking every n-th
  document, tokenizes each with BOS and EOS and packs the tokens into rows of `seq_len`, in
  the layout of the torchtitan version's own text dataset:
  - "documents" (0.3): inputs and labels shifted within each document (no document's last
    token is trained to predict the next one's first), each row with its tokens' positions in
    their documents (0.3's models take them for RoPE and document masks);
  - "stream" (0.2.2): the documents' tokens as one stream, each row the next `seq_len` + 1
    tokens (inputs the first `seq_len`, labels the last), so that EOS stays in the inputs,
    where 0.2.2's document masks look for it.
  Its state (the next document, the epoch and the tokens waiting in the buffers) goes into
  torchtitan's checkpoints, so a resumed run reads on where it stopped; it re-reads the files
  up to that document without tokenizing them.

This module imports no torchtitan: `titan.train_v0_3` and `titan.train_v0_2` wrap the dataset
in each version's data loader.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset, get_worker_info

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
SUFFIXES = (".txt", ".txt.gz")


class Tokenizer(Protocol):
    """What the dataset needs of a tokenizer: torchtitan's `encode` with BOS and EOS."""

    def encode(self, text: str, *, add_bos: bool, add_eos: bool) -> list[int]: ...


def text_files(spec: str) -> list[Path]:
    """The files a data spec names: a `.txt` / `.txt.gz` file, a folder of them (searched
    recursively, sorted by path), or several of either separated by commas."""
    files: list[Path] = []
    for part in (p.strip() for p in spec.split(",")):
        path = Path(part)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.name.endswith(SUFFIXES))
            if not found:
                raise FileNotFoundError(f"data folder {part!r} holds no .txt or .txt.gz files")
            files.extend(found)
        else:
            raise FileNotFoundError(f"data path {part!r} does not exist (want a .txt/.txt.gz "
                                    "file or a folder of them)")  # fmt: skip
    if not files:
        raise FileNotFoundError(f"data spec {spec!r} names no files")
    return files


def documents(files: Sequence[Path]) -> Iterator[str]:
    """The documents of `files` in order: runs of lines between blank lines."""
    for path in files:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            lines: list[str] = []
            for line in f:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines).rstrip("\n")
                    lines = []
            if lines:
                yield "".join(lines).rstrip("\n")


def write_tokenizer(files: Sequence[Path], out: Path, vocab_size: int, max_bytes: int = 0) -> Path:
    """Train a byte-level BPE of `vocab_size` tokens (BOS and EOS included) on the documents
    of `files` (the first `max_bytes` of text where > 0) and write torchtitan's assets folder
    `out`: tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer as HFTokenizer  # noqa: PLC0415 (optional dependency)
    from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"vocab_size={vocab_size} is below the {len(alphabet)} bytes and "
                         "BOS and EOS of a byte-level BPE")  # fmt: skip

    def texts() -> Iterator[str]:
        seen = 0
        for doc in documents(files):
            yield doc
            seen += len(doc)
            if 0 < max_bytes <= seen:
                return

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": False,  # the dataset asks for both around each document
        "add_eos_token": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


class LocalTextDataset(IterableDataset, Stateful):
    """Rows of `seq_len` tokens packed from the documents of local text files in `layout`
    "documents" or "stream" (module docstring): yields `({"input": ids} [+ "positions"],
    labels)`, int64 tensors of `seq_len`, forever when `infinite` (epoch after epoch over the
    same documents)."""

    def __init__(
        self,
        files: Sequence[Path],
        tokenizer: Tokenizer,
        seq_len: int,
        dp_rank: int = 0,
        dp_world_size: int = 1,
        infinite: bool = True,
        layout: str = "documents",
    ) -> None:
        if layout not in ("documents", "stream"):
            raise ValueError(f"layout={layout!r} is not 'documents' (0.3) or 'stream' (0.2.2)")
        self.files = list(files)
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_world_size = dp_world_size
        self.infinite = infinite
        self.layout = layout
        self._next_doc = 0  # index over all ranks' documents of this epoch
        self._epoch = 0
        self._inputs: list[int] = []
        self._labels: list[int] = []
        self._pos: list[int] = []

    def _documents(self) -> Iterator[str]:
        """This reader's documents from `_next_doc` on, keeping `_next_doc` one past each: a
        reader is a data-parallel rank, or one of its data loader's worker processes, each of
        which runs a copy of the dataset (`num_workers`: the loader takes their rows in turn)."""
        worker = get_worker_info()
        workers, worker_id = (worker.num_workers, worker.id) if worker else (1, 0)
        readers = self.dp_world_size * workers
        reader = self.dp_rank * workers + worker_id
        for index, doc in enumerate(documents(self.files)):
            if index < self._next_doc or index % readers != reader:
                continue
            self._next_doc = index + 1
            yield doc

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        rows = self._document_rows if self.layout == "documents" else self._stream_rows
        while True:
            for doc in self._documents():
                ids = self.tokenizer.encode(doc, add_bos=True, add_eos=True)
                yield from rows(ids)
            if not self.infinite:
                return
            self._epoch += 1
            self._next_doc = 0

    def _document_rows(
        self, ids: list[int]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        n = self.seq_len
        self._inputs.extend(ids[:-1])
        self._labels.extend(ids[1:])
        self._pos.extend(range(len(ids) - 1))
        while len(self._inputs) >= n:
            row = {"input": torch.tensor(self._inputs[:n]),
                   "positions": torch.tensor(self._row_positions(n))}  # fmt: skip
            labels = torch.tensor(self._labels[:n])
            del self._inputs[:n], self._labels[:n], self._pos[:n]
            yield row, labels

    def _stream_rows(
        self, ids: list[int]
    ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        n = self.seq_len + 1
        self._inputs.extend(ids)
        while len(self._inputs) >= n:
            window = torch.tensor(self._inputs[:n])
            del self._inputs[:n]
            yield {"input": window[:-1]}, window[1:]

    def _row_positions(self, n: int) -> list[int]:
        """The next row's positions, those of a document begun in an earlier row counted from
        0 (as torchtitan's: so no position reaches `seq_len`, RoPE's table)."""
        pos = self._pos[:n]
        first = pos[0]
        for i, p in enumerate(pos):
            if p == 0 and i > 0:
                break
            pos[i] = p - first
        return pos

    def state_dict(self) -> dict[str, Any]:
        return {
            "next_doc": self._next_doc,
            "epoch": self._epoch,
            "inputs": list(self._inputs),
            "labels": list(self._labels),
            "positions": list(self._pos),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._next_doc = state_dict["next_doc"]
        self._epoch = state_dict["epoch"]
        self._inputs = list(state_dict["inputs"])
        self._labels = list(state_dict["labels"])
        self._pos = list(state_dict["positions"])


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description="Train a byte-level BPE on local text and write torchtitan's tokenizer "
        "assets folder (its --hf_assets_path / --model.hf_assets_path)."
    )
    parser.add_argument("--data", required=True,
                        help="a .txt/.txt.gz file, a folder of them, or a comma list")  # fmt: skip
    parser.add_argument("--out", required=True, type=Path, help="the assets folder to write")
    parser.add_argument("--vocab-size", type=int, default=32768,
                        help="tokens, BOS and EOS included (at most the model's)")  # fmt: skip
    parser.add_argument("--max-mb", type=float, default=0,
                        help="train on the first MB of text only (0: all of it)")  # fmt: skip
    args = parser.parse_args(argv)
    out = write_tokenizer(text_files(args.data), args.out, args.vocab_size, int(args.max_mb * 1e6))
    print(f"wrote {out}/tokenizer.json and tokenizer_config.json ({args.vocab_size} tokens)")
    return out


if __name__ == "__main__":
    main()
