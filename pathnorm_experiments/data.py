"""Datasets for the main job: MNIST, Fashion-MNIST, KMNIST and the embedded MNIST subset.

NumPy only (no framework import): every loader returns a :class:`Dataset` of float32 images in
[0, 1], flattened to (N, 784), and int64 labels. Nothing is downloaded; files are looked up in a
data directory (argument, else ``$PATHNORM_DATA_DIR``, else ``~/.cache/pathnorm``) laid out as
``<data_dir>/<dataset>/<file>`` (the layout of the official archives), and checked: IDX magic
numbers, shapes, sample counts and, where the original files' checksums are known, SHA-256.
A missing or corrupt file raises :class:`DataError` naming the file and where to get it. The
file-format readers and array checks live in ``_data_files``.

``python -m pathnorm_experiments.data --make-subset`` regenerates the embedded subset
``pathnorm_experiments/data/mnist_subset.npz`` deterministically from the real MNIST files.
"""

from __future__ import annotations

import argparse
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from pathnorm_experiments._data_files import (
    IMAGE_MAGIC,
    IMAGE_SHAPE,
    LABEL_MAGIC,
    N_CLASSES,
    N_PIXELS,
    DataError,
    check_images,
    check_labels,
    file_sha256,
    npz_arrays,
    read_idx,
    read_npz,
    read_truncated_idx_gz,
)

__all__ = [
    "DATASETS",
    "DATASET_LABELS",
    "DATASET_NAMES",
    "FULL_TRAIN",
    "IMAGE_MAGIC",
    "LABEL_MAGIC",
    "N_CLASSES",
    "PAPER_DATASETS",
    "DataError",
    "Dataset",
    "default_data_dir",
    "load_dataset",
    "load_embedded",
    "make_subset",
    "read_idx",
]

EMBEDDED_PATH = Path(__file__).parent / "data" / "mnist_subset.npz"
ENV_VAR = "PATHNORM_DATA_DIR"


@dataclass(frozen=True)
class FileSpec:
    """One published data file: its name, sample count and (if known) SHA-256."""

    name: str
    count: int
    sha256: str | None
    kind: str  # "images" or "labels"


@dataclass(frozen=True)
class DatasetSpec:
    """Where a dataset's files live and how they are checked."""

    name: str
    subdir: str
    url: str
    license: str
    train_images: tuple[FileSpec, ...]  # alternatives, first found wins
    train_labels: tuple[FileSpec, ...]
    test_images: tuple[FileSpec, ...]
    test_labels: tuple[FileSpec, ...]
    partial_train_images: FileSpec | None = None


FULL_TRAIN = 60000  # training images of MNIST, Fashion-MNIST and KMNIST as published
_SPLITS = (("train_images", FULL_TRAIN), ("train_labels", FULL_TRAIN), ("test_images", 10000),
           ("test_labels", 10000))  # fmt: skip
_IDX = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz")  # fmt: skip
_NPZ = ("kmnist-train-imgs.npz", "kmnist-train-labels.npz", "kmnist-test-imgs.npz",
        "kmnist-test-labels.npz")  # fmt: skip


def _spec(
    name: str,
    url: str,
    license: str,
    *files: tuple[tuple[str, ...], tuple[str | None, ...]],
    partial: FileSpec | None = None,
) -> DatasetSpec:
    """A dataset's spec from its files: (names, SHA-256s) of the four splits, one pair per
    alternative format, the first found wins."""
    tr_img, tr_lab, te_img, te_lab = (
        tuple(FileSpec(names[k], count, shas[k], split.split("_")[1]) for names, shas in files)
        for k, (split, count) in enumerate(_SPLITS)
    )
    return DatasetSpec(name, name, url, license, tr_img, tr_lab, te_img, te_lab, partial)


