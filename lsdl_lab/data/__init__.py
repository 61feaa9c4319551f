"""Data sets and batches: real data, verified, and batches that are a function of the step.

Two kinds of data feed the labs. At the ``smoke`` and ``cpu`` scales the data ship with
the software and need no network: scikit-learn's 8x8 handwritten digits, and a character
corpus made from Python's own standard-library source. At the ``gpu`` scale the labs use
the data sets the papers use, downloaded once and verified against published checksums:
CIFAR-10 (Krizhevsky, 2009) and Tiny Shakespeare (Karpathy's char-rnn).

Downloads are atomic: bytes stream into a ``*.part`` file beside the target, are checked
(size and checksum), and only then renamed into place, so a killed download never leaves
a file that a later run would load. Files live under :data:`DEFAULT_ROOT`
(``$LSDL_DATA`` if set, else ``~/.cache/lsdl_lab``). On a machine without internet, put
the file at the path the error message names; it is verified, not downloaded.

Batches are a pure function of the step (:class:`ImageBatches`, :class:`TextBatches`), so
a run resumed from a checkpoint at step ``t`` reads exactly the batches an uninterrupted
run would have read::

    data = load_images("digits").subset(512)
    batches = ImageBatches(data.train_x, data.train_y, batch_size=64, seed=0)
    xb, yb = batches(step)
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import importlib.util
import io
import math
import numbers
import os
import pickle
import platform
import sysconfig
import tarfile
import tempfile
import time
import urllib.request
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .batches import BatchSource

__all__ = [
    "BatchSource",
    "DEFAULT_ROOT",
    "DataIntegrityError",
    "ImageBatches",
    "ImageData",
    "TextBatches",
    "TextData",
    "download",
    "eval_batches",
    "load_cifar10",
    "load_digits",
    "load_images",
    "load_python_source",
    "load_text",
    "load_tiny_shakespeare",
    "python_source_files",
    "random_crop_flip",
    "text_eval_batches",
    "verify",
]

DEFAULT_ROOT = Path(os.environ.get("LSDL_DATA") or Path.home() / ".cache" / "lsdl_lab")

# https://www.cs.toronto.edu/~kriz/cifar.html (the md5 is the one published there).
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
CIFAR10_SIZE = 170_498_071
CIFAR10_FILENAME = "cifar-10-python.tar.gz"
CIFAR10_MEMBERS = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]

# Size and sha256 as recorded by tensorflow_datasets (url_checksums/tiny_shakespeare.txt).
TINY_SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TINY_SHAKESPEARE_SIZE = 1_115_394
TINY_SHAKESPEARE_FILENAME = "tiny_shakespeare.txt"

# A part file untouched this long belongs to a killed process, not to a running download.
STALE_PART_SECONDS = 3600.0


class DataIntegrityError(RuntimeError):
    """A data file is not what it should be (size, checksum or format)."""


# ---------------------------------------------------------------------------------------
# argument checks


def _int_arg(name: str, value, low: int, high: int | None = None) -> int:
    expected = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"Invalid {name}: {value!r} (expected {expected})")
    if value < low or (high is not None and value > high):
        raise ValueError(f"Invalid {name}: {value!r} (expected {expected})")
    return int(value)


def _fraction_arg(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"Invalid {name}: {value!r} (expected a float in (0, 1))")
    if not 0.0 < value < 1.0:
        raise ValueError(f"Invalid {name}: {value!r} (expected a float in (0, 1))")
    return float(value)


def _tensor_arg(name: str, value, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"Invalid {name}: expected a torch.Tensor, got {type(value).__name__}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"Invalid {name}: expected {ndim} dimension(s), got shape {value.shape}")
    return value


def _seed(*parts) -> int:
    """A 63-bit seed from a tuple such as ("epoch", seed, e): independent streams per use."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _generator(*parts) -> torch.Generator:
    # Always a CPU generator: the same seed then gives the same batches on every device.
    return torch.Generator().manual_seed(_seed(*parts))


# ---------------------------------------------------------------------------------------
# verified, atomic files


def _root(root) -> Path:
    return Path(root) if root is not None else DEFAULT_ROOT


def _mismatches(path: Path, md5: str | None, sha256: str | None, size: int | None) -> list[str]:
    problems = []
    actual_size = path.stat().st_size
    if size is not None and actual_size != size:
        problems.append(f"size {actual_size} bytes, expected {size}")
    for algorithm, expected in (("md5", md5), ("sha256", sha256)):
        # A size mismatch already condemns the file; hashing it too would only cost time.
        if expected is None or problems:
            continue
        h = hashlib.new(algorithm)
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        if h.hexdigest() != expected.lower():
            problems.append(f"{algorithm} {h.hexdigest()}, expected {expected.lower()}")
    return problems


