"""Which saved tensors we touch, and when two saves are the same tensor.

Identity is (storage, storage_offset, shape, stride, dtype, version). Split views of one fused
projection (same storage, different offsets) are therefore different tensors — the reference
code left the offset out and returned one view's data for the other. The storage is tracked
through a weak reference to its C++ object: while we hold it, that object's address cannot be
reused, so a freed and re-allocated buffer never matches an old record.
"""

from __future__ import annotations

from typing import Optional, Set, Tuple

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_TENSOR = torch.Tensor
_STRIDED = torch.strided


def offloadable_storage(t: torch.Tensor, device: torch.device,
                        param_storages: Set[int]) -> Optional[torch.UntypedStorage]:
    """The pack hook's test, once per saved tensor that is large enough: ``t``'s untyped
    storage when the offloader may take it, else None. The same rules as :func:`pass_reason`
    (which says why not), ordered so that an activation reads each attribute once."""
    if type(t) is not _TENSOR or t.layout is not _STRIDED or t.device != device:
        return None  # a subclass (or Parameter), a sparse layout, another device
    if t.requires_grad and t.is_leaf:
        return None  # a parameter (or a leaf that needs its gradient)
    base = t._base
    if base is not None and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad)):
        return None  # a view of a parameter
    storage = t.untyped_storage()
    if storage._cdata in param_storages:
        return None
    return storage


def pass_reason(t: torch.Tensor, device: torch.device, param_storages: Set[int],
                min_bytes: int, storage: Optional[torch.UntypedStorage] = None) -> Optional[str]:
    """Why ``t`` stays with autograd (None: it may be offloaded). ``storage``: ``t``'s
    untyped storage, when the caller has already looked it up (one lookup per tensor)."""
    if type(t) not in _PLAIN:
        return "subclass"
    if t.layout is not torch.strided:
        return "layout"
    if t.device != device:
        return "device"
    if t.numel() * t.element_size() < max(min_bytes, 1):
        return "small"
    if storage is None:
        storage = t.untyped_storage()
    if _is_parameter(t) or storage._cdata in param_storages:
        return "parameter"
    return None


def _is_parameter(t: torch.Tensor) -> bool:
    if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
        return True
    base = t._base
    return base is not None and (isinstance(base, torch.nn.Parameter) or (base.is_leaf and base.requires_grad))


def dedup_key(t: torch.Tensor, storage: Optional[torch.UntypedStorage] = None) -> Tuple:
    cdata = (storage if storage is not None else t.untyped_storage())._cdata
    return (cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)


def storage_ref(t: torch.Tensor, storage: Optional[torch.UntypedStorage] = None) -> StorageWeakRef:
    return StorageWeakRef(storage if storage is not None else t.untyped_storage())
