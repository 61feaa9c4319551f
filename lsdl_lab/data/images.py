"""Image classification data: scikit-learn's digits (offline) and CIFAR-10 (downloaded).

At the ``smoke`` and ``cpu`` scales the labs use the 8x8 handwritten digits that ship with
scikit-learn; at the ``gpu`` scale, CIFAR-10 (Krizhevsky, 2009), downloaded once and
verified against its published md5 (:mod:`lsdl_lab.data.files`). Either way the images
come as an :class:`ImageData`, normalized per channel with the training statistics::

    data = load_images("digits").subset(512)
"""

from __future__ import annotations

import codecs
import importlib.util
import io
import pickle
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .._util import atomic_path, check_choice, check_fraction, check_int, generator
from .files import REMOTE_FILES, DataIntegrityError, RemoteFile, fetch

__all__ = [
    "ImageData",
    "load_cifar10",
    "load_digits",
    "load_images",
    "stratified_split",
]

_CIFAR10_MEMBERS = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]


@dataclass(eq=False)
class ImageData:
    """An image classification data set, normalized per channel with the train statistics."""

    name: str
    train_x: torch.Tensor  # float32 (N, C, H, W)
    train_y: torch.Tensor  # int64 (N,)
    test_x: torch.Tensor
    test_y: torch.Tensor
    classes: tuple[str, ...]
    mean: tuple[float, ...] = ()  # per-channel train mean before normalization (pixels in [0, 1])
    std: tuple[float, ...] = ()

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])

    def subset(self, max_train: int | None, seed: int = 0) -> ImageData:
        """At most ``max_train`` training examples, each class kept in its proportion.

        Deterministic in ``seed``. The test set and the normalization (that of the full
        training set) are unchanged, so results on subsets of different sizes compare.
        """
        if max_train is None:
            return self
        max_train = check_int("max_train", max_train, 1)
        seed = check_int("seed", seed, 0)
        n = len(self.train_y)
        if max_train >= n:
            return self
        # Shuffle, then rank each example within its class; sorting by (rank + 1/2) / count
        # interleaves the classes so that any prefix holds each class in proportion (+-1).
        perm = torch.randperm(n, generator=generator("subset", seed))
        y = self.train_y.cpu()[perm]
        counts = torch.bincount(y, minlength=self.num_classes)
        by_class = torch.sort(y, stable=True).indices
        first_of_class = torch.cumsum(counts, 0) - counts
        rank = torch.empty(n, dtype=torch.long)
        rank[by_class] = torch.arange(n) - first_of_class[y[by_class]]
        key = (rank + 0.5) / counts[y]
        keep = perm[torch.sort(key, stable=True).indices[:max_train]].sort().values
        keep = keep.to(self.train_y.device)
        return ImageData(
            self.name,
            self.train_x[keep],
            self.train_y[keep],
            self.test_x,
            self.test_y,
            self.classes,
            self.mean,
            self.std,
        )


def _image_data(name, train_x, train_y, test_x, test_y, classes, scale: float) -> ImageData:
    """Normalize uint8-like arrays to zero mean, unit variance per channel (train statistics)."""
    train = torch.as_tensor(train_x).float().div_(scale)
    test = torch.as_tensor(test_x).float().div_(scale)
    std, mean = torch.std_mean(train, dim=(0, 2, 3), keepdim=True)
    return ImageData(
        name=name,
        train_x=train.sub_(mean).div_(std),
        train_y=torch.as_tensor(train_y).long(),
        test_x=test.sub_(mean).div_(std),
        test_y=torch.as_tensor(test_y).long(),
        classes=tuple(classes),
        mean=tuple(mean.flatten().tolist()),
        std=tuple(std.flatten().tolist()),
    )


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1,797 digits as (images uint8 (N, 8, 8), labels int64).

    Read straight from the CSV file scikit-learn ships (65 integers a row: 64 pixels, then
    the label), which avoids importing scikit-learn (seconds on a small machine); falls
    back to ``sklearn.datasets.load_digits`` if the file is not where it used to be.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
        if path.exists():
            rows = np.loadtxt(path, delimiter=",", dtype=np.int64)
            return rows[:, :64].reshape(-1, 8, 8).astype(np.uint8), rows[:, 64]
    from sklearn.datasets import load_digits as sklearn_digits

    digits = sklearn_digits()
    return digits.images.astype(np.uint8), digits.target.astype(np.int64)