def verify(path, *, md5: str | None = None, sha256: str | None = None, size: int | None = None):
    """Check a file's size (bytes) and checksums; raise :class:`DataIntegrityError` if off.

    A missing file raises :class:`FileNotFoundError`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No file at {path}")
    problems = _mismatches(path, md5, sha256, size)
    if problems:
        raise DataIntegrityError(
            f"{path} is corrupt or incomplete ({'; '.join(problems)}). "
            f"Delete {path} and re-run: it will be downloaded again."
        )


@contextlib.contextmanager
def _atomic_path(path: Path) -> Iterator[Path]:
    """Yield a ``*.part`` path beside ``path``; move it into place only if the body succeeds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    now = time.time()
    for part in path.parent.glob(f"{path.name}.*.part"):
        with contextlib.suppress(OSError):  # another process may remove it first
            if now - part.stat().st_mtime > STALE_PART_SECONDS:
                part.unlink()
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f"{path.name}.", suffix=".part")
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)  # atomic on POSIX and Windows: readers see old or new, never half
    finally:
        tmp.unlink(missing_ok=True)


def download(
    url: str,
    path,
    *,
    md5: str | None = None,
    sha256: str | None = None,
    size: int | None = None,
    progress: bool = True,
) -> Path:
    """Download ``url`` to ``path`` once, verified; return ``path``.

    If ``path`` exists and verifies, nothing is downloaded. Otherwise the bytes stream
    into a temporary ``*.part`` file in the same directory, are checked against ``size``
    and the checksums, and are renamed into place. A mismatch raises
    :class:`DataIntegrityError` and leaves nothing at ``path``.
    """
    path = Path(path)
    if path.is_file():
        problems = _mismatches(path, md5, sha256, size)
        if not problems:
            return path
        warnings.warn(
            f"{path} fails verification ({'; '.join(problems)}); downloading it again",
            stacklevel=2,
        )
    with _atomic_path(path) as tmp:
        try:
            with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
                total = size or int(response.headers.get("Content-Length") or 0) or None
                with tqdm(
                    total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress
                ) as bar:
                    for chunk in iter(lambda: response.read(1 << 20), b""):
                        f.write(chunk)
                        bar.update(len(chunk))
        except (OSError, http.client.HTTPException) as err:  # URLError is an OSError
            raise RuntimeError(
                f"Could not download {url} ({err}). On a machine without internet, fetch "
                f"the file elsewhere and place it at {path} (size {size} bytes, "
                f"md5 {md5}, sha256 {sha256}); a file there is verified, not downloaded."
            ) from err
        problems = _mismatches(tmp, md5, sha256, size)
        if problems:
            raise DataIntegrityError(
                f"Downloaded {url} does not match ({'; '.join(problems)}); nothing was saved "
                f"at {path}. Re-run to try again; if it persists the file upstream has changed."
            )
    return path


_download = download  # the loaders' ``download`` flag shadows the function's name


# ---------------------------------------------------------------------------------------
# images


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
        max_train = _int_arg("max_train", max_train, 1)
        seed = _int_arg("seed", seed, 0)
        n = len(self.train_y)
        if max_train >= n:
            return self
        # Shuffle, then rank each example within its class; sorting by (rank + 1/2) / count
        # interleaves the classes so that any prefix holds each class in proportion (+-1).
        perm = torch.randperm(n, generator=_generator("subset", seed))
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
    gen = _generator("split", seed)
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
    seed = _int_arg("seed", seed, 0, 2**32 - 1)
    test_fraction = _fraction_arg("test_fraction", test_fraction)
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
        ("_codecs", "encode"): __import__("codecs").encode,
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
    wanted = {f"cifar-10-batches-py/{m}": m for m in CIFAR10_MEMBERS}
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
    missing = [m for m in CIFAR10_MEMBERS if m not in parsed]
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


