"""Type aliases of the public API's signatures (light: no framework is imported for them)."""

from __future__ import annotations

from typing import Any, TypeAlias

#: An array argument: a NumPy or CuPy array, a torch tensor, or any object with
#: ``__cuda_array_interface__`` or ``__dlpack__`` (JAX arrays inside ``ropekv.jax``).
ArrayLike: TypeAlias = Any

#: A ``stream=`` argument: a CuPy stream, an int ``cudaStream_t`` or an object with
#: ``__cuda_stream__`` / ``cuda_stream`` (``torch.cuda.Stream``).
StreamLike: TypeAlias = Any

#: A dtype argument: a NumPy/ml_dtypes dtype, its name, or a torch dtype.
DTypeLike: TypeAlias = Any