def stratified_split(labels, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted train and test indices; each class contributes round(n_c * fraction) to test."""
    labels = np.asarray(labels)
    gen = generator("split", seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        idx = idx[torch.randperm(len(idx), generator=gen).numpy()]
        k = int(round(len(idx) * test_fraction))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_digits(seed: int = 0, test_fraction: float = 0.25) -> ImageData:
    """scikit-learn's handwritten digits: 1,797 images of 8x8 pixels, 10 classes.

    The UCI optical-recognition digits (Alpaydin and Kaynak, 1998), shipped inside
    scikit-learn, so it works offline. The train/test split is stratified and
    deterministic in ``seed``. Shapes: ``(N, 1, 8, 8)``.
    """
    seed = check_int("seed", seed, 0, 2**32 - 1)
    test_fraction = check_fraction("test_fraction", test_fraction)
    images, labels = _digits_arrays()
    images = images[:, None]
    train, test = stratified_split(labels, test_fraction, seed)
    classes = [str(c) for c in range(10)]
    # Pixels are counts in 0..16 (Alpaydin and Kaynak's 4x4-block sums).
    return _image_data(
        "digits", images[train], labels[train], images[test], labels[test], classes, scale=16.0
    )


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only plain containers and numpy arrays: a downloaded pickle runs no code."""

    _allowed = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        # numpy moved numpy.core to numpy._core in 2.0; old pickles name the old module.
        ("numpy.core.multiarray", "_reconstruct"): np.array(0).__reduce__()[0],
        ("numpy._core.multiarray", "_reconstruct"): np.array(0).__reduce__()[0],
        ("numpy.core.multiarray", "scalar"): np.uint8(0).__reduce__()[0],
        ("numpy._core.multiarray", "scalar"): np.uint8(0).__reduce__()[0],
        # Python 3's protocol 2 writes bytes as _codecs.encode(str, "latin1").
        ("_codecs", "encode"): codecs.encode,
    }

    def find_class(self, module, name):
        try:
            return self._allowed[(module, name)]
        except KeyError:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}") from None


def _cifar_member(raw: bytes, member: str, archive: Path) -> dict:
    def bad(why: str) -> DataIntegrityError:
        return DataIntegrityError(
            f"{archive}: member {member} is not a valid CIFAR-10 batch ({why}). "
            f"Delete {archive} and re-run: it will be downloaded again."
        )

    try:
        obj = _RestrictedUnpickler(io.BytesIO(raw), encoding="bytes").load()
    except Exception as err:  # any failure to parse untrusted bytes is a bad file
        raise bad(f"unpickling failed: {err!r}") from err
    if not isinstance(obj, dict):
        raise bad(f"expected a dict, got {type(obj).__name__}")
    obj = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in obj.items()}
    if member == "batches.meta":
        names = obj.get("label_names")
        if not isinstance(names, list) or not all(isinstance(s, bytes | str) for s in names):
            raise bad("no list label_names")
        return {"classes": [s.decode() if isinstance(s, bytes) else s for s in names]}
    data, labels = obj.get("data"), np.asarray(obj.get("labels"))
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.shape[1:] != (3072,):
        raise bad(f"data is not a uint8 array of shape (n, 3072): {getattr(data, 'shape', data)}")
    if labels.dtype.kind not in "iu" or labels.shape != (len(data),):
        raise bad(f"labels are not {len(data)} integers")
    # Rows are 1024 red, then 1024 green, then 1024 blue values, each plane row-major.
    return {"x": data.reshape(-1, 3, 32, 32), "y": labels.astype(np.int64)}