# SHA-256 of the files the datasets' authors publish (each checked against their published md5s).
DATASETS: dict[str, DatasetSpec] = {
    "mnist": _spec(
        "mnist",
        "https://ossci-datasets.s3.amazonaws.com/mnist/ (mirror of http://yann.lecun.com/exdb/mnist/)",
        "CC BY-SA 3.0, Yann LeCun and Corinna Cortes",
        (_IDX, (
            "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609",
            "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c",
            "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6",
            "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6",
        )),
    ),
    "fashion-mnist": _spec(
        "fashion-mnist",
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/ "
        "(see https://github.com/zalandoresearch/fashion-mnist)",
        "MIT, Copyright (c) 2017 Zalando SE",
        (_IDX, (
            "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84",
            "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845",
            "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073",
            "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5",
        )),
    ),
    # CODH publishes no SHA-256 for KMNIST's training images; the md5s are bdb82020... (.gz)
    # and a183fbc0... (.npz), so these two are checked by format and count only.
    "kmnist": _spec(
        "kmnist",
        "http://codh.rois.ac.jp/kmnist/dataset/kmnist/ (see https://github.com/rois-codh/kmnist)",
        "CC BY-SA 4.0, ROIS-DS Center for Open Data in the Humanities",
        (_IDX, (
            None,
            "e38f9ebcd0f3ebcdec7fc8eabdcdaef93bb0df8ea12bee65224341c8183d8e17",
            "edd7a857845ad6bb1d0ba43fe7e794d164fe2dce499a1694695a792adfac43c5",
            "20bb9a0ef54c7db3efc55a92eef5582c109615df22683c380526788f98e42a1c",
        )),
        (_NPZ, (
            None,
            "a325c877035602cb9b9ba54f4194a2a1b5f718026a463db5b5e0cdc124c03720",
            "692d824896bec8f3c357ebf7a0fe904ed67ac632ce953d0b58f7fbef7bb27d87",
            "660f13a4705431ea2a6391c41ecbe384cd0d932c595a101ec4f3b8989e785046",
        )),
        partial=FileSpec(
            "partial/train-images-idx3-ubyte.gz.truncated",
            FULL_TRAIN,
            "4f8c6e5967b96c4b1f2d8cad3ca2a9c8b3cfb98a3c24ce45361cd7f4aaf8d0c5",
            "images",
        ),
    ),
}  # fmt: skip
DATASET_NAMES = ("embedded", *DATASETS)
PAPER_DATASETS = tuple(DATASETS)  # the paper's, in its order (the report's, the sweep's default)
DATASET_LABELS = {
    "mnist": "MNIST",
    "fashion-mnist": "Fashion-MNIST",
    "kmnist": "KMNIST",
    "embedded": "embedded MNIST subset",
}


