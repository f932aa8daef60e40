"""Build the embedded default corpus (data/corpus/) from the Python 3.11 documentation sources.

Source: the Debian package ``python3.11-doc`` (PSF licence). Its ``html/_sources/**/*.rst.txt`` files are the
reStructuredText sources of the Python documentation: ~500 English documents, ~11 MB, the longest ~210 KB.

Output (all rebuilt from scratch, byte-for-byte deterministic for a given package version):

    data/corpus/train-0000{0..N-1}.jsonl.zst   training documents, spread over N shards (so per-rank
                                               sharding by file is real), one JSON record per line
    data/corpus/heldout.jsonl.zst              held-out documents (never in train), long ones first
    data/corpus/LICENSE                        the package's copyright file (PSF licence + notices)

Each record is ``{"text": <document>, "source": <path relative to _sources, e.g. "library/os.rst.txt">}``.

Held-out split (deterministic, no RNG): documents sorted by (size descending, path); every third of the
``3 * num_heldout_long`` longest (ranks 1, 4, 7, ...) plus every ``heldout_stride``-th of the remaining documents
in path order. So the held-out set holds ~24 documents of 35-180 KB (10K-50K tokens with the default
tokenizer: per-position evaluation at 2K-16K tokens has real documents) and some ordinary short ones, while
the longest document (library/stdtypes) and two of every three long ones stay in train.

Usage (rerunnable; either point at an already extracted package or let it download one with apt):

    python data/build_corpus.py --extracted /tmp/pydoc/x
    python data/build_corpus.py                 # apt-get download python3.11-doc && dpkg -x into a temp dir
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import zstandard

PACKAGE = "python3.11-doc"
SOURCES_REL = "usr/share/doc/python3.11/html/_sources"
COPYRIGHT_REL = "usr/share/doc/python3.11-doc/copyright"
OUT_DIR = Path(__file__).resolve().parent / "corpus"


def extract_package(workdir: Path) -> Path:
    """Download ``python3.11-doc`` with apt-get and unpack it with dpkg -x; returns the extraction root."""
    subprocess.run(["apt-get", "download", PACKAGE], cwd=workdir, check=True)
    debs = sorted(workdir.glob(f"{PACKAGE}_*.deb"))
    if not debs:
        raise FileNotFoundError(f"apt-get download {PACKAGE} produced no .deb in {workdir}")
    root = workdir / "x"
    subprocess.run(["dpkg", "-x", str(debs[-1]), str(root)], check=True)
    return root


def load_documents(root: Path) -> list[tuple[str, str]]:
    """Return [(relpath, text)] of every ``*.rst.txt`` under the package's _sources, sorted by path."""
    src = root / SOURCES_REL
    if not src.is_dir():
        raise FileNotFoundError(f"{src} does not exist: pass the directory where {PACKAGE} was extracted "
                                f"(dpkg -x {PACKAGE}_*.deb DIR), or omit --extracted to download it")
    docs = []
    for path in sorted(src.rglob("*.rst.txt")):
        text = path.read_text(encoding="utf-8")
        if text.strip():
            docs.append((path.relative_to(src).as_posix(), text))
    return docs


def split_heldout(docs: list[tuple[str, str]], num_heldout_long: int, heldout_stride: int):
    """Deterministic held-out choice (see module docstring); returns (train, heldout) lists of (relpath, text)."""
    by_size = sorted(docs, key=lambda d: (-len(d[1].encode()), d[0]))
    long_pool = by_size[: 3 * num_heldout_long]
    heldout_paths = {d[0] for i, d in enumerate(long_pool) if i % 3 == 1}
    rest = sorted(d[0] for d in docs if d[0] not in heldout_paths and d not in long_pool)
    heldout_paths |= set(rest[heldout_stride // 2 :: heldout_stride])
    heldout = sorted((d for d in docs if d[0] in heldout_paths), key=lambda d: (-len(d[1].encode()), d[0]))
    train = [d for d in docs if d[0] not in heldout_paths]
    return train, heldout


def write_jsonl_zst(path: Path, docs: list[tuple[str, str]]) -> None:
    """Write records {"text", "source"} as one zstd frame (level 19), atomically."""
    payload = "".join(json.dumps({"text": text, "source": rel}, ensure_ascii=False) + "\n" for rel, text in docs)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(zstandard.ZstdCompressor(level=19).compress(payload.encode("utf-8")))
    tmp.replace(path)


def build(root: Path, out_dir: Path, num_shards: int, num_heldout_long: int, heldout_stride: int, seed: int):
    docs = load_documents(root)
    train, heldout = split_heldout(docs, num_heldout_long, heldout_stride)
    # A seeded shuffle so that each shard (and the stream inside it) mixes library/, whatsnew/, c-api/, ...
    random.Random(seed).shuffle(train)
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("train-*.jsonl.zst"):
        old.unlink()
    for k in range(num_shards):
        write_jsonl_zst(out_dir / f"train-{k:05d}.jsonl.zst", train[k::num_shards])
    write_jsonl_zst(out_dir / "heldout.jsonl.zst", heldout)
    shutil.copyfile(root / COPYRIGHT_REL, out_dir / "LICENSE")
    mb = lambda ds: sum(len(t.encode()) for _, t in ds) / 1e6
    print(f"{len(docs)} documents, {mb(docs):.2f} MB: train {len(train)} docs ({mb(train):.2f} MB) in "
          f"{num_shards} shards, heldout {len(heldout)} docs ({mb(heldout):.2f} MB) -> {out_dir}")
    for f in sorted(out_dir.glob("*.jsonl.zst")):
        print(f"  {f.name}: {f.stat().st_size / 1e6:.2f} MB")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--extracted", type=Path, default=None,
                   help=f"directory where {PACKAGE} was extracted with dpkg -x (default: download it with apt)")
    p.add_argument("--out", type=Path, default=OUT_DIR)
    p.add_argument("--num-shards", type=int, default=4)
    p.add_argument("--num-heldout-long", type=int, default=24)
    p.add_argument("--heldout-stride", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.extracted is not None:
        build(a.extracted, a.out, a.num_shards, a.num_heldout_long, a.heldout_stride, a.seed)
        return
    with tempfile.TemporaryDirectory() as tmp:
        build(extract_package(Path(tmp)), a.out, a.num_shards, a.num_heldout_long, a.heldout_stride, a.seed)


if __name__ == "__main__":
    main()
