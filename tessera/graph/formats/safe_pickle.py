"""A restricted unpickler that only admits plain numpy/scipy arrays and builtin containers."""

from __future__ import annotations

import collections
import functools
import importlib
import io
import pickle
from pathlib import Path
from typing import Any, BinaryIO

from tessera.errors import DatasetError, UnsafePickleError


def _numpy_core(submodule: str) -> Any:
    # numpy 2 moved numpy.core to numpy._core; both names are fixed here, never taken from the pickle.
    try:
        return importlib.import_module(f"numpy._core.{submodule}")
    except ImportError:
        return importlib.import_module(f"numpy.core.{submodule}")


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    # Stands in for _codecs.encode, which Python 3 uses for bytes in protocol <= 2 pickles.
    if encoding.lower().replace("-", "").replace("_", "") not in ("latin1", "iso88591"):
        raise UnsafePickleError(f"refusing to decode pickled bytes with codec {encoding!r}")
    return text.encode("latin1")


@functools.cache
def allowed_globals() -> dict[tuple[str, str], Any]:
    """The ``(module, name) -> object`` allow-list consulted for every global a pickle references."""
    import numpy as np
    import scipy.sparse

    multiarray = _numpy_core("multiarray")
    numeric = _numpy_core("numeric")
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("scipy.sparse.csr", "csr_matrix"): scipy.sparse.csr_matrix,
        ("scipy.sparse._csr", "csr_matrix"): scipy.sparse.csr_matrix,
        ("collections", "defaultdict"): collections.defaultdict,
        ("_codecs", "encode"): _latin1_encode,
    }
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        allowed[(mod, "_reconstruct")] = multiarray._reconstruct
        allowed[(mod, "scalar")] = multiarray.scalar
    for mod in ("numpy.core.numeric", "numpy._core.numeric"):
        allowed[(mod, "_frombuffer")] = numeric._frombuffer
    for mod in ("__builtin__", "builtins"):
        for obj in (list, dict, set, frozenset, tuple, int, float):
            allowed[(mod, obj.__name__)] = obj
    return allowed


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose ``find_class`` resolves only names in :func:`allowed_globals`."""

    def __init__(self, file: BinaryIO, source: str = "<pickle>", encoding: str = "latin1") -> None:
        super().__init__(file, encoding=encoding)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        """Return the allow-listed object for ``module.name`` or raise :class:`UnsafePickleError`."""
        obj = allowed_globals().get((module, name))
        if obj is None:
            raise UnsafePickleError(
                f"refusing to load {module}.{name} from {self.source}: only numpy arrays, scipy CSR "
                "matrices and builtin containers are allowed in dataset pickles"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refusing to load {self.source}: persistent ids are not allowed")


def safe_load(source: str | Path | bytes, *, encoding: str = "latin1") -> Any:
    """Unpickle a file (or bytes) with :class:`RestrictedUnpickler`; any failure is a DatasetError."""
    if isinstance(source, bytes):
        name, data = "<bytes>", source
    else:
        name = str(source)
        try:
            data = Path(source).read_bytes()
        except OSError as e:
            raise DatasetError(f"cannot read {name}: {e.strerror or e}") from e
    try:
        return RestrictedUnpickler(io.BytesIO(data), source=name, encoding=encoding).load()
    except DatasetError:
        raise
    except Exception as e:  # a corrupt pickle can fail in the unpickler or in an allowed constructor
        raise DatasetError(f"{name} is truncated or not a valid pickle ({type(e).__name__}: {e})") from e