def load_cifar10(root=None, download: bool = True) -> ImageData:
    """CIFAR-10 (Krizhevsky, 2009): 50,000 train and 10,000 test 32x32 colour images.

    The official python-version archive is downloaded once into ``root`` (default
    :data:`DEFAULT_ROOT`), checked against its published md5, parsed from the tar by this
    module (pickles are read with an unpickler that allows only numpy arrays and plain
    containers), and cached as ``cifar-10-python.npz`` beside it for fast later loads.
    With ``download=False`` the archive must already be at ``root``.
    """
    root = _root(root)
    archive, cache = root / CIFAR10_FILENAME, root / "cifar-10-python.npz"
    arrays = None
    if cache.is_file():
        try:
            with np.load(cache, allow_pickle=False) as npz:
                # A cache built from another archive (other checksum) is rebuilt, not used.
                if str(npz["archive_md5"]) == CIFAR10_MD5:
                    arrays = {k: npz[k] for k in ("train_x", "train_y", "test_x", "test_y")}
                    arrays["classes"] = npz["classes"]
        except Exception as err:  # zipfile, pickle and shape errors: the cache is unusable
            raise DataIntegrityError(
                f"The cache {cache} is unreadable ({err!r}). Delete {cache} and re-run: "
                f"it will be rebuilt from the archive."
            ) from err
    if arrays is None:
        if download:
            _download(CIFAR10_URL, archive, md5=CIFAR10_MD5, size=CIFAR10_SIZE)
        elif not archive.is_file():
            raise FileNotFoundError(
                f"No CIFAR-10 archive at {archive} and download=False; "
                f"download {CIFAR10_URL} and place it there."
            )
        else:
            verify(archive, md5=CIFAR10_MD5, size=CIFAR10_SIZE)
        arrays = _parse_cifar10(archive)
        with _atomic_path(cache) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays, archive_md5=np.array(CIFAR10_MD5))
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
    if name not in IMAGE_DATASETS:
        valid = ", ".join(repr(k) for k in IMAGE_DATASETS)
        raise ValueError(f"Unknown image data set {name!r}; valid names: {valid}")
    return IMAGE_DATASETS[name](**kwargs)


# ---------------------------------------------------------------------------------------
# text


@dataclass(eq=False)
class TextData:
    """A character-level corpus: token ids index ``vocab``, the sorted characters."""

    name: str
    train: torch.Tensor  # int64 (n_train,)
    val: torch.Tensor  # int64 (n_val,): the text right after the train split
    vocab: tuple[str, ...]
    source: str = ""  # where the text came from, with its checksum
    _codes: np.ndarray = field(init=False, repr=False)

    def __post_init__(self):
        self._codes = np.array([ord(c) for c in self.vocab], dtype=np.uint32)
        if len(self.vocab) == 0 or np.any(np.diff(self._codes.astype(np.int64)) <= 0):
            raise ValueError("Invalid vocab: expected distinct single characters, sorted")

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> torch.Tensor:
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # one per character
        ids = np.searchsorted(self._codes, codes)
        known = ids < len(self._codes)
        known[known] = self._codes[ids[known]] == codes[known]
        if not known.all():
            unknown = sorted({text[i] for i in np.flatnonzero(~known)})
            raise ValueError(f"Characters not in the vocabulary of {self.name!r}: {unknown!r}")
        return torch.from_numpy(ids.astype(np.int64))

    def decode(self, ids) -> str:
        ids = torch.as_tensor(ids).reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"Invalid ids: expected values in [0, {self.vocab_size - 1}]")
        return self._codes[ids].tobytes().decode("utf-32-le")


def _text_data(name: str, text: str, max_chars, val_fraction, source: str) -> TextData:
    if max_chars is not None:
        text = text[: _int_arg("max_chars", max_chars, 2)]
    val_fraction = _fraction_arg("val_fraction", val_fraction)
    n_train = int(len(text) * (1 - val_fraction))
    if not 0 < n_train < len(text):
        raise ValueError(
            f"Invalid val_fraction: {val_fraction} leaves an empty split of {len(text)} characters"
        )
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    source = f"{source}; {len(text):,} characters, sha256 {digest}"
    empty = torch.empty(0, dtype=torch.long)
    data = TextData(name, empty, empty, tuple(sorted(set(text))), source)
    ids = data.encode(text)
    # No shuffle: validation is the text after the training text, so no window straddles both.
    data.train, data.val = ids[:n_train], ids[n_train:]
    return data


