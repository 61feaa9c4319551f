"""Data sets and batches: real data, verified, and batches that are a function of the step.

Two kinds of data feed the labs. At the ``smoke`` and ``cpu`` scales the data ship with
the software and need no network: scikit-learn's 8x8 handwritten digits, and a character
corpus made from Python's own standard-library source. At the ``gpu`` scale the labs use
the data sets the papers use, downloaded once and verified against published checksums:
CIFAR-10 (Krizhevsky, 2009) and Tiny Shakespeare (Karpathy's char-rnn).

* :mod:`~lsdl_lab.data.files`: verified, atomic downloads, each file described by a
  :class:`RemoteFile` record in :data:`REMOTE_FILES`;
* :mod:`~lsdl_lab.data.images`: :class:`ImageData`, the digits and CIFAR-10;
* :mod:`~lsdl_lab.data.text`: :class:`TextData`, the Python-source corpus and Tiny
  Shakespeare;
* :mod:`~lsdl_lab.data.batches`: batch sources (:class:`BatchSource`), pure functions of
  the step, so a run resumed at step ``t`` reads the batches an uninterrupted run would::

    data = load_images("digits").subset(512)
    batches = ImageBatches(data.train_x, data.train_y, batch_size=64, seed=0)
    xb, yb = batches(step)
"""

from .batches import (
    BatchSource,
    GrowingBatches,
    ImageBatches,
    TextBatches,
    epoch_permutation,
    eval_batches,
    random_crop_flip,
    text_eval_batches,
)
from .files import (
    DEFAULT_ROOT,
    REMOTE_FILES,
    DataIntegrityError,
    RemoteFile,
    download,
    fetch,
    verify,
)
from .images import ImageData, load_cifar10, load_digits, load_images, stratified_split
from .text import (
    TextData,
    load_python_source,
    load_text,
    load_tiny_shakespeare,
    python_source_files,
)

__all__ = [
    "DEFAULT_ROOT",
    "REMOTE_FILES",
    "BatchSource",
    "DataIntegrityError",
    "GrowingBatches",
    "ImageBatches",
    "ImageData",
    "RemoteFile",
    "TextBatches",
    "TextData",
    "download",
    "epoch_permutation",
    "eval_batches",
    "fetch",
    "load_cifar10",
    "load_digits",
    "load_images",
    "load_python_source",
    "load_text",
    "load_tiny_shakespeare",
    "python_source_files",
    "random_crop_flip",
    "stratified_split",
    "text_eval_batches",
    "verify",
]