@dataclass(frozen=True)
class Dataset:
    """Flattened images in [0, 1] (float32, (N, 784)) and int64 labels, train and test."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    source: str
    partial: bool = False

    def __post_init__(self) -> None:
        for x, y, split in (
            (self.x_train, self.y_train, "train"),
            (self.x_test, self.y_test, "test"),
        ):
            if x.ndim != 2 or x.shape[1] != N_PIXELS or x.dtype != np.float32:
                raise DataError(f"{split} images must be float32 (N, 784), got {x.dtype} {x.shape}")
            if y.shape != (x.shape[0],):
                raise DataError(f"{split} labels {y.shape} do not match images {x.shape}")

    def subset(self, n_train: int | None = None, n_test: int | None = None) -> Dataset:
        """The first ``n_train`` / ``n_test`` samples (``None`` keeps a split whole)."""
        for n, what in ((n_train, "n_train"), (n_test, "n_test")):
            if n is not None and n < 1:
                raise ValueError(f"{what} must be >= 1 or None, got {n}")
        return replace(
            self,
            x_train=self.x_train[:n_train],
            y_train=self.y_train[:n_train],
            x_test=self.x_test[:n_test],
            y_test=self.y_test[:n_test],
        )


def default_data_dir() -> Path:
    """``$PATHNORM_DATA_DIR`` if set, else ``~/.cache/pathnorm``."""
    env = os.environ.get(ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pathnorm"


def _where_to_get(spec: DatasetSpec, fname: str) -> str:
    return f"get {fname} from {spec.url} and put it in <data-dir>/{spec.subdir}/"


def _find(
    spec: DatasetSpec, data_dir: Path, alternatives: tuple[FileSpec, ...]
) -> tuple[FileSpec, Path] | None:
    for fs in alternatives:  # never <data_dir>/<file>: the three datasets share file names
        if (data_dir / spec.subdir / fs.name).is_file():
            return fs, data_dir / spec.subdir / fs.name
    return None


def _read(spec: DatasetSpec, root: Path, split: str, verify: bool) -> np.ndarray:
    """The checked array of ``split`` from the first of its alternative files found."""
    alternatives: tuple[FileSpec, ...] = getattr(spec, split)
    found = _find(spec, root, alternatives)
    if found is None:
        raise _missing(spec, root, alternatives)
    fs, path = found
    if verify and fs.sha256 is not None:
        got = file_sha256(path)
        if got != fs.sha256:
            raise DataError(
                f"{path}: SHA-256 mismatch (got {got}, expected {fs.sha256}); the file is "
                f"corrupt or not the original: {_where_to_get(spec, fs.name)}, or pass "
                "verify=False (--no-verify) to use a re-packed copy"
            )
    if fs.name.endswith(".npz"):
        arr = read_npz(path, _where_to_get(spec, fs.name))
    else:
        arr = read_idx(path, fs.kind)
    want_shape = (fs.count, *IMAGE_SHAPE) if fs.kind == "images" else (fs.count,)
    if arr.shape != want_shape:
        raise DataError(f"{path}: {fs.kind} have shape {arr.shape}, expected {want_shape}")
    if fs.kind == "labels":
        check_labels(arr, str(path), _where_to_get(spec, fs.name))
    return arr


def _missing(spec: DatasetSpec, data_dir: Path, alternatives: tuple[FileSpec, ...]) -> DataError:
    names = " or ".join(fs.name for fs in alternatives)
    flat = [data_dir / fs.name for fs in alternatives if (data_dir / fs.name).is_file()]
    note = f" ({flat[0]} is not read: the datasets share file names)" if flat else ""
    return DataError(
        f"{spec.name}: {names} not found in {data_dir / spec.subdir}{note}; "
        f"{_where_to_get(spec, alternatives[0].name)} (or set --data-dir / ${ENV_VAR}). "
        "Nothing is downloaded automatically."
    )


def _to_float(images: np.ndarray) -> np.ndarray:
    return images.reshape(images.shape[0], N_PIXELS).astype(np.float32) / np.float32(255.0)


def _load_partial_train_images(
    spec: DatasetSpec, part: FileSpec, root: Path, *, allow_partial: bool, verify: bool
) -> np.ndarray:
    """The complete images of the truncated training-image file ``part`` (the full one is
    missing); refused unless ``allow_partial``, and a warning says how many."""
    alts = spec.train_images
    ppath = root / spec.subdir / part.name
    if not ppath.is_file():
        raise _missing(spec, root, alts)
    if not allow_partial:
        raise DataError(
            f"{spec.name}: the full training images ({alts[0].name}) are not in "
            f"{root / spec.subdir}, only the truncated {part.name}; pass "
            "allow_partial=True (--allow-partial) to train on the complete images it "
            f"holds, or {_where_to_get(spec, alts[0].name)}"
        )
    if verify and part.sha256 is not None and file_sha256(ppath) != part.sha256:
        raise DataError(f"{ppath}: SHA-256 mismatch with the known truncated copy")
    imgs = read_truncated_idx_gz(ppath)
    n = imgs.shape[0]
    if n == 0:
        raise DataError(
            f"{ppath}: holds no complete image to train on: " + _where_to_get(spec, alts[0].name)
        )
    warnings.warn(
        f"{spec.name}: using a PARTIAL training set: {n} of {part.count} training "
        f"images (from {ppath}), paired with the first {n} labels",
        stacklevel=3,  # the caller of load_dataset
    )
    return imgs


def load_dataset(
    name: str,
    data_dir: str | Path | None = None,
    *,
    allow_partial: bool = False,
    verify: bool = True,
) -> Dataset:
    """Load ``name`` (``embedded``, ``mnist``, ``fashion-mnist`` or ``kmnist``).

    Args:
        name: dataset name.
        data_dir: directory holding ``<dataset>/<file>``; default :func:`default_data_dir`.
        allow_partial: accept a truncated training-image file (KMNIST's
            ``partial/train-images-idx3-ubyte.gz.truncated``) and train on the complete images
            it holds, paired with the first labels; a warning says how many.
        verify: check SHA-256 of files whose original checksum is known.
    """
    if name == "embedded":
        return load_embedded()
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)}")
    spec = DATASETS[name]
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    train_labels, test_images, test_labels = (
        _read(spec, root, split, verify) for split in ("train_labels", "test_images", "test_labels")
    )
    part, partial = spec.partial_train_images, False
    if part is not None and _find(spec, root, spec.train_images) is None:
        train_images = _load_partial_train_images(
            spec, part, root, allow_partial=allow_partial, verify=verify
        )
        partial = True
    else:
        train_images = _read(spec, root, "train_images", verify)
    return Dataset(
        name=name,
        x_train=_to_float(train_images),
        y_train=train_labels[: train_images.shape[0]].astype(np.int64),
        x_test=_to_float(test_images),
        y_test=test_labels.astype(np.int64),
        source=str(root / spec.subdir),
        partial=partial,
    )


def load_embedded(path: str | Path = EMBEDDED_PATH) -> Dataset:
    """The embedded stratified MNIST subset (5,000 train + 1,000 test), shipped with the package."""
    path = Path(path)
    fix = (
        "regenerate it with `python -m pathnorm_experiments.data --make-subset --data-dir "
        "<dir with mnist/>`, or reinstall pathnorm"
    )
    if not path.is_file():
        raise DataError(f"embedded subset {path} is missing; {fix}")
    what = f"embedded subset {path}"
    x_tr, y_tr, x_te, y_te = npz_arrays(path, ("x_train", "y_train", "x_test", "y_test"), what, fix)
    for key, images, labels in (("train", x_tr, y_tr), ("test", x_te, y_te)):
        check_images(images, f"{what}: x_{key}", fix)
        check_labels(labels, f"{what}: y_{key}", fix)
        if labels.shape[0] != images.shape[0]:
            raise DataError(
                f"{what}: y_{key} holds {labels.shape[0]} labels for {images.shape[0]} images "
                f"in x_{key}: {fix}"
            )
    return Dataset(
        "embedded",
        _to_float(x_tr),
        y_tr.astype(np.int64),
        _to_float(x_te),
        y_te.astype(np.int64),
        source=str(path),
    )


def _stratified(y: np.ndarray, per_class: int, rng: np.random.Generator) -> np.ndarray:
    idx = []
    for c in range(N_CLASSES):
        members = np.flatnonzero(y == c)
        if members.size < per_class:
            raise DataError(f"class {c} has {members.size} samples, need {per_class}")
        idx.append(np.sort(rng.choice(members, per_class, replace=False)))
    order = np.concatenate(idx)
    return order[rng.permutation(order.size)]


def make_subset(
    data_dir: str | Path | None = None,
    out: str | Path = EMBEDDED_PATH,
    *,
    train_per_class: int = 500,
    test_per_class: int = 100,
    seed: int = 0,
) -> Path:
    """Write the stratified MNIST subset (uint8, compressed npz); deterministic given ``seed``."""
    root = Path(data_dir) if data_dir is not None else default_data_dir()
    spec = DATASETS["mnist"]
    splits = ("train_images", "train_labels", "test_images", "test_labels")
    raw = {split: _read(spec, root, split, verify=True) for split in splits}
    rng = np.random.default_rng(seed)
    tr = _stratified(raw["train_labels"], train_per_class, rng)
    te = _stratified(raw["test_labels"], test_per_class, rng)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out,
        x_train=raw["train_images"][tr],
        y_train=raw["train_labels"][tr],
        x_test=raw["test_images"][te],
        y_test=raw["test_labels"][te],
        train_index=tr.astype(np.int32),
        test_index=te.astype(np.int32),
    )
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m pathnorm_experiments.data``: inspect datasets or regenerate the subset."""
    p = argparse.ArgumentParser(
        prog="python -m pathnorm_experiments.data",
        description="Check the datasets (MNIST, Fashion-MNIST, KMNIST, the embedded subset), or "
        "regenerate the embedded MNIST subset deterministically from the real MNIST files.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--data-dir", default=None, help=f"None: ${ENV_VAR}, else ~/.cache/pathnorm")
    p.add_argument("--make-subset", action="store_true", help="regenerate the embedded subset")
    p.add_argument("--out", default=str(EMBEDDED_PATH), help="where --make-subset writes it")
    p.add_argument("--check", nargs="*", default=None, help="load and summarise these datasets")
    p.add_argument("--allow-partial", action="store_true", help="accept KMNIST's partial set")
    args = p.parse_args(argv)
    if args.make_subset:
        path = make_subset(args.data_dir, args.out)
        print(f"wrote {path} ({path.stat().st_size} bytes, sha256 {file_sha256(path)})")
    for name in args.check or ():
        ds = load_dataset(name, args.data_dir, allow_partial=args.allow_partial)
        print(
            f"{name}: train {ds.x_train.shape} test {ds.x_test.shape} partial={ds.partial} "
            f"from {ds.source}"
        )


if __name__ == "__main__":
    main()