def _parse_cifar10(archive: Path) -> dict[str, np.ndarray]:
    wanted = {f"cifar-10-batches-py/{m}": m for m in _CIFAR10_MEMBERS}
    parsed = {}
    try:
        # One pass in archive order: seeking back in a gzip stream would decompress it again.
        with tarfile.open(archive, "r:gz") as tar:
            for info in tar:
                if info.name in wanted and info.isfile():
                    raw = tar.extractfile(info).read()
                    parsed[wanted[info.name]] = _cifar_member(raw, wanted[info.name], archive)
    except (tarfile.TarError, EOFError, OSError, zlib.error) as err:
        raise DataIntegrityError(
            f"{archive} is not a readable tar.gz archive ({err!r}). "
            f"Delete {archive} and re-run: it will be downloaded again."
        ) from err
    missing = [m for m in _CIFAR10_MEMBERS if m not in parsed]
    if missing:
        raise DataIntegrityError(
            f"{archive} lacks {', '.join('cifar-10-batches-py/' + m for m in missing)}. "
            f"Delete {archive} and re-run: it will be downloaded again."
        )
    classes = parsed["batches.meta"]["classes"]
    train = [parsed[f"data_batch_{i}"] for i in range(1, 6)]
    arrays = {
        "train_x": np.concatenate([b["x"] for b in train]),
        "train_y": np.concatenate([b["y"] for b in train]),
        "test_x": parsed["test_batch"]["x"],
        "test_y": parsed["test_batch"]["y"],
        "classes": np.array(classes, dtype=str),
    }
    for split in ("train_y", "test_y"):
        if arrays[split].min(initial=0) < 0 or arrays[split].max(initial=0) >= len(classes):
            raise DataIntegrityError(
                f"{archive}: labels outside [0, {len(classes)}). "
                f"Delete {archive} and re-run: it will be downloaded again."
            )
    return arrays


def load_cifar10(
    root=None, download: bool = True, *, remote: RemoteFile | None = None
) -> ImageData:
    """CIFAR-10 (Krizhevsky, 2009): 50,000 train and 10,000 test 32x32 colour images.

    The official python-version archive (the record ``REMOTE_FILES["cifar10"]``, or
    ``remote``) is downloaded once into ``root`` (default :data:`DEFAULT_ROOT`), checked
    against its published md5, parsed from the tar by this module (pickles are read with
    an unpickler that allows only numpy arrays and plain containers), and cached as
    ``cifar-10-python.npz`` beside it for fast later loads. With ``download=False`` the
    archive must already be at ``root``.
    """
    remote = REMOTE_FILES["cifar10"] if remote is None else remote
    archive = remote.path(root)
    cache = archive.with_name("cifar-10-python.npz")
    arrays = None
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as npz:
                # A cache built from another archive (other checksum) is rebuilt, not used.
                if str(npz["archive_md5"]) == str(remote.md5):
                    arrays = {k: npz[k] for k in ("train_x", "train_y", "test_x", "test_y")}
                    arrays["classes"] = npz["classes"]
        except Exception as err:  # zipfile, pickle and shape errors: the cache is unusable
            raise DataIntegrityError(
                f"The cache {cache} is unreadable ({err!r}). Delete {cache} and re-run: "
                f"it will be rebuilt from the archive."
            ) from err
    if arrays is None:
        arrays = _parse_cifar10(fetch(remote, root, download=download))
        with atomic_path(cache) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays, archive_md5=np.array(str(remote.md5)))
    return _image_data(
        "cifar10",
        arrays["train_x"],
        arrays["train_y"],
        arrays["test_x"],
        arrays["test_y"],
        [str(c) for c in arrays["classes"]],
        scale=255.0,
    )


IMAGE_DATASETS = {"digits": load_digits, "cifar10": load_cifar10}


def load_images(name: str, **kwargs) -> ImageData:
    """Load an image data set by name: ``"digits"`` or ``"cifar10"``."""
    check_choice("name", name, list(IMAGE_DATASETS))
    return IMAGE_DATASETS[name](**kwargs)
