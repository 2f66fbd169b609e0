"""Dataset loaders: generated IDX files, corrupt files, the real files when present."""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from pathnorm_experiments import data as D

SHARED = Path(
    os.environ.get("PATHNORM_SHARED_DATA", Path(__file__).parents[1] / ".." / "shared" / "data")
)
needs_shared = pytest.mark.skipif(
    not (SHARED / "mnist").is_dir(),
    reason=f"real datasets not found at {SHARED} (set PATHNORM_SHARED_DATA)",
)


def idx_bytes(arr: np.ndarray, kind: str, count: int | None = None) -> bytes:
    n = arr.shape[0] if count is None else count
    if kind == "images":
        head = struct.pack(">IIII", D.IMAGE_MAGIC, n, 28, 28)
    else:
        head = struct.pack(">II", D.LABEL_MAGIC, n)
    return head + arr.astype(np.uint8).tobytes()


def write_gz(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wb") as f:
        f.write(payload)


def make_mnist_dir(
    root: Path, n_train: int = 30, n_test: int = 20, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    arrs = {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    d = root / "mnist"
    write_gz(d / "train-images-idx3-ubyte.gz", idx_bytes(arrs["train_images"], "images"))
    write_gz(d / "train-labels-idx1-ubyte.gz", idx_bytes(arrs["train_labels"], "labels"))
    write_gz(d / "t10k-images-idx3-ubyte.gz", idx_bytes(arrs["test_images"], "images"))
    write_gz(d / "t10k-labels-idx1-ubyte.gz", idx_bytes(arrs["test_labels"], "labels"))
    return arrs


@pytest.fixture
def small_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrink the expected sample counts of every dataset to 30 train / 20 test."""
    for name, spec in list(D.DATASETS.items()):

        def shrink(fs: D.FileSpec) -> D.FileSpec:
            return D.FileSpec(fs.name, 30 if fs.count == 60000 else 20, fs.sha256, fs.kind)

        new = D.DatasetSpec(
            spec.name,
            spec.subdir,
            spec.url,
            spec.license,
            tuple(map(shrink, spec.train_images)),
            tuple(map(shrink, spec.train_labels)),
            tuple(map(shrink, spec.test_images)),
            tuple(map(shrink, spec.test_labels)),
            shrink(spec.partial_train_images) if spec.partial_train_images else None,
        )
        monkeypatch.setitem(D.DATASETS, name, new)


def test_generated_idx_roundtrip(tmp_path: Path, small_counts: None) -> None:
    arrs = make_mnist_dir(tmp_path)
    ds = D.load_dataset("mnist", tmp_path, verify=False)
    assert ds.x_train.shape == (30, 784) and ds.x_train.dtype == np.float32
    np.testing.assert_array_equal(
        ds.x_train, arrs["train_images"].reshape(30, 784) / np.float32(255)
    )
    np.testing.assert_array_equal(ds.y_test, arrs["test_labels"])
    assert ds.x_train.min() >= 0 and ds.x_train.max() <= 1
    assert not ds.partial


def test_env_var_data_dir(
    tmp_path: Path, small_counts: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_mnist_dir(tmp_path)
    monkeypatch.setenv(D.ENV_VAR, str(tmp_path))
    assert D.default_data_dir() == tmp_path
    assert D.load_dataset("mnist", verify=False).x_test.shape == (20, 784)


def test_raw_idx_uncompressed(tmp_path: Path) -> None:
    lab = np.arange(10, dtype=np.uint8)
    p = tmp_path / "labels-idx1-ubyte"
    p.write_bytes(idx_bytes(lab, "labels"))
    np.testing.assert_array_equal(D.read_idx(p, "labels"), lab)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: struct.pack(">I", 1234) + b[4:], "bad IDX magic number 1234"),
        (lambda b: b[: len(b) - 100], "truncated"),
        (lambda b: b[:4] + struct.pack(">I", 31) + b[8:], "truncated: header says 31"),
        (lambda b: b[:8] + struct.pack(">II", 32, 28) + b[16:], "images are 32x28"),
        (lambda b: b[:10], "truncated IDX file"),
    ],
    ids=["bad-magic", "truncated-body", "count-mismatch", "bad-shape", "short-header"],
)
def test_corrupt_image_file(tmp_path: Path, small_counts: None, mutate, match: str) -> None:
    arrs = make_mnist_dir(tmp_path)
    p = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    write_gz(p, mutate(idx_bytes(arrs["train_images"], "images")))
    with pytest.raises(D.DataError, match=match) as e:
        D.load_dataset("mnist", tmp_path, verify=False)
    assert "train-images-idx3-ubyte.gz" in str(e.value)


def test_wrong_count_against_spec(tmp_path: Path, small_counts: None) -> None:
    make_mnist_dir(tmp_path, n_train=29)  # consistent file, but not the published count
    with pytest.raises(D.DataError, match=r"labels have shape \(29,\), expected \(30,\)"):
        D.load_dataset("mnist", tmp_path, verify=False)


def test_label_out_of_range(tmp_path: Path, small_counts: None) -> None:
    make_mnist_dir(tmp_path)
    write_gz(tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz", idx_bytes(np.full(20, 11), "labels"))
    with pytest.raises(D.DataError, match=r"labels must be in 0\.\.9, found 11"):
        D.load_dataset("mnist", tmp_path, verify=False)


def test_broken_gzip(tmp_path: Path, small_counts: None) -> None:
    make_mnist_dir(tmp_path)
    p = tmp_path / "mnist" / "t10k-labels-idx1-ubyte.gz"
    p.write_bytes(p.read_bytes()[:-12])
    with pytest.raises(D.DataError, match="cannot decompress"):
        D.load_dataset("mnist", tmp_path, verify=False)


def test_checksum_mismatch_names_file_and_source(tmp_path: Path, small_counts: None) -> None:
    make_mnist_dir(tmp_path)
    with pytest.raises(D.DataError) as e:
        D.load_dataset("mnist", tmp_path)  # verify=True: generated files are not the originals
    msg = str(e.value)
    assert "SHA-256 mismatch" in msg and "expected 3552534a" in msg and "ossci-datasets" in msg


def test_missing_file_says_where_to_get_it(tmp_path: Path) -> None:
    with pytest.raises(D.DataError) as e:
        D.load_dataset("fashion-mnist", tmp_path)
    msg = str(e.value)
    assert "train-labels-idx1-ubyte.gz not found" in msg
    assert "fashion-mnist.s3-website" in msg and "Nothing is downloaded" in msg


def test_unknown_dataset() -> None:
    with pytest.raises(ValueError, match="unknown dataset 'cifar'"):
        D.load_dataset("cifar")


def _truncated_gz(payload: bytes, keep: int) -> bytes:
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    body = comp.compress(payload) + comp.flush()
    header = (
        b"\x1f\x8b\x08\x08" + struct.pack("<I", 0) + b"\x02\xff" + b"train-images-idx3-ubyte\x00"
    )
    return (header + body)[:keep]


def make_kmnist_partial(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """KMNIST's files but the full training images (30 train, 20 test)."""
    rng = np.random.default_rng(1)
    imgs = rng.integers(0, 256, (30, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 30, dtype=np.uint8)
    d = root / "kmnist"
    blob = _truncated_gz(idx_bytes(imgs, "images"), keep=10**9)
    # keep the header and part of the stream: a prefix of the images decodes
    (d / "partial").mkdir(parents=True)
    (d / "partial" / "train-images-idx3-ubyte.gz.truncated").write_bytes(blob[: len(blob) * 2 // 3])
    write_gz(d / "train-labels-idx1-ubyte.gz", idx_bytes(labels, "labels"))
    write_gz(d / "t10k-images-idx3-ubyte.gz", idx_bytes(imgs[:20], "images"))
    write_gz(d / "t10k-labels-idx1-ubyte.gz", idx_bytes(labels[:20], "labels"))
    return imgs, labels


def test_kmnist_partial_train_set(tmp_path: Path, small_counts: None) -> None:
    imgs, labels = make_kmnist_partial(tmp_path)
    with pytest.raises(D.DataError, match="allow_partial=True"):
        D.load_dataset("kmnist", tmp_path, verify=False)
    with pytest.warns(UserWarning, match=r"PARTIAL training set: (\d+) of 30"):
        ds = D.load_dataset("kmnist", tmp_path, verify=False, allow_partial=True)
    n = ds.x_train.shape[0]
    assert 0 < n < 30 and ds.partial
    np.testing.assert_array_equal(ds.x_train, imgs[:n].reshape(n, 784) / np.float32(255))
    np.testing.assert_array_equal(ds.y_train, labels[:n])


def test_files_directly_in_the_data_dir_are_not_read(tmp_path: Path, small_counts: None) -> None:
    # MNIST's files flat in <data-dir> were taken for KMNIST's (or Fashion-MNIST's) missing
    # training images: the three datasets share file names
    make_mnist_dir(tmp_path)
    for f in (tmp_path / "mnist").iterdir():
        f.rename(tmp_path / f.name)
    make_kmnist_partial(tmp_path)
    with pytest.raises(D.DataError, match="allow_partial=True"):
        D.load_dataset("kmnist", tmp_path, verify=False)
    with pytest.warns(UserWarning, match="PARTIAL training set"):
        assert D.load_dataset("kmnist", tmp_path, verify=False, allow_partial=True).partial
    fashion = tmp_path / "fashion-mnist"
    fashion.mkdir()
    for f in (tmp_path / "kmnist").glob("*.gz"):  # all but the training images
        (fashion / f.name).write_bytes(f.read_bytes())
    for name in ("fashion-mnist", "mnist"):
        with pytest.raises(D.DataError) as e:
            D.load_dataset(name, tmp_path, verify=False)
        assert f"not found in {tmp_path / name} ({tmp_path}/" in str(e.value)
        assert "-ubyte.gz is not read: the datasets share file names); get" in str(e.value)


def test_embedded_subset_is_stratified() -> None:
    ds = D.load_dataset("embedded")
    assert ds.x_train.shape == (5000, 784) and ds.x_test.shape == (1000, 784)
    np.testing.assert_array_equal(np.bincount(ds.y_train), np.full(10, 500))
    np.testing.assert_array_equal(np.bincount(ds.y_test), np.full(10, 100))
    assert ds.x_train.dtype == np.float32 and 0 <= ds.x_train.min() and ds.x_train.max() <= 1
    assert (D.EMBEDDED_PATH.parent / "LICENSE-DATA.md").is_file()


def test_subset_validation() -> None:
    ds = D.load_dataset("embedded")
    assert ds.subset(100, 10).x_train.shape == (100, 784)
    with pytest.raises(ValueError, match="n_train must be >= 1"):
        ds.subset(0)


@needs_shared
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
def test_real_datasets(name: str) -> None:
    ds = D.load_dataset(name, SHARED)
    assert ds.x_train.shape == (60000, 784) and ds.x_test.shape == (10000, 784)
    assert np.bincount(ds.y_train).min() > 5000
    assert 0.1 < ds.x_train.mean() < 0.4


@needs_shared
def test_real_kmnist_partial() -> None:
    with pytest.raises(D.DataError, match="only the truncated"):
        D.load_dataset("kmnist", SHARED)
    with pytest.warns(UserWarning, match="7011 of 60000"):
        ds = D.load_dataset("kmnist", SHARED, allow_partial=True)
    assert ds.x_train.shape == (7011, 784) and ds.partial
    assert ds.x_test.shape == (10000, 784)


@needs_shared
def test_embedded_subset_matches_real_mnist() -> None:
    with np.load(D.EMBEDDED_PATH) as z:
        tr, te, x_tr, y_te = z["train_index"], z["test_index"], z["x_train"], z["y_test"]
    mnist = D.load_dataset("mnist", SHARED)
    np.testing.assert_array_equal(x_tr.reshape(-1, 784) / np.float32(255), mnist.x_train[tr])
    np.testing.assert_array_equal(y_te, mnist.y_test[te])


@needs_shared
def test_make_subset_is_deterministic(tmp_path: Path) -> None:
    out = D.make_subset(SHARED, tmp_path / "s.npz")
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    assert digest == hashlib.sha256(D.EMBEDDED_PATH.read_bytes()).hexdigest()


def _flip_payload_byte(blob: bytes, payload: bytes) -> bytes:
    """Flip one byte of a stored (uncompressed) npz member: the zip's CRC-32 no longer matches."""
    at = blob.index(payload) + len(payload) // 2
    return blob[:at] + bytes([blob[at] ^ 0xFF]) + blob[at + 1 :]


NPZ_CORRUPTIONS = {
    "truncated": (lambda blob, payload: blob[: len(blob) // 2], "File is not a zip file"),
    "bad-crc": (_flip_payload_byte, "Bad CRC-32"),
    "not-a-zip": (
        lambda blob, payload: b"<html>404 Not Found</html>",
        "not a zip archive (an npz is one): it starts with b'<htm'",
    ),
    "empty": (lambda blob, payload: b"", "the file is empty"),
}


def make_kmnist_npz_dir(root: Path, n_train: int = 30, n_test: int = 20) -> dict[str, bytes]:
    """KMNIST's four .npz files (stored, uncompressed); returns the raw array bytes by file."""
    rng = np.random.default_rng(2)
    arrays = {
        "kmnist-train-imgs.npz": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "kmnist-train-labels.npz": rng.integers(0, 10, n_train, dtype=np.uint8),
        "kmnist-test-imgs.npz": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "kmnist-test-labels.npz": rng.integers(0, 10, n_test, dtype=np.uint8),
    }
    (root / "kmnist").mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        np.savez(root / "kmnist" / name, arr)
    return {name: arr.tobytes() for name, arr in arrays.items()}


@pytest.mark.parametrize("corruption", sorted(NPZ_CORRUPTIONS))
def test_corrupt_npz_names_file_cause_and_source(
    tmp_path: Path, small_counts: None, corruption: str
) -> None:
    # kmnist-train-imgs.npz has no published SHA-256, so only the reader can catch the damage
    payloads = make_kmnist_npz_dir(tmp_path)
    assert D.load_dataset("kmnist", tmp_path, verify=False).x_train.shape == (30, 784)
    mutate, cause = NPZ_CORRUPTIONS[corruption]
    p = tmp_path / "kmnist" / "kmnist-train-imgs.npz"
    p.write_bytes(mutate(p.read_bytes(), payloads[p.name]))
    with pytest.raises(D.DataError) as e:
        D.load_dataset("kmnist", tmp_path, verify=False)
    msg = str(e.value)
    assert msg.startswith(f"{p}: cannot read npz"), msg
    assert cause in msg and "corrupt or truncated" in msg
    assert "get kmnist-train-imgs.npz from http://codh.rois.ac.jp/kmnist/" in msg
    assert "<data-dir>/kmnist/" in msg


@pytest.mark.parametrize(
    ("write", "cause"),
    [
        (lambda p: p.write_bytes(D.EMBEDDED_PATH.read_bytes()[:5000]), "File is not a zip file"),
        (lambda p: p.write_bytes(b""), "the file is empty"),
        (lambda p: np.savez(p, x_train=np.zeros((1, 28, 28), np.uint8)), "no array 'y_train'"),
    ],
    ids=["truncated", "empty", "missing-array"],
)
def test_corrupt_embedded_subset_says_how_to_rebuild(tmp_path: Path, write, cause: str) -> None:
    p = tmp_path / "mnist_subset.npz"
    write(p)
    with pytest.raises(D.DataError) as e:
        D.load_embedded(p)
    msg = str(e.value)
    assert msg.startswith(f"embedded subset {p}"), msg
    assert cause in msg
    assert "python -m pathnorm_experiments.data --make-subset" in msg


def _embedded_arrays() -> dict[str, np.ndarray]:
    with np.load(D.EMBEDDED_PATH) as z:
        return {k: z[k][:50] for k in ("x_train", "y_train", "x_test", "y_test")}


def _with_nan(a: dict[str, np.ndarray]) -> None:
    a["x_test"] = a["x_test"].astype(np.float32)
    a["x_test"][3, 5, 7] = np.nan


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda a: a["y_train"].__setitem__(7, 42), "y_train: labels must be in 0..9, found 42 at index 7 (1 out of range)"),
        (lambda a: a.__setitem__("y_test", a["y_test"].astype(np.int64) - 1), "y_test: labels must be in 0..9, found -1 at index"),
        (_with_nan, "x_test: 1 pixels are NaN or inf"),
        (lambda a: a.__setitem__("x_train", a["x_train"].astype(np.float64)), "x_train: pixels must be uint8 (0..255), got float64"),
        (lambda a: a.__setitem__("x_train", a["x_train"][:, :27]), "x_train: images have shape (50, 27, 28), expected (N, 28, 28) or (N, 784)"),
        (lambda a: a.__setitem__("x_test", a["x_test"].reshape(50, 2, 392)), "x_test: images have shape (50, 2, 392)"),
        (lambda a: a.__setitem__("y_train", a["y_train"][:49]), "y_train holds 49 labels for 50 images in x_train"),
        (lambda a: a.__setitem__("y_test", a["y_test"].astype(np.float32)), "y_test: labels must be a 1-D integer array, got float32 (50,)"),
    ],
    ids=["label-42", "label-negative", "nan-pixel", "float-pixels", "image-27x28", "image-2x392", "count-mismatch", "float-labels"],
)  # fmt: skip
def test_embedded_file_gets_the_checks_of_load_dataset(tmp_path: Path, edit, problem: str) -> None:
    arrays = _embedded_arrays()
    p = tmp_path / "subset.npz"
    np.savez(p, **arrays)
    assert D.load_embedded(p).x_train.shape == (50, 784)  # the unedited copy loads
    edit(arrays)
    np.savez(p, **arrays)
    with pytest.raises(D.DataError) as e:
        D.load_embedded(p)
    msg = str(e.value)
    assert msg.startswith(f"embedded subset {p}: {problem}"), msg
    assert msg.endswith("or reinstall pathnorm"), msg


def test_flat_embedded_images_load_like_square_ones(tmp_path: Path) -> None:
    arrays = _embedded_arrays()
    p = tmp_path / "flat.npz"
    np.savez(p, **{k: v.reshape(50, 784) if k[0] == "x" else v for k, v in arrays.items()})
    flat, ref = D.load_embedded(p), D.load_embedded(D.EMBEDDED_PATH).subset(50, 50)
    np.testing.assert_array_equal(flat.x_train, ref.x_train)
    np.testing.assert_array_equal(flat.y_test, ref.y_test)


# --- the LightningDataModule -------------------------------------------------------------


def test_image_data_module_reads_the_embedded_subset() -> None:
    torch = pytest.importorskip("torch")
    from pathnorm_experiments.lightning_module import ImageDataModule

    dm = ImageDataModule("embedded", batch_size=100, n_train=300)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 3
    x, y = batches[0]
    assert x.shape == (100, 784) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert float(x.min()) >= 0.0 and float(x.max()) <= 1.0 and float(x.max()) > 0.5
    embedded = D.load_embedded()
    seen = torch.cat([b[1] for b in batches]).sort().values
    assert torch.equal(seen, torch.from_numpy(embedded.y_train[:300]).sort().values)
    ((x_te, y_te),) = list(dm.test_dataloader())
    assert x_te.shape == (1000, 784) and torch.equal(y_te, torch.from_numpy(embedded.y_test))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataset": "cifar10"}, r"unknown dataset 'cifar10'; choose one of embedded, mnist"),
        ({"batch_size": 0}, r"batch_size must be >= 1, got 0"),
        ({"n_train": 0}, r"n_train must be >= 1, or None for all, got 0"),
    ],
)
def test_image_data_module_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    from pathnorm_experiments.lightning_module import ImageDataModule

    with pytest.raises(ValueError, match=match):
        ImageDataModule(**kwargs)


def test_image_data_module_says_which_file_is_missing(tmp_path: Path) -> None:
    from pathnorm_experiments.lightning_module import ImageDataModule

    dm = ImageDataModule("fashion-mnist", data_dir=str(tmp_path))
    with pytest.raises(D.DataError, match=r"fashion-mnist.*not found"):
        dm.setup("fit")


@needs_shared
def test_image_data_module_reads_real_mnist() -> None:
    from pathnorm_experiments.lightning_module import ImageDataModule

    dm = ImageDataModule("mnist", data_dir=str(SHARED), batch_size=1000)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert len(loader.dataset) == 60_000  # type: ignore[arg-type]
    x, _ = next(iter(loader))
    assert x.shape == (1000, 784) and float(x.max()) == 1.0


def test_data_cli_help_is_plain_text_with_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        D.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "``" not in text and ":class:" not in text
    assert "regenerate the embedded subset (default: False)" in text
