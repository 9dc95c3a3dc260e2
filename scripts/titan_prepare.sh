#!/usr/bin/env bash
# Local text and tokenizers for torchtitan's trainer (docs/TORCHTITAN.md, "Training on local
# text"), run once from the repository root on a machine with the corpus:
#
#   scripts/titan_prepare.sh [CORPUS_DIR]      (default: ../shared/data/text)
#
# copies train.txt.gz and val.txt.gz into .data/ (ignored; the corpus is never added to the
# repository) and trains two byte-level BPE tokenizers on the training text into
# .titan-assets/ (ignored): bpe-2k (2048 tokens, the size of torchtitan's debug models'
# vocabulary) and bpe-32k (32768, for the other flavors). Both folders travel to a GPU machine
# as carried paths; the tokenizers train in about a minute each on two cores.
set -euo pipefail
corpus=${1:-../shared/data/text}
mkdir -p .data .titan-assets
for f in train.txt.gz val.txt.gz; do
  [ -f ".data/$f" ] || cp "$corpus/$f" ".data/$f"
done
for size in 2k:2048 32k:32768; do
  name=${size%%:*}; vocab=${size##*:}
  [ -f ".titan-assets/bpe-$name/tokenizer.json" ] && continue
  python3 -m blockscale.integrations.titan.local_text --data .data/train.txt.gz \
    --out ".titan-assets/bpe-$name" --vocab-size "$vocab"
done