def python_source_files() -> list[Path]:
    """The standard-library files of the running Python that make up the corpus, in order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        stdlib = Path(os.__file__).parent
    return sorted(
        (
            p
            for p in stdlib.glob("*.py")
            if not (p.stem.startswith("test") or p.stem.endswith("_test"))
        ),
        key=lambda p: p.name,
    )


def load_python_source(max_chars: int | None = None, val_fraction: float = 0.1) -> TextData:
    """A character corpus from Python's own standard library; ships with Python, no network.

    The top-level ``Lib/*.py`` files of the running interpreter (tests excluded), sorted
    by name and concatenated, each after a ``# ==== name ====`` header line. The first
    ``max_chars`` characters are kept; the last ``val_fraction`` of them is the validation
    split. The corpus depends on the Python version: :func:`python_source_files` lists
    the files and ``TextData.source`` records the version and the text's sha256.
    """
    files = python_source_files()
    if not files:
        raise RuntimeError(
            "No standard-library source found (is this Python installation stripped?)"
        )
    # errors="replace" keeps a stray byte from failing the load; stdlib sources are UTF-8.
    text = "".join(
        f"# ==== {p.name} ====\n{p.read_text(encoding='utf-8', errors='replace')}\n\n"
        for p in files
    )
    source = f"Python {platform.python_version()} standard library, {len(files)} files"
    return _text_data("python_source", text, max_chars, val_fraction, source)


def load_tiny_shakespeare(
    root=None, download: bool = True, max_chars: int | None = None, val_fraction: float = 0.1
) -> TextData:
    """Tiny Shakespeare: 1,115,394 characters of Shakespeare's plays.

    From Karpathy's char-rnn (``data/tinyshakespeare/input.txt``), checked against the
    size and sha256 recorded by tensorflow_datasets. As in nanoGPT's ``prepare.py`` the
    first 90% is the training split and the last 10% the validation split.
    """
    path = _root(root) / TINY_SHAKESPEARE_FILENAME
    expected = {"sha256": TINY_SHAKESPEARE_SHA256, "size": TINY_SHAKESPEARE_SIZE}
    if download:
        _download(TINY_SHAKESPEARE_URL, path, **expected)
    elif not path.is_file():
        raise FileNotFoundError(
            f"No Tiny Shakespeare at {path} and download=False; "
            f"download {TINY_SHAKESPEARE_URL} and place it there."
        )
    else:
        verify(path, **expected)
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataIntegrityError(
            f"{path} is not UTF-8 text ({err}). Delete {path} and re-run: "
            f"it will be downloaded again."
        ) from err
    return _text_data("tiny_shakespeare", text, max_chars, val_fraction, TINY_SHAKESPEARE_URL)


TEXT_DATASETS = {"python_source": load_python_source, "tiny_shakespeare": load_tiny_shakespeare}


def load_text(name: str, **kwargs) -> TextData:
    """Load a character corpus by name: ``"python_source"`` or ``"tiny_shakespeare"``."""
    if name not in TEXT_DATASETS:
        valid = ", ".join(repr(k) for k in TEXT_DATASETS)
        raise ValueError(f"Unknown text data set {name!r}; valid names: {valid}")
    return TEXT_DATASETS[name](**kwargs)


# ---------------------------------------------------------------------------------------
# batches


def random_crop_flip(x: torch.Tensor, generator: torch.Generator, padding: int = 4):
    """Random crop after zero padding, then a random horizontal flip, for a whole batch.

    The standard CIFAR augmentation of He et al. (2016), Section 4.2. The images are
    already normalized, so zero padding is padding with the mean colour. The random
    offsets come from ``generator`` (on the CPU); the pixels move on ``x``'s device.
    """
    b, _, h, w = x.shape
    offsets = torch.randint(0, 2 * padding + 1, (2, b), generator=generator).to(x.device)
    flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
    rows = offsets[0, :, None] + torch.arange(h, device=x.device)  # (B, H)
    cols = offsets[1, :, None] + torch.arange(w, device=x.device)  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    padded = F.pad(x, (padding, padding, padding, padding))
    batch = torch.arange(b, device=x.device)[:, None, None]
    # Advanced indices split by the channel slice put the indexed dims first: (B, H, W, C).
    return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


class ImageBatches(BatchSource):
    """Mini-batches of images as a pure function of the step: ``xb, yb = batches(step)``.

    Epoch ``e = step // len(self)`` reads the examples in a permutation drawn from a
    generator seeded by ``(seed, e)``; with ``augment`` each batch is randomly cropped and
    flipped (:func:`random_crop_flip`) with randomness seeded by ``(seed, step)``. So
    step ``t`` gives the same batch whether or not the run was interrupted before it.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        augment: bool = False,
        device=None,
    ):
        x, y = _tensor_arg("x", x), _tensor_arg("y", y, ndim=1)
        if len(x) != len(y) or len(x) == 0:
            raise ValueError(
                f"Invalid x, y: expected equal non-zero lengths, got {len(x)}, {len(y)}"
            )
        if augment and x.ndim != 4:
            raise ValueError(f"Invalid x for augment=True: expected (N, C, H, W), got {x.shape}")
        self.batch_size = _int_arg("batch_size", batch_size, 1, len(x))
        self.seed = _int_arg("seed", seed, 0)
        self.shuffle, self.drop_last, self.augment = bool(shuffle), bool(drop_last), bool(augment)
        self.x, self.y = x.to(device), y.to(device)
        n = len(x)
        self.steps_per_epoch = n // self.batch_size if drop_last else math.ceil(n / self.batch_size)
        self._epoch, self._perm = -1, None

    def __len__(self) -> int:
        return self.steps_per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        """The order in which epoch ``epoch`` reads the examples."""
        if epoch != self._epoch:
            n = len(self.y)
            perm = (
                torch.randperm(n, generator=_generator("epoch", self.seed, epoch))
                if self.shuffle
                else torch.arange(n)
            )
            self._epoch, self._perm = epoch, perm.to(self.y.device)
        return self._perm

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = _int_arg("step", step, 0)
        epoch, i = divmod(step, self.steps_per_epoch)
        idx = self.permutation(epoch)[i * self.batch_size : (i + 1) * self.batch_size]
        xb, yb = self.x[idx], self.y[idx]
        if self.augment:
            xb = random_crop_flip(xb, _generator("augment", self.seed, step))
        return xb, yb


def eval_batches(x, y, batch_size: int, max_batches: int | None = None, device=None) -> list:
    """``(xb, yb)`` batches in order, no shuffle, the last one possibly smaller."""
    x, y = _tensor_arg("x", x), _tensor_arg("y", y, ndim=1)
    if len(x) != len(y):
        raise ValueError(f"Invalid x, y: expected equal lengths, got {len(x)}, {len(y)}")
    batch_size = _int_arg("batch_size", batch_size, 1)
    n_batches = math.ceil(len(x) / batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, _int_arg("max_batches", max_batches, 1))
    return [
        (x[i : i + batch_size].to(device), y[i : i + batch_size].to(device))
        for i in range(0, n_batches * batch_size, batch_size)
    ]


class TextBatches(BatchSource):
    """Random windows of a token stream as a pure function of the step: ``x, y = batches(step)``.

    ``x`` and ``y`` are ``(batch_size, block_size)`` int64; ``y`` is ``x`` shifted one
    token ahead (the next-character targets). The window starts are drawn from a
    generator seeded by ``(seed, step)``, as nanoGPT's ``get_batch`` draws them, but
    reproducibly.
    """

    def __init__(self, tokens, block_size: int, batch_size: int, *, seed: int = 0, device=None):
        tokens = _tensor_arg("tokens", tokens, ndim=1)
        if len(tokens) < 2:
            raise ValueError(f"Invalid tokens: expected at least 2, got {len(tokens)}")
        self.block_size = _int_arg("block_size", block_size, 1, len(tokens) - 1)
        self.batch_size = _int_arg("batch_size", batch_size, 1)
        self.seed = _int_arg("seed", seed, 0)
        self.tokens = tokens.to(device=device, dtype=torch.long)
        self._span = torch.arange(self.block_size + 1, device=self.tokens.device)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        step = _int_arg("step", step, 0)
        g = _generator("text", self.seed, step)
        starts = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,), generator=g)
        windows = self.tokens[starts.to(self.tokens.device)[:, None] + self._span]
        return windows[:, :-1], windows[:, 1:]


def text_eval_batches(
    tokens, block_size: int, batch_size: int, max_batches: int | None = None, device=None
) -> list:
    """Contiguous, non-overlapping windows in order, batched; the last batch may be smaller."""
    tokens = _tensor_arg("tokens", tokens, ndim=1)
    if len(tokens) < 2:
        raise ValueError(f"Invalid tokens: expected at least 2, got {len(tokens)}")
    block_size = _int_arg("block_size", block_size, 1, len(tokens) - 1)
    batch_size = _int_arg("batch_size", batch_size, 1)
    n_windows = (len(tokens) - 1) // block_size
    starts = torch.arange(n_windows) * block_size
    if max_batches is not None:
        starts = starts[: _int_arg("max_batches", max_batches, 1) * batch_size]
    windows = tokens[starts[:, None] + torch.arange(block_size + 1)].to(device)
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
